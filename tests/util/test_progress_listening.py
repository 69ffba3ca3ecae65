"""featcal.util.progress: a listener hears every bar of its thread (stage, step, total, time
left), bars drawn or not; other threads' bars are not its."""

from __future__ import annotations

import threading

from featcal.util.progress import bar, listening


def test_a_listener_hears_each_bar_to_its_last_step():
    heard = []
    with listening(heard.append):
        assert list(bar(range(5), desc="stage one", show=False)) == list(range(5))
        with bar(total=3, desc="stage two", show=False) as b:
            for _ in range(3):
                b.update()
    stages = {p.stage for p in heard}
    assert stages == {"stage one", "stage two"}
    last = [p for p in heard if p.stage == "stage one"][-1]
    assert (last.step, last.total, last.fraction) == (5, 5, 1.0)
    assert [p for p in heard if p.stage == "stage two"][-1].step == 3
    assert "stage two: step 3/3" in heard[-1].describe()


def test_bars_outside_the_block_or_on_other_threads_are_not_heard():
    heard = []
    with listening(heard.append):
        t = threading.Thread(target=lambda: list(bar(range(4), desc="other thread", show=False)))
        t.start()
        t.join()
    list(bar(range(4), desc="after", show=False))
    assert heard == []

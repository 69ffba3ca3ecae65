"""The app's bookkeeping of exact runs (app.runs.Latest): which runs keep their statistics,
and when the others are let go."""

import threading

import pytest

from app.runs import Latest


class Run:
    def __init__(self, name: str, size: int = 1):
        self.name, self.size, self.seconds = name, size, 1.0


def _latest(keep: int = 2, budget: int | None = None):
    released: list[str] = []
    latest = Latest(
        keep=keep,
        budget=None if budget is None else (lambda: budget),
        size=lambda run: run.size,
        release=lambda run: released.append(run.name),
    )
    return latest, released


def test_a_newer_run_of_a_key_lets_the_older_go():
    latest, released = _latest()
    latest.remember("A", 1, Run("a1"))
    latest.remember("A", 2, Run("a2"))
    assert released == ["a1"]
    assert latest.run("A", 1) is None and latest.run("A", 2).name == "a2"
    assert ("A", 1) in latest.done  # run once: never previewed again


def test_at_most_keep_keys_and_the_newest_always_stays():
    latest, released = _latest(keep=2)
    for key in "ABC":
        latest.remember(key, 1, Run(key))
    assert released == ["A"] and list(latest.latest) == ["B", "C"]
    latest, released = _latest(keep=2, budget=5)  # B and C do not fit together
    latest.remember("B", 1, Run("B", size=4))
    latest.remember("C", 1, Run("C", size=4))
    assert released == ["B"] and list(latest.latest) == ["C"]
    latest.remember("D", 1, Run("D", size=9))  # over the budget alone: still kept
    assert released == ["B", "C"] and list(latest.latest) == ["D"]


def test_a_run_being_previewed_keeps_its_statistics_until_the_preview_is_done():
    latest, released = _latest()
    latest.remember("A", 1, Run("a1"))
    with latest.previewing("A", 2) as from_cal:
        assert from_cal == 1
        latest.remember("A", 2, Run("a2"))  # the exact run finishes while the preview is drawn
        assert released == []
        assert latest.run("A", 1).name == "a1"  # the preview still finds its run
    assert released == ["a1"] and latest.run("A", 1) is None


def test_nothing_to_preview_from_holds_nothing():
    latest, released = _latest()
    with latest.previewing("A", 1) as from_cal:  # no run yet
        assert from_cal is None
    latest.remember("A", 1, Run("a1"))
    with latest.previewing("A", 1) as from_cal:  # its exact run is done: no preview
        assert from_cal is None
    latest.remember("A", 2, Run("a2"))
    assert released == ["a1"] and not latest.holders


def test_a_failing_preview_still_lets_its_run_go():
    latest, released = _latest()
    latest.remember("A", 1, Run("a1"))
    with pytest.raises(ValueError):
        with latest.previewing("A", 2):
            latest.remember("A", 2, Run("a2"))
            raise ValueError("the preview failed")
    assert released == ["a1"] and not latest.holders and not latest.leaving


def test_two_previews_of_one_run_let_it_go_after_the_last():
    latest, released = _latest()
    latest.remember("A", 1, Run("a1"))
    started, go = threading.Event(), threading.Event()

    def other_tab():
        with latest.previewing("A", 3):
            started.set()
            go.wait(1800)

    tab = threading.Thread(target=other_tab)
    tab.start()
    assert started.wait(1800)
    with latest.previewing("A", 2):
        latest.remember("A", 2, Run("a2"))
    assert released == []  # the other tab still reads a1
    go.set()
    tab.join(1800)
    assert released == ["a1"]

"""The Calibrate page's look-ahead (app/ahead.py, app/runs.py): which settings it computes and
in what order, the store of runs computed ahead, that it stops when told, and under AppTest
that a one-step change then draws its exact result without calibrating or previewing, while a
jump goes the usual way. In the browser: tests/app/test_browser_ahead.py."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("streamlit")
from test_app import _app, _ok, _page  # noqa: E402  (AppTest helpers)

POINT = {"log_lam": -1.3, "rho": 2.0, "alpha": 0.3}


# ----------------------------------------------------------------------------- pure parts


def test_neighbours_are_one_step_away_most_likely_first():
    from app.ahead import neighbours

    plain = neighbours(POINT)
    assert plain == [
        {**POINT, "log_lam": -1.2},
        {**POINT, "log_lam": -1.4},
        {**POINT, "rho": 2.05},
        {**POINT, "rho": 1.95},
        {**POINT, "alpha": 0.35},
        {**POINT, "alpha": 0.25},
    ]
    # After alpha moved down: alpha onward (down), alpha back (up), then the others as before.
    after = neighbours(POINT, ("alpha", -1))
    assert after[:2] == [{**POINT, "alpha": 0.25}, {**POINT, "alpha": 0.35}]
    assert after[2:] == plain[:4]
    # A slider at its end has one neighbour on it.
    assert [p["alpha"] for p in neighbours({**POINT, "alpha": 1.0}) if p["alpha"] != 1.0] == [0.95]


def test_the_last_move_is_one_slider_and_its_direction():
    from app.ahead import last_move

    assert last_move(None, POINT) is None
    assert last_move(POINT, POINT) is None
    assert last_move(POINT, {**POINT, "rho": 1.9}) == ("rho", -1)
    assert last_move(POINT, {**POINT, "log_lam": -1.0}) == ("log_lam", 1)
    assert last_move(POINT, {**POINT, "rho": 1.9, "alpha": 0.5}) is None  # two sliders: no guess


def test_a_moved_setting_is_the_one_the_widgets_would_give():
    from app.settings import AppCal

    cal = AppCal.from_widgets(-1.3, 2.0, 0.3, 16, True, False)
    assert cal.moved(-1.2, 1.95, 0.35) == AppCal.from_widgets(-1.2, 1.95, 0.35, 16, True, False)
    assert cal.moved(-1.2, 1.95, 0.35).structure == cal.structure  # a preview of it is possible


def test_worth_it_only_for_quick_small_runs_on_the_live_subset(monkeypatch):
    from app import ahead

    monkeypatch.setenv("FEATCAL_LOOK_AHEAD", "1")
    assert ahead.worth_it(0.3, 1 << 20, 50)
    assert not ahead.worth_it(ahead.MAX_RUN_S, 1 << 20, 50)
    assert not ahead.worth_it(0.3, ahead.MAX_MODEL_BYTES + 1, 50)
    assert not ahead.worth_it(0.3, 1 << 20, None)  # the full test split
    monkeypatch.setenv("FEATCAL_LOOK_AHEAD", "off")
    assert not ahead.worth_it(0.3, 1 << 20, 50)


def test_the_store_hands_out_each_run_once_and_keeps_the_newest():
    from app.runs import Ahead

    store = Ahead(keep=2)
    first = store.reserve("a")
    assert first is not None and store.reserve("a") is None and store.has("a")
    waiter = threading.Thread(target=lambda: seen.append(store.peek("a")))
    seen: list = []
    waiter.start()  # waits for the result
    first.set_result("run a")
    waiter.join(1800)
    assert seen == ["run a"]
    assert store.take("a") == "run a" and not store.has("a") and store.take("a") is None
    failed = store.reserve("b")
    failed.set_exception(RuntimeError("boom"))
    assert store.peek("b") is None  # whoever needs it computes it again
    store.reserve("c").set_result("run c")
    store.reserve("d").set_result("run d")
    assert not store.has("b") and store.has("c") and store.has("d")  # keep=2: the oldest left
    generation = store.generation
    store.stop()
    assert not store.current(generation) and store.current(store.generation)


def test_the_look_ahead_stops_at_its_next_block_unless_the_page_waits_for_it(monkeypatch):
    from app import ahead, state
    from app.settings import AppCal, Merger

    store = state.ahead_store()
    runs, blocks, tables, seen = [], [], [], []
    merger = Merger("task_arithmetic", (("scale", 0.3),))

    def exact_run(source, fp, merger, cal, on_block=None, waiter=None):
        runs.append(cal)
        store.stop()  # a change arrives while the run is computed
        if waiter is not None:  # ... and the page asks for this very run
            waiter.start()
            while not store.is_wanted((source, fp, merger, cal)):
                waiter.join(0.01)
        for block in range(3):
            blocks.append(block)
            on_block(block, {"done": block + 1, "blocks": 3, "seconds": 0.0})
        return f"run of {cal.label}"

    monkeypatch.setattr(state, "exact_run", exact_run)
    monkeypatch.setattr(state, "was_run", lambda *a: False)
    for name in ("output_scores", "cosine_scores", "drift"):
        monkeypatch.setattr(state, name, lambda *a, name=name: tables.append(name))
    cal = AppCal.from_widgets(-2.7, 0.65, 0.85, 8, True, True)  # a point no other test uses
    cals = [cal.moved(**p) for p in ahead.neighbours({"log_lam": -2.7, "rho": 0.65, "alpha": 0.85})]
    ahead._compute(store.generation - 1, "src", "fp", merger, cals, 50)  # already stale: nothing
    assert runs == [] and tables == []
    ahead._compute(store.generation, "src", "fp", merger, cals, 50)
    # Stopped after its first block, dropped, and nothing after it.
    assert runs == cals[:1] and blocks == [0] and tables == []
    assert not store.has(("src", "fp", merger, cals[0]))
    # The same, with the page waiting for that run: it goes on to its end and is handed over.
    runs.clear(), blocks.clear()
    key = ("src", "fp", merger, cals[0])
    waiter = threading.Thread(target=lambda: seen.append(store.peek(key)))
    monkeypatch.setattr(state, "exact_run", lambda *a, **k: exact_run(*a, **k, waiter=waiter))
    ahead._compute(store.generation, "src", "fp", merger, cals, 50)
    waiter.join(1800)
    assert runs == cals[:1] and blocks == [0, 1, 2] and tables == []
    assert seen == [f"run of {cals[0].label}"]


# ----------------------------------------------------------------------------- the page


def _wait_for_look_ahead() -> None:
    """The background thread runs one job at a time: a job queued now runs after the look-ahead."""
    from app import state

    state.calibrations().in_background(lambda: None).result(timeout=1800)


def test_a_one_step_change_draws_the_exact_result_computed_ahead(tiny_zoo_dir, monkeypatch):
    from app import ahead, compute

    monkeypatch.setenv("FEATCAL_LOOK_AHEAD", "1")
    monkeypatch.setattr(ahead, "MAX_RUN_S", 600.0)  # whatever a cold first run takes on a busy machine
    calls = []
    real = compute.calibrate
    monkeypatch.setattr(compute, "calibrate", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    # A point no other test uses (the runs are cached for the whole process).
    at = _page(_app(tiny_zoo_dir, rho=1.35, alpha=0.55).run(), "calibrate")
    _wait_for_look_ahead()
    ahead_of_time = {(c.lam, c.rho, c.alpha) for c in calls}
    assert (0.05, 1.35, 0.6) in ahead_of_time and (0.05, 1.3, 0.55) in ahead_of_time, ahead_of_time
    calls.clear()
    _ok(at.slider(key="alpha").set_value(0.6).run())
    # Drawn from the run computed ahead: not calibrated again (the calls now are the next
    # look-ahead's, started once the result was drawn).
    assert not any((c.rho, c.alpha) == (1.35, 0.6) for c in calls), calls
    assert any("Exact FeatCal" in s.value and "α=0.6" in s.value for s in at.success)
    assert not any("Preview" in i.value for i in at.info)
    _wait_for_look_ahead()
    # The next look-ahead continued along alpha first: 0.65 was computed before anything else.
    assert calls and (calls[0].rho, calls[0].alpha) == (1.35, 0.65), calls
    calls.clear()
    _ok(at.slider(key="alpha").set_value(0.8).run())  # a jump: the usual way, calibrated now
    assert any(c.alpha == 0.8 for c in calls)
    assert any("Exact FeatCal" in s.value and "α=0.8" in s.value for s in at.success)

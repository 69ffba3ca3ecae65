"""Exact results one slider step away, computed while the page is idle (the look-ahead).

Tuning λ, ρ and α by eye, a person moves a slider a step and looks at the result before
the next move. On a zoo whose exact run takes a moment (the demo zoo: a fraction of a
second), the Calibrate page spends that look computing the exact results of the settings one
step away on each slider, most likely first (the slider moved last, onward, then back; then
the others), starting ``DELAY_S`` after the page is written (the browser draws it meanwhile),
so that the next step's exact result is drawn at once, with no preview and no wait. Any new
script run stops the work at its next step (the run's next block, or the next table), unless
the page waits for that very run; what was finished stays (at most ``runs.Ahead.keep`` runs).
A jump of several steps, or a change made before the look-ahead reached it, goes the usual
way: the preview, then the exact result.

Off with ``FEATCAL_LOOK_AHEAD=0``; never where the last exact run took ``MAX_RUN_S`` or more,
where the model is over ``MAX_MODEL_BYTES``, or where the full test split is scored. What it
gives is measured in benchmarks/README.md, 'Look-ahead'.
"""

from __future__ import annotations

import os
import time

from app import state
from app.controls import SLIDERS, on_slider
from app.settings import AppCal, Merger, ModelRef

MAX_RUN_S = float(os.environ.get("FEATCAL_LOOK_AHEAD_MAX_S", "3.0"))  # seconds of the last exact run
MAX_MODEL_BYTES = 64 << 20  # the runs kept ahead hold a model each
# Seconds the look-ahead waits after the page is written, leaving the cores to the browser
# while it draws the result (benchmarks/README.md, 'Look-ahead').
DELAY_S = float(os.environ.get("FEATCAL_LOOK_AHEAD_DELAY_S", "0.3"))


def neighbours(values: dict[str, float], last: tuple[str, int] | None = None) -> list[dict[str, float]]:
    """The slider points one step from ``values`` (``{"log_lam", "rho", "alpha"}``), most
    likely first: ``last`` = (slider, direction) of the latest move, continued, then undone;
    then every other slider, up, then down. Points past a slider's end are left out."""
    moves = [last, (last[0], -last[1])] if last else []
    moves += [(key, d) for key in SLIDERS for d in (1, -1) if (key, d) not in moves]
    points = []
    for key, direction in moves:
        value = on_slider(key, values[key] + direction * SLIDERS[key][2])
        if value != on_slider(key, values[key]):
            points.append({**values, key: value})
    return points


def last_move(before: dict[str, float] | None, now: dict[str, float]) -> tuple[str, int] | None:
    """The one slider that moved from ``before`` to ``now``, with its direction (None: no
    earlier point, or not exactly one slider moved)."""
    if not before:
        return None
    moved = [(key, 1 if now[key] > before[key] else -1) for key in SLIDERS if now[key] != before[key]]
    return moved[0] if len(moved) == 1 else None


def enabled() -> bool:
    """``FEATCAL_LOOK_AHEAD`` (read at each use): on unless 0, false, no or off."""
    return os.environ.get("FEATCAL_LOOK_AHEAD", "1").strip().lower() not in ("0", "false", "no", "off")


def worth_it(seconds: float, model_bytes: int, limit: int | None) -> bool:
    """Whether to look ahead after an exact run of ``seconds`` on a model of ``model_bytes``,
    scored on ``limit`` test examples per task (None: the whole split, too slow to guess at)."""
    return enabled() and limit is not None and seconds < MAX_RUN_S and model_bytes <= MAX_MODEL_BYTES


def start(source: str, fp: str, merger: Merger, cal: AppCal, points: list[dict], limit: int) -> None:
    """Compute, on the background thread, the exact results of ``cal`` moved to each of
    ``points`` (:func:`neighbours`) and their tables, in order, until the next :func:`stop`."""
    store = state.ahead_store()
    cals = [cal.moved(**p) for p in points]
    state.calibrations().in_background(_compute, store.generation, source, fp, merger, cals, limit)


def stop() -> None:
    """A script run has started: the look-ahead under way stops at its next step."""
    state.ahead_store().stop()


class Stale(Exception):
    """The page has moved on: the run computed ahead stops (between two blocks)."""


def _compute(generation: int, source: str, fp: str, merger: Merger, cals: list[AppCal], limit: int) -> None:
    store = state.ahead_store()
    time.sleep(DELAY_S)
    for cal in cals:
        key = (source, fp, merger, cal)
        if not store.current(generation):
            return
        if state.was_run(source, fp, merger, cal) or (future := store.reserve(key)) is None:
            continue

        def unless_stale(block, info, key=key) -> None:  # a jump waits one block for the cores, not a run
            if not store.current(generation) and not store.is_wanted(key):
                raise Stale

        try:
            future.set_result(state.exact_run(source, fp, merger, cal, on_block=unless_stale))
        except Exception as exc:  # (Stale included) whoever needs it computes it again, and sees any error
            future.set_exception(exc)
            store.drop(key)
            return
        ref = ModelRef.calibrated(merger, cal)
        for table in (
            lambda: state.output_scores(source, fp, ref, limit),
            lambda: state.cosine_scores(source, fp, ref),
            lambda: state.drift(source, fp, ref),
        ):
            if not store.current(generation):
                return
            table()

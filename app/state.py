"""The app's shared state: the zoo, its models and the tables computed from them, cached.

1. the zoo (``st.cache_resource``, shared by every browser tab): loaded once per source;
2. models: merged and calibrated models (with their kept statistics), data subsets, the
   latest exact runs the instant preview starts from, and :func:`model_of`, which resolves
   a :class:`~app.settings.ModelRef` to a model with the lock its use needs;
3. results (``st.cache_data``, keyed by the zoo's fingerprint and a ``ModelRef``): score
   and drift tables.

Cached functions resolve the resources they need *before* taking a lock
(:mod:`app.workers`) and never call another cached function while holding it, so the
locks and Streamlit's per-key cache locks cannot deadlock.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator

import pandas as pd
import streamlit as st
import torch

from app import compute, runs, st_patch, workers, zoos
from app.settings import HASH_FUNCS, AppCal, Merger, ModelRef
from app.workers import torch_lock
from featcal.util.memory import trim_heap

DIAG_N = compute.DIAG_N
device = zoos.device


# ============================================================================ 1. the zoo


_BUILD = threading.Lock()  # one zoo build at a time; other sessions wait for it


@st.cache_resource(max_entries=2, show_spinner="Loading the zoo…")
def _zoo(source: str, dev: str):
    zoo = zoos.load_zoo(source, dev)
    for alone in (False, True):
        workers.THREADS[source, alone] = zoos.cpu_threads(zoo, dev, alone)
    return zoo


def zoo_or_error(source: str) -> tuple[object | None, str | None]:
    """``(zoo, None)`` or ``(None, message naming the problem and the fix)``; never raises
    for a bad source (exceptions are not cached, so a fixed file loads on the next try)."""
    if not source:
        return None, "No zoo selected. Fix: enter the path of a zoo spec YAML (or pick the embedded demo)."
    try:
        if zoos.zoo_needs_build(source):
            _build_with_progress(source)
        return _zoo(source, device()), None
    except Exception as exc:  # shown to the user, never as a traceback
        return None, zoos.explain_load_error(source, exc)


def _build_with_progress(source: str) -> None:
    """Build the demo zoo ``source`` with a progress bar on the page (stage, step, time left)."""
    box = st.empty()
    with box.container():
        st.info(f"Building the `{source}` zoo offline: first use on this machine, cached afterwards.")
        progress = st.progress(0.0, text="Waiting for another session's build…" if _BUILD.locked() else "Starting…")
    with _BUILD:
        if zoos.zoo_needs_build(source):  # another session may have built it meanwhile
            zoos.build_zoo(source, lambda p: progress.progress(p.fraction, text=p.describe()))
    box.empty()


def active_source() -> str:
    """The zoo source the main script picked for this run (a run that started at a page
    URL before the main script ever ran has none: see :mod:`app.st_patch`)."""
    if "_zoo_source" not in st.session_state:
        st_patch.leave_pages_directory_mode()
        st.rerun()
    return st.session_state["_zoo_source"]


def active_zoo():
    """The zoo the sidebar picked (the main script has loaded it already)."""
    return _zoo(active_source(), device())


def fingerprint(source: str) -> str:
    return zoos.fingerprint(active_zoo() if source == active_source() else _zoo(source, device()), source)


# ============================================================================ 2. models


@st.cache_resource(max_entries=4, show_spinner=False, hash_funcs=HASH_FUNCS)
def merged_model(source: str, fp: str, merger: Merger):
    zoo = _zoo(source, device())
    with torch_lock(source):
        return zoo.merged(merger.method, **merger.kwargs)


@st.cache_resource(max_entries=6, show_spinner=False)
def calib_data(source: str, fp: str, n: int, split: str = "calib", seed: int = 42) -> dict:
    zoo = _zoo(source, device())
    return zoo.calib_data(n, seed=seed, split=split)


def diag_data(source: str, fp: str) -> dict:
    """The held-out subset the drift and cosines are measured on (``val``, else ``calib``)."""
    zoo = _zoo(source, device())
    split = "val" if "val" in zoos.splits_of(zoo) else "calib"
    n = min(DIAG_N, zoos.split_size(zoo, split))
    return calib_data(source, fp, n, split=split, seed=0)


@dataclass
class Calibrated:
    model: torch.nn.Module
    report: object  # featcal.CalibrationReport, with preview_state
    seconds: float


def _stats_bytes(run: Calibrated) -> int:
    preview = run.report.preview_state
    return 0 if preview is None else preview.nbytes()


def _release_stats(run: Calibrated) -> None:
    """Free the statistics of a run no preview will start from again (its model stays cached)."""
    run.report.preview_state = None
    trim_heap()


@st.cache_resource(show_spinner=False)
def _runs() -> runs.Latest:
    """The runs the preview starts from: the only ones that keep their statistics, the older
    of two kept while both fit in :func:`app.compute.keep_budget`."""
    return runs.Latest(budget=compute.keep_budget, size=_stats_bytes, release=_release_stats)


@st.cache_resource(show_spinner=False)
def ahead_store() -> runs.Ahead:
    """The exact runs computed ahead of the sliders (:mod:`app.ahead`)."""
    return runs.Ahead()


@st.cache_resource(max_entries=2, show_spinner=False)
def _expert_trace(source: str, fp: str, n: int):
    """What the exact runs on this zoo and calibration size compute of the experts, kept
    from run to run (as much as fits, see :func:`app.compute.expert_trace`)."""
    return compute.expert_trace()


def exact_run(source: str, fp: str, merger: Merger, cal: AppCal, on_block=None) -> Calibrated:
    """The exact forward-order FeatCal run (kept statistics included), uncached (``on_block``:
    :func:`featcal.calibrate`'s)."""
    zoo = _zoo(source, device())
    merged = merged_model(source, fp, merger)
    data = calib_data(source, fp, cal.n)
    trace = _expert_trace(source, fp, cal.n)
    with torch_lock(source, alone=True):  # nothing runs beside it until the preview's deadline
        t0 = time.perf_counter()
        try:
            model, report = compute.calibrate(merged, zoo, data, cal.config, trace, on_block)
        finally:
            trim_heap()  # the run's freed work: gigabytes on a language model
        return Calibrated(model, report, time.perf_counter() - t0)


_BLOCKS: dict[tuple, tuple[int, int]] = {}  # (source, fp, merger, cal) -> (blocks done, blocks) while it runs


@st.cache_resource(max_entries=4, show_spinner=False, hash_funcs=HASH_FUNCS)
def calibrated(source: str, fp: str, merger: Merger, cal: AppCal) -> Calibrated:
    """:func:`exact_run`, cached; taken from the runs computed ahead when it is there."""
    key = (source, fp, merger, cal)

    def on_block(block, info) -> None:
        _BLOCKS[key] = (info["done"], info["blocks"])

    try:
        run = ahead_store().take(key) or exact_run(source, fp, merger, cal, on_block=on_block)
    finally:
        _BLOCKS.pop(key, None)
    _runs().remember((source, fp, merger, cal.structure), cal, run)
    return run


def blocks_done(source: str, fp: str, merger: Merger, cal: AppCal) -> tuple[int, int] | None:
    """``(blocks done, blocks)`` of :func:`calibrated`'s run of ``cal`` while it runs, else None."""
    return _BLOCKS.get((source, fp, merger, cal))


# id(report) -> (a weak reference to the report, its preview's eigendecompositions under way or
# done); the reference tells a live report from a later one that reuses a collected one's id
_PREPARING: dict[int, tuple[weakref.ref, Future]] = {}


def _preparing(report) -> Future | None:
    entry = _PREPARING.get(id(report))
    return entry[1] if entry is not None and entry[0]() is report else None


def prepare_preview(run: Calibrated) -> None:
    """Start the one-off eigendecompositions of ``run``'s preview in the background: the next
    slider change previews from this run, and so no longer waits for them (benchmarks/README.md,
    'Issue 28: a faster preview')."""
    preview = run.report.preview_state
    if preview is not None and _preparing(run.report) is None:
        while len(_PREPARING) >= 4:
            _PREPARING.pop(next(iter(_PREPARING)))
        _PREPARING[id(run.report)] = (weakref.ref(run.report), workers.in_background(compute.prepare_preview, preview))


def last_seconds() -> float | None:
    """The wall seconds of the latest exact run on any zoo (a progress estimate), or None."""
    return _runs().seconds()


def start_calibration(source: str, fp: str, merger: Merger, cal: AppCal) -> Future:
    """Start the exact run on the worker thread (while the script scores the preview on the
    other core); :func:`calibrated` then returns its result once it is cached."""
    return workers.submit(calibrated, source, fp, merger, cal)


@contextmanager
def preview_from(source: str, fp: str, merger: Merger, cal: AppCal) -> Iterator[AppCal | None]:
    """The exact run whose kept statistics preview ``cal`` (None: exact is cached or computed
    ahead, or no run yet); its statistics are kept until the block ends, even if the exact
    run of ``cal`` finishes meanwhile and displaces it."""
    if ahead_store().has((source, fp, merger, cal)):
        yield None
        return
    with _runs().previewing((source, fp, merger, cal.structure), cal) as from_run:
        yield from_run


def to_compute(source: str, fp: str, merger: Merger, cal: AppCal) -> bool:
    """Whether the exact run of ``cal`` is neither run nor computed ahead (so far as is known)."""
    return not was_run(source, fp, merger, cal) and not ahead_store().has((source, fp, merger, cal))


def was_run(source: str, fp: str, merger: Merger, cal: AppCal) -> bool:
    """Whether the exact run of ``cal`` has been computed on this server (cached, unless evicted)."""
    return ((source, fp, merger, cal.structure), cal) in _runs().done


def _calibrated_run(source: str, fp: str, merger: Merger, cal: AppCal) -> Calibrated:
    return (
        _runs().run((source, fp, merger, cal.structure), cal)
        or ahead_store().peek((source, fp, merger, cal))
        or calibrated(source, fp, merger, cal)
    )


_SCRATCH_HOLDS: dict[tuple, tuple] = {}  # (source, fp) -> (preview ref, id of its run, id of the scratch model)


@st.cache_resource(max_entries=2, show_spinner=False)
def _scratch(source: str, fp: str) -> torch.nn.Module:
    """One model per zoo that previews are written into (under its own lock)."""
    return copy.deepcopy(_zoo(source, device()).base)


@contextmanager
def model_of(
    source: str, fp: str, ref: ModelRef, hooks: bool = True, experts: bool = True
) -> Iterator[torch.nn.Module]:
    """The model ``ref`` names, with the lock its use needs (resolved before it).

    ``hooks``: the computation sets hooks (a drift table) rather than only calling the
    model (scores with the experts' cached outputs). The rules that let an exact run, its
    drift and a preview's scores run side by side on two cores:

    - hook-setting work takes the main lock (experts are hooked only under it), and on a
      calibrated model runs on a private copy, so nobody ever hooks a cached calibrated
      model and scoring one needs no lock;
    - a preview lives in the zoo's scratch model, under its own lock; its hook-setting work
      takes the main lock only when it also runs the experts (``experts``: a drift table
      without the experts' cached streams), so a preview's drift is drawn while the exact
      run holds the main lock;
    - base and merged models (every page uses them) are used under the main lock.
    """
    if ref.kind == "preview":
        prev = _calibrated_run(source, fp, ref.merger, ref.from_run)
        model = _scratch(source, fp)
        with torch_lock(source, workers.scratch_lock()), torch_lock(source) if hooks and experts else nullcontext():
            holds = (ref, id(prev), id(model))
            if _SCRATCH_HOLDS.get((source, fp)) != holds:  # its scores, cosines and drift: one write
                _SCRATCH_HOLDS.pop((source, fp), None)
                preparing = _preparing(prev.report)
                if preparing is not None:  # under way: wait for it rather than decompose twice
                    preparing.result()
                elif prev.report.preview_state is None:
                    raise RuntimeError(
                        f"the exact run at {ref.from_run.point_label} no longer keeps its statistics "
                        "(a newer run replaced it). Fix: move a slider again to preview from the latest run."
                    )
                else:  # never started (the page moved on before its end)
                    compute.prepare_preview(prev.report.preview_state)
                compute.load_preview(model, prev.model, prev.report, ref.cal.config)
                _SCRATCH_HOLDS[(source, fp)] = holds
            yield model
    elif ref.kind == "calibrated":
        model = _calibrated_run(source, fp, ref.merger, ref.cal).model
        with torch_lock(source, None if hooks else nullcontext()):
            yield copy.deepcopy(model) if hooks else model
    else:
        model = _zoo(source, device()).base if ref.kind == "base" else merged_model(source, fp, ref.merger)
        with torch_lock(source):
            yield model


# ============================================================================ 3. results


@st.cache_resource(max_entries=4, show_spinner=False)
def expert_side(source: str, fp: str, max_per_task: int | None) -> compute.ExpertSide:
    """The experts' logits and features on the live subsets (they never change); a smaller
    test subset's (the preview's) are the first rows of the live one's."""
    if max_per_task is not None and max_per_task < live_test(source):
        live = expert_side(source, fp, live_test(source))
        logits = {t: v[:max_per_task] for t, v in live.logits.items()}
        return compute.ExpertSide(max_per_task, logits, live.features)
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    with torch_lock(source):
        return compute.expert_side(zoo, data, max_per_task)


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs=HASH_FUNCS)
def output_scores(source: str, fp: str, ref: ModelRef, max_per_task: int | None) -> dict[str, pd.DataFrame]:
    """Output drift (KL, agreement, accuracy) on the test split, task-vector cosine:
    ``{"output", "task_vector"}``."""
    zoo = _zoo(source, device())
    side = expert_side(source, fp, max_per_task)
    with model_of(source, fp, ref, hooks=False) as model:
        return compute.output_scores(model, zoo, side)


_OWN_STREAMS: OrderedDict[tuple, object] = OrderedDict()  # (source, fp, ref) -> the model's held-out streams
_OWN_LOCK = threading.Lock()


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs=HASH_FUNCS)
def cosine_scores(source: str, fp: str, ref: ModelRef) -> pd.DataFrame:
    """Expert cosine on the held-out subset (the experts' features do not depend on the
    test subset's size, so any cached side serves). The model's streams are kept on the way
    (when the experts' are) for its :func:`drift`, which then runs its blocks only on the
    experts' streams (the worker computes the two in turn; a preview, the script). Only the
    model is hooked, so a preview's pass takes the scratch lock alone, not the exact run's."""
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    side = expert_side(source, fp, live_test(source))
    keep = expert_streams(source, fp) is not None
    with model_of(source, fp, ref, hooks=keep, experts=False) as model:
        if not keep:
            return compute.cosine_scores(model, zoo, data, side)
        frame, own = compute.cosine_scores_and_streams(model, zoo, data, side)
    with _OWN_LOCK:
        _OWN_STREAMS[(source, fp, ref)] = own
        while len(_OWN_STREAMS) > 2:
            _OWN_STREAMS.popitem(last=False)
    return frame


def scores(source: str, fp: str, ref: ModelRef, max_per_task: int | None) -> dict[str, pd.DataFrame]:
    """``{"output", "task_vector"}`` (:func:`output_scores`) and ``"expert_cosine"``
    (:func:`cosine_scores`; computed by :func:`start_heldout` when it was started)."""
    return {**output_scores(source, fp, ref, max_per_task), "expert_cosine": cosine_scores(source, fp, ref)}


@st.cache_resource(max_entries=2, show_spinner=False)
def expert_streams(source: str, fp: str):
    """The experts' streams on the held-out subset, at every block (they never change;
    None when too large to keep, see :func:`app.compute.expert_streams`)."""
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    with torch_lock(source):
        return compute.expert_streams(zoo, data)


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs=HASH_FUNCS)
def drift(source: str, fp: str, ref: ModelRef) -> pd.DataFrame:
    """:func:`diagnostics.drift_table` of the model on the held-out subset."""
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    cache = expert_streams(source, fp)
    with _OWN_LOCK:
        own = _OWN_STREAMS.pop((source, fp, ref), None)  # kept by cosine_scores, else none
    with model_of(source, fp, ref, experts=cache is None) as model:
        return compute.drift(model, zoo, data, cache, own)


def start_heldout(source: str, fp: str, ref: ModelRef) -> Future:
    """Measure the expert cosine, then the drift (both on the held-out subset) on the worker
    thread, while the script scores the same model's outputs: about half the work each."""

    def both() -> pd.DataFrame:
        cosine_scores(source, fp, ref)
        return drift(source, fp, ref)

    return workers.submit(both)


@st.cache_data(max_entries=8, show_spinner=False)
def zoo_tables(source: str, fp: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The zoo's models (role, parameters, MB) and tasks (classes, split sizes)."""
    zoo = _zoo(source, device())
    return zoos.zoo_models(zoo), zoos.zoo_tasks(zoo)


@st.cache_data(max_entries=64, show_spinner=False)
def png(fig_json: str) -> bytes:
    """PNG bytes of a figure (kaleido; raises when no Chrome/Chromium is found)."""
    import plotly.io as pio

    from app import figures

    return figures.to_png(pio.from_json(fig_json))


def live_test(source: str) -> int:
    """Test examples per task the live view scores on the zoo ``source`` (:func:`app.compute.live_test`)."""
    return compute.live_test(_zoo(source, device()))


def live_note(zoo) -> str:
    live = compute.live_test(zoo)
    n = min(live, zoos.split_size(zoo, "test"))
    fewer = " (fewer on a language model: each is a pass of the whole model)" if live < compute.LIVE_TEST else ""
    return (
        f"Live view: accuracy, KL and agreement on the first {n} test examples per task{fewer}; drift and "
        f"cosines on {DIAG_N} held-out examples per task. Full-test-set evaluation on demand."
    )


def short_hash(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:8]


@st.cache_data(max_entries=4, show_spinner=False)
def expert_task_vectors(source: str, fp: str) -> pd.DataFrame:
    """:func:`diagnostics.task_vector_matrix` of the zoo's experts (constant for a zoo)."""
    from diagnostics import task_vector_matrix

    zoo = _zoo(source, device())
    with workers.torch_lock():
        return task_vector_matrix(zoo.base, zoo.experts)


@st.cache_data(max_entries=4, show_spinner=False)
def weight_views(source: str, fp: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The experts' weight-space views (:mod:`diagnostics.weights`): per tensor and per
    block (constant for a zoo)."""
    from diagnostics.weights import block_table, weight_table

    zoo = _zoo(source, device())
    matrix = expert_task_vectors(source, fp)
    with workers.torch_lock():
        table = weight_table(zoo.base, zoo.experts)
    return table, block_table(table, matrix)


@st.cache_resource(show_spinner=False)
def _memo() -> OrderedDict:
    return OrderedDict()


def memoized(fn, *args, keep: int = 16):
    """``fn(*args)``, remembered for the server by ``fn``'s name and ``repr(args)``: a cache
    for long jobs that draw their progress on the page (``st.cache_data`` forbids a cached
    function to write into the page's elements)."""
    key, memo = (fn.__module__, fn.__qualname__, repr(args)), _memo()
    if key not in memo:
        memo[key] = fn(*args)
        while len(memo) > keep:
            memo.popitem(last=False)
    return memo[key]

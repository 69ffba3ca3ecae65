"""The app's shared state: the zoo, its models and the tables computed from them, cached.

1. the zoo (``st.cache_resource``, shared by every browser tab): loaded once per source;
2. models: merged and calibrated models (with their kept statistics), data subsets, and
   :func:`model_of`, which resolves a :class:`~app.settings.ModelRef` to a model in use;
3. results (``st.cache_data``, keyed by the zoo's fingerprint and a ``ModelRef``): score
   and drift tables.

What the server shares between tabs and threads (the runs, previews, threads and locks) is
one :class:`~app.calibrations.Calibrations` (:func:`calibrations`), whose methods take the
locks; this module only caches around it. Cached functions resolve the resources they need
*before* a service method takes a lock and never call another cached function inside one,
so the locks and Streamlit's per-key cache locks cannot deadlock (docs/app.md).
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pandas as pd
import streamlit as st
import torch

from app import compute, st_patch, zoos
from app.calibrations import Calibrated, Calibrations, RunKey
from app.settings import HASH_FUNCS, AppCal, Merger, ModelRef

DIAG_N = compute.DIAG_N
device = zoos.device


@st.cache_resource(show_spinner=False)
def calibrations() -> Calibrations:
    """The server's one :class:`~app.calibrations.Calibrations`: runs, previews, threads, locks."""
    return Calibrations()


# ============================================================================ 1. the zoo


@st.cache_resource(show_spinner=False)
def _handed() -> dict:
    """``{spec path: (its text, zoo)}``: zoos the Zoo page's *Your models* form has just loaded from
    the spec it wrote (:func:`hand_over`), taken by :func:`_zoo` instead of loading them again."""
    return {}


def hand_over(path: str, text: str, zoo) -> None:
    """Give :func:`_zoo` the zoo (loaded on :func:`device`) that the spec ``text`` written at ``path`` makes."""
    _handed()[path] = (text, zoo)


def _taken(source: str):
    """The zoo handed over for ``source`` when the file still holds the text it was loaded from."""
    text, zoo = _handed().pop(source, (None, None))
    try:
        return zoo if text is not None and Path(source).read_text() == text else None
    except OSError:
        return None


@st.cache_resource(max_entries=2, show_spinner="Loading the zoo…")
def _zoo(source: str, dev: str):
    zoo = _taken(source) if dev == device() else None
    zoo = zoo if zoo is not None else zoos.load_zoo(source, dev)
    calibrations().zoo_loaded(source, zoo, dev)
    return zoo


def zoo_or_error(source: str) -> tuple[object | None, str | None]:
    """``(zoo, None)`` or ``(None, message naming the problem and the fix)``; never raises
    for a bad source (exceptions are not cached, so a fixed file loads on the next try)."""
    if not source:
        return None, "No zoo selected. Fix: enter the path of a zoo spec YAML (or pick the embedded demo)."
    try:
        if calibrations().needs_build(source):
            _build_with_progress(source)
        return _zoo(source, device()), None
    except Exception as exc:  # shown to the user, never as a traceback
        return None, zoos.explain_load_error(source, exc)


def _build_with_progress(source: str) -> None:
    """Build the demo zoo ``source`` with a progress bar on the page (stage, step, time left)."""
    box = st.empty()
    with box.container():
        st.info(f"Building the `{source}` zoo offline: first use on this machine, cached afterwards.")
        progress = st.progress(0.0, text="Starting…")
    calibrations().build_zoo(
        source,
        lambda p: progress.progress(p.fraction, text=p.describe()),
        waiting=lambda: progress.progress(0.0, text="Waiting for another session's build…"),
    )
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
    return calibrations().on_shared_models(source, lambda: zoo.merged(merger.method, **merger.kwargs))


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


def ahead_store():
    """The exact runs computed ahead of the sliders (:mod:`app.ahead`)."""
    return calibrations().ahead


@st.cache_resource(max_entries=2, show_spinner=False)
def _expert_trace(source: str, fp: str, n: int):
    """What the exact runs on this zoo and calibration size compute of the experts, kept
    from run to run (as much as fits, see :func:`app.compute.expert_trace`)."""
    return compute.expert_trace()


def exact_run(source: str, fp: str, merger: Merger, cal: AppCal, on_block=None) -> Calibrated:
    """The exact forward-order FeatCal run (kept statistics included), uncached (``on_block``:
    :func:`featcal.calibrate`'s)."""
    zoo, merged = _zoo(source, device()), merged_model(source, fp, merger)
    data, trace = calib_data(source, fp, cal.n), _expert_trace(source, fp, cal.n)
    return calibrations().exact_run(source, zoo, merged, data, trace, cal, on_block)


@st.cache_resource(max_entries=4, show_spinner=False, hash_funcs=HASH_FUNCS)
def calibrated(source: str, fp: str, merger: Merger, cal: AppCal) -> Calibrated:
    """:func:`exact_run`, cached; taken from the runs computed ahead when it is there."""
    return calibrations().calibrated(
        (source, fp, merger, cal), lambda on_block: exact_run(source, fp, merger, cal, on_block)
    )


def blocks_done(source: str, fp: str, merger: Merger, cal: AppCal) -> tuple[int, int] | None:
    """``(blocks done, blocks)`` of :func:`calibrated`'s run of ``cal`` while it runs, else None."""
    return calibrations().blocks_done((source, fp, merger, cal))


def prepare_preview(run: Calibrated) -> None:
    """:meth:`~app.calibrations.Calibrations.prepare_preview`: the next preview's one-off work."""
    calibrations().prepare_preview(run)


def last_seconds() -> float | None:
    """The wall seconds of the latest exact run on any zoo (a progress estimate), or None."""
    return calibrations().last_seconds()


def start_calibration(source: str, fp: str, merger: Merger, cal: AppCal) -> Future:
    """Start the exact run on the worker thread (while the script scores the preview on the
    other core); :func:`calibrated` then returns its result once it is cached."""
    return calibrations().submit(calibrated, source, fp, merger, cal)


def preview_from(source: str, fp: str, merger: Merger, cal: AppCal):
    """:meth:`~app.calibrations.Calibrations.preview_from` (a context: the exact run to preview
    ``cal`` from, or None)."""
    return calibrations().preview_from((source, fp, merger, cal))


def to_compute(source: str, fp: str, merger: Merger, cal: AppCal) -> bool:
    """Whether the exact run of ``cal`` is neither run nor computed ahead (so far as is known)."""
    return calibrations().to_compute((source, fp, merger, cal))


def was_run(source: str, fp: str, merger: Merger, cal: AppCal) -> bool:
    """Whether the exact run of ``cal`` has been computed on this server (cached, unless evicted)."""
    return calibrations().was_run((source, fp, merger, cal))


def _calibrated_run(key: RunKey) -> Calibrated:
    return calibrations().run_of(key) or calibrated(*key)


def on_shared_models(source: str, job):
    """``job()`` on the zoo's shared models, one at a time (a sweep, a study, a save)."""
    return calibrations().on_shared_models(source, job)


@contextmanager
def model_of(
    source: str, fp: str, ref: ModelRef, hooks: bool = True, experts: bool = True
) -> Iterator[torch.nn.Module]:
    """The model ``ref`` names, in use under the lock it needs (resolved before it).

    ``hooks``: the computation sets hooks (a drift table) rather than only calling the
    model (scores with the experts' cached outputs); ``experts``: it also runs the experts
    (a drift table without their cached streams). What lets an exact run, its drift and a
    preview's scores run side by side on two cores (docs/app.md):

    - hook-setting work on a calibrated model runs on a private copy under the shared lock,
      so nobody ever hooks a cached calibrated model and scoring one needs no lock;
    - a preview lives in the zoo's scratch model, under its own lock; its hook-setting work
      takes the shared lock only when it also runs the experts, so a preview's drift is
      drawn while the exact run holds the shared lock;
    - base and merged models (every page uses them) are used under the shared lock.
    """
    service = calibrations()
    if ref.kind == "preview":
        run, zoo = _calibrated_run((source, fp, ref.merger, ref.from_run)), _zoo(source, device())
        with service.preview(source, fp, ref, run, zoo, hooks=hooks and experts) as model:
            yield model
    elif ref.kind == "calibrated":
        run = _calibrated_run((source, fp, ref.merger, ref.cal))
        with service.calibrated_model(source, run.model, hooks) as model:
            yield model
    else:
        shared = _zoo(source, device()).base if ref.kind == "base" else merged_model(source, fp, ref.merger)
        with service.shared_model(source, shared) as model:
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
    return on_shared_models(source, lambda: compute.expert_side(zoo, data, max_per_task))


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs=HASH_FUNCS)
def output_scores(source: str, fp: str, ref: ModelRef, max_per_task: int | None) -> dict[str, pd.DataFrame]:
    """Output drift (KL, agreement, accuracy) on the test split, task-vector cosine:
    ``{"output", "task_vector"}``."""
    zoo = _zoo(source, device())
    side = expert_side(source, fp, max_per_task)
    with model_of(source, fp, ref, hooks=False) as model:
        return compute.output_scores(model, zoo, side)


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
    calibrations().keep_streams((source, fp, ref), own)
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
    return on_shared_models(source, lambda: compute.expert_streams(zoo, data))


@st.cache_data(max_entries=256, show_spinner=False, hash_funcs=HASH_FUNCS)
def drift(source: str, fp: str, ref: ModelRef) -> pd.DataFrame:
    """:func:`diagnostics.drift_table` of the model on the held-out subset."""
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    cache = expert_streams(source, fp)
    own = calibrations().take_streams((source, fp, ref))  # kept by cosine_scores, else none
    with model_of(source, fp, ref, experts=cache is None) as model:
        return compute.drift(model, zoo, data, cache, own)


def start_heldout(source: str, fp: str, ref: ModelRef) -> Future:
    """Measure the expert cosine, then the drift (both on the held-out subset) on the worker
    thread, while the script scores the same model's outputs: about half the work each."""

    def both() -> pd.DataFrame:
        cosine_scores(source, fp, ref)
        return drift(source, fp, ref)

    return calibrations().submit(both)


@st.cache_data(max_entries=8, show_spinner=False)
def zoo_tables(source: str, fp: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The zoo's models (role, parameters, MB) and tasks (classes or scorer, split sizes)."""
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
    """What the live scores are computed on, then :func:`accuracy_note`."""
    live = compute.live_test(zoo)
    n = min(live, zoos.split_size(zoo, "test"))
    fewer = " (fewer on a language model: each is a pass of the whole model)" if live < compute.LIVE_TEST else ""
    return (
        f"Live view: accuracy, KL and agreement on the first {n} test examples per task{fewer}; drift and "
        f"cosines on {DIAG_N} held-out examples per task. Full-test-set evaluation on demand.{accuracy_note(zoo)}"
    )


def accuracy_note(zoo) -> str:
    """On a language-model zoo (decoder or encoder-decoder) the pages' accuracy, on a live subset or
    a full split alike, is the reply's first token (:meth:`featcal.zoo.score.lm.LMZoo.logits`), not the
    whole reply scored as the Compare page and the paper score it: the two differ (on a random
    stand-in, 22% here and 0% there), so every page that shows it says which it is. Empty elsewhere."""
    from featcal.zoo.score.lm import LMZoo

    if not isinstance(zoo, LMZoo):
        return ""
    return (
        " Accuracy here: the reply's first token is the reference's (the Compare page scores the whole generated "
        "reply, with each task's metric)."
    )


def compare_score_note(zoo) -> str:
    """What the Compare page's scores are: test accuracy, or on a language-model zoo each task's
    metric on the whole greedy reply (:meth:`featcal.zoo.score.lm.LMZoo.score`)."""
    from featcal.zoo.score.lm import LMZoo

    if isinstance(zoo, LMZoo):
        return "Average test score: each task's metric on the whole generated reply (not the first token)"
    return "Average test accuracy"


def short_hash(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:8]


@st.cache_data(max_entries=4, show_spinner=False)
def expert_task_vectors(source: str, fp: str) -> pd.DataFrame:
    """:func:`diagnostics.task_vector_matrix` of the zoo's experts (constant for a zoo)."""
    from diagnostics import task_vector_matrix

    zoo = _zoo(source, device())
    return on_shared_models(source, lambda: task_vector_matrix(zoo.base, zoo.experts))


@st.cache_data(max_entries=4, show_spinner=False)
def weight_views(source: str, fp: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The experts' weight-space views (:mod:`diagnostics.weights`): per tensor and per
    block (constant for a zoo)."""
    from diagnostics.weights import block_table, weight_table

    zoo = _zoo(source, device())
    matrix = expert_task_vectors(source, fp)
    table = on_shared_models(source, lambda: weight_table(zoo.base, zoo.experts))
    return table, block_table(table, matrix)


def memoized(fn, *args, keep: int = 16):
    """:meth:`~app.calibrations.Calibrations.memoized`: ``fn(*args)``, remembered for the server."""
    return calibrations().memoized(fn, *args, keep=keep)

"""The app's state: settings widgets (mirrored in the URL), the zoo picker, and the caches.

Layers, one way:

1. settings (:mod:`app.settings`, re-exported here): small frozen values read from the
   widgets, bound to the URL and kept for the whole session;
2. resources (``st.cache_resource``, shared by every browser tab): the zoo, merged and
   calibrated models with their kept statistics, the data subsets;
3. results (``st.cache_data``, keyed by the zoo fingerprint and a *model reference*, a
   tuple naming the model and every hyper-parameter that made it): diagnostics tables.

Torch work on shared models runs under one process-wide lock (hooks on a shared
expert must not interleave between tabs). Cached functions resolve the resources
they need *before* taking the lock and never call another cached function while
holding it, so the lock and Streamlit's per-key cache locks cannot deadlock.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pandas as pd
import streamlit as st
import torch

from app import compute
from app.settings import (BIND, CAL_DEFAULTS, CAL_SIZES, DEFAULT_N, MERGE_METHODS, PREVIEW_AFTER_S,  # noqa: F401
                          CalSettings, Merger, calibration_controls, current_calibration, current_merger,
                          merger_controls)

REPO = compute.REPO
OTHER = "other (path)…"

LIVE_TEST, DIAG_N = compute.LIVE_TEST, compute.DIAG_N


# ============================================================================ zoo picker

def zoo_choices() -> list[str]:
    specs = sorted(str(p.relative_to(REPO)) for p in (REPO / "assets" / "zoos").glob("*.yaml"))
    return ["demo", "demo-fashion", *specs, OTHER]   # the first is the default


def zoo_picker() -> str:
    """The sidebar zoo selector; returns the zoo source (``demo``, a spec path, a zoo directory)."""
    choices = zoo_choices()
    pick = st.sidebar.selectbox("Zoo", choices, index=0, key="zoo", **BIND,
                                help="The embedded demo builds offline on first use. A spec YAML names a base, "
                                     "experts, heads and data found locally or in the HF cache (never downloaded).")
    if pick != OTHER:
        return pick
    path = st.sidebar.text_input("Zoo spec (YAML) or zoo directory", key="zoo_path", **BIND,
                                 placeholder="~/zoos/my-zoo.yaml")
    return path.strip()


device = compute.device


_THREADS: dict[tuple[str, bool], int] = {}   # torch CPU threads per (zoo source, alone) (see torch_lock)


@st.cache_resource(max_entries=2, show_spinner="Loading the zoo (the demo builds offline on first use, ~3 min)…")
def _zoo(source: str, dev: str):
    zoo = compute.load_zoo(source, dev)
    for alone in (False, True):
        _THREADS[source, alone] = compute.cpu_threads(zoo, dev, alone)
    return zoo


def zoo_or_error(source: str) -> tuple[object | None, str | None]:
    """``(zoo, None)`` or ``(None, message naming the problem and the fix)``; never raises
    for a bad source (exceptions are not cached, so a fixed file loads on the next try)."""
    if not source:
        return None, "No zoo selected. Fix: enter the path of a zoo spec YAML (or pick the embedded demo)."
    try:
        return _zoo(source, device()), None
    except Exception as exc:  # noqa: BLE001 — shown to the user, never as a traceback
        return None, compute.explain_load_error(source, exc)


def active_source() -> str:
    """The zoo source the main script picked for this run.

    Streamlit runs a page file on its own (its "pages/ directory" mode, kept for old
    apps) on a server's very first run when that run starts at a page URL; st.navigation
    switches the mode off only once the main script has run. Such a run finds no source:
    it switches the mode off and reruns, now through the main script.
    """
    if "_zoo_source" not in st.session_state:
        from streamlit.runtime.pages_manager import PagesManager

        PagesManager.uses_pages_directory = False
        st.rerun()
    return st.session_state["_zoo_source"]


def active_zoo():
    """The zoo the sidebar picked (the main script has loaded it already)."""
    return _zoo(active_source(), device())


def fingerprint(source: str) -> str:
    return compute.fingerprint(active_zoo() if source == active_source() else _zoo(source, device()), source)


# ============================================================================ 2. resources

@st.cache_resource(show_spinner=False)
def _lock() -> threading.RLock:
    return threading.RLock()


@st.cache_resource(show_spinner=False)
def _scratch_lock() -> threading.RLock:
    return threading.RLock()


def _set_threads(source: str | None, alone: bool = False) -> None:
    if source is None:
        try:
            source = st.session_state.get("_zoo_source")
        except Exception:  # noqa: BLE001 — a worker thread has no session
            source = None
    threads = _THREADS.get((source or "", alone)) or (min(_THREADS.values()) if _THREADS else None)
    if threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_lock(source: str | None = None, lock=None, alone: bool = False) -> Iterator[None]:
    """Run torch work on the shared models: one at a time (``lock``, by default the one
    every hook-setting or shared-model computation takes; a ``nullcontext`` for none),
    without autograd, with the zoo's CPU thread count (set on every call: it is per thread;
    ``alone``: for work that has the machine to itself, :func:`app.compute.cpu_threads`)."""
    with (lock or _lock()), torch.no_grad():
        _set_threads(source, alone)
        yield


@st.cache_resource(max_entries=4, show_spinner=False)
def merged_model(source: str, fp: str, merger: Merger):
    zoo = _zoo(source, device())
    with torch_lock(source):
        return zoo.merged(merger.method, **dict(merger.params))


@st.cache_resource(max_entries=6, show_spinner=False)
def calib_data(source: str, fp: str, n: int, split: str = "calib", seed: int = 42) -> dict:
    zoo = _zoo(source, device())
    return zoo.calib_data(n, seed=seed, split=split)


def diag_data(source: str, fp: str) -> dict:
    """The held-out subset the drift and cosines are measured on (``val``, else ``calib``)."""
    zoo = _zoo(source, device())
    split = "val" if "val" in compute.splits_of(zoo) else "calib"
    n = min(DIAG_N, compute.split_size(zoo, split))
    return calib_data(source, fp, n, split=split, seed=0)


@dataclass
class Calibrated:
    model: torch.nn.Module
    report: object          # featcal.CalibrationReport, with preview_state
    seconds: float


class _Runs:
    """The latest exact run per (zoo, merger, statistics structure), kept alive for the
    instant preview even after the calibration cache evicts it."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.lock = threading.Lock()
        self.latest: OrderedDict[tuple, tuple[CalSettings, Calibrated]] = OrderedDict()
        self.done: set[tuple] = set()

    def remember(self, key: tuple, cal: CalSettings, run: Calibrated) -> None:
        with self.lock:
            self.latest[key] = (cal, run)
            self.latest.move_to_end(key)
            while len(self.latest) > self.keep:
                self.latest.popitem(last=False)
            self.done.add((key, cal))

    def base_for(self, key: tuple, cal: CalSettings) -> CalSettings | None:
        """The settings of the run to preview ``cal`` from, or None (exact already done / no run)."""
        with self.lock:
            if (key, cal) in self.done or key not in self.latest:
                return None
            return self.latest[key][0]

    def run(self, key: tuple, cal: CalSettings) -> Calibrated | None:
        with self.lock:
            hit = self.latest.get(key)
            return hit[1] if hit is not None and hit[0] == cal else None


@st.cache_resource(show_spinner=False)
def _runs() -> _Runs:
    return _Runs()


@st.cache_resource(max_entries=2, show_spinner=False)
def _expert_trace(source: str, fp: str, n: int):
    """What the exact runs on this zoo and calibration size compute of the experts, kept
    from run to run (None when too large, see :func:`app.compute.expert_trace`)."""
    zoo = _zoo(source, device())
    data = calib_data(source, fp, n)
    with torch_lock(source):
        return compute.expert_trace(zoo, data)


@st.cache_resource(max_entries=4, show_spinner=False)
def calibrated(source: str, fp: str, merger: Merger, cal: CalSettings) -> Calibrated:
    """The exact forward-order FeatCal run (kept statistics included)."""
    zoo = _zoo(source, device())
    merged = merged_model(source, fp, merger)
    data = calib_data(source, fp, cal.n)
    trace = _expert_trace(source, fp, cal.n)
    with torch_lock(source, alone=True):      # nothing runs beside it until the preview's deadline
        t0 = time.perf_counter()
        model, report = compute.calibrate(merged, zoo, data, cal.lam, cal.rho, cal.alpha, cal.bias, cal.layernorm,
                                          trace)
        run = Calibrated(model, report, time.perf_counter() - t0)
    _runs().remember((source, fp, merger, cal.structure), cal, run)
    return run


@st.cache_resource(show_spinner=False)
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="featcal-exact")


def start_calibration(source: str, fp: str, merger: Merger, cal: CalSettings) -> Future:
    """Start the exact run on a worker thread (while the script scores the preview on the
    other core); :func:`calibrated` then returns its result once it is cached."""
    return _worker().submit(calibrated, source, fp, merger, cal)


def done_within(job: Future, seconds: float) -> bool:
    """Whether ``job`` finishes within ``seconds`` (waits at most that long)."""
    wait([job], timeout=seconds)
    return job.done()


def preview_base(source: str, fp: str, merger: Merger, cal: CalSettings) -> CalSettings | None:
    """The exact run whose kept statistics preview ``cal`` (None: exact is cached, or no run yet)."""
    return _runs().base_for((source, fp, merger, cal.structure), cal)


def _calibrated_run(source: str, fp: str, merger: Merger, cal: CalSettings) -> Calibrated:
    return _runs().run((source, fp, merger, cal.structure), cal) or calibrated(source, fp, merger, cal)


@st.cache_resource(max_entries=2, show_spinner=False)
def _scratch(source: str, fp: str) -> torch.nn.Module:
    """One model per zoo that previews are written into (under its own lock)."""
    return copy.deepcopy(_zoo(source, device()).base)


# ---------------------------------------------------------------- model references

def merged_ref(merger: Merger) -> tuple:
    return ("merged", merger.ref)


def calibrated_ref(merger: Merger, cal: CalSettings) -> tuple:
    return ("calibrated", merger.ref, cal.ref)


def preview_ref(merger: Merger, base: CalSettings, cal: CalSettings) -> tuple:
    return ("preview", merger.ref, base.ref, (cal.lam, cal.rho, cal.alpha))


@contextlib.contextmanager
def model_of(source: str, fp: str, ref: tuple, hooks: bool = True) -> Iterator[torch.nn.Module]:
    """The model a reference names, with the lock its use needs (resolved before it).

    ``hooks``: the computation sets hooks (a drift table) rather than only calling the
    model (scores with the experts' cached outputs). The rules that let an exact run, its
    drift and a preview's scores run side by side on two cores:

    - hook-setting work takes the main lock (experts are hooked only under it), and on a
      calibrated model runs on a private copy, so nobody ever hooks a cached calibrated
      model and scoring one needs no lock;
    - a preview lives in the zoo's scratch model, under its own lock;
    - base, experts and merged models (every page uses them) are used under the main lock.
    """
    zoo = _zoo(source, device())
    kind = ref[0]
    if kind == "preview":
        prev = _calibrated_run(source, fp, Merger(*ref[1]), CalSettings(*ref[2]))
        model = _scratch(source, fp)
        with torch_lock(source, _scratch_lock()), (torch_lock(source) if hooks else contextlib.nullcontext()):
            compute.load_preview(model, prev.model, prev.report, *ref[3])
            yield model
    elif kind == "calibrated":
        model = _calibrated_run(source, fp, Merger(*ref[1]), CalSettings(*ref[2])).model
        with torch_lock(source, None if hooks else contextlib.nullcontext()):
            yield copy.deepcopy(model) if hooks else model
    else:
        if kind == "base":
            model = zoo.base
        elif kind == "expert":
            model = zoo.experts[ref[1]]
        elif kind == "merged":
            model = merged_model(source, fp, Merger(*ref[1]))
        else:
            raise ValueError(f"unknown model reference {ref!r}")
        with torch_lock(source):
            yield model


def start_heldout(source: str, fp: str, ref: tuple) -> Future:
    """Measure the expert cosine, then the drift (both on the held-out subset) on the worker
    thread, while the script scores the same model's outputs: about half the work each."""
    def both() -> pd.DataFrame:
        cosine_scores(source, fp, ref)
        return drift(source, fp, ref)

    return _worker().submit(both)


# ============================================================================ 3. results

@st.cache_resource(max_entries=4, show_spinner=False)
def expert_side(source: str, fp: str, max_per_task: int | None) -> compute.ExpertSide:
    """The experts' logits and features on the live subsets (they never change)."""
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    with torch_lock(source):
        return compute.expert_side(zoo, data, max_per_task)


@st.cache_data(max_entries=256, show_spinner=False)
def output_scores(source: str, fp: str, ref: tuple, max_per_task: int | None = LIVE_TEST) -> dict[str, pd.DataFrame]:
    """Output drift (KL, agreement, accuracy) on the test split, task-vector cosine:
    ``{"output", "task_vector"}``."""
    zoo = _zoo(source, device())
    side = expert_side(source, fp, max_per_task)
    with model_of(source, fp, ref, hooks=False) as model:
        return compute.output_scores(model, zoo, side)


_OWN_STREAMS: OrderedDict[tuple, object] = OrderedDict()   # (source, fp, ref) -> the model's held-out streams
_OWN_LOCK = threading.Lock()


@st.cache_data(max_entries=256, show_spinner=False)
def cosine_scores(source: str, fp: str, ref: tuple) -> pd.DataFrame:
    """Expert cosine on the held-out subset (the experts' features do not depend on the
    test subset's size, so any cached side serves). Unless the model is a preview, its
    streams are kept on the way (when the experts' are) for its :func:`drift`, which then
    runs its blocks only on the experts' streams (the worker computes the two in turn)."""
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    side = expert_side(source, fp, LIVE_TEST)
    keep = ref[0] != "preview" and expert_streams(source, fp) is not None
    with model_of(source, fp, ref, hooks=keep) as model:
        if not keep:
            return compute.cosine_scores(model, zoo, data, side)
        frame, own = compute.cosine_scores_and_streams(model, zoo, data, side)
    with _OWN_LOCK:
        _OWN_STREAMS[(source, fp, ref)] = own
        while len(_OWN_STREAMS) > 2:
            _OWN_STREAMS.popitem(last=False)
    return frame


def scores(source: str, fp: str, ref: tuple, max_per_task: int | None = LIVE_TEST) -> dict[str, pd.DataFrame]:
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


@st.cache_data(max_entries=256, show_spinner=False)
def drift(source: str, fp: str, ref: tuple) -> pd.DataFrame:
    """:func:`diagnostics.drift_table` of the model on the held-out subset."""
    zoo = _zoo(source, device())
    data = diag_data(source, fp)
    cache = expert_streams(source, fp)
    with _OWN_LOCK:
        own = _OWN_STREAMS.pop((source, fp, ref), None)     # kept by cosine_scores, else none
    with model_of(source, fp, ref) as model:
        return compute.drift(model, zoo, data, cache, own)


@st.cache_data(max_entries=8, show_spinner=False)
def zoo_tables(source: str, fp: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The zoo's models (role, parameters, MB) and tasks (classes, split sizes)."""
    zoo = _zoo(source, device())
    return compute.zoo_models(zoo), compute.zoo_tasks(zoo)


@st.cache_data(max_entries=64, show_spinner=False)
def png(fig_json: str) -> bytes:
    """PNG bytes of a figure (kaleido; raises when no Chrome/Chromium is found)."""
    import plotly.io as pio

    from app import figures

    return figures.to_png(pio.from_json(fig_json))


def live_note(zoo) -> str:
    n = min(LIVE_TEST, compute.split_size(zoo, "test"))
    return (f"Live view: accuracy, KL and agreement on the first {n} test examples per task; drift and "
            f"cosines on {DIAG_N} held-out examples per task. Full-test-set evaluation on demand.")


def short_hash(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:8]

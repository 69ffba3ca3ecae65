"""The app's calibrations as one service, free of Streamlit: its exact runs and previews, the
threads they run on and the locks on the models they share.

:class:`Calibrations` owns everything the server shares between tabs and threads: the runs the
preview starts from (:class:`~app.runs.Latest`) and those computed ahead of the sliders
(:class:`~app.runs.Ahead`), the exact runs' block progress, the scratch models previews are
written into, the model streams the drift reuses, the worker and background threads, and the
locks. Its methods take the locks their work needs, so that nothing else does: :mod:`app.state`
wraps one instance per server in ``st.cache_*`` functions and passes it the models to use, and
the pages only draw. The threads, the locks and the life of a slider change: docs/app.md.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from app import compute, runs, warnlog, zoos
from app.settings import AppCal, Merger, ModelRef
from featcal.util.memory import trim_heap

# (source, fingerprint, merger, calibration): one exact run of the app
RunKey = tuple[str, str, Merger, AppCal]


@dataclass(eq=False)  # compared and hashed as itself: the bookkeeping of app.runs keys runs by identity
class Calibrated:
    """One exact run: the calibrated model, its report (with the statistics a preview
    re-solves, until released), its wall seconds."""

    model: nn.Module
    report: object  # featcal.CalibrationReport, with preview_state
    seconds: float
    prepared: Future | None = None  # its preview's one-off eigendecompositions, once started


def stats_bytes(run: Calibrated) -> int:
    preview = run.report.preview_state
    return 0 if preview is None else preview.nbytes()


def release_stats(run: Calibrated) -> None:
    """Free the statistics of a run no preview will start from again (its model stays cached)."""
    run.report.preview_state = None
    trim_heap()


@dataclass
class Scratch:
    """A zoo's scratch model and the preview written into it (a weak reference to its run:
    a newer run of the same settings is another preview)."""

    model: nn.Module
    ref: ModelRef | None = None
    run: weakref.ref | None = None

    def holds(self, ref: ModelRef, run: Calibrated) -> bool:
        return self.ref == ref and self.run is not None and self.run() is run


class Calibrations:
    """The server's exact runs, previews, threads and locks (one per server: :func:`app.state.calibrations`).

    Threads: the scripts (one per browser tab's run), :meth:`submit`'s worker (exact runs,
    held-out tables) and :meth:`in_background`'s (a preview's preparation, the look-ahead).
    Locks, never held while waiting for another thread's work:

    - ``shared``: every computation on the shared models (base, merged, experts: hooks on them
      must not interleave), and any that sets hooks (on a private copy of a cached calibrated model);
    - ``scratch``: the scratch models previews are written into (taken before ``shared``);
    - ``building``: one zoo build at a time;
    - ``tables``: this object's small tables (block progress, kept streams, threads, memo);
      held for a lookup only. :class:`~app.runs.Latest`, :class:`~app.runs.Ahead` and the
      warning log guard their own.
    """

    def __init__(self, budget: Callable[[], int] = compute.keep_budget):
        self.shared = threading.RLock()
        self.scratch = threading.RLock()
        self.building = threading.Lock()
        self.tables = threading.Lock()
        self.latest = runs.Latest(budget=budget, size=stats_bytes, release=release_stats)
        self.ahead = runs.Ahead()
        self.warnings = warnlog.WarningLog()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="featcal-exact")
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="featcal-prepare")
        self._threads: dict[tuple[str, bool], int] = {}  # (source, alone) -> torch CPU threads
        self._blocks: dict[RunKey, tuple[int, int]] = {}  # (blocks done, blocks) of the exact runs under way
        self._scratch: OrderedDict[tuple[str, str], Scratch] = OrderedDict()  # (source, fp) -> at most 2
        self._streams: OrderedDict[tuple, object] = OrderedDict()  # (source, fp, ref) -> the model's streams
        self._memo: OrderedDict[tuple, object] = OrderedDict()
        self._ready: set[str] = set()  # built-in zoos found loadable without a build

    # ------------------------------------------------------------------ threads and locks

    def zoo_loaded(self, source: str, zoo, device: str) -> None:
        """Set the torch CPU threads of the work on ``zoo`` (:func:`app.zoos.cpu_threads`)."""
        with self.tables:
            for alone in (False, True):
                self._threads[source, alone] = zoos.cpu_threads(zoo, device, alone)

    @contextlib.contextmanager
    def _torch(self, source: str, locks: tuple = (), alone: bool = False) -> Iterator[None]:
        """Torch work under ``locks`` (in that order; none for a private model), without
        autograd, with the zoo's CPU thread count (set on every call: it is per thread;
        ``alone``: work that has the machine to itself)."""
        with contextlib.ExitStack() as stack:
            for lock in locks:
                stack.enter_context(lock)
            stack.enter_context(torch.no_grad())
            with self.tables:
                threads = self._threads.get((source, alone)) or min(self._threads.values(), default=None)
            if threads:
                torch.set_num_threads(threads)
            yield

    def on_shared_models(self, source: str, job: Callable[[], object]):
        """``job()`` on the shared models of ``source``'s zoo (a sweep, a study, a comparison,
        a save): under the ``shared`` lock, without autograd."""
        with self._torch(source, (self.shared,)):
            return job()

    def submit(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the one worker thread (shared by all tabs, so jobs queue)."""
        return self._worker.submit(fn, *args)

    def in_background(self, fn, *args) -> Future:
        """Run ``fn(*args)`` on the background thread, for work nobody waits for yet (what makes
        the next preview quick, the look-ahead of :mod:`app.ahead`), so that it never queues in
        front of the worker's exact runs."""
        return self._background.submit(fn, *args)

    def needs_build(self, source: str) -> bool:
        """Whether loading ``source`` builds a built-in zoo first (a "no" is remembered)."""
        return zoos.zoo_needs_build(source, self._ready)

    def build_zoo(self, source: str, on_step, waiting: Callable[[], None]) -> None:
        """Build ``source``'s zoo (``on_step``: :func:`app.zoos.build_zoo`'s), one build at a
        time: ``waiting()`` first when another is under way, and no build when that one built it."""
        if self.building.locked():
            waiting()
        with self.building:
            if self.needs_build(source):
                zoos.build_zoo(source, on_step)

    # ------------------------------------------------------------------ exact runs

    def exact_run(self, source: str, zoo, merged, data: dict, trace, cal: AppCal, on_block=None) -> Calibrated:
        """The exact forward-order FeatCal of ``merged`` under ``cal.config`` (kept statistics
        included), with the machine to itself (``on_block``: :func:`featcal.calibrate`'s)."""
        with self._torch(source, (self.shared,), alone=True):  # nothing runs beside it until the preview's deadline
            t0 = time.perf_counter()
            try:
                model, report = compute.calibrate(merged, zoo, data, cal.config, trace, on_block)
            finally:
                trim_heap()  # the run's freed work: gigabytes on a language model
            return Calibrated(model, report, time.perf_counter() - t0)

    def calibrated(self, key: RunKey, run_exact: Callable[[Callable], Calibrated]) -> Calibrated:
        """The run of ``key``: the one computed ahead, else ``run_exact(on_block)`` (its blocks
        counted for :meth:`blocks_done`); remembered as the latest of its structure."""

        def on_block(block, info) -> None:
            with self.tables:
                self._blocks[key] = (info["done"], info["blocks"])

        try:
            run = self.ahead.take(key) or run_exact(on_block)
        finally:
            with self.tables:
                self._blocks.pop(key, None)
        self.latest.remember(_family(key), key[3], run)
        return run

    def blocks_done(self, key: RunKey) -> tuple[int, int] | None:
        """``(blocks done, blocks)`` of the exact run of ``key`` while it runs, else None."""
        with self.tables:
            return self._blocks.get(key)

    def run_of(self, key: RunKey) -> Calibrated | None:
        """The run of ``key`` if the preview starts from it or it was computed ahead, else None."""
        return self.latest.run(_family(key), key[3]) or self.ahead.peek(key)

    def was_run(self, key: RunKey) -> bool:
        """Whether the exact run of ``key`` has been computed on this server."""
        return (_family(key), key[3]) in self.latest.done

    def to_compute(self, key: RunKey) -> bool:
        """Whether the exact run of ``key`` is neither run nor computed ahead (so far as is known)."""
        return not self.was_run(key) and not self.ahead.has(key)

    def last_seconds(self) -> float | None:
        """The wall seconds of the latest exact run on any zoo (a progress estimate), or None."""
        return self.latest.seconds()

    # ------------------------------------------------------------------ previews

    @contextlib.contextmanager
    def preview_from(self, key: RunKey) -> Iterator[AppCal | None]:
        """The settings of the exact run whose kept statistics preview ``key`` (None: exact is
        done or computed ahead, or no run yet); they are kept until the block ends, even if the
        exact run of ``key`` finishes meanwhile and displaces that run."""
        if self.ahead.has(key):
            yield None
            return
        with self.latest.previewing(_family(key), key[3]) as from_run:
            yield from_run

    def prepare_preview(self, run: Calibrated) -> None:
        """Start ``run``'s preview's one-off eigendecompositions in the background: the next
        slider change previews from this run, and so no longer waits for them
        (benchmarks/README.md, 'Issue 28: a faster preview')."""
        preview = run.report.preview_state
        with self.tables:
            if preview is not None and run.prepared is None:
                run.prepared = self.in_background(compute.prepare_preview, preview)

    @contextlib.contextmanager
    def preview(self, source: str, fp: str, ref: ModelRef, run: Calibrated, zoo, hooks: bool) -> Iterator[nn.Module]:
        """``ref`` (a preview) written into the zoo's scratch model from ``run``'s kept
        statistics, once for its scores, cosines and drift; under the ``scratch`` lock, and the
        ``shared`` one too when the work ``hooks`` the shared experts."""
        with self._torch(source, (self.scratch, self.shared) if hooks else (self.scratch,)):
            scratch = self._scratch_of(source, fp, zoo)
            if not scratch.holds(ref, run):
                scratch.ref = scratch.run = None
                if run.prepared is not None:  # under way: wait for it rather than decompose twice
                    run.prepared.result()
                elif run.report.preview_state is None:
                    raise RuntimeError(
                        f"the exact run at {ref.from_run.point_label} no longer keeps its statistics "
                        "(a newer run replaced it). Fix: move a slider again to preview from the latest run."
                    )
                else:  # never started (the page moved on before its end)
                    compute.prepare_preview(run.report.preview_state)
                compute.load_preview(scratch.model, run.model, run.report, ref.cal.config)
                scratch.ref, scratch.run = ref, weakref.ref(run)
            yield scratch.model

    def _scratch_of(self, source: str, fp: str, zoo) -> Scratch:
        """The scratch model of the zoo (a copy of its base; the two latest zoos keep theirs)."""
        key = (source, fp)
        if key not in self._scratch:
            self._scratch[key] = Scratch(copy.deepcopy(zoo.base))
            while len(self._scratch) > 2:
                self._scratch.popitem(last=False)
        self._scratch.move_to_end(key)
        return self._scratch[key]

    # ------------------------------------------------------------------ models in use

    @contextlib.contextmanager
    def calibrated_model(self, source: str, model: nn.Module, hooks: bool) -> Iterator[nn.Module]:
        """A cached calibrated ``model`` to use: a private copy under the ``shared`` lock for
        work that sets hooks (so nobody hooks a cached model), else itself, with no lock."""
        if not hooks:
            with self._torch(source):
                yield model
            return
        with self._torch(source, (self.shared,)):
            yield copy.deepcopy(model)

    @contextlib.contextmanager
    def shared_model(self, source: str, model: nn.Module) -> Iterator[nn.Module]:
        """A shared ``model`` (base, merged, an expert) to use, under the ``shared`` lock."""
        with self._torch(source, (self.shared,)):
            yield model

    def keep_streams(self, key: tuple, streams) -> None:
        """Keep a model's held-out streams (the two latest) for the drift table that follows."""
        with self.tables:
            self._streams[key] = streams
            while len(self._streams) > 2:
                self._streams.popitem(last=False)

    def take_streams(self, key: tuple):
        """The streams :meth:`keep_streams` kept for ``key`` (they leave), else None."""
        with self.tables:
            return self._streams.pop(key, None)

    def memoized(self, fn, *args, keep: int = 16):
        """``fn(*args)``, remembered for the server by ``fn``'s name and ``repr(args)``: a cache
        for long jobs that draw their progress on the page (``st.cache_data`` forbids a cached
        function to write into the page's elements)."""
        key = (fn.__module__, fn.__qualname__, repr(args))
        with self.tables:
            if key in self._memo:
                return self._memo[key]
        value = fn(*args)
        with self.tables:
            self._memo[key] = value
            while len(self._memo) > keep:
                self._memo.popitem(last=False)
        return value


def _family(key: RunKey) -> tuple:
    """The runs that preview each other: same zoo, merger and statistics structure."""
    source, fp, merger, cal = key
    return (source, fp, merger, cal.structure)

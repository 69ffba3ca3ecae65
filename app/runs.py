"""Bookkeeping of the app's exact runs, free of Streamlit: which run the instant preview
starts from (:class:`Latest`), and the runs computed ahead of the sliders (:class:`Ahead`,
driven by :mod:`app.ahead`). :class:`app.calibrations.Calibrations` owns one of each per server.

Runs are kept and counted by identity (the app's :class:`~app.calibrations.Calibrated` compares
as itself), never by ``id()``, which a collected run's successor may reuse."""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Callable, Iterator


class Latest:
    """The latest exact run per (zoo, merger, statistics structure): the runs the instant
    preview starts from, and the only ones that keep their statistics (gigabytes on a
    language model); and every (key, settings) ever run, so a setting already run is not
    previewed.

    At most ``keep`` keys, and only as many as fit in ``budget()`` bytes (each run measured
    by ``size``); the newest always stays. A run that leaves is handed to ``release`` (which
    frees its statistics) as soon as no preview reads it (:meth:`previewing`)."""

    def __init__(
        self,
        keep: int = 2,
        budget: Callable[[], int] | None = None,
        size: Callable[[object], int] = lambda run: 0,
        release: Callable[[object], None] = lambda run: None,
    ):
        self.keep, self.budget, self.size, self.release = keep, budget, size, release
        self.lock = threading.Lock()
        self.latest: OrderedDict[tuple, tuple[object, object]] = OrderedDict()
        self.done: set[tuple] = set()
        self.holders: Counter[object] = Counter()  # run -> previews reading it now
        self.leaving: dict[object, tuple[tuple, object]] = {}  # run -> (key, cal): left, still read

    def remember(self, key: tuple, cal, run) -> None:
        with self.lock:
            before = self.latest.get(key)
            self.latest[key] = (cal, run)
            self.latest.move_to_end(key)
            self.done.add((key, cal))
            gone = [] if before is None or before[1] is run else [(key, *before)]
            while len(self.latest) > 1 and (len(self.latest) > self.keep or self._over_budget()):
                old_key, (old_cal, old_run) = self.latest.popitem(last=False)
                gone.append((old_key, old_cal, old_run))
            free = []
            for old_key, old_cal, old_run in gone:
                if self.holders[old_run] > 0:
                    self.leaving[old_run] = (old_key, old_cal)
                else:
                    free.append(old_run)
        for old_run in free:
            self.release(old_run)

    def _over_budget(self) -> bool:
        if self.budget is None:
            return False
        return sum(self.size(run) for _, run in self.latest.values()) > self.budget()

    @contextmanager
    def previewing(self, key: tuple, cal) -> Iterator[object | None]:
        """The settings of the run to preview ``cal`` from, or None (exact already done / no
        run); that run keeps its statistics until the block ends, even if a newer run
        displaces it meanwhile."""
        with self.lock:
            run = None
            if (key, cal) not in self.done and key in self.latest:
                from_cal, run = self.latest[key]
                self.holders[run] += 1
        try:
            yield None if run is None else from_cal
        finally:
            if run is not None:
                self._unhold(run)

    def _unhold(self, run) -> None:
        with self.lock:
            self.holders[run] -= 1
            if self.holders[run] > 0:
                return
            del self.holders[run]
            left = self.leaving.pop(run, None)
        if left is not None:
            self.release(run)

    def run(self, key: tuple, cal):
        """The run of ``cal`` if it is the latest of ``key`` or still read after leaving, else None."""
        with self.lock:
            hit = self.latest.get(key)
            if hit is not None and hit[0] == cal:
                return hit[1]
            return next((r for r, (k, c) in self.leaving.items() if k == key and c == cal), None)

    def kept(self) -> list:
        """The runs kept now (the latest of each key, and those left but still read)."""
        with self.lock:
            return [run for _, run in self.latest.values()] + list(self.leaving)

    def seconds(self) -> float | None:
        """The wall seconds of the latest run (a progress estimate), or None."""
        with self.lock:
            return next((run.seconds for _, run in reversed(self.latest.values())), None)


class Ahead:
    """Exact runs started before anyone asked for them, by key: at most ``keep``, the oldest
    dropped first. Each is a :class:`~concurrent.futures.Future`, so whoever needs one that is
    still being computed waits for it instead of computing it twice. ``generation`` counts
    the changes that tell the work under way to stop (:meth:`stop`)."""

    def __init__(self, keep: int = 8):
        self.keep = keep
        self.lock = threading.Lock()
        self.generation = 0
        self.runs: OrderedDict[tuple, Future] = OrderedDict()
        self.wanted: set[tuple] = set()  # keys someone has asked for (:meth:`peek`): never stopped

    def stop(self) -> None:
        """A new setting is on the page: work started for an older one stops at its next step."""
        with self.lock:
            self.generation += 1

    def current(self, generation: int) -> bool:
        return self.generation == generation

    def has(self, key: tuple) -> bool:
        with self.lock:
            return key in self.runs

    def reserve(self, key: tuple) -> Future | None:
        """A new future for ``key`` (its computer sets the result), or None if it has one."""
        with self.lock:
            if key in self.runs:
                return None
            self.runs[key] = future = Future()
            while len(self.runs) > self.keep:
                self.wanted.discard(self.runs.popitem(last=False)[0])
            return future

    def drop(self, key: tuple) -> None:
        with self.lock:
            self.runs.pop(key, None)
            self.wanted.discard(key)

    def is_wanted(self, key: tuple) -> bool:
        """Whether someone waits for (or took) ``key``'s run: its computer should not stop it."""
        with self.lock:
            return key in self.wanted

    def peek(self, key: tuple):
        """The run for ``key`` (waiting while it is computed, which then goes on to the end
        even if its work is told to stop), or None: none, or it failed or was stopped."""
        with self.lock:
            future = self.runs.get(key)
            if future is not None:
                self.wanted.add(key)
        if future is None or future.exception() is not None:
            return None
        return future.result()

    def take(self, key: tuple):
        """:meth:`peek`, and the run leaves this store (its taker caches it from now on)."""
        run = self.peek(key)
        self.drop(key)
        return run

"""Bookkeeping of the app's exact runs, free of Streamlit: which run the instant preview
starts from (:class:`Latest`), and the runs computed ahead of the sliders (:class:`Ahead`,
driven by :mod:`app.ahead`). :mod:`app.state` keeps one of each per server."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future


class Latest:
    """The latest exact run per (zoo, merger, statistics structure), kept alive for the
    instant preview even after the calibration cache evicts it; and every (key, settings)
    ever run, so a setting already run is not previewed."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.lock = threading.Lock()
        self.latest: OrderedDict[tuple, tuple[object, object]] = OrderedDict()
        self.done: set[tuple] = set()

    def remember(self, key: tuple, cal, run) -> None:
        with self.lock:
            self.latest[key] = (cal, run)
            self.latest.move_to_end(key)
            while len(self.latest) > self.keep:
                self.latest.popitem(last=False)
            self.done.add((key, cal))

    def preview_from(self, key: tuple, cal):
        """The settings of the run to preview ``cal`` from, or None (exact already done / no run)."""
        with self.lock:
            if (key, cal) in self.done or key not in self.latest:
                return None
            return self.latest[key][0]

    def run(self, key: tuple, cal):
        with self.lock:
            hit = self.latest.get(key)
            return hit[1] if hit is not None and hit[0] == cal else None

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

"""Progress bars: the one place featcal and diagnostics make one (tqdm underneath).

Usage::

    for task in bar(tasks, desc="experts", show=progress):
        ...
    with bar(total=len(jobs), desc="preview", unit="job", show=progress) as b:
        b.update()

A job of several stages that someone waits for (building a zoo) reports its
:class:`Progress` through a :class:`Tracker`: the same bars in the terminal, and a
callback (an app's progress bar) with the stage, the step and an estimate of the time left.
"""

from __future__ import annotations

import contextlib
import io
import math
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from tqdm.auto import tqdm

_LOCAL = threading.local()  # this thread's listener (see listening)


def bar(
    iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it", show: bool = True
) -> tqdm:
    """A tqdm bar over ``iterable`` (or counting to ``total``, advanced with ``update``) that
    disappears when done (in a terminal; written out complete, ``200/200``, into a log); with
    ``show=False`` it draws nothing and only passes the items on. Inside :func:`listening`, it
    also reports every step to the listener."""
    leave = not sys.stderr.isatty()  # a log keeps the finished bar, not its last refresh
    on_step = getattr(_LOCAL, "on_step", None)
    if on_step is None:
        return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not show, leave=leave)
    return _Reporting(iterable, on_step, total=total, desc=desc, unit=unit, show=show, leave=leave)


@contextlib.contextmanager
def listening(on_step: Callable[["Progress"], None]) -> Iterator[None]:
    """Within the block, every :func:`bar` this thread makes also reports its stage (the bar's
    ``desc``), step, total and time left to ``on_step`` (an app's progress bar), at most
    every quarter second and at its last step."""
    previous = getattr(_LOCAL, "on_step", None)
    _LOCAL.on_step = on_step
    try:
        yield
    finally:
        _LOCAL.on_step = previous


class _Reporting(tqdm):
    """A bar that reports to a listener (drawn only with ``show``)."""

    def __init__(self, iterable, on_step, total=None, show=True, every_s: float = 0.25, **kw):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self._on_step, self._every_s, self._t0, self._last = on_step, every_s, time.perf_counter(), -math.inf
        self._items = iterable
        super().__init__(iterable, total=total, file=None if show else _NULL, **kw)
        self._report(force=True)

    def __iter__(self):
        for item in self._items:
            yield item
            self.update(1)
        self.close()

    def update(self, n=1):
        out = super().update(n)
        self._report(force=self.total is not None and self.n >= self.total)
        return out

    def _report(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._last < self._every_s:
            return
        self._last = now
        total = self.total or 0
        fraction = min(1.0, self.n / total) if total else 0.0
        elapsed = now - self._t0
        eta = elapsed * (1 - fraction) / fraction if fraction > 0 and elapsed > 0.5 else None
        self._on_step(Progress(self.desc or "working", int(self.n), int(total), fraction, elapsed, eta))


class _Null(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


_NULL = _Null()


def note(message: str) -> None:
    """One line on stderr that does not break a progress bar being drawn (it goes above it)."""
    tqdm.write(message, file=sys.stderr)


@dataclass(frozen=True)
class Progress:
    """Where a long job is: its stage, the step within the stage, and the whole job's
    fraction done, seconds elapsed and estimated seconds left (None until measurable)."""

    stage: str
    step: int
    total: int
    fraction: float
    elapsed_s: float
    eta_s: float | None

    def describe(self) -> str:
        """``"pretrain base: step 300/800 (35% of the build, about 2 min left)"``."""
        left = "estimating the time left" if self.eta_s is None else f"about {_duration(self.eta_s)} left"
        return f"{self.stage}: step {self.step}/{self.total} ({100 * self.fraction:.0f}% done, {left})"


class Tracker:
    """The stages of one long job, each shown as a bar with its total, and reported to
    ``on_step(Progress)`` (at most every ``every_s`` seconds, and at each stage's start and end).

    ``total_work`` is the job's cost in arbitrary units; each step of a stage adds its ``work``.
    The estimate of the time left assumes the remaining units cost what the done ones did.
    """

    def __init__(
        self,
        total_work: float,
        on_step: Callable[[Progress], None] | None = None,
        show: bool = True,
        every_s: float = 0.25,
    ):
        self.total_work, self.on_step, self.show, self.every_s = max(total_work, 1e-9), on_step, show, every_s
        self.done, self.t0, self._last = 0.0, time.perf_counter(), -math.inf

    def steps(self, iterable: Iterable, desc: str, total: int | None = None, work: float = 1.0) -> Iterator:
        """Yield ``iterable``'s items under a bar called ``desc``, counting ``work`` per item."""
        total = len(iterable) if total is None else total
        self._report(desc, 0, total, force=True)
        step = 0
        for item in bar(iterable, total=total, desc=desc, show=self.show):
            yield item
            step += 1
            self.done += work
            self._report(desc, step, total, force=step == total)

    def advance(self, work: float) -> None:
        """Count ``work`` units done outside :meth:`steps` (a step too short for a bar)."""
        self.done += work

    def _report(self, stage: str, step: int, total: int, force: bool = False) -> None:
        now = time.perf_counter()
        if self.on_step is None or (not force and now - self._last < self.every_s):
            return
        self._last = now
        elapsed, fraction = now - self.t0, min(1.0, self.done / self.total_work)
        eta = elapsed * (1 - fraction) / fraction if fraction > 0.02 and elapsed > 1 else None
        self.on_step(Progress(stage, step, total, fraction, elapsed, eta))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds} s" if seconds < 90 else f"{seconds // 60} min {seconds % 60:02d} s"

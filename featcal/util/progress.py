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

import math
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from tqdm.auto import tqdm


def bar(
    iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it", show: bool = True
) -> tqdm:
    """A tqdm bar over ``iterable`` (or counting to ``total``, advanced with ``update``) that
    disappears when done; with ``show=False`` it draws nothing and only passes the items on."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not show, leave=False)


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

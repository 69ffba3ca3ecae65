"""Parameters as data: a :class:`Range` (what a slider spans, what a sweep searches, what a
method accepts) and :func:`option`, a dataclass field that carries its help text, range and
choices beside its default.

An options object is a frozen dataclass whose fields are declared with :func:`option`; the
method registry (:mod:`featcal.baselines.registry`) reads those fields, not a function's
signature, for ``--param`` checking, help and the app. :data:`featcal.config.RANGES` is the one
table of FeatCal's own ranges.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """A number's range: ``low`` to ``high`` is what the app's slider spans and ``featcal tune``
    searches, by ``step`` (decades when ``log``: the slider then moves ``log10`` of the value);
    ``accept`` is what a run takes, checked before any work (None: the method checks its own)."""

    low: float
    high: float
    step: float | None = None  # None: no slider
    log: bool = False
    accept: tuple[float, float] | None = None
    what: str = ""

    @property
    def slider(self) -> tuple[float, float, float]:
        """``(min, max, step)`` of a slider over this range (``log10`` of the value when ``log``)."""
        if self.log:
            return (math.log10(self.low), math.log10(self.high), self.step)
        return (self.low, self.high, self.step)

    def __iter__(self):
        """A range unpacks as its slider's ``(min, max, step)``."""
        return iter(self.slider)

    def admits(self, value: float) -> bool:
        """Whether a run takes ``value``: inside :attr:`accept`, ends included (always, without one)."""
        return self.accept is None or self.accept[0] <= value <= self.accept[1]


def option(default: Any, help: str, *, range: Range | None = None, choices: tuple | None = None) -> Any:
    """A field of an options dataclass: its ``default``, one line of ``help``, and where it has
    them the :class:`Range` of a number and the ``choices`` of a string."""
    return dataclasses.field(default=default, metadata={"help": help, "range": range, "choices": choices})

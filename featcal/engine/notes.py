"""What one :func:`featcal.calibrate` call has to say beyond its numbers (:class:`Notes`): collected
as the blocks are solved, said once when the run ends.

Two kinds: a *warning* is something the user can act on (a solve re-done in float64, float32
statistics that move the weights, a norm featcal leaves as merged): it goes to
``report.warnings`` and, once per kind and run, to Python's ``warnings``. A *note* is a fact about
the run that asks for nothing (a task with fewer token rows than a module is wide: the ridge
``lam + eps`` keeps the solve defined): it goes to ``report.notes`` only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from featcal.engine.report import CalibrationReport


def summarised(lines: list[str], first: int = 3, same: str = "re-solved the same way") -> list[str]:
    """The first ``first`` of ``lines`` and one line counting the rest (one per module could be hundreds)."""
    if len(lines) <= first:
        return list(lines)
    return lines[:first] + [f"... and {len(lines) - first} more modules {same}."]


@dataclass
class Notes:
    """The run's warnings and notes, by kind, in the order they came."""

    said: list[str] = field(default_factory=list)  # warnings every process has alike (e.g. untouched norms)
    rows: list[str] = field(default_factory=list)  # the first task with fewer rows than a module's width
    fallbacks: list[str] = field(default_factory=list)  # solves re-done in float64 (linalg.EigenSolve)
    precision: list[str] = field(default_factory=list)  # float32 solves with a large estimated error

    def thin_task(self, task: str, rows: int, name: str, block: int, width: int) -> None:
        """Note the first task that gives a module fewer token rows than its input width."""
        if not self.rows:
            self.rows.append(
                f"task {task!r} gives {rows} token rows for {name!r} (block {block}), fewer than its input "
                f"width {width}; the ridge (lam + eps) keeps the solve defined."
            )

    def solved(self, what: str, fallbacks: list[str], precision: list[str]) -> None:
        """What the solve of the module ``what`` (e.g. ``"block 3 mlp.fc1"``) had to say."""
        self.fallbacks += [f"{what}: {m}" for m in fallbacks]
        self.precision += [f"{what}: {m}" for m in precision]

    def gather(self, dist) -> None:
        """Under a process group: every rank's notes of the modules it solved, in rank order."""
        parts = dist.gather_objects((self.rows, self.fallbacks, self.precision), "gathering the warnings")
        self.rows = [m for r, _, _ in parts for m in r][:1]
        self.fallbacks = [m for _, f, _ in parts for m in f]
        self.precision = [m for _, _, p in parts for m in p]

    def publish(self, report: CalibrationReport, say: bool, stacklevel: int) -> None:
        """Into ``report.warnings`` (the per-module kinds summarised) and ``report.notes``; with
        ``say`` (one process of a group), each kind of warning said once, as one Python warning
        (``stacklevel``: from the caller's)."""
        kinds = [
            self.said,
            summarised(self.fallbacks),
            summarised(self.precision, same="with the same float32 precision warning"),
        ]
        for lines in kinds:
            report.warnings.extend(lines)
            if lines and say:
                warnings.warn("\n".join(lines), stacklevel=stacklevel + 1)
        report.notes.extend(self.rows)

"""What a calibration run did: per block and module, what was solved, the
relative residual before and after, and the time spent (:class:`CalibrationReport`); and what it has
to say beyond its numbers (:class:`Notes`), collected as the blocks are solved, said once when the
run ends.

Two kinds of saying: a *warning* is something the user can act on (a solve re-done in float64,
float32 statistics that move the weights, a norm featcal leaves as merged): it goes to
``report.warnings`` and, once per kind and run, to Python's ``warnings``. A *note* is a fact about
the run that asks for nothing (a task with fewer token rows than a module is wide: the ridge
``lam + eps`` keeps the solve defined): it goes to ``report.notes`` only."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from torch import nn

    from featcal.config import FeatCalConfig
    from featcal.engine.preview import Preview


RESIDUAL_ROSE = "the mean relative residual rose"  # how check_residuals' warning starts
RESIDUAL_NOISE = 1e-3  # a relative rise of the mean residual below this (or below 1e-6) is not warned of


@dataclass
class ModuleRecord:
    block: int
    name: str  # inside the block, e.g. "self_attn.q_proj", "attn.in_proj[k]"
    kind: str  # "linear" or "layernorm"
    d_in: int
    d_out: int
    rows: int  # fewest weighted rows of any task
    residual_before: float  # relative residual of the merged parameters
    residual_after: float  # relative residual of the calibrated parameters
    seconds: float  # solve time


@dataclass
class BlockRecord:
    block: int
    stats_seconds: float  # streams through the merged and expert blocks + statistics
    solve_seconds: float
    advance_seconds: float  # calibrated block applied to the calibrating streams


@dataclass
class CalibrationReport:
    config: "FeatCalConfig"
    blocks_path: str
    tasks: list[str]
    modules: list[ModuleRecord] = field(default_factory=list)
    blocks: list[BlockRecord] = field(default_factory=list)
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # what the user may act on (Notes)
    notes: list[str] = field(default_factory=list)  # facts about the run that ask for nothing
    preview_state: "Preview | None" = field(default=None, repr=False)

    def to_frame(self) -> "pd.DataFrame":
        import pandas as pd

        return pd.DataFrame([asdict(m) for m in self.modules])

    def to_dict(self) -> dict:
        return {
            "config": self.config.to_dict(),
            "blocks_path": self.blocks_path,
            "tasks": list(self.tasks),
            "seconds": self.seconds,
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "blocks": [asdict(b) for b in self.blocks],
            "modules": [asdict(m) for m in self.modules],
        }

    def save_json(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def mean_residuals(self) -> tuple[float, float]:
        """The mean relative residual over every module, ``(before, after)`` calibration."""
        n = max(len(self.modules), 1)
        return sum(m.residual_before for m in self.modules) / n, sum(m.residual_after for m in self.modules) / n

    def check_residuals(self) -> str | None:
        """When the mean relative residual rose (the calibrated model matches the experts'
        features worse than the merged one did), add a warning saying so and return it."""
        if not self.modules:
            return None
        before, after = self.mean_residuals()
        if not after > before + max(RESIDUAL_NOISE * before, 1e-6):  # (a smaller rise is rounding, not a worse fit)
            return None
        c = self.config
        msg = (
            f"{RESIDUAL_ROSE} from {before:.4g} to {after:.4g}: the calibrated model matches the experts' "
            f"features worse than the merged model did. The setting (lam {c.lam:g}, rho {c.rho:g}, alpha "
            f"{c.alpha:g}) may not suit this model: use the preset of its architecture or tune it (featcal tune)."
        )
        self.warnings = [w for w in self.warnings if not w.startswith(RESIDUAL_ROSE)] + [msg]
        return msg

    def summary(self, notes_at: str = "report.notes") -> str:
        """One line: modules, blocks, tasks, seconds, the mean relative residual before -> after,
        and how many notes there are, read at ``notes_at`` (the app names where it shows them)."""
        if not self.modules:
            return "nothing calibrated"
        before, after = self.mean_residuals()
        notes = f" ({len(self.notes)} note{'s' * (len(self.notes) != 1)}: {notes_at})" if self.notes else ""
        return (
            f"{len(self.modules)} modules in {len(self.blocks)} blocks, {len(self.tasks)} tasks, "
            f"{self.seconds:.2f} s; mean relative residual {before:.4f} -> {after:.4f}{notes}"
        )

    def preview(
        self, lam: float | None = None, rho: float | None = None, alpha: float | None = None, schedule=None
    ) -> "nn.Module":
        """A new model with every calibrated module re-solved for another (lam, rho, alpha) and
        per-block ``schedule`` (``FeatCalConfig.schedule``; None: the run's) from the statistics
        of this run. A *preview*: it ignores how earlier blocks' changes would move later
        features (an exact run does not). Needs ``keep_stats=True``."""
        if self.preview_state is None:
            raise RuntimeError("this report kept no statistics; run calibrate(..., keep_stats=True) to preview.")
        at = self.config.setting.replace(lam, rho, alpha)
        schedule = self.config.schedule if schedule is None else schedule
        return self.preview_state.model(self.config.with_(lam=at.lam, rho=at.rho, alpha=at.alpha, schedule=schedule))


# ------------------------------------------------------------------ what the run has to say


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

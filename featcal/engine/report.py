"""What a calibration run did: per block and module, what was solved, the
relative residual before and after, and the time spent."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd
    from torch import nn

    from featcal.config import FeatCalConfig
    from featcal.engine.preview import Preview


RESIDUAL_ROSE = "the mean relative residual rose"  # how check_residuals' warning starts


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
    warnings: list[str] = field(default_factory=list)  # what the user may act on (featcal.engine.notes)
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
        if not after > before:
            return None
        c = self.config
        msg = (
            f"{RESIDUAL_ROSE} from {before:.4f} to {after:.4f}: the calibrated model matches the experts' "
            f"features worse than the merged model did. The setting (lam {c.lam:g}, rho {c.rho:g}, alpha "
            f"{c.alpha:g}) may not suit this model: use the preset of its architecture or tune it (featcal tune)."
        )
        self.warnings = [w for w in self.warnings if not w.startswith(RESIDUAL_ROSE)] + [msg]
        return msg

    def summary(self) -> str:
        if not self.modules:
            return "nothing calibrated"
        before, after = self.mean_residuals()
        notes = f" ({len(self.notes)} note{'s' * (len(self.notes) != 1)}: report.notes)" if self.notes else ""
        return (
            f"{len(self.modules)} modules in {len(self.blocks)} blocks, {len(self.tasks)} tasks, "
            f"{self.seconds:.2f} s; mean relative residual {before:.4f} -> {after:.4f}{notes}"
        )

    def preview(self, lam: float | None = None, rho: float | None = None, alpha: float | None = None) -> "nn.Module":
        """A new model with every calibrated module re-solved for another (lam, rho, alpha)
        from the statistics of this run. A *preview*: it ignores how earlier blocks'
        changes would move later features (an exact run does not). Needs ``keep_stats=True``."""
        if self.preview_state is None:
            raise RuntimeError("this report kept no statistics; run calibrate(..., keep_stats=True) to preview.")
        return self.preview_state.model(self.config.setting.replace(lam, rho, alpha))

"""Running a paper table's rows on a zoo: merge, calibrate in order, score each task.

Every row sees the same calibration examples (``n`` per task from the zoo's ``calib`` split, drawn
with one seed) and is scored on the ``test`` split (the first ``max_test`` examples per task, or
all), as :mod:`diagnostics.compare` does; only the scores and the costs are kept (a reproduction
compares numbers with the paper's, not drift). Consecutive rows on the same merge (``ta``,
``ta+featcal``, ``ta+surgery``) share one merged model.

A method row merges and calibrates as ``featcal compare`` does (:mod:`featcal.baselines.runner`),
FeatCal from the table's preset (:data:`featcal.config.PRESETS`) with the row's changes to it
(``lam``, ``rho``, ``alpha``, ...); after a trained calibrator (ESCal, Surgery, SurgeryV2,
ProbSurgery) each task is scored with its own modules. ``experts``: each task's expert on its task;
``base``: the pretrained model.

A row's ``merge_seconds`` and ``calib_seconds`` are :class:`featcal.baselines.runner.Costs`'s: wall
clock, a trained calibrator's its training seconds, scoring excluded (the paper's efficiency table
times the calibration after Task Arithmetic, final evaluation excluded).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Mapping

from torch import nn

from featcal.baselines import registry, runner
from featcal.reproduce.plan import PlannedRow
from featcal.reproduce.tables import AVG
from featcal.util.progress import bar
from featcal.zoo.core import evaluate


@dataclass
class RowResult:
    """One row's outcome: ``scores`` ``{task: %}`` (empty for a row featcal does not run), the wall
    seconds of its merge and of its calibration chain, and the peak memory (MB, host and GPU) they
    took above what was in use."""

    planned: PlannedRow
    scores: dict[str, float] = field(default_factory=dict)
    merge_seconds: float = 0.0
    calib_seconds: float = 0.0
    peak_mb: float = float("nan")
    peak_gpu_mb: float | None = None

    def ours(self, metric: str = "score") -> dict[str, float]:
        """The row's cells as the table has them: ``{task: score, "avg": mean}``, or for an
        efficiency table ``{"seconds": calibration seconds}``; empty when the row did not run."""
        if not self.planned.runs:
            return {}
        if metric == "seconds":
            return {"seconds": self.calib_seconds}
        return {**self.scores, AVG: sum(self.scores.values()) / len(self.scores)}


def _score(zoo, models: Mapping[str, nn.Module], max_test: int | None) -> dict[str, float]:
    """Each task's score with its model (one call for all tasks when one model serves them all)."""
    distinct = {id(m) for m in models.values()}
    if len(distinct) == 1:
        return evaluate(next(iter(models.values())), zoo, max_per_task=max_test)
    scores: dict[str, float] = {}
    for task, model in models.items():
        scores.update(evaluate(model, zoo, tasks=[task], max_per_task=max_test))
    return scores


def run_row(zoo, row: PlannedRow, *, data: Callable, merged: Callable, preset: str, max_test, progress) -> RowResult:
    """Run and score one planned row; ``data(n)`` gives the calibration data, ``merged(row, data)``
    the (shared) merged model; a row featcal does not run comes back unscored."""
    result = RowResult(row)
    if not row.runs:
        return result
    if row.reference == "experts":
        result.scores = _score(zoo, dict(zoo.experts), max_test)
        return result
    if row.reference == "base":
        result.scores = _score(zoo, {t: zoo.base for t in zoo.tasks}, max_test)
        return result
    calib = data(row.n)
    shared = functools.partial(merged, row, calib)
    _, models, costs = runner.run(
        zoo, row.merger, row.chain, calib, row.params, preset=preset, progress=progress, get_merged=shared
    )
    result.merge_seconds, result.calib_seconds = costs.merge_seconds, costs.calib_seconds
    result.peak_mb, result.peak_gpu_mb = costs.peak_mb, costs.peak_gpu_mb
    result.scores = _score(zoo, models, max_test)
    return result


def run_rows(
    zoo,
    planned: list[PlannedRow],
    *,
    preset: str,
    seed: int = 42,
    max_test: int | None = None,
    progress: bool = True,
) -> list[RowResult]:
    """Run every planned row on ``zoo`` (see the module docstring), in order, with a progress bar
    over the rows; FeatCal with ``preset``; calibration draws seeded with ``seed``."""
    draws: dict[int, dict] = {}
    kept: dict[tuple, nn.Module] = {}

    def data(n: int) -> dict:
        if n not in draws:
            draws[n] = zoo.calib_data(n, seed=seed)
        return draws[n]

    def merged(row: PlannedRow, calib) -> nn.Module:
        with_data = registry.get(row.merger).kind == "data_merger"
        key = (row.merger, runner.params_key(row.params.get(row.merger)), row.n if with_data else None)
        if key not in kept:
            kept.clear()  # one merged model held at a time
            kept[key] = runner.merge(zoo, row.merger, calib, row.params.get(row.merger), progress)
        return kept[key]

    out = []
    for row in bar(planned, desc="reproduce", unit="row", show=progress):
        out.append(run_row(zoo, row, data=data, merged=merged, preset=preset, max_test=max_test, progress=progress))
    return out

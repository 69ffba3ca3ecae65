"""Running a paper table's rows on a zoo: merge, calibrate in order, score each task.

Every row sees the same calibration examples (``n`` per task from the zoo's ``calib`` split, drawn
with one seed) and is scored on the ``test`` split (the first ``max_test`` examples per task, or
all), as :mod:`diagnostics.compare` does; only the scores and the costs are kept (a reproduction
compares numbers with the paper's, not drift). Consecutive rows on the same merge (``ta``,
``ta+featcal``, ``ta+surgery``) share one merged model.

- a data-free merger: :meth:`featcal.zoo.Zoo.merged`; a data-using one:
  :func:`featcal.baselines.registry.merge_with_data` on the calibration data;
- FeatCal: :func:`featcal.calibrate` with the table's preset (:data:`featcal.config.PRESETS`) and the
  row's changes to it (``lam``, ``rho``, ``alpha``, ...); SVC on the weights; a trained calibrator
  (ESCal, Surgery, SurgeryV2, ProbSurgery) with its options, each task then scored with its own modules;
- ``experts``: each task's expert on its task; ``base``: the pretrained model.

A row's ``merge_seconds`` and ``calib_seconds`` are wall clock (scoring excluded: the paper's
efficiency table times the calibration after Task Arithmetic, final evaluation excluded).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from featcal.baselines import registry
from featcal.config import FeatCalConfig, preset_config
from featcal.reproduce.plan import PlannedRow
from featcal.reproduce.tables import AVG
from featcal.util.memory import PeakMemory
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


def _frozen(params: Mapping | None) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in (params or {}).items()))


def _merge(zoo, row: PlannedRow, data, progress: bool) -> nn.Module:
    params = dict(row.params.get(row.merger, {}))
    if registry.get(row.merger).kind != "data_merger":
        return zoo.merged(row.merger, **params)
    logits = registry.zoo_logits(zoo)
    return registry.merge_with_data(
        row.merger, base=zoo.base, experts=zoo.experts, calib_data=data, logits=logits, progress=progress, **params
    )


def _featcal(zoo, model: nn.Module, data, params: dict, preset: str, progress: bool) -> nn.Module:
    """FeatCal on ``model`` with ``preset`` and the row's changes to it."""
    fields = {f.name for f in dataclasses.fields(FeatCalConfig)}
    config = preset_config(preset).with_(**{k: params.pop(k) for k in list(params) if k in fields})
    calibrated, _ = registry.get("featcal").fn(
        model, base=zoo.base, experts=zoo.experts, calib_data=data, config=config, progress=progress, **params
    )
    return calibrated


def _svc(zoo, model: nn.Module, params: dict, merger: str) -> nn.Module:
    experts = {t: m.state_dict() for t, m in zoo.experts.items()}
    sd = registry.get("svc").fn(model.state_dict(), zoo.base.state_dict(), experts, merger=merger, **params)
    out = copy.deepcopy(model)
    out.load_state_dict(sd)
    return out.eval()


def _chain(zoo, row: PlannedRow, merged: nn.Module, data, preset: str, progress: bool) -> dict[str, nn.Module]:
    """Each task's model after the row's calibrators, in order, on ``merged``."""
    models = {t: merged for t in zoo.tasks}
    for name in row.chain:
        params = dict(row.params.get(name, {}))
        current = models[zoo.tasks[0]]
        if name == "featcal":
            model = _featcal(zoo, current, data, params, preset, progress)
        elif name == "svc":
            model = _svc(zoo, current, params, row.merger)
        else:
            method = registry.get(name)
            opts = method.options(**{"progress": progress, **params})
            with torch.enable_grad():  # trained by gradient descent, even when called under no_grad
                trained = method.fn(current, zoo.experts, data, opts)
            return {t: trained.for_task(t) for t in zoo.tasks}
        models = {t: model for t in zoo.tasks}
    return models


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
    with PeakMemory() as peak:
        t0 = time.perf_counter()
        model = merged(row, calib)
        result.merge_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        models = _chain(zoo, row, model, calib, preset, progress)
        result.calib_seconds = time.perf_counter() - t0
    result.peak_mb, result.peak_gpu_mb = peak.mb, peak.gpu_mb
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
        key = (row.merger, _frozen(row.params.get(row.merger)), row.n if with_data else None)
        if key not in kept:
            kept.clear()  # one merged model held at a time
            kept[key] = _merge(zoo, row, calib, progress)
        return kept[key]

    out = []
    for row in bar(planned, desc="reproduce", unit="row", show=progress):
        out.append(run_row(zoo, row, data=data, merged=merged, preset=preset, max_test=max_test, progress=progress))
    return out

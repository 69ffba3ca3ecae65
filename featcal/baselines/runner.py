"""Running a method on a zoo: merge, then apply the calibrators in order; what it cost.

The one place that runs ``merger[+calibrator...]`` for :mod:`diagnostics.compare` (``featcal
compare``, the app's Compare page) and :mod:`featcal.reproduce.run` (``featcal reproduce``), so
that both merge, calibrate and time a method alike; each keeps its own scoring.

- :func:`merge`: a data-free merger's model (:meth:`featcal.zoo.Zoo.merged`), or a data-using one's
  on the calibration data (:func:`featcal.baselines.registry.merge_with_data`);
- :func:`run_chain`: the calibrators in order on the merged model: ``featcal`` (the given preset, by
  default the zoo's, :func:`featcal.config.preset_for_zoo`, or its ``config``, with its changes to
  :class:`featcal.FeatCalConfig`'s fields), ``svc`` (data-free; ``alpha`` by default FusionBench's
  after the merger), and last a trained one (ESCal, Surgery, SurgeryV2, ProbSurgery), after which
  each task has its own model;
- :func:`run`: both, with the merge's and the chain's seconds and the peak memory (:class:`Costs`).

Parameters are ``{registry name: {name: value}}`` for the merger and each calibrator (a method
without an entry runs at its defaults). The zoo is any object with ``tasks``, ``base``,
``experts`` and ``merged`` (and ``heads``, ``features`` for AdaMerging and Fisher merging).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from featcal.baselines import registry
from featcal.baselines.svc import svc
from featcal.config import FeatCalConfig, preset_config, preset_for_zoo
from featcal.engine.run import calibrate
from featcal.util.memory import PeakMemory

CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(FeatCalConfig))
TRAINED = tuple(registry.names("trained"))


@dataclass
class Costs:
    """What running a method cost: the wall seconds of its merge (``merge_seconds``) and of its
    calibration chain (``calib_seconds``: each calibrator's wall seconds, a trained one's training
    seconds, :attr:`~featcal.baselines.trained.calibrators.TaskCalibrated.training_seconds`; scoring
    is never included); the numbers the chain adds to each task's model (``added``: ``trained``,
    ``stored`` and their ``fraction`` of the merged model, counted on what it produced); the peak
    memory (MB, host and GPU) merge and chain took above what was in use (NaN, None: not measured)."""

    merge_seconds: float = 0.0
    calib_seconds: float = 0.0
    added: dict[str, float] = field(default_factory=lambda: {"trained": 0, "stored": 0, "fraction": 0.0})
    peak_mb: float = float("nan")
    peak_gpu_mb: float | None = None


def params_key(params: Mapping | None) -> tuple:
    """A hashable key of one method's parameters (sorted names, values by ``repr``): what a cache
    of merged models or results is keyed by."""
    return tuple(sorted((k, repr(v)) for k, v in (params or {}).items()))


def parse_method(spec: str) -> tuple[str, tuple[str, ...]]:
    """``"ta+svc+featcal"`` -> ``("task_arithmetic", ("svc", "featcal"))`` (registry names; any
    case, aliases): a merger, data-free or data-using, then the calibrators in order
    (:func:`check_chain`). A ``ValueError`` names the method and what is wrong."""
    merger, *calibrators = [part.strip() for part in spec.strip().lower().split("+")]
    try:
        return registry.get(merger, "merger", "data_merger").name, check_chain(calibrators)
    except ValueError as e:
        raise ValueError(f"method {spec!r}: {e}") from None


def check_chain(chain: Sequence[str]) -> tuple[str, ...]:
    """``chain``'s calibrators by their registry names, or a ``ValueError`` for an unknown one, one
    that appears twice, or a trained one anywhere but last (each task is then scored with its own
    modules: nothing can follow)."""
    names = tuple(registry.get(c, "calibrator", "trained").name for c in chain)
    trained = [i for i, c in enumerate(names) if c in TRAINED]
    if trained and (len(trained) > 1 or trained[0] != len(names) - 1):
        raise ValueError(f"a trained calibrator ({', '.join(TRAINED)}) must come last, once.")
    if len(set(names)) != len(names):
        raise ValueError("a calibrator appears twice.")
    return names


def merge(zoo, merger: str, calib_data, params: Mapping | None = None, progress: bool = False) -> nn.Module:
    """The merged model of ``merger`` with ``params``: a data-free merger's, or a data-using one's
    on ``calib_data`` (AdaMerging and Fisher merging read the zoo's heads)."""
    params = dict(params or {})
    if registry.get(merger).kind != "data_merger":
        return zoo.merged(merger, **params)
    logits = registry.zoo_logits(zoo)
    return registry.merge_with_data(
        merger, base=zoo.base, experts=zoo.experts, calib_data=calib_data, logits=logits, progress=progress, **params
    )


def run_chain(
    zoo,
    merger: str,
    chain: Sequence[str],
    merged: nn.Module,
    calib_data,
    params: Mapping[str, Mapping] | None = None,
    *,
    preset: str | None = None,
    progress: bool = False,
) -> tuple[dict[str, nn.Module], Costs]:
    """Each task's model after the calibrators of ``chain`` (registry names, in order) on
    ``merged``, which came from ``merger``; with the chain's seconds and the numbers it adds
    (:class:`Costs`, merge and memory left unmeasured). ``params``: each calibrator's (featcal's may
    hold ``config``, a :class:`featcal.FeatCalConfig`, else it starts from ``preset``, by default
    the zoo's). A chain :func:`check_chain` refuses is refused before any work; the models given
    are never changed."""
    params = params or {}
    model, costs = merged, Costs()
    for name in check_chain(chain):
        own = dict(params.get(name, {}))
        if name in TRAINED:  # last (check_chain): each task then gets its own modules
            return _trained(zoo, name, model, calib_data, own, costs, progress)
        t0 = time.perf_counter()
        if name == "svc":
            model = _svc(zoo, model, own, merger)
        else:
            model = _featcal(zoo, model, calib_data, own, preset, progress)
        costs.calib_seconds += time.perf_counter() - t0
    added = _numel(model) - _numel(merged)
    costs.added = {"trained": added, "stored": added, "fraction": added / _numel(merged)}
    return {t: model for t in zoo.tasks}, costs


def run(
    zoo,
    merger: str,
    chain: Sequence[str],
    calib_data,
    params: Mapping[str, Mapping] | None = None,
    *,
    preset: str | None = None,
    progress: bool = False,
    get_merged: Callable[[], nn.Module] | None = None,
) -> tuple[nn.Module, dict[str, nn.Module], Costs]:
    """Merge (:func:`merge`), then calibrate (:func:`run_chain`), timed and with their peak memory:
    ``(merged model, {task: model}, costs)``. ``get_merged()``: where the merged model comes from
    when rows share it (a cache, whose seconds are then the merge's), default :func:`merge`."""
    params = params or {}
    with PeakMemory() as peak:
        t0 = time.perf_counter()
        model = get_merged() if get_merged is not None else merge(zoo, merger, calib_data, params.get(merger), progress)
        merge_seconds = time.perf_counter() - t0
        models, costs = run_chain(zoo, merger, chain, model, calib_data, params, preset=preset, progress=progress)
    costs.merge_seconds, costs.peak_mb, costs.peak_gpu_mb = merge_seconds, peak.mb, peak.gpu_mb
    return model, models, costs


def _featcal(zoo, model: nn.Module, calib_data, params: dict, preset: str | None, progress: bool) -> nn.Module:
    """FeatCal on ``model``: from ``params``' ``config``, else ``preset`` (default the zoo's), with
    ``params``' changes to its fields; the rest of ``params`` are :func:`featcal.calibrate`'s."""
    config = params.pop("config", None) or preset_config(preset or preset_for_zoo(zoo))
    config = config.with_(**{k: params.pop(k) for k in list(params) if k in CONFIG_FIELDS})
    params.setdefault("progress", progress)
    calibrated, _ = calibrate(model, base=zoo.base, experts=zoo.experts, calib_data=calib_data, config=config, **params)
    return calibrated


def _svc(zoo, model: nn.Module, params: dict, merger: str) -> nn.Module:
    """SVC on ``model``'s weights (``alpha`` by default FusionBench's after ``merger``): a new model."""
    experts = {t: m.state_dict() for t, m in zoo.experts.items()}
    sd = svc(model.state_dict(), zoo.base.state_dict(), experts, merger=merger, **params)
    out = copy.deepcopy(model)
    out.load_state_dict(sd)
    return out.eval()


def _trained(zoo, name: str, model: nn.Module, calib_data, params: dict, costs: Costs, progress: bool):
    """A trained calibrator on ``model`` (``params``: fields of its options): each task's model with
    its own modules, and ``costs`` with its training seconds and the numbers one task's modules add."""
    method = registry.get(name)
    opts = method.options(**{"progress": progress, **params})
    with torch.enable_grad():  # trained by gradient descent, even when called under no_grad (an app's lock)
        trained = method.fn(model, zoo.experts, calib_data, opts)
    costs.calib_seconds += trained.training_seconds
    added = trained.added_parameters
    first = added["per_task"][zoo.tasks[0]]
    costs.added = {"trained": first["trained"], "stored": first["stored"], "fraction": added["stored_fraction"]}
    return {t: trained.for_task(t) for t in zoo.tasks}, costs


def _numel(model: nn.Module) -> int:
    return sum(v.numel() for v in model.state_dict().values())

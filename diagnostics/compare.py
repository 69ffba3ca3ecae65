"""Compare merging and post-merging calibration methods side by side on one zoo.

A method is ``merger`` or ``merger+calibrator[+calibrator...]`` (names and aliases from
:mod:`featcal.baselines.registry`): the merger is a data-free one of :data:`featcal.MERGERS`
(``ta`` is ``task_arithmetic``) or a data-using one of :data:`featcal.MERGERS_WITH_DATA`
(RegMean, AdaMerging, Fisher merging; on the calibration split); the calibrators apply in
order: ``svc`` (data-free), ``featcal`` (closed form, no added modules), and last, at most one
trained one (``escal``, ``surgery``, ``surgery_v2``: task-specific modules, each task scored
with its own), e.g. ``ta+svc+featcal``. Every method sees the same calibration examples
(``n`` per task from the zoo's ``calib`` split, seeded) and is scored on the ``test`` split:
accuracy, KL to the experts and top-1 agreement (through the zoo's heads), the drift
decomposition per block (on the first ``drift_n`` test examples per task), and what it costs
(:mod:`diagnostics.compare_table`): one model or modules per task, the examples per task it
read, the numbers it adds, its forward time over the merged model's (``repeats`` timed calls),
its merge and calibration seconds and its peak memory. SVC's ``alpha`` defaults to FusionBench's
after the chain's merger (:data:`featcal.baselines.svc.ALPHA_AFTER`). Merging and calibrating are
:mod:`featcal.baselines.runner`'s, as ``featcal reproduce``'s are; the scoring is this module's.

Usage::

    cmp = compare(zoo, ["ta", "ties", "ta+featcal", "ta+escal"],
                  CompareOptions(n=64, calibrator_params={"escal": {"epochs": 50}}))
    cmp.summary      # one row per method (experts and base first), scores and costs
                     # (diagnostics.compare_table)
    cmp.accuracy     # method, task, accuracy
    cmp.output       # method, task, metric (kl, agreement), value
    cmp.drift        # method, task, block, metric, value

:class:`CompareOptions` holds what every method runs and is scored with. Results are cached
per setting (method, its parameters, ``n``, seed, test sizes) in a dict
(:data:`CACHE` unless one is given), so adding a method to a comparison runs only that one.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import pandas as pd
import torch
from torch import nn

from diagnostics.compare_table import SUMMARY_COLUMNS, average, examples_read, further_than_base, label, summary_row
from diagnostics.compare_table import gap_closed as gap_closed  # re-exported: the table's own names
from diagnostics.compare_table import markdown as markdown
from diagnostics.drift import drift_table
from diagnostics.output import output_drift
from featcal.baselines import registry, runner
from featcal.baselines.trained.calibrators import forward_seconds
from featcal.model.streams import device_of
from featcal.util.progress import bar
from featcal.zoo.core import evaluate
from featcal.zoo.tokens import as_batch

ALIASES = registry.ALIASES  # ta -> task_arithmetic, fisher -> fisher_merging
TRAINED = runner.TRAINED  # escal, surgery, surgery_v2, probsurgery
REFERENCES = ("experts", "base")
GAP_REFERENCE = "task_arithmetic"  # the gap to the experts is measured from Task Arithmetic
DRIFT_METRICS = ("drift_rel", "mismatch_rel", "propagation_rel")
CACHE: dict[tuple, "MethodResult"] = {}


@dataclass
class MethodResult:
    """One method's scores: ``accuracy`` ``{task: %}``, ``output`` (tidy: task, metric, value),
    ``drift`` (tidy: task, block, metric, value); and its costs: its ``label`` (settings a reader
    needs, :func:`diagnostics.compare_table.label`), whether it adds modules per task
    (``task_specific``), the calibration examples per task it read (``n_per_task``, None: none),
    the numbers it adds per task (``trained``, ``stored``, ``fraction`` of the model, counted on
    what it produced), ``forward_ratio`` (measured forward time of the produced model over the
    merged model's; 1 for a merger alone, NaN: not measured), the seconds its merge and
    calibration took and the peak memory (MB, host and GPU) they took above what was in use."""

    method: str
    merger: str
    calibrator: str
    accuracy: dict[str, float]
    output: pd.DataFrame
    drift: pd.DataFrame
    label: str = ""
    task_specific: bool | None = None
    n_per_task: int | None = None
    added: dict[str, float] = field(default_factory=lambda: {"trained": 0, "stored": 0, "fraction": 0.0})
    forward_ratio: float = float("nan")
    merge_seconds: float = 0.0
    calib_seconds: float = 0.0
    peak_mb: float = float("nan")
    peak_gpu_mb: float | None = None


@dataclass
class Comparison:
    """Tidy tables of a comparison (see the module docstring); ``settings`` records ``n``,
    seed, test sizes and each method's parameters."""

    summary: pd.DataFrame
    accuracy: pd.DataFrame
    output: pd.DataFrame
    drift: pd.DataFrame
    settings: dict[str, Any]


@dataclass(frozen=True)
class CompareOptions:
    """What every method of a comparison runs and is scored with (:func:`compare`,
    :func:`run_method`): ``n`` calibration examples per task from the ``calib`` split drawn with
    ``seed``; each method's parameters, ``{name: {param: value}}`` (names or aliases, checked
    against the registry by :func:`compare`; ``featcal`` also takes ``config``, a
    :class:`featcal.FeatCalConfig`); the first ``max_test`` test examples per task scored (None:
    all) and ``drift_n`` of them for the drift; ``repeats`` timed forward passes of
    ``overhead_batch`` test examples for the forward time of what a calibrator produced over the
    merged model's (0: not measured, NaN)."""

    n: int = 64
    seed: int = 42
    merger_params: Mapping[str, Mapping] = field(default_factory=dict)
    calibrator_params: Mapping[str, Mapping] = field(default_factory=dict)
    max_test: int | None = None
    drift_n: int | None = 64
    overhead_batch: int = 64
    repeats: int = 5

    def __post_init__(self):
        object.__setattr__(self, "merger_params", _by_merger(self.merger_params))
        object.__setattr__(self, "calibrator_params", dict(self.calibrator_params or {}))

    def settings(self, methods: list[str]) -> dict[str, Any]:
        """What a :class:`Comparison` records: these options (``featcal``'s ``config`` left out)
        and the ``methods`` run."""
        cal_params = {k: {p: v for p, v in d.items() if p != "config"} for k, d in self.calibrator_params.items()}
        return dict(
            n=self.n,
            seed=self.seed,
            max_test=self.max_test,
            drift_n=self.drift_n,
            methods=methods,
            merger_params=dict(self.merger_params),
            calibrator_params=cal_params,
        )


def parse_method(spec: str) -> tuple[str, str]:
    """``"ta+svc+featcal"`` -> ``("task_arithmetic", "svc+featcal")``; ``"ties"`` -> ``("ties", "")``.

    A method is a merger (data-free or data-using) followed by calibrators applied in order:
    any of ``featcal`` and ``svc``, and at most one trained calibrator, last (its task-specific
    modules are what each task is scored with); :func:`featcal.baselines.runner.parse_method`."""
    merger, chain = runner.parse_method(spec)
    return merger, "+".join(chain)


def allowed_params(name: str) -> list[str]:
    """The parameters a merger or calibrator (any registered name or alias) accepts."""
    return registry.get(name).param_names


def _by_merger(params: Mapping | None) -> dict:
    """``merger_params`` keyed by the registry names (``ta`` -> ``task_arithmetic``)."""
    return {registry.get(k).name: v for k, v in (params or {}).items()}


def check_params(merger_params: Mapping | None, calibrator_params: Mapping | None) -> None:
    """Fail before any work on a parameter a merger or calibrator does not take, or a value of
    the wrong type (checked against :mod:`featcal.baselines.registry`)."""
    for table in (merger_params or {}), (calibrator_params or {}):
        for name, params in table.items():
            registry.check_params(name, {k: v for k, v in params.items() if k != "config"})


def method_name(merger: str, calibrator: str = "") -> str:
    """The canonical name: ``ta`` for Task Arithmetic, ``+calibrator`` when there is one."""
    short = registry.get(merger).short
    return f"{short}+{calibrator}" if calibrator else short


def test_batches(zoo, n: int | None, batch_size: int = 64) -> dict[str, list[torch.Tensor]]:
    """The first ``n`` test examples of each task (all when None) in batches: the drift data."""
    return {t: [as_batch(b) for b in zoo.split(t, "test")[0][:n].split(batch_size)] for t in zoo.tasks}


def _zoo_key(zoo) -> tuple:
    return (zoo.name, str(zoo.meta.get("content_sha256", "")), id(zoo))


def run_method(
    zoo, spec: str, options: CompareOptions = CompareOptions(), *, cache: dict | None = None, progress: bool = False
) -> MethodResult:
    """Run one method (``merger[+calibrator...]``, see :func:`parse_method`) on ``zoo`` and score it.

    ``options``: :class:`CompareOptions`. ``featcal`` takes ``config`` (a
    :class:`featcal.FeatCalConfig`, default the zoo's preset, :func:`featcal.config.preset_for_zoo`,
    via :func:`featcal.config.preset_config`) and changes to it (``lam``, ``rho``, ``alpha``, ...);
    ``svc`` its ``alpha``; the trained ones the fields of their options (``epochs``, ``steps``,
    ``rank``, ...). AdaMerging and Fisher merging read the zoo's heads. Cached in ``cache``
    (default :data:`CACHE`) per setting.
    """
    merger, cal = parse_method(spec)
    chain = cal.split("+") if cal else []
    o = options
    mp = dict(o.merger_params.get(merger, {}))
    cps = {c: dict(o.calibrator_params.get(c, {})) for c in chain}
    cache = CACHE if cache is None else cache
    frozen_cps = tuple((c, runner.params_key(p)) for c, p in cps.items())
    key = (_zoo_key(zoo), merger, runner.params_key(mp), cal, frozen_cps, o.n, o.seed, o.max_test, o.drift_n)
    key += (o.overhead_batch, o.repeats)
    if key in cache:
        return cache[key]
    data = zoo.calib_data(o.n, seed=o.seed)
    merged, models, costs = runner.run(zoo, merger, chain, data, {merger: mp, **cps}, progress=progress)
    method = method_name(merger, cal)
    forward_ratio = 1.0 if not chain else _forward_ratio(zoo, models[zoo.tasks[0]], merged, o)
    result = MethodResult(
        method,
        merger,
        cal,
        *_score(zoo, models, test_batches(zoo, o.drift_n), o.max_test),
        label=label(method, merger, cps),
        task_specific=any(registry.get(c).task_specific for c in chain),
        n_per_task=examples_read({merger: mp, **cps}, data),
        forward_ratio=forward_ratio,
        **vars(costs),
    )
    cache[key] = result
    return result


def _forward_ratio(zoo, model: nn.Module, merged: nn.Module, o: CompareOptions) -> float:
    """The forward time of ``model`` over ``merged``'s on the first ``overhead_batch`` test
    examples of the first task, medians of ``repeats`` calls each (NaN when ``repeats`` is 0)."""
    if o.repeats < 1:
        return float("nan")
    probe = as_batch(zoo.split(zoo.tasks[0], "test")[0][: o.overhead_batch])
    if device_of(model) != device_of(merged):
        merged = copy.deepcopy(merged).to(device_of(model))
    seconds = forward_seconds({"produced": model, "merged": merged}, probe, o.repeats)
    return seconds["produced"] / seconds["merged"]


def _score(zoo, models: Mapping[str, nn.Module], drift_data: Mapping, max_test: int | None):
    """Accuracy, output drift and block drift of each task's model on that task."""
    accuracy, outputs, drifts = {}, [], []
    for t, model in models.items():
        accuracy.update(evaluate(model, zoo, tasks=[t], max_per_task=max_test))
        outputs.append(output_drift(model, zoo, max_per_task=max_test, tasks=[t]))
        drifts.append(drift_table(model, {t: zoo.experts[t]}, {t: drift_data[t]}, cka=False))
    output = pd.concat(outputs, ignore_index=True)
    output = output[output["metric"].isin(["kl", "agreement"])].drop(columns="block")
    drift = pd.concat(drifts, ignore_index=True)
    drift = drift[drift["metric"].isin(DRIFT_METRICS)]
    return accuracy, output.reset_index(drop=True), drift.reset_index(drop=True)


def reference(zoo, which: str, max_test: int | None = None, drift_n: int | None = 64, cache: dict | None = None):
    """The ``experts`` (each task's own expert) or ``base`` row, scored as a method is."""
    if which not in REFERENCES:
        raise ValueError(f"reference {which!r}; choose one of {REFERENCES}.")
    cache = CACHE if cache is None else cache
    key = (_zoo_key(zoo), which, max_test, drift_n)
    if key not in cache:
        models = dict(zoo.experts) if which == "experts" else {t: zoo.base for t in zoo.tasks}
        res = MethodResult(which, "", "", *_score(zoo, models, test_batches(zoo, drift_n), max_test))
        cache[key] = res
    return cache[key]


def compare(
    zoo,
    methods: Sequence[str],
    options: CompareOptions = CompareOptions(),
    *,
    cache: dict | None = None,
    progress: bool = True,
    on_method: Callable[[int, int, str], None] | None = None,
) -> Comparison:
    """Run ``methods`` (see :func:`run_method`) with ``options`` (:class:`CompareOptions`) plus
    the experts and base rows; return the tidy tables. The summary's ``gap_closed`` is measured
    from Task Arithmetic (with its ``merger_params``, run for the purpose when not listed),
    ``gap_closed_vs_merger`` from the method's own merger alone (NaN without a calibrator).
    ``on_method(i, total, name)`` is called before each method (an app's progress bar)."""
    if not methods:
        raise ValueError("no methods to compare; give at least one, e.g. ['ta', 'ta+featcal'].")
    specs = list(dict.fromkeys(method_name(*parse_method(m)) for m in methods))
    check_params(options.merger_params, options.calibrator_params)
    results = [reference(zoo, r, options.max_test, options.drift_n, cache) for r in REFERENCES]
    for i, spec in enumerate(bar(specs, desc="compare", unit="method", show=progress)):
        if on_method is not None:
            on_method(i, len(specs), spec)
        results.append(run_method(zoo, spec, options, cache=cache, progress=progress))
    merger_accs, ta = _gap_starts(zoo, results[len(REFERENCES) :], options, cache)
    experts = average(results[0].accuracy)
    rows = [summary_row(r, ta, merger_accs, experts) for r in results]
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS).astype({"n_per_task": "Int64"})
    for failed in further_than_base(summary):
        warnings.warn(
            f"compare: {failed}: no better than the pretrained model and far from the experts' outputs; the "
            "merge failed on this zoo (check the method's parameters), so its scores do not measure the method.",
            stacklevel=2,
        )
    return Comparison(
        summary=summary,
        accuracy=_tidy(
            results, lambda r: pd.DataFrame({"task": list(r.accuracy), "accuracy": list(r.accuracy.values())})
        ),
        output=_tidy(results, lambda r: r.output),
        drift=_tidy(results, lambda r: r.drift),
        settings=options.settings(specs),
    )


def _gap_starts(zoo, results: list[MethodResult], options: CompareOptions, cache) -> tuple[dict[str, float], float]:
    """Where the gaps to the experts are measured from: ``({merger: its mean accuracy alone}, Task
    Arithmetic's)``, each merger of ``results`` run alone (with ``options``, into ``cache``)."""
    merger_accs = {}
    for r in results:
        if r.merger not in merger_accs:
            merger_accs[r.merger] = average(run_method(zoo, method_name(r.merger), options, cache=cache).accuracy)
    ta = merger_accs.get(GAP_REFERENCE)
    if ta is None:
        ta = average(run_method(zoo, "ta", options, cache=cache).accuracy)
    return merger_accs, ta


def _tidy(results: list[MethodResult], frame: Callable[[MethodResult], pd.DataFrame]) -> pd.DataFrame:
    frames = [frame(r).assign(method=r.method) for r in results]
    df = pd.concat(frames, ignore_index=True)
    return df[["method", *[c for c in df.columns if c != "method"]]]

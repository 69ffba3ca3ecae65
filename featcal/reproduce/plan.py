"""What a reproduction runs: each row of a paper table as a featcal method, and its forward passes.

A row's ``method`` is ``merger[+calibrator...]`` in :mod:`featcal.baselines.registry`'s names or
aliases (``ta``, ``ta+featcal``, ``ties+svc+featcal``, ``ta+surgery``; a trained calibrator last,
once), or ``experts`` / ``base`` (each task's own expert, the pretrained model). A row whose method
featcal does not have (``null`` in the data, or a name the registry does not know) is planned as
"not in featcal" with the reason, and listed, never dropped.

Forward passes (:func:`row_passes`) count one example through one whole model as one pass, for
``n`` calibration examples per task over ``T`` tasks:

- a data-free merger: none (arithmetic on the weights); a data-using one (RegMean, Fisher, ...):
  ``2 n T`` (the experts and the merged model on the calibration data; an approximation: AdaMerging
  trains longer);
- FeatCal: its reference, ``2 n T`` (the merged model and each expert on its task's examples); one
  calibration costs :data:`FEATCAL_FWD` times the reference's time (benchmarks/README.md,
  ``calibration_cost.py``: 2.0x to 4.7x measured on ViT-B/32 from 8 to 128 examples per task; the
  upper-leaning 4 is used);
- SVC: none (an SVD of the weights);
- a trained calibrator: ``2 n T`` for the features computed once, plus, for the ones whose
  every step runs the model (ESCal, SurgeryV2: :data:`STEPS_RUN_THE_MODEL`), ``steps x batch x T x``
  :data:`TRAIN_STEP_PASSES` (a backward pass costs about two forward passes); Surgery's and
  ProbSurgery's steps run their small module alone and are not counted;
- scoring: one pass per test example per task (an LLM zoo scoring by generation costs more: the
  estimate says so).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from featcal.baselines import registry, runner
from featcal.reproduce.tables import PaperRow, PaperTable, row_params
from featcal.zoo.score.lm import LMZoo

REFERENCES = ("experts", "base")
FEATCAL_FWD = 4.0  # one calibrate over its reference forward passes (benchmarks/README.md, calibration_cost.py)
TRAIN_STEP_PASSES = 3  # a training step's forward and backward, in forward passes
STEPS_RUN_THE_MODEL = ("escal", "surgery_v2")  # every step runs the blocks; Surgery's and ProbSurgery's, a module


@dataclass(frozen=True)
class PlannedRow:
    """One table row as featcal runs it: the paper ``row``, the canonical ``method`` (None: not in
    featcal, ``why_not`` says why), its ``merger`` and calibrator ``chain`` (registry names), its
    ``params`` (``{registry name: {name: value}}``, checked) and ``n`` examples per task."""

    row: PaperRow
    method: str | None
    merger: str | None = None
    chain: tuple[str, ...] = ()
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    n: int = 0
    why_not: str = ""
    skipped: bool = False  # in featcal, but not run on this zoo (``why_not`` says why)

    @property
    def runs(self) -> bool:
        return self.method is not None and not self.skipped

    @property
    def status(self) -> str:
        return "ran" if self.runs else "not run on this zoo" if self.skipped else "not in featcal"

    @property
    def reference(self) -> str | None:
        """``experts`` or ``base`` for a reference row, else None."""
        return self.method if self.method in REFERENCES else None


def parse_method(spec: str) -> tuple[str, tuple[str, ...]]:
    """``"ta+svc+featcal"`` -> ``("task_arithmetic", ("svc", "featcal"))``; ``"experts"`` -> ``("experts", ())``.

    A reference row, or a merger (data-free or data-using) then calibrators in order, as ``featcal
    compare`` reads them (:func:`featcal.baselines.runner.parse_method`: ``featcal`` and ``svc`` once
    each, a trained one last, once). A ``ValueError`` names what is wrong."""
    if spec.strip().lower() in REFERENCES:
        return spec.strip().lower(), ()
    return runner.parse_method(spec)


def canonical(merger: str, chain: tuple[str, ...]) -> str:
    """The method's name as printed: ``ta+featcal`` (the registry's short names)."""
    if merger in REFERENCES:
        return merger
    return "+".join([registry.get(merger).short, *(registry.get(c).short for c in chain)])


def _checked_params(params: Mapping[str, Mapping], used: set[str], where: str) -> dict[str, dict]:
    """``params`` keyed by registry names, only those of the methods ``used``, each checked."""
    out: dict[str, dict] = {}
    for name, values in params.items():
        try:
            key = registry.get(name).name
        except ValueError as e:
            raise ValueError(f"{where}: params: {e}") from None
        if key not in used:
            continue
        try:
            out[key] = registry.check_params(key, dict(values))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    return out


def plan_row(table: PaperTable, row: PaperRow, n: int | None = None, extra: Mapping | None = None) -> PlannedRow:
    """``row`` of ``table`` as featcal runs it, with ``n`` examples per task (default: the row's,
    else the table's) and ``extra`` parameters (``{method: {name: value}}``, the command line's)
    over the row's. Bad parameters raise ``ValueError``; an unknown method plans "not in featcal"."""
    if row.method is None:
        return PlannedRow(row, None, why_not="featcal has no such method")
    try:
        merger, chain = parse_method(row.method)
    except ValueError as e:
        return PlannedRow(row, None, why_not=str(e))
    params = row_params(table, row)
    for method, values in (extra or {}).items():
        params.setdefault(method, {}).update(values)
    used = {merger, *chain} - set(REFERENCES)
    checked = _checked_params(params, used, f"table {table.name}, row {row.label!r}")
    n_row = n or row.n or table.setting.n
    return PlannedRow(row, canonical(merger, chain), merger, chain, checked, n_row)


def plan_table(
    table: PaperTable, n: int | None = None, only: list[str] | None = None, extra: Mapping | None = None
) -> list[PlannedRow]:
    """Every row of ``table`` planned (:func:`plan_row`), or those ``only`` names (a row's label or
    method, any case); an unknown name is a ``ValueError`` listing the rows."""
    rows = list(table.rows)
    if only:
        wanted = {o.strip().lower() for o in only if o.strip()}
        keys = {r.label.lower() for r in rows} | {(r.method or "").lower() for r in rows}
        unknown = sorted(wanted - keys)
        if unknown:
            names = ", ".join(f"{r.method or '-'} ({r.label})" for r in rows)
            raise ValueError(f"--rows {', '.join(unknown)}: not a row of {table.name}; its rows: {names}.")
        rows = [r for r in rows if r.label.lower() in wanted or (r.method or "").lower() in wanted]
    return [plan_row(table, r, n, extra) for r in rows]


# ------------------------------------------------------------------ forward passes


@dataclass(frozen=True)
class Passes:
    """A row's forward passes (examples through one whole model): ``featcal`` (FeatCal's reference
    passes, each costing :data:`FEATCAL_FWD` times its time), ``calibration`` (other passes over the
    calibration data), ``training`` (a trained calibrator's steps) and ``scoring`` (the test examples)."""

    featcal: int = 0
    calibration: int = 0
    training: int = 0
    scoring: int | None = 0  # None: the test splits' sizes are not known without decoding them

    @property
    def total(self) -> int:
        """Every pass counted (scoring left out when unknown)."""
        return self.featcal + self.calibration + self.training + (self.scoring or 0)

    @property
    def weighted(self) -> float:
        """Passes weighted by what they cost (FeatCal's reference :data:`FEATCAL_FWD` times)."""
        return FEATCAL_FWD * self.featcal + self.calibration + self.training + (self.scoring or 0)


def _training_passes(name: str, params: Mapping, n: int, tasks: int) -> int:
    """A trained calibrator's model passes over its steps (none when the steps run a module alone)."""
    if name not in STEPS_RUN_THE_MODEL:
        return 0
    opts = registry.get(name).options(**params)
    steps = opts.length if opts.LENGTH == "steps" else opts.length * math.ceil(n / opts.batch)
    return steps * opts.batch * tasks * TRAIN_STEP_PASSES


def row_passes(planned: PlannedRow, tasks: int, test_sizes: Mapping[str, int] | None) -> Passes:
    """The forward passes of ``planned`` on a zoo of ``tasks`` tasks with ``test_sizes`` test
    examples per task (None: unknown, scoring not counted; see the module docstring); zero for a
    row featcal does not run."""
    if not planned.runs:
        return Passes()
    scoring = None if test_sizes is None else sum(test_sizes.values())
    if planned.reference:
        return Passes(scoring=scoring)
    reference = 2 * planned.n * tasks
    calibration = reference if registry.get(planned.merger).kind == "data_merger" else 0
    featcal = training = 0
    for c in planned.chain:
        kind = registry.get(c).kind
        if c == "featcal":
            featcal += reference
        elif kind == "trained":
            calibration += reference
            training += _training_passes(c, planned.params.get(c, {}), planned.n, tasks)
    return Passes(featcal, calibration, training, scoring)


def on_zoo(planned: list[PlannedRow], zoo) -> list[PlannedRow]:
    """``planned`` with the rows this zoo cannot run marked skipped: a trained calibrator (ESCal, Surgery,
    SurgeryV2, ProbSurgery) trains per-task modules on the features a classification zoo's heads read,
    and a language-model zoo (:class:`~featcal.zoo.score.lm.LMZoo`) scores replies instead."""
    if not isinstance(zoo, LMZoo):
        return planned
    out = []
    for p in planned:
        trained = [c for c in p.chain if registry.get(c).kind == "trained"]
        if p.runs and trained:
            why = f"{', '.join(trained)} trains modules on a classification head's features; this zoo scores replies"
            p = dataclasses.replace(p, skipped=True, why_not=why)
        out.append(p)
    return out

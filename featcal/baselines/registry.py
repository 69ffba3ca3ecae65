"""Every merger and post-merging calibrator featcal knows, by name: the one registry.

A :class:`Method` says what a method is (``kind``), which function runs it, its parameters (name,
default, help, range and choices where it has them), its label and its aliases. The command line
(``featcal merge``, ``featcal calibrate --merge``, ``featcal compare``), :mod:`diagnostics.compare`
and the app read it; :data:`MERGERS` and :data:`MERGERS_WITH_DATA` are derived from it.

Parameters are data: a trained calibrator's are the fields of its options dataclass (help, default,
range, choices: :class:`~featcal.baselines.trained.surgery.SurgeryOptions`, ...); FeatCal's those of
:class:`~featcal.config.FeatCalConfig` (ranges: :data:`featcal.config.RANGES`) and :func:`featcal.calibrate`'s
run options (:data:`FEATCAL_RUN`); a merger's its function's keywords, with the ranges and choices given here.

Kinds:

- ``merger``: data-free, ``fn(base_sd, expert_sds, **params) -> state dict``;
- ``data_merger``: reads calibration inputs, ``fn(base=, experts=, calib_data=, **params) -> model``;
- ``calibrator``: after a merge, one model for every task (FeatCal; SVC, data-free);
- ``trained``: after a merge, task-specific modules trained per task (ESCal, Surgery, SurgeryV2, ProbSurgery).

Parameters on the command line: ``--param NAME=VALUE`` where one method runs (``featcal merge``,
``featcal calibrate --merge``), ``--param METHOD.NAME=VALUE`` where several do (``featcal compare``);
:func:`parse_param_items` reads both and :func:`check_params` checks names, types and ranges against
the registry (and builds a trained calibrator's options, so they check themselves) before any work.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from torch import nn

from featcal.baselines import adamerging as ada
from featcal.baselines import bmm, esm, fisher, merging
from featcal.baselines import svc as svc_defaults
from featcal.baselines.bmm_search import GRANULARITIES, bmm_search
from featcal.baselines.lot import lot
from featcal.baselines.params import Param, ParamError, parse_value  # noqa: F401 (the registry's API)
from featcal.baselines.regmean import regmean, regmean_plusplus
from featcal.baselines.svc import svc
from featcal.baselines.trained.calibrators import ESCalOptions, escal
from featcal.baselines.trained.probsurgery import ProbSurgeryOptions, probsurgery
from featcal.baselines.trained.surgery import SurgeryOptions, surgery, surgery_v2
from featcal.config import FeatCalConfig
from featcal.engine.run import calibrate
from featcal.util.options import Range

KINDS = ("merger", "data_merger", "calibrator", "trained")
# Arguments the runners fill themselves: never a user's --param.
FILLED = (
    "base",
    "base_sd",
    "experts",
    "expert_sds",
    "merged",
    "merged_sd",
    "calib_data",
    "logits",
    "progress",
    "config",
    "expert_trace",
    "block_source",
    "inplace",
    "keep_stats",
)


@dataclass(frozen=True)
class Method:
    """A registered method (see the module docstring)."""

    name: str
    kind: str
    fn: Callable
    label: str
    params: tuple[Param, ...]
    aliases: tuple[str, ...] = ()
    app: bool = False  # offered on the app's Zoo page (fast enough to re-run on a slider's change)
    data_free: bool = True
    options: type | None = None  # a trained calibrator's options dataclass, built from its parameters
    examples_cap: str | None = None  # the parameter capping the examples per task it reads (Fisher's)

    def param(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise ParamError(f"{self.name} takes no parameter {name!r}; it takes {', '.join(self.param_names) or 'none'}.")

    @property
    def param_names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def defaults(self) -> dict[str, Any]:
        return {p.name: p.default for p in self.params}

    def defaults_after(self, merger: str | None) -> dict[str, Any]:
        """The defaults when this method runs after ``merger`` (:meth:`Param.default_after`)."""
        return {p.name: p.default_after(merger) for p in self.params}

    @property
    def task_specific(self) -> bool:
        """Whether it adds modules per task (a trained calibrator): the task must be known at
        inference. Every other method gives one model for every task."""
        return self.kind == "trained"

    @property
    def length(self) -> Param | None:
        """A trained calibrator's training length (``epochs`` or ``steps``, its authors' schedule
        the default); None for other kinds."""
        return self.param(self.options.LENGTH) if self.options is not None else None

    @property
    def short(self) -> str:
        """The name a comparison shows (the first alias, e.g. ``ta``, else the name)."""
        return self.aliases[0] if self.aliases else self.name


def _params(fn: Callable, ranges: Mapping | None = None, choices: Mapping | None = None, helps=None) -> tuple:
    """A merger's (or SVC's) parameters: every keyword of ``fn`` with a default, minus :data:`FILLED`,
    with the slider ``ranges`` ``{name: (min, max, step)}``, ``choices`` and ``helps`` given."""
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if name in FILLED or p.default is inspect.Parameter.empty or name.startswith("_"):
            continue
        span = (ranges or {}).get(name)
        span = Range(*span) if span else None
        out.append(Param(name, p.default, span, (choices or {}).get(name), (helps or {}).get(name, "")))
    return tuple(out)


def _option_params(options: type, defaults: Any = None) -> tuple[Param, ...]:
    """The parameters an options dataclass declares (:func:`featcal.util.options.option`: help,
    range, choices), minus :data:`FILLED`; defaults from ``defaults`` (an instance) when given."""
    return tuple(
        Param(
            f.name,
            getattr(defaults, f.name) if defaults is not None else f.default,
            f.metadata.get("range"),
            f.metadata.get("choices"),
            f.metadata.get("help", ""),
        )
        for f in dataclasses.fields(options)
        if f.name not in FILLED
    )


# FeatCal's run options (:func:`featcal.calibrate`'s keywords a comparison may set).
FEATCAL_RUN = (
    Param("blocks", None, help="dotted path of the blocks, for architectures featcal does not know"),
    Param("fast", None, help="the engine's fast paths (featcal.FastPaths)"),
    Param("device", None, help="where each block runs (default: the merged model's device)"),
    Param("on_block", None, help="called after each block with its timings"),
)


def _featcal_params() -> tuple[Param, ...]:
    """FeatCal's: the numbers and switches of :class:`FeatCalConfig` (defaults: the CLIP preset's,
    what ``featcal compare`` starts from on a CLIP zoo; eps left out) and its run options."""
    numbers = [p for p in _option_params(FeatCalConfig, FeatCalConfig.clip()) if p.name != "eps"]
    numbers = [p for p in numbers if isinstance(p.default, (bool, int, float))]
    return (*numbers, *FEATCAL_RUN)


def _with_data(kind: str, fn: Callable, label: str, ranges=None, choices=None, aliases=(), helps=None) -> Method:
    """The entry of a data merger, named as its function is, its parameters read from the
    function's signature."""
    return Method(fn.__name__, kind, fn, label, _params(fn, ranges, choices, helps), aliases=aliases, data_free=False)


def _trained(fn: Callable, label: str, options: type) -> Method:
    """The entry of a trained calibrator, named as its function is, its parameters the fields of
    its ``options`` dataclass."""
    return Method(fn.__name__, "trained", fn, label, _option_params(options), data_free=False, options=options)


# SVC's alpha: FusionBench's per upstream merger (featcal.baselines.svc.ALPHA_AFTER), else the fallback.
SVC_ALPHA = Param(
    "alpha",
    svc_defaults.ALPHA_FALLBACK,
    Range(0.05, 2.0, 0.05),
    help="floor of the projection coefficients (> 0; gamma <= 1/alpha); default FusionBench's after the merger",
    after=svc_defaults.ALPHA_AFTER,
)
# RegMean and its forward-order variant: one data merger each, the same parameters.
REGMEANS = ((regmean, "RegMean"), (regmean_plusplus, "RegMean++"))
SCALE = (0.05, 2.0, 0.05)
ESM_HELP = {
    "recipe": "the authors' script: vit (CLIP ViTs), roberta (GLUE); auto: roberta on a decoder-only LM "
    "(the ViT script's scalings break it), vit elsewhere"
}
# BMM (featcal.baselines.bmm): the prior's strength sigma, relative to the mean eigenvalue of the summed Gram.
SIGMA = (1e-3, 10.0, 0.25, True, (0.0, 1e6), "prior strength / mean Gram eigenvalue")
BMM_HELP = {
    "anchor": "the merge the prior is centred on (with its registry defaults)",
    "sigma": "the prior's strength, times the mean eigenvalue of sum_i G_i (0: RegMean; large: the anchor)",
    "trials": "TPE trials after the global sigma (0: no search)",
    "granularity": "one sigma per Linear of each block group (the paper's) or per block group",
    "groups": "the blocks in this many runs of consecutive blocks (None: one block each)",
    "val_fraction": "the share of each task's calibration examples held out to score the trials",
    "seed": "TPE's seed",
    "blocks": "dotted path of the blocks, for architectures featcal does not know",
}
BMM_CHOICES = {"anchor": tuple(bmm.ANCHORS), "granularity": GRANULARITIES}
BMM_SEARCH_RANGES = {
    "sigma": (*SIGMA[:4], (1e-8, 1e6), SIGMA[5]),
    "val_fraction": (0.05, 0.5, 0.05, False, (0.01, 0.99)),
}
ACE_RANGES = {
    "scale": (0.1, 2.0, 0.05),
    "eps": (1e-4, 1.0, 0.25, True, (1e-12, 1e6), "ridge on each task's covariance"),
    "k_frac": (0.0, 1.0, 0.05, False, (0.0, 1.0)),
    "threshold": (0.0, 2.0, 0.05, False, (-1e6, 1e6)),
}
ACE_HELP = {
    "eps": "ridge on each task's covariance (divided by its trace when the tasks are heterogeneous); the authors' 0.01",
    "k_frac": "share of the singular directions spectral refinement lifts to their mean singular value; "
    "the authors' 0.3",
    "threshold": "gamma (variance over squared mean of the tasks' log squared update norms) above which the "
    "tasks count as heterogeneous: trace normalisation and spectral refinement; the authors' 0.3",
}
METHODS: tuple[Method, ...] = (
    Method("average", "merger", merging.average, "Simple averaging", (), app=True),
    Method(
        "task_arithmetic",
        "merger",
        merging.task_arithmetic,
        "Task Arithmetic",
        _params(merging.task_arithmetic, {"scale": (0.05, 1.0, 0.05)}),
        aliases=("ta",),
        app=True,
    ),
    Method(
        "ties",
        "merger",
        merging.ties,
        "TIES",
        _params(merging.ties, {"density": (0.05, 1.0, 0.05), "scale": SCALE}, {"disjoint": ("mean", "sum")}),
        app=True,
    ),
    Method("dare", "merger", merging.dare, "DARE", _params(merging.dare, {"drop": (0.0, 0.95, 0.05), "scale": SCALE})),
    Method("iso_c", "merger", merging.iso_c, "Iso-C", _params(merging.iso_c, {"scale": (0.1, 2.0, 0.05)}), app=True),
    Method(
        "iso_cts",
        "merger",
        merging.iso_cts,
        "Iso-CTS",
        _params(merging.iso_cts, {"scale": (0.1, 2.0, 0.05), "common_space_fraction": (0.0, 1.0, 0.05)}),
        app=True,
    ),
    Method("tsv", "merger", merging.tsv, "TSV", _params(merging.tsv, {"scale": (0.1, 2.0, 0.05)}), app=True),
    Method("wudi", "merger", merging.wudi, "WUDI", _params(merging.wudi)),
    Method("ace", "merger", merging.ace, "ACE-Merging", _params(merging.ace, ACE_RANGES, helps=ACE_HELP)),
    Method(
        "bmm_datafree",
        "merger",
        bmm.bmm_datafree,
        "BMM (data-free)",
        _params(bmm.bmm_datafree, {"sigma": SIGMA}, BMM_CHOICES, BMM_HELP),
    ),
    *(_with_data("data_merger", fn, label, {"reduce_nondiag": (0.0, 1.0, 0.05)}) for fn, label in REGMEANS),
    _with_data("data_merger", ada.adamerging, "AdaMerging", choices={"granularity": ada.GRANULARITY}),
    dataclasses.replace(
        _with_data("data_merger", fisher.fisher_merging, "Fisher merging", aliases=("fisher",)),
        examples_cap="n_examples",
    ),
    _with_data("data_merger", lot, "LOT Merging", {"rtol": (1e-8, 1e-2, 1.0, True, (1e-12, 0.5), "pinv cut")}),
    _with_data("data_merger", esm.esm, "ESM", {"scale": esm.SCALE_RANGE}, {"recipe": esm.RECIPES}, helps=ESM_HELP),
    _with_data("data_merger", bmm.bmm, "BMM", {"sigma": SIGMA}, BMM_CHOICES, helps=BMM_HELP),
    _with_data("data_merger", bmm_search, "BMM (searched)", BMM_SEARCH_RANGES, BMM_CHOICES, helps=BMM_HELP),
    Method("featcal", "calibrator", calibrate, "FeatCal", _featcal_params(), data_free=False),
    Method("svc", "calibrator", svc, "SVC", (SVC_ALPHA,)),
    _trained(escal, "ESCal", ESCalOptions),
    _trained(surgery, "Surgery", SurgeryOptions),
    _trained(surgery_v2, "SurgeryV2", SurgeryOptions),
    _trained(probsurgery, "ProbSurgery", ProbSurgeryOptions),
)
REGISTRY: dict[str, Method] = {m.name: m for m in METHODS}
ALIASES: dict[str, str] = {a: m.name for m in METHODS for a in m.aliases}


def names(*kinds: str) -> list[str]:
    """The registered names of ``kinds`` (all when none), in registry order."""
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"unknown kind {k!r}; choose one of {KINDS}.")
    return [m.name for m in METHODS if not kinds or m.kind in kinds]


def get(name: str, *kinds: str) -> Method:
    """The method ``name`` (or an alias; any case), of one of ``kinds`` when given; a
    ``ValueError`` listing the choices otherwise."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    method = REGISTRY.get(key)
    if method is None or (kinds and method.kind not in kinds):
        known = names(*kinds)
        aliases = [a for a, n in ALIASES.items() if n in known]
        what = "method"
        if kinds == ("data_merger",):
            what = "data-using merge method"
        elif kinds and set(kinds) <= {"merger", "data_merger"}:
            what = "merge method"
        elif kinds and set(kinds) <= {"calibrator", "trained"}:
            what = "calibrator"
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(known + aliases)}.")
    return method


def check_params(name: str, params: Mapping[str, Any], *kinds: str) -> dict[str, Any]:
    """``params`` checked against method ``name``'s (names, types, ranges; a trained calibrator's
    options built from them, which check themselves): returned with numbers normalised, or a
    ``ValueError`` naming the first wrong one and what the method takes."""
    method = get(name, *kinds)
    checked = {k: method.param(k).check(method.name, v) for k, v in params.items()}
    if method.options is not None:
        method.options(**checked)
    return checked


def describe(name: str) -> str:
    """Method ``name``'s parameters, one line each: ``NAME=DEFAULT  help [range or choices]``
    (what ``featcal compare --help`` lists)."""
    method = get(name)
    lines = [f"{method.name} ({method.label}):"]
    for p in method.params:
        span = ""
        if p.choices is not None:
            span = f" [{' | '.join(map(str, p.choices))}]"
        elif p.range is not None and p.range.accept is not None:
            span = f" [{p.range.accept[0]:g} .. {p.range.accept[1]:g}]"
        lines.append(f"  {p.name}={p.default!r}  {p.help}{span}".rstrip())
        if p.after:
            after = ", ".join(f"{get(m).short} {v!r}" for m, v in p.after.items())
            lines.append(f"    after {after}; {p.default!r} after any other merger")
    return "\n".join(lines)


MERGERS: dict[str, Callable[..., dict]] = {m.name: m.fn for m in METHODS if m.kind == "merger"}
MERGERS_WITH_DATA: dict[str, Callable[..., nn.Module]] = {m.name: m.fn for m in METHODS if m.kind == "data_merger"}


def merge(method: str, base_sd: Mapping, expert_sds: Mapping | list, **params) -> dict:
    """Merge expert state dicts into a new one with a data-free merger of :data:`MERGERS`.

    ``expert_sds`` is ``{task: state_dict}`` (a list is numbered). ``params`` are the method's
    own (``scale``, ``density``, ...), checked against the registry first; ``progress`` is passed on
    to the mergers that show a bar."""
    m = get(method, "merger")
    filled = {"progress": params.pop("progress")} if "progress" in params else {}
    if filled and "progress" not in inspect.signature(m.fn).parameters:
        filled = {}  # a merger without a progress bar
    params = {**check_params(m.name, params), **filled}
    if not isinstance(expert_sds, Mapping):
        expert_sds = {str(i): sd for i, sd in enumerate(expert_sds)}
    return m.fn(base_sd, expert_sds, **params)


def merge_model(method: str, base: nn.Module, experts: Mapping | list, **params) -> nn.Module:
    """:func:`merge` on models: a new model (a deep copy of ``base``, in eval mode) holding the
    merge of ``experts`` (``{task: model}`` or a list) by ``method``; ``base`` and the experts
    are left as they are. What :func:`featcal.calibrate` takes as its ``merged``."""
    import copy

    if not isinstance(experts, Mapping):
        experts = {str(i): m for i, m in enumerate(experts)}
    merged_sd = merge(method, base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, **params)
    model = copy.deepcopy(base)
    model.load_state_dict(merged_sd)
    return model.eval()


def merge_with_data(method: str, *, base: nn.Module, experts: Mapping, calib_data: Mapping, **params) -> nn.Module:
    """Merge ``experts`` into a new model with a merger that reads calibration data
    (:data:`MERGERS_WITH_DATA`): ``calib_data`` is ``{task: [batch, ...]}`` as for
    :func:`featcal.calibrate`. AdaMerging and Fisher merging also need ``logits=fn(model, task,
    batch)``; ``progress`` is passed on; other ``params`` are checked against the registry."""
    m = get(method, "data_merger")
    filled = {k: params.pop(k) for k in ("logits", "progress") if k in params}
    params = check_params(m.name, params)
    if "logits" in filled and "logits" not in inspect.signature(m.fn).parameters:
        filled.pop("logits")  # RegMean reads no predictions
    return m.fn(base=base, experts=experts, calib_data=calib_data, **filled, **params)


# ------------------------------------------------------------------ the command line's --param


def parse_param_items(items: list[str] | None, methods: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """``["NAME=VALUE" | "METHOD.NAME=VALUE", ...]`` -> ``{method: {name: value}}`` (registry
    names), checked against the registry. ``methods``: where one method runs, ``[that one]``
    (a bare ``NAME=VALUE`` is its); where several, ``None`` (every item must say its method)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items or []:
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--param {item!r}: write NAME=VALUE (e.g. scale=0.3) or METHOD.NAME=VALUE.")
        owner, dot, name = key.rpartition(".")
        if not dot:
            if methods is None or len(methods) != 1:
                raise ValueError(
                    f"--param {item!r}: several methods run here; say whose it is: METHOD.NAME=VALUE "
                    f"(e.g. ta.scale=0.3, escal.epochs=50)."
                )
            owner = methods[0]
        method = get(owner)
        if methods is not None and method.name not in [get(m).name for m in methods]:
            raise ValueError(f"--param {item!r}: {method.name} does not run here (it runs {', '.join(methods)}).")
        value = method.param(name).check(method.name, parse_value(text))
        out.setdefault(method.name, {})[name] = value
    return out


def zoo_logits(zoo) -> Callable | None:
    """``logits(model, task, batch)``: the class logits of ``model`` through the zoo's frozen head
    for ``task`` (with gradients, unlike ``Zoo.logits``): what AdaMerging and Fisher merging read.
    None for a zoo without heads (an LLM zoo), which those two then refuse with their reason."""
    if not zoo.heads:
        return None

    def logits(model: nn.Module, task: str, batch):
        head = zoo.heads[task]
        feats = zoo.features(model, batch)
        return head(feats.to(device=head.weight.device, dtype=head.weight.dtype))

    return logits

"""What :func:`featcal.sweep.search.tune` searches and how: the grid's axes (:class:`Grid`) and the
search's options (:class:`TuneConfig`, :func:`tune_options`). Every value is one
:data:`featcal.config.RANGES` accepts, checked before any work."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from featcal.config import RANGES
from featcal.sweep.jobs import Point

SEARCHES = ("grid", "adaptive", "per_block")
SCORES = ("auto", "accuracy", "kl")


# ------------------------------------------------------------------ the search space


@dataclass(frozen=True)
class Grid:
    """The sweep's axes; points are their product, in ``lam``-major order. The defaults lie inside
    the ranges the app's sliders span (:data:`featcal.config.RANGES`, lam on a log scale); every
    value must be one a run accepts (the same table), lam > 0 (its axis is searched in decades)."""

    lam: tuple[float, ...] = (0.005, 0.02, 0.05, 0.2, 1.0)  # lambda, ridge strength (> 0)
    rho: tuple[float, ...] = (0.5, 1.0, 1.5, 2.0, 2.5)  # rho, anchor blend
    alpha: tuple[float, ...] = (0.0, 0.15, 0.3, 0.5, 0.7)  # alpha, target interpolation

    def __post_init__(self):
        for name in ("lam", "rho", "alpha"):
            v = tuple(float(x) for x in getattr(self, name))
            if not v or not all(math.isfinite(x) for x in v):
                raise ValueError(f"Grid.{name} needs at least one finite value, got {v}.")
            bad = [x for x in v if not RANGES[name].admits(x)]
            if bad:
                (low, high), what = RANGES[name].accept, RANGES[name].what
                raise ValueError(f"Grid.{name} values must lie in [{low:g}, {high:g}] ({what}), got {bad}.")
            object.__setattr__(self, name, v)
        if min(self.lam) <= 0:
            raise ValueError(f"Grid.lam values must be > 0, got {self.lam}.")

    def points(self) -> list[Point]:
        return list(itertools.product(self.lam, self.rho, self.alpha))

    @classmethod
    def parse(cls, text: str) -> "Grid":
        """``"lam=0.01,0.05;rho=1,2;alpha=0.3"`` (axes left out keep their defaults)."""
        axes = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            name, _, values = part.partition("=")
            if name.strip() not in ("lam", "rho", "alpha") or not values:
                raise ValueError(f"bad grid axis {part!r}; write e.g. 'lam=0.01,0.05;rho=1,2;alpha=0.3'.")
            axes[name.strip()] = tuple(float(v) for v in values.split(","))
        return cls(**axes)


@dataclass(frozen=True)
class TuneConfig:
    """How :func:`tune` searches and scores (the FeatCal switches live in ``FeatCalConfig``)."""

    grid: Grid = field(default_factory=Grid)  # the points previewed first
    search: str = (
        "grid"  # "grid"; "adaptive": then refine around the best previews; "per_block": featcal.sweep.perblock
    )
    rounds: int = 2  # adaptive: refinement rounds, each halving the step
    top_k: int = 3  # adaptive: previews refined per round
    n_confirm: int = 4  # best previews re-run exactly (besides the anchor)
    score: str = "auto"  # "accuracy" (needs labels), "kl" (to the experts), "auto"
    batch_size: int = 256  # validation batch size
    ray: bool | str = False  # fan jobs out as Ray tasks (a string: the address of an existing cluster)
    num_cpus: int | None = None  # Ray: CPUs of a locally started Ray (None: Ray's default)
    trials: int = 40  # per_block: TPE trials, one preview each
    groups: int | None = (
        None  # per_block: the blocks in this many consecutive groups, one setting each (None: per block)
    )
    seed: int = 0  # per_block: TPE's seed

    def __post_init__(self):
        if self.search not in SEARCHES:
            raise ValueError(f"search must be one of {SEARCHES}, got {self.search!r}.")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}.")
        if self.n_confirm < 0 or self.rounds < 0 or self.top_k < 1 or self.batch_size < 1:
            raise ValueError("n_confirm and rounds must be >= 0, top_k and batch_size >= 1.")
        if self.trials < 1 or (self.groups is not None and self.groups < 1):
            raise ValueError(f"trials must be >= 1 and groups None or >= 1, got {self.trials} and {self.groups}.")


def tune_options(options: TuneConfig | None = None, **fields) -> TuneConfig:
    """``options`` (default :class:`TuneConfig`'s) with ``fields`` replaced; an unknown name is an
    error listing the known ones."""
    known = {f.name for f in dataclasses.fields(TuneConfig)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"unknown tune option(s) {unknown}; TuneConfig has {sorted(known)}.")
    if fields.get("grid", 0) is None:
        fields["grid"] = Grid()
    return dataclasses.replace(options or TuneConfig(), **fields)

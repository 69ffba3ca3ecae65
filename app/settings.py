"""The app's settings as values: the merger, the calibration and the model a table is about.

Three frozen dataclasses, hashable (``st.cache_*`` keys, with :data:`HASH_FUNCS`, and dict
keys) and free of Streamlit (the widgets that build them are in :mod:`app.controls`):

- :class:`Merger`: the merge method and its parameters (Zoo page);
- :class:`AppCal`: the one :class:`featcal.FeatCalConfig` the exact run takes (the maths: λ,
  ρ, α, switches, token weights; the sliders' values land in it once, :meth:`AppCal.from_widgets`)
  plus what only the app chooses (``n``, calibration examples per task); every cache key of a
  run is read from it, never a repacked copy;
- :class:`ModelRef`: which model a score or drift table is of, with every setting that made it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from featcal import FeatCalConfig
from featcal.baselines import registry
from featcal.config import preset_config

CAL_SIZES = (4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_N = 16  # calibration examples per task: the largest meeting the 1 s target (benchmarks/README.md)
# The instant preview (numbers and charts) is scored and drawn when the exact run has not
# finished this long after a change; an exact run quicker than that is drawn once
# (measured: benchmarks/README.md, 'App latency').
PREVIEW_AFTER_S = float(os.environ.get("FEATCAL_PREVIEW_AFTER_S", "0.1"))
# The preview's scores are read on the first PREVIEW_TEST test examples per task (the exact
# result's on the live subset, 50): a third of the forward work, so its plots come sooner; the
# page says so. Its drift and cosines use the same held-out examples as the exact result's.
PREVIEW_TEST = int(os.environ.get("FEATCAL_PREVIEW_TEST", "16"))
# The mergers the Zoo page offers, their labels and slider (min, max, step) per parameter: read from
# the registry (featcal.baselines.registry: those marked ``app``, fast enough to re-run on a
# slider's change; the timings are in benchmarks/README.md, "mergers_table.py").
MERGE_METHODS = {m.name: m.label for m in registry.METHODS if m.kind == "merger" and m.app}
GIVEN = "given"  # a zoo's own merged model (featcal.zoo.core.GIVEN: a spec's `merged:`)
METHOD_LABELS = {**MERGE_METHODS, GIVEN: "your merged model (the zoo's own)"}
MERGE_PARAMS = {
    name: {p.name: p.range for p in registry.get(name).params if p.range is not None}
    for name in MERGE_METHODS
    if any(p.range is not None for p in registry.get(name).params)
}
# What more calibration examples give on the embedded demo zoo, as benchmarks/app_latency.py --record
# measured it: {n: (accuracy gain in points over the merged model, the exact result's CPU seconds)}.
MEASURED_SIZES = Path(__file__).resolve().parents[1] / "assets" / "measured" / "demo_calibration_sizes.json"


def demo_n_gains(path: Path = MEASURED_SIZES) -> dict[int, tuple[float, float]]:
    """The measured gains per calibration size (empty when the file is missing)."""
    if not path.is_file():
        return {}
    return {int(n): (r["gain_pp"], r["exact_cpu_s"]) for n, r in json.loads(path.read_text()).items()}


DEMO_N_GAINS = demo_n_gains()


def cal_defaults(preset: str = "clip") -> dict:
    """The FeatCal widgets' defaults on a zoo whose architecture takes ``preset``
    (:func:`featcal.config.preset_for_zoo`): the preset's λ (as log10, one decimal: the slider's step), ρ, α and
    switches, and the app's ``n``."""
    c = FeatCalConfig.preset(preset)
    log_lam = round(math.log10(c.lam), 1)
    return dict(log_lam=log_lam, rho=c.rho, alpha=c.alpha, n_cal=DEFAULT_N, bias=c.bias, layernorm=c.layernorm)


def merge_default(method: str, name: str) -> float:
    """The default of a merger parameter (the registry reads it from the function)."""
    return float(registry.get(method).param(name).default)


@dataclass(frozen=True)
class Merger:
    """A merge method (a key of :data:`featcal.MERGERS`) and its parameters."""

    method: str
    params: tuple[tuple[str, float], ...] = ()  # (name, value) pairs, in the sliders' order

    @property
    def kwargs(self) -> dict[str, float]:
        """The parameters as keyword arguments of the merge function."""
        return dict(self.params)

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v:g}" for k, v in self.params)
        return f"{METHOD_LABELS.get(self.method, self.method)}" + (f" ({args})" if args else "")


@dataclass(frozen=True)
class AppCal:
    """One exact FeatCal run of the app: its :class:`featcal.FeatCalConfig` and the number of
    calibration examples per task it reads (the only setting the app adds)."""

    config: FeatCalConfig  # the zoo's preset (featcal.config.preset_for_zoo) with the sliders' λ, ρ, α and switches
    n: int  # calibration examples per task

    def __post_init__(self):
        if not (isinstance(self.n, int) and self.n > 0):
            raise ValueError(f"n (calibration examples per task) must be a positive int, got {self.n!r}.")

    @classmethod
    def from_widgets(
        cls, log_lam: float, rho: float, alpha: float, n: int, bias: bool, layernorm: bool, preset: str = "clip"
    ) -> "AppCal":
        """The settings the widgets show, on ``preset`` (its token weights; the CLIP one but on
        LLM zoos, :func:`featcal.config.preset_for_zoo`). λ moves on a log10 slider and becomes ``config.lam``
        here, once (:func:`lam_of`)."""
        lam = lam_of(log_lam)
        config = preset_config(
            preset, lam=lam, rho=float(rho), alpha=float(alpha), bias=bool(bias), layernorm=bool(layernorm)
        )
        return cls(config, int(n))

    def moved(self, log_lam: float, rho: float, alpha: float) -> "AppCal":
        """These settings at another point of the three sliders (λ from its log10 slider, as
        :meth:`from_widgets` reads it); every other setting kept."""
        return AppCal(self.config.with_(lam=lam_of(log_lam), rho=float(rho), alpha=float(alpha)), self.n)

    @property
    def structure(self) -> tuple:
        """What the kept statistics depend on: ``n`` and every field of the config but its
        setting (λ, ρ, α), read from it as ``(name, value)`` pairs. Runs sharing it can preview
        each other."""
        point = {f.name for f in dataclasses.fields(self.config.setting)}
        fields = dataclasses.fields(self.config)
        return (self.n, *((f.name, getattr(self.config, f.name)) for f in fields if f.name not in point))

    @property
    def point_label(self) -> str:
        """λ, ρ, α: what a preview from this run's kept statistics can change."""
        return f"λ={self.config.lam:.3g}, ρ={self.config.rho:g}, α={self.config.alpha:g}"

    @property
    def label(self) -> str:
        c = self.config
        sw = ", ".join(s for s, on in (("bias", c.bias), ("LayerNorm", c.layernorm)) if on) or "weights only"
        return f"{self.point_label}, n={self.n}/task, {sw}"


def lam_of(log_lam: float) -> float:
    """λ of the log10 slider's value, to two significant digits: the slider's 0.1 steps are
    26% apart, so nothing is lost, and the default -1.3 is the paper's λ = 0.05 exactly
    (10^-1.3 = 0.0501...); a URL or a slider step's float noise cannot split the cache."""
    return float(f"{10 ** round(float(log_lam), 4):.2g}")


MODEL_KINDS = ("base", "merged", "calibrated", "preview")


@dataclass(frozen=True)
class ModelRef:
    """Names a model the app scores, with every setting that made it: the key of the score
    and drift caches.

    ``base``: the zoo's pre-trained model; ``merged``: ``merger``'s merge; ``calibrated``: the
    exact FeatCal run ``cal`` on it; ``preview``: ``cal`` re-solved from the kept statistics of
    the exact run ``from_run`` (same :attr:`AppCal.structure`, other λ, ρ, α). Build them with
    the class methods.
    """

    kind: str
    merger: Merger | None = None
    cal: AppCal | None = None
    from_run: AppCal | None = None  # preview only: the exact run whose kept statistics it re-solves

    def __post_init__(self):
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"kind must be one of {MODEL_KINDS}, got {self.kind!r}.")
        needs = {
            "base": (),
            "merged": ("merger",),
            "calibrated": ("merger", "cal"),
            "preview": ("merger", "cal", "from_run"),
        }[self.kind]
        for name in ("merger", "cal", "from_run"):
            if (getattr(self, name) is None) == (name in needs):
                state = "needs" if name in needs else "takes no"
                build = "base_model" if self.kind == "base" else self.kind
                raise ValueError(
                    f"a {self.kind!r} model reference {state} {name!r}; build it with ModelRef.{build}(...)."
                )
        if self.kind == "preview" and self.cal.structure != self.from_run.structure:
            raise ValueError(
                "a preview re-solves only λ, ρ, α: it and the run it comes from must share "
                "n and every other setting (AppCal.structure)."
            )

    @classmethod
    def base_model(cls) -> "ModelRef":
        return cls("base")

    @classmethod
    def merged(cls, merger: Merger) -> "ModelRef":
        return cls("merged", merger)

    @classmethod
    def calibrated(cls, merger: Merger, cal: AppCal) -> "ModelRef":
        return cls("calibrated", merger, cal)

    @classmethod
    def preview(cls, merger: Merger, from_run: AppCal, cal: AppCal) -> "ModelRef":
        return cls("preview", merger, cal, from_run)


# How the st.cache_* functions hash these values: by their repr, one string naming every field
# exactly (floats round-trip). Streamlit's default hashes a dataclass field by field, through the
# whole FeatCalConfig, slowly enough to add up over the cached calls of one slider change.
HASH_FUNCS = {Merger: repr, AppCal: repr, ModelRef: repr}

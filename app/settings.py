"""The app's settings as values: the merger, the calibration and the model a table is about.

Three frozen dataclasses, hashable (``st.cache_*`` keys, with :data:`HASH_FUNCS`, and dict
keys) and free of Streamlit (the widgets that build them are in :mod:`app.controls`):

- :class:`Merger`: the merge method and its parameters (Zoo page);
- :class:`AppCal`: a :class:`featcal.FeatCalConfig` (the maths: λ, ρ, α, switches, token
  weights) plus what only the app chooses (``n``, calibration examples per task);
- :class:`ModelRef`: which model a score or drift table is of, with every setting that made it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass

from featcal import FeatCalConfig

CAL_SIZES = (4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_N = 16  # calibration examples per task: the largest meeting the 1 s target (benchmarks/README.md)
# The instant preview (numbers and charts) is scored and drawn when the exact run has not
# finished this long after a change; an exact run quicker than that is drawn once
# (measured: benchmarks/README.md, 'App latency').
PREVIEW_AFTER_S = float(os.environ.get("FEATCAL_PREVIEW_AFTER_S", "0.1"))
# The mergers the Zoo page offers: those fast enough to re-run on a slider's change (on the
# demo zoo, 1 thread on a busy 2-core VM: Iso-C 0.3-0.5 s, Iso-CTS 1.7-3.8 s, TSV 2.0-3.4 s, TIES
# 0.6-1.2 s; WUDI's 400 Adam steps per matrix take 2 minutes, so it stays on the command line;
# benchmarks/README.md, "mergers_table.py").
MERGE_METHODS = {
    "average": "Simple averaging",
    "task_arithmetic": "Task Arithmetic",
    "ties": "TIES",
    "iso_c": "Iso-C",
    "iso_cts": "Iso-CTS",
    "tsv": "TSV",
}
# Slider (min, max, step) of every merger parameter; defaults come from featcal.baselines.merging.
MERGE_PARAMS = {
    "task_arithmetic": {"scale": (0.05, 1.0, 0.05)},
    "ties": {"density": (0.05, 1.0, 0.05), "scale": (0.05, 2.0, 0.05)},
    "iso_c": {"scale": (0.1, 2.0, 0.05)},
    "iso_cts": {"scale": (0.1, 2.0, 0.05), "common_space_fraction": (0.0, 1.0, 0.05)},
    "tsv": {"scale": (0.1, 2.0, 0.05)},
}
# What more calibration examples give on the embedded demo zoo: exact FeatCal at the default
# setting on Task Arithmetic (0.3), mean accuracy gain in points over the merged model on the live
# test subset, and the exact result's CPU seconds (benchmarks/README.md, 'Default calibration size').
DEMO_N_GAINS = {8: (7.4, 0.34), 16: (8.6, 0.43), 32: (8.9, 0.67), 64: (9.4, 1.00)}
CAL_DEFAULTS = dict(log_lam=-1.3, rho=2.0, alpha=0.3, n_cal=DEFAULT_N, bias=True, layernorm=True)


def merge_default(method: str, name: str) -> float:
    """The default of a merger parameter, read from its function in :mod:`featcal.baselines.merging`."""
    from featcal.baselines.merging import MERGERS

    return float(inspect.signature(MERGERS[method]).parameters[name].default)


@dataclass(frozen=True)
class Merger:
    """A merge method (a key of :data:`featcal.baselines.merging.MERGERS`) and its parameters."""

    method: str
    params: tuple[tuple[str, float], ...] = ()  # (name, value) pairs, in the sliders' order

    @property
    def kwargs(self) -> dict[str, float]:
        """The parameters as keyword arguments of the merge function."""
        return dict(self.params)

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v:g}" for k, v in self.params)
        return f"{MERGE_METHODS.get(self.method, self.method)}" + (f" ({args})" if args else "")


@dataclass(frozen=True)
class AppCal:
    """One exact FeatCal run of the app: its :class:`featcal.FeatCalConfig` and the number of
    calibration examples per task it reads (the only setting the app adds)."""

    config: FeatCalConfig  # the CLIP preset (token weights) with the sliders' λ, ρ, α and switches
    n: int  # calibration examples per task

    def __post_init__(self):
        if not (isinstance(self.n, int) and self.n > 0):
            raise ValueError(f"n (calibration examples per task) must be a positive int, got {self.n!r}.")

    @classmethod
    def from_widgets(cls, log_lam: float, rho: float, alpha: float, n: int, bias: bool, layernorm: bool) -> "AppCal":
        """The settings the widgets show. λ moves on a log10 slider and becomes ``config.lam``
        here, once (:func:`lam_of`)."""
        lam = lam_of(log_lam)
        config = FeatCalConfig.clip(
            lam=lam, rho=float(rho), alpha=float(alpha), bias=bool(bias), layernorm=bool(layernorm)
        )
        return cls(config, int(n))

    @property
    def structure(self) -> tuple:
        """What the kept statistics depend on (everything but λ, ρ, α): runs sharing it can
        preview each other."""
        return (self.n, dataclasses.replace(self.config, lam=0.0, rho=0.0, alpha=0.0))

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

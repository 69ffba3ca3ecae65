"""Validated, frozen configuration of one FeatCal run.

:class:`FeatCalConfig` holds what the method is (the hyper-parameters and switches, each
with its paper symbol); :class:`FastPaths` only how fast the engine gets there (every
setting of it gives the same calibration up to float rounding). Invalid values are
rejected at construction, so a config that exists is a config that runs.
"""

from __future__ import annotations

import math
import operator
from dataclasses import asdict, dataclass, replace
from typing import Mapping

import torch

from featcal.util.options import Range, option

# Names whose modules the CLIP token-weight preset leaves at weight 1 (the key
# and value projections): HF ``k_proj``/``v_proj``, open_clip's packed
# ``in_proj[k]``/``in_proj[v]``.
KEY_VALUE_SUFFIXES = ("k_proj", "v_proj", "in_proj[k]", "in_proj[v]", "key", "value")


@dataclass(frozen=True)
class TokenWeights:
    """Per-token weights ``w`` of the statistics (the CLIP preset of the reference run).

    In the blocks selected (``last_block_only``: the last block alone), every
    token except the first (the class token) gets weight ``other``, for every
    module except those whose name ends with one of ``exclude``.
    """

    other: float = 0.01  # weight of every non-class token
    last_block_only: bool = True  # apply in the last block only
    exclude: tuple[str, ...] = KEY_VALUE_SUFFIXES  # modules left at weight 1

    def __post_init__(self):
        if not self.other >= 0.0:
            raise ValueError(f"TokenWeights.other must be >= 0, got {self.other}.")

    def applies(self, block: int, n_blocks: int, module: str) -> bool:
        if self.last_block_only and block != n_blocks - 1:
            return False
        return not module.endswith(self.exclude)


# The one table of FeatCal's ranges. ``low``..``high`` (log scale for lambda) is what the app's
# sliders span, ``featcal tune`` searches around and the registry shows; ``accept`` is what a run
# takes, checked by every config and setting (so every solve and preview) and by ``--param`` before
# any work: wider than any setting in use (the paper's lam 1e-5 to 3, rho 0.5 to 2, alpha 0.15 to
# 0.6); past it the anchor or the target is extrapolated beyond anything meaningful, or eps swamps lam.
RANGES = {
    "lam": Range(1e-6, 1e2, 0.1, log=True, accept=(0.0, math.inf), what="lambda, the ridge strength toward the anchor"),
    "rho": Range(-1.0, 3.0, 0.05, accept=(-10.0, 10.0), what="rho, the anchor blend rho*W_mer + (1-rho)*W_0"),
    "alpha": Range(
        0.0, 1.0, 0.05, accept=(-1.0, 2.0), what="alpha, the target interpolation alpha*x_e + (1-alpha)*x_s"
    ),
    "eps": Range(0.0, 1e-2, accept=(0.0, 1e-2), what="eps, the tiny ridge and the clamp of the task scales (> 0)"),
}


def check_setting(lam, rho, alpha, eps=None) -> None:
    """Every hyper-parameter a finite number :data:`RANGES` accepts (eps > 0), else ``ValueError``
    naming it, its value and its range: :class:`Setting` (so every solve and preview) and the
    config call it."""
    for name, v in (("lam", lam), ("rho", rho), ("alpha", alpha), ("eps", eps)):
        if v is None and name == "eps":
            continue
        (low, high), what = RANGES[name].accept, RANGES[name].what
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (low < v if name == "eps" else low <= v) and v <= high
        if not ok:
            lo = "(" if name == "eps" else "["
            raise ValueError(f"{name} ({what}) must be a finite number in {lo}{low:g}, {high:g}], got {v!r}.")


@dataclass(frozen=True)
class Setting:
    """One point of FeatCal's three hyper-parameters, what a solve needs beyond the statistics
    (docs/maths.md, 'Linear weight'): ``lam`` the ridge toward the anchor, ``rho`` the anchor's
    blend ``W_anc = rho W_mer + (1 - rho) W_0``, ``alpha`` the target ``xt = alpha xe + (1 - alpha) xs``."""

    lam: float
    rho: float
    alpha: float

    def __post_init__(self):
        check_setting(self.lam, self.rho, self.alpha)

    def replace(self, lam: float | None = None, rho: float | None = None, alpha: float | None = None) -> "Setting":
        """This setting with the given values changed (None: kept)."""
        return Setting(
            self.lam if lam is None else lam, self.rho if rho is None else rho, self.alpha if alpha is None else alpha
        )


STATS_DTYPES = (torch.float32, torch.float64)
SCHEDULED = ("lam", "rho", "alpha")  # what a block's entry of FeatCalConfig.schedule may set
Schedule = tuple[tuple[int, tuple[tuple[str, float], ...]], ...]  # ((block, ((name, value), ...)), ...)


def normal_schedule(schedule: Mapping | Schedule | None, setting: Setting) -> Schedule:
    """``{block: {"lam": x, "alpha": y}}`` (or the form this returns) as a sorted, hashable tuple
    ``((block, (("alpha", y), ("lam", x))), ...)``; every block's setting (``setting`` with its
    values) checked as a :class:`Setting` is, blocks without values dropped. A block is a number
    >= 0 (or its digits: JSON writes keys as strings)."""
    items = (schedule.items() if isinstance(schedule, Mapping) else schedule) or ()
    out = {}
    for block, values in items:
        where = f"FeatCalConfig.schedule, block {block!r}"
        try:
            n = int(block) if isinstance(block, str) and block.strip().isdigit() else operator.index(block)
        except TypeError:
            n = -1
        if isinstance(block, bool) or n < 0:
            raise ValueError(f"{where}: a block is its number (an integer >= 0) in the report's order.")
        values = dict(values)
        unknown = sorted(set(values) - set(SCHEDULED))
        if unknown:
            raise ValueError(f"{where}: unknown name(s) {unknown}; a block may set {SCHEDULED}.")
        try:
            setting.replace(**values)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        if values:
            out[n] = tuple(sorted((k, float(v)) for k, v in values.items()))
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class FeatCalConfig:
    """Hyper-parameters and switches of FeatCal (docs/maths.md, 'Linear weight' and 'Switches').

    Attributes:
        lam: ``lambda``, ridge strength pulling toward the anchor ``W_anc``.
        rho: ``rho``, anchor blend ``W_anc = rho*W_mer + (1-rho)*W_0``.
        alpha: ``alpha``, target interpolation ``xt = alpha*xe + (1-alpha)*xs``.
        eps: ``eps``, the tiny ridge and the clamp of the task scale ``s_i``.
        bias: calibrate Linear biases (else keep the merged ones).
        layernorm: calibrate LayerNorm affine parameters (else keep the merged ones).
        linear: calibrate Linear weights (and packed attention input projections).
        token_weights: per-token weights of the statistics (``None``: all 1).
        stats_dtype: dtype of the running statistics and of the solve (float32 or float64).
        offload_streams: keep the hidden-state streams on the CPU between blocks.
        modules: if given, only modules whose name (inside a block) ends with one of these.
        schedule: per-block settings, ``{block: {"lam": x, "alpha": y}}`` (any of lam, rho,
            alpha), each overriding the global value in that block (numbered as in the report:
            an encoder-decoder's decoder blocks after the encoder's); kept in a sorted, hashable
            form (:func:`normal_schedule`), read through :meth:`setting_at`. Empty: the global
            setting everywhere.
    """

    lam: float = option(0.05, RANGES["lam"].what, range=RANGES["lam"])
    rho: float = option(2.0, RANGES["rho"].what, range=RANGES["rho"])
    alpha: float = option(0.3, RANGES["alpha"].what, range=RANGES["alpha"])
    eps: float = option(1e-8, RANGES["eps"].what, range=RANGES["eps"])
    bias: bool = option(True, "calibrate Linear biases (else keep the merged ones)")
    layernorm: bool = option(True, "calibrate LayerNorm affine parameters (else keep the merged ones)")
    linear: bool = option(True, "calibrate Linear weights (and packed attention input projections)")
    token_weights: TokenWeights | None = option(None, "per-token weights of the statistics (None: all 1)")
    stats_dtype: torch.dtype = option(torch.float32, "dtype of the statistics and the solve", choices=STATS_DTYPES)
    offload_streams: bool = option(False, "keep the hidden-state streams on the CPU between blocks")
    modules: tuple[str, ...] | None = option(None, "only modules whose name (inside a block) ends with one of these")
    schedule: Schedule = option((), "per-block settings {block: {'lam': x, 'alpha': y}} over the global ones")

    def __post_init__(self):
        check_setting(self.lam, self.rho, self.alpha, self.eps)
        object.__setattr__(self, "schedule", normal_schedule(self.schedule, self.setting))
        if self.stats_dtype not in STATS_DTYPES:
            raise ValueError(f"stats_dtype must be torch.float32 or torch.float64, got {self.stats_dtype}.")
        if not (self.linear or self.layernorm):
            raise ValueError("nothing to calibrate: linear and layernorm are both off.")
        if self.modules is not None and isinstance(self.modules, str):
            object.__setattr__(self, "modules", (self.modules,))

    @property
    def setting(self) -> "Setting":
        """This run's (lam, rho, alpha)."""
        return Setting(self.lam, self.rho, self.alpha)

    def setting_at(self, block: int) -> Setting:
        """The (lam, rho, alpha) block ``block`` (its number in the report) is solved with: the
        global setting with the schedule's values for that block. The one place the exact run
        and the preview read a block's setting from, so the two agree for a schedule as they do
        for a global setting."""
        return self.setting.replace(**dict(dict(self.schedule).get(block, ())))

    # Presets (the table: :data:`PRESETS`) ------------------------------------
    @classmethod
    def clip(cls, **overrides) -> "FeatCalConfig":
        """The paper's CLIP setting (lam 0.05, rho 2.0, alpha 0.3, bias, LayerNorm) with
        the reference run's token weights (last block: non-class tokens at 0.01, except
        key/value projections). Any field can be overridden by keyword."""
        return cls.preset("clip", **overrides)

    @classmethod
    def flan_t5(cls, **overrides) -> "FeatCalConfig":
        """The paper's FLAN-T5 setting (lam 1e-5, rho 2.0, alpha 0.6, bias, no LayerNorm)."""
        return cls.preset("flan-t5", **overrides)

    @classmethod
    def llama(cls, size: str = "3b", **overrides) -> "FeatCalConfig":
        """The paper's Llama settings: 3B (lam 1e-5) or 8B (lam 3.0), rho 0.5, alpha 0.15, bias
        on; RMSNorm scales kept merged as in the paper (Llama has no LayerNorm), ``layernorm=True``
        calibrates them too."""
        if size.lower() not in ("3b", "8b"):
            raise ValueError(f"llama preset size must be '3b' or '8b', got {size!r}.")
        return cls.preset(f"llama-{size.lower()}", **overrides)

    @classmethod
    def preset(cls, name: str, **overrides) -> "FeatCalConfig":
        """The preset ``name`` (a key of :data:`PRESETS`; ``none``: the plain config) with
        ``overrides``; :func:`preset_for_model` names the one for an architecture."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; one of {tuple(PRESETS)}.")
        return cls(**{**PRESETS[name], **overrides})

    def with_(self, **changes) -> "FeatCalConfig":
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["stats_dtype"] = str(self.stats_dtype).removeprefix("torch.")
        d.pop("schedule")  # recorded only where there is one, as {block: {name: value}}
        if self.schedule:
            d["schedule"] = {block: dict(values) for block, values in self.schedule}
        return d


# The one table of presets: the paper's settings by model family, the fields each sets (the
# rest keep FeatCalConfig's defaults). ``featcal calibrate --preset``, ``featcal tune`` and
# ``featcal study``, ``featcal compare`` and the app read it; :func:`preset_for` picks one for
# an architecture, :func:`preset_config` adds float64 statistics where lam needs them.
PRESETS: dict[str, dict] = {
    # CLIP: the reference run's token weights (last block: non-class tokens at 0.01, key/value kept at 1).
    "clip": dict(lam=0.05, rho=2.0, alpha=0.3, bias=True, layernorm=True, token_weights=TokenWeights()),
    "flan-t5": dict(lam=1e-5, rho=2.0, alpha=0.6, bias=True, layernorm=False),
    # Llama-family: RMSNorm scales kept merged as in the paper (Llama has no LayerNorm).
    "llama-3b": dict(lam=1e-5, rho=0.5, alpha=0.15, layernorm=False),
    "llama-8b": dict(lam=3.0, rho=0.5, alpha=0.15, layernorm=False),
    "none": {},  # FeatCalConfig() as it is (lam 0.05, rho 2.0, alpha 0.3, no token weights)
}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "smollm")
LLAMA_8B_WIDTH = 4096  # Llama-3.1-8B's hidden size; narrower Llama-family models take the 3B setting


def preset_for(config: dict) -> tuple[str, str]:
    """``(preset, why)`` for a Hugging Face ``config.json`` dict: ``clip`` for CLIP models,
    ``flan-t5`` for T5, ``llama-8b`` / ``llama-3b`` for Llama-family decoders by width, ``none``
    (plain FeatCalConfig) for any other architecture."""
    model_type = str(config.get("model_type", "")).lower()
    archs = " ".join(config.get("architectures") or []).lower()
    width = config.get("hidden_size") or config.get("d_model")
    if model_type.startswith("clip") or "clip" in archs:
        return "clip", f"model_type {model_type!r} is CLIP"
    if model_type in ("t5", "mt5", "umt5") or "t5" in archs:
        return "flan-t5", f"model_type {model_type!r} is T5"
    if model_type in LLAMA_FAMILY or "llama" in archs:
        size = "8b" if (width or 0) >= LLAMA_8B_WIDTH else "3b"
        return f"llama-{size}", f"model_type {model_type!r} is Llama-family, hidden size {width}"
    return "none", f"model_type {model_type!r} has no paper setting"


# Presets whose λ (1e-5) leaves float32 factorisations within their rounding noise
# (docs/architectures.md, 'Dtypes and precision'): :func:`preset_config` computes their statistics
# in float64. On the 30-block LLM zoo, float32 ones made the solves fall back to float64
# eigendecompositions, slower than float64 statistics, with weights up to 26% (of a tensor's
# largest entry) away (docs/llm_zoo.md).
FLOAT64_PRESETS = ("flan-t5", "llama-3b")
LANGUAGE_PRESETS = ("flan-t5", "llama-3b", "llama-8b")  # no class token for CLIP's token weights


def preset_config(name: str, **fields) -> FeatCalConfig:
    """``FeatCalConfig.preset(name, **fields)``, with float64 statistics for
    :data:`FLOAT64_PRESETS` unless ``fields`` set ``stats_dtype``."""
    if name in FLOAT64_PRESETS:
        fields.setdefault("stats_dtype", torch.float64)
    return FeatCalConfig.preset(name, **fields)


def preset_for_zoo(zoo) -> str:
    """The preset a zoo is calibrated with when nobody chose one (the app, ``featcal compare``):
    a language model's own (:func:`preset_for_model`), whose first token is no class token for
    CLIP's token weights to single out; the CLIP preset for every other zoo (the demo zoos,
    CLIP and text-encoder zoos)."""
    found = preset_for_model(zoo.base)[0]
    return found if found in LANGUAGE_PRESETS else "clip"


def preset_for_model(model) -> tuple[str, str]:
    """:func:`preset_for` of an ``nn.Module``: its Hugging Face config when it has one, else
    its class name (an open_clip or plain torch model)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        cfg = config.to_dict()
        cfg.setdefault("architectures", [type(model).__name__])
        return preset_for(cfg)
    return preset_for({"model_type": "", "architectures": [type(model).__name__]})


FORMS = ("P", "PW", "PW+CW")  # the exact forms of the cross-moment statistics, by what they keep (featcal.method.stats)


@dataclass(frozen=True)
class FastPaths:
    """Which of the engine's faster paths :func:`featcal.calibrate` may take. Each one is
    exact (the calibration equals the plainest path's up to float rounding) and only pays
    in some regime, hence its threshold; the defaults are the tuned ones,
    :meth:`plainest` turns every one off. Timings: ``benchmarks/engine_notes.md``.
    """

    # Run every task's calibrating batches through a block as one call up to this many rows in all (0: never).
    pool_rows: int = 4096
    # Reduce every task's statistics as one stack up to tasks x (widest input)^2 elements (0: task by task).
    stack_max: int = 1 << 22
    # A one-batch task with at most this many rows per input column adds its rows straight into the
    # systems, with no Gram matrix of its own ("direct sums"; 0: never).
    direct_rows: float = 0.5
    # Factor CPU systems this wide or wider by LAPACK's potrf in place (None: torch's Cholesky always).
    lapack_min_d: int | None = 128
    # Column block of the Gram accumulations: only their upper block triangle is summed (None: full products).
    gram_block: int | None = 384
    # Keep buffers up to this many elements from one block for the next one (0: none; 1 << 26 is 256 MB in float32).
    scratch_keep: int = 1 << 26
    # Statistics form of every Linear input, one of FORMS (None: the cheapest for its widths and rows).
    form: str | None = None
    # Under a process group (featcal.engine.distributed): "owner" solves each module on one rank and sends
    # the result to the others, "everywhere" adds every sum onto every rank and solves there too.
    dist_solve: str = "owner"

    def __post_init__(self):
        def count(name: str, lowest: int, off: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lowest:
                raise ValueError(f"FastPaths.{name} must be an integer >= {lowest} ({off} turns it off), got {v!r}.")

        for name in ("pool_rows", "stack_max", "scratch_keep"):
            count(name, 0, "0")
        for name in ("lapack_min_d", "gram_block"):
            if getattr(self, name) is not None:
                count(name, 1, "None")
        v = self.direct_rows
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < float("inf"):
            raise ValueError(f"FastPaths.direct_rows must be a finite number >= 0, got {v!r}.")
        if self.dist_solve not in ("owner", "everywhere"):
            raise ValueError(f"FastPaths.dist_solve must be 'owner' or 'everywhere', got {self.dist_solve!r}.")
        if self.form is not None and self.form not in FORMS:
            raise ValueError(f"FastPaths.form must be one of {FORMS} or None (the cheapest), got {self.form!r}.")

    @classmethod
    def plainest(cls) -> "FastPaths":
        """Every fast path off: one call per batch, task by task, Gram matrices in full, the
        shared cross moment ``P``, torch's Cholesky, no buffer kept from block to block."""
        return cls(
            pool_rows=0, stack_max=0, direct_rows=0.0, lapack_min_d=None, gram_block=None, scratch_keep=0, form="P"
        )

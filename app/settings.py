"""The app's settings: small frozen values read from the widgets.

Every widget is bound to the URL (``bind="query-params"``: a view can be shared and
restored) and kept for the whole session (``persist_state="session"``), so a page
that does not draw a widget still reads its value (:func:`current_merger`,
:func:`current_calibration`).
"""
from __future__ import annotations

import inspect
import os
from dataclasses import dataclass

import streamlit as st

BIND = dict(bind="query-params", persist_state="session")
CAL_SIZES = (4, 8, 16, 32, 64, 128, 256, 512)
DEFAULT_N = 8        # calibration examples per task (see benchmarks/app_latency.py)
# The instant preview is scored and drawn only when the exact run has not finished this long
# after a change: a quick exact run then has both cores to itself and is drawn once (on the
# demo zoo, 1.0 s gave the exact result in Chromium 1.38-1.55 s after a key press, 0.5 s
# 1.46-1.81 s: benchmarks/app_latency.py --browser, medians of 5).
PREVIEW_AFTER_S = float(os.environ.get("FEATCAL_PREVIEW_AFTER_S", "1.0"))
MERGE_METHODS = {"average": "Simple averaging", "task_arithmetic": "Task Arithmetic", "ties": "TIES"}
# Slider (min, max, step) of every merger parameter; defaults come from featcal.merging.
MERGE_PARAMS = {"task_arithmetic": {"scale": (0.05, 1.0, 0.05)},
                "ties": {"density": (0.05, 1.0, 0.05), "scale": (0.05, 2.0, 0.05)}}
CAL_DEFAULTS = dict(log_lam=-1.3, rho=2.0, alpha=0.3, n_cal=DEFAULT_N, bias=True, layernorm=True)


@dataclass(frozen=True)
class Merger:
    method: str
    params: tuple[tuple[str, float], ...] = ()

    @property
    def label(self) -> str:
        args = ", ".join(f"{k}={v:g}" for k, v in self.params)
        return f"{MERGE_METHODS.get(self.method, self.method)}" + (f" ({args})" if args else "")

    @property
    def ref(self) -> tuple:
        return (self.method, self.params)


@dataclass(frozen=True)
class CalSettings:
    n: int
    lam: float
    rho: float
    alpha: float
    bias: bool
    layernorm: bool

    @property
    def structure(self) -> tuple:
        """What the kept statistics depend on: runs sharing it can preview each other."""
        return (self.n, self.bias, self.layernorm)

    @property
    def ref(self) -> tuple:
        return (self.n, self.lam, self.rho, self.alpha, self.bias, self.layernorm)

    @property
    def label(self) -> str:
        sw = ", ".join(s for s, on in (("bias", self.bias), ("LayerNorm", self.layernorm)) if on) or "weights only"
        return f"λ={self.lam:.3g}, ρ={self.rho:g}, α={self.alpha:g}, n={self.n}/task, {sw}"


def _merge_default(method: str, name: str) -> float:
    from featcal.merging import MERGERS

    return float(inspect.signature(MERGERS[method]).parameters[name].default)


def _setting(key: str, default, cast):
    """A widget's value on any page: its session value, else its URL parameter, else ``default``."""
    if key in st.session_state:
        return st.session_state[key]
    raw = st.query_params.get(key)
    if raw is None:
        return default
    try:
        return cast(raw)
    except (TypeError, ValueError):
        return default


def _bool(raw) -> bool:
    return str(raw).lower() in ("1", "true", "yes", "on")


def merger_controls() -> Merger:
    """The merger's widgets (Zoo page): method and its parameters."""
    methods = list(MERGE_METHODS)
    method = st.selectbox("Merger", methods, index=methods.index("task_arithmetic"),
                          format_func=MERGE_METHODS.get, key="merge", **BIND)
    params = []
    for name, (lo, hi, step) in MERGE_PARAMS.get(method, {}).items():
        key = f"{method}_{name}"
        v = st.slider(f"{MERGE_METHODS[method]} {name}", lo, hi, _merge_default(method, name), step,
                      key=key, **BIND)
        params.append((name, round(float(v), 4)))
    return Merger(method, tuple(params))


def current_merger() -> Merger:
    method = _setting("merge", "task_arithmetic", str)
    if method not in MERGE_METHODS:
        method = "task_arithmetic"
    params = tuple((name, round(float(_setting(f"{method}_{name}", _merge_default(method, name), float)), 4))
                   for name in MERGE_PARAMS.get(method, {}))
    return Merger(method, params)


def calibration_controls(max_n: int) -> CalSettings:
    """The FeatCal widgets (Calibrate page). λ moves on a log10 scale."""
    sizes = [n for n in CAL_SIZES if n <= max_n] or [max_n]
    c1, c2, c3 = st.columns(3)
    log_lam = c1.slider("log₁₀ λ  (ridge strength)", -6.0, 2.0, CAL_DEFAULTS["log_lam"], 0.1, key="log_lam",
                        help="λ pulls every calibrated weight toward the anchor W_anc.", **BIND)
    c1.caption(f"λ = {10 ** log_lam:.3g}")
    rho = c2.slider("ρ  (anchor blend)", -1.0, 3.0, CAL_DEFAULTS["rho"], 0.05, key="rho",
                    help="W_anc = ρ·W_mer + (1-ρ)·W_0", **BIND)
    alpha = c3.slider("α  (target interpolation)", 0.0, 1.0, CAL_DEFAULTS["alpha"], 0.05, key="alpha",
                      help="x_t = α·x_expert + (1-α)·x_calibrating", **BIND)
    c4, c5, c6 = st.columns(3)
    default_n = CAL_DEFAULTS["n_cal"] if CAL_DEFAULTS["n_cal"] in sizes else sizes[-1]
    n = c4.select_slider("calibration examples per task", sizes, default_n, key="n_cal", **BIND)
    bias = c5.toggle("calibrate Linear biases", CAL_DEFAULTS["bias"], key="bias", **BIND)
    layernorm = c6.toggle("calibrate LayerNorm affine", CAL_DEFAULTS["layernorm"], key="layernorm", **BIND)
    return CalSettings(int(n), round(10 ** float(log_lam), 8), float(rho), float(alpha), bool(bias), bool(layernorm))


def current_calibration(max_n: int) -> CalSettings:
    n = int(_setting("n_cal", CAL_DEFAULTS["n_cal"], int))
    return CalSettings(
        n if n <= max_n else max_n,
        round(10 ** float(_setting("log_lam", CAL_DEFAULTS["log_lam"], float)), 8),
        float(_setting("rho", CAL_DEFAULTS["rho"], float)),
        float(_setting("alpha", CAL_DEFAULTS["alpha"], float)),
        bool(_setting("bias", CAL_DEFAULTS["bias"], _bool)),
        bool(_setting("layernorm", CAL_DEFAULTS["layernorm"], _bool)),
    )

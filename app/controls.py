"""The widgets that set the app's settings (:mod:`app.settings`): the zoo, the merger, FeatCal.

Every widget is bound to the URL (``bind="query-params"``: a view can be shared and
restored) and kept for the whole session (``persist_state="session"``), so a page
that does not draw a widget still reads its value (:func:`current_merger`,
:func:`current_calibration`).
"""

from __future__ import annotations

import streamlit as st

from app.settings import (
    CAL_SIZES,
    GIVEN,
    MERGE_METHODS,
    MERGE_PARAMS,
    METHOD_LABELS,
    AppCal,
    Merger,
    cal_defaults,
    merge_default,
)
from app.zoos import REPO
from featcal.config import RANGES

BIND = dict(bind="query-params", persist_state="session")
OTHER = "other (path)…"
APPLIED = "_applied_notice"  # session key: what another page just set on the Calibrate page (shown once)
OPEN_ZOO = "_open_zoo"  # session key: a zoo source for the picker to switch to on the next run
# (min, max, step) of the Calibrate page's sliders: featcal.config.RANGES, lambda's on a log10 scale.
SLIDERS = {"log_lam": RANGES["lam"].slider, "rho": RANGES["rho"].slider, "alpha": RANGES["alpha"].slider}


def on_slider(key: str, value: float) -> float:
    """``value`` as slider ``key`` can show it: clipped to its range, rounded to its step."""
    lo, hi, step = SLIDERS[key]
    v = lo + round((min(max(float(value), lo), hi) - lo) / step) * step
    return round(v, 4)


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


# ----------------------------------------------------------------------------- zoo


def zoo_choices() -> list[str]:
    specs = sorted(str(p.relative_to(REPO)) for p in (REPO / "assets" / "zoos").glob("*.yaml"))
    return ["demo", "demo-fashion", "real-text", "smollm2", *specs, OTHER]  # the first is the default


def zoo_picker() -> str:
    """The sidebar zoo selector; returns the zoo source (``demo``, a spec path, a zoo directory)."""
    choices = zoo_choices()
    opened = st.session_state.pop(OPEN_ZOO, None)
    if opened is not None:  # a zoo spec just written (Zoo page, "Your models"): set before the widgets exist
        st.session_state["zoo"], st.session_state["zoo_path"] = OTHER, opened
        _path_to_url(opened)
    pick = st.sidebar.selectbox(
        "Zoo",
        choices,
        index=0,
        key="zoo",
        **BIND,
        help="The embedded demo and the real text zoo build offline on first use. A spec YAML names a base, "
        "experts, heads and data found locally or in the HF cache (never downloaded).",
    )
    if pick != OTHER:
        return pick
    path = st.sidebar.text_input(
        "Zoo spec or FusionBench model pool (YAML), or zoo directory",
        key="zoo_path",
        **BIND,
        placeholder="~/zoos/my-zoo.yaml",
    )
    return path.strip()


def _path_to_url(path: str) -> None:
    """Put the opened zoo's path in the page's URL, so that a reload or a shared link opens it. Streamlit
    writes a bound widget's value set by code to the URL only when the widget existed on the run before;
    the path box did not (the sidebar showed a built-in zoo), so the URL said ``zoo=other`` without a
    path and a reload showed "No zoo selected". Set directly, unless the box is bound already (it
    existed: Streamlit writes it then)."""
    from streamlit.errors import StreamlitAPIException

    try:
        st.query_params["zoo_path"] = path
    except StreamlitAPIException:  # bound to the path box of the run before: its value reaches the URL
        pass


# ----------------------------------------------------------------------------- merger


def _methods(given: bool) -> list[str]:
    """The mergers offered: the zoo's own merged model first when it has one, then the registry's."""
    return [GIVEN, *MERGE_METHODS] if given else list(MERGE_METHODS)


def merger_controls(given: bool = False) -> Merger:
    """The merger's widgets (Zoo page): method and its parameters; ``given``: the zoo has a
    merged model of its own (offered first, and the default)."""
    methods = _methods(given)
    method = st.selectbox(
        "Merger",
        methods,
        index=0 if given else methods.index("task_arithmetic"),
        format_func=METHOD_LABELS.get,
        key="merge",
        **BIND,
    )
    params = []
    for name, (lo, hi, step) in MERGE_PARAMS.get(method, {}).items():
        v = st.slider(
            f"{MERGE_METHODS[method]} {name}", lo, hi, merge_default(method, name), step, key=f"{method}_{name}", **BIND
        )
        params.append((name, round(float(v), 4)))
    return Merger(method, tuple(params))


def current_merger(given: bool | None = None) -> Merger:
    """The merger the Zoo page's widgets (or the URL) set, on any page; ``given``: whether the
    zoo has a merged model of its own (default: the active zoo's), then its default."""
    if given is None:
        from app import state

        given = state.active_zoo().given_merged is not None
    method = _setting("merge", GIVEN if given else "task_arithmetic", str)
    if method not in _methods(given):
        method = "task_arithmetic"
    params = tuple(
        (name, round(float(_setting(f"{method}_{name}", merge_default(method, name), float)), 4))
        for name in MERGE_PARAMS.get(method, {})
    )
    return Merger(method, params)


# ----------------------------------------------------------------------------- FeatCal


def zoo_preset(preset: str | None = None) -> str:
    """``preset``, else the active zoo's (:func:`featcal.config.preset_for_zoo`)."""
    if preset is not None:
        return preset
    from app import state
    from featcal.config import preset_for_zoo

    return preset_for_zoo(state.active_zoo())


def calibration_controls(max_n: int, preset: str | None = None) -> AppCal:
    """The FeatCal widgets (Calibrate page); ``max_n``: the calibration split's size per task;
    ``preset``: the zoo's (default: the active zoo's), which sets their defaults."""
    preset = zoo_preset(preset)
    defaults = cal_defaults(preset)
    sizes = [n for n in CAL_SIZES if n <= max_n] or [max_n]
    c1, c2, c3 = st.columns(3)
    sliders = (
        (c1, "log_lam", "log₁₀ λ  (ridge strength)", "λ pulls every calibrated weight toward the anchor W_anc."),
        (c2, "rho", "ρ  (anchor blend)", "W_anc = ρ·W_mer + (1-ρ)·W_0"),
        (c3, "alpha", "α  (target interpolation)", "x_t = α·x_expert + (1-α)·x_calibrating"),
    )
    log_lam, rho, alpha = (
        col.slider(
            label, *SLIDERS[key][:2], step=SLIDERS[key][2], key=key, help=why, **_initial(key, defaults[key]), **BIND
        )
        for col, key, label, why in sliders
    )
    c4, c5, c6 = st.columns(3)
    default_n = defaults["n_cal"] if defaults["n_cal"] in sizes else sizes[-1]
    if st.session_state.get("n_cal") not in (None, *sizes):
        st.session_state["n_cal"] = sizes[-1]  # a size another page set that this zoo's split cannot give
    n = c4.select_slider("calibration examples per task", sizes, key="n_cal", **_initial("n_cal", default_n), **BIND)
    bias = c5.toggle("calibrate Linear biases", key="bias", **_initial("bias", defaults["bias"]), **BIND)
    norm = _initial("layernorm", defaults["layernorm"])
    layernorm = c6.toggle("calibrate LayerNorm affine", key="layernorm", **norm, **BIND)
    cal = AppCal.from_widgets(log_lam, rho, alpha, n, bias, layernorm, preset)
    c1.caption(f"λ = {cal.config.lam:.3g}" + ("" if preset == "clip" else f" · preset {preset}"))
    return cal


def _initial(key: str, default) -> dict:
    """The widget's ``value`` argument: its default, unless Session State already holds a value
    (another page set it: Streamlit warns when a widget gets both)."""
    if key in st.session_state:
        return {}
    return {"value": default}


def current_calibration(max_n: int, preset: str | None = None) -> AppCal:
    """The calibration the Calibrate page's widgets (or the URL) set, on any page; ``preset``:
    the zoo's (default: the active zoo's)."""
    preset = zoo_preset(preset)
    d = cal_defaults(preset)
    n = int(_setting("n_cal", d["n_cal"], int))
    return AppCal.from_widgets(
        float(_setting("log_lam", d["log_lam"], float)),
        float(_setting("rho", d["rho"], float)),
        float(_setting("alpha", d["alpha"], float)),
        min(n, max_n),
        bool(_setting("bias", d["bias"], _bool)),
        bool(_setting("layernorm", d["layernorm"], _bool)),
        preset,
    )

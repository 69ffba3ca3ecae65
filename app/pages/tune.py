"""Tune page: sweep FeatCal's (lam, rho, alpha) with previews, confirm the best exactly,
choose on the validation split; the test split only on request, after the choice.

1. the sweep's settings (the merger comes from the Zoo page);
2. the sweep runs on "Run sweep" (cached per setting: :func:`featcal.sweep.search.tune_zoo`);
3. the chosen setting, the table of every point, the parallel-coordinates plot and the
   (rho, alpha) heatmap at a chosen lambda; a button scores anchor and tuned on test.

The "per block" search (:mod:`featcal.sweep.perblock`) chooses a schedule of λ and α per block
instead; its results are the schedule and the table (no grid, so no figures, and the Calibrate
page's sliders hold one setting: nothing to apply there).
"""

import dataclasses
import math

import pandas as pd
import streamlit as st

from app import controls, settings, state, ui, zoos
from featcal.config import LANGUAGE_PRESETS, RANGES, preset_config, preset_for_zoo
from featcal.sweep import figures as tune_figures
from featcal.sweep.search import Grid, holdout_report, tune_zoo

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()
preset = preset_for_zoo(zoo)  # the anchor: the setting the Calibrate page starts from on this zoo
anchor = preset_config(preset)
GRIDS = {
    "quick · 3 × 3 × 3": Grid(lam=(0.01, 0.05, 0.3), rho=(1.0, 2.0, 2.5), alpha=(0.15, 0.3, 0.5)),
    "default · 5 × 5 × 5": Grid(),
}
if preset in LANGUAGE_PRESETS:  # around the LLM presets' λ (1e-5 to 3, float64 statistics)
    GRIDS = {"LLM · 3 × 1 × 2": Grid(lam=(1e-5, 1e-2, 3.0), rho=(0.5,), alpha=(0.15, 0.5)), **GRIDS}
WIDENED = "widened"  # the grid the edge warning's buttons grow (kept for the session)
AXES = {"lam": "λ", "rho": "ρ", "alpha": "α"}
# alpha interpolates between two targets: a widened grid never leaves its slider range
ALPHA_BOUNDS = (RANGES["alpha"].low, RANGES["alpha"].high)
if st.session_state.get("tune_widened") is not None:
    GRIDS[WIDENED] = st.session_state["tune_widened"]


def _sweep(
    source: str,
    fp: str,
    merger: settings.Merger,
    n: int,
    grid: Grid,
    search: str,
    n_confirm: int,
    val_per_task: int | None,
    trials: int,
):
    z = state.active_zoo()
    return state.on_shared_models(
        source,
        lambda: tune_zoo(
            z,
            progress=True,  # the terminal's bars, and the page's through ui.progress_of
            method=merger.method,
            merge_params=merger.kwargs,
            n_calib=n,
            val_per_task=val_per_task,
            config=preset_config(preset_for_zoo(z)),
            grid=grid,
            search=search,
            n_confirm=n_confirm,
            trials=trials,
        ),
    )


@st.cache_data(max_entries=8, show_spinner=False)
def _test(source: str, fp: str, key: tuple, _result) -> pd.DataFrame:
    z = state.active_zoo()
    return state.on_shared_models(source, lambda: holdout_report(z, _result))


# 1. Settings.
st.title("Tune")
st.caption(
    f"Merged model: **{merger.label}** (change it on the Zoo page). One exact FeatCal run at the "
    f"{preset} setting (λ={anchor.lam:g}, ρ={anchor.rho:g}, α={anchor.alpha:g}) keeps its statistics; "
    "every grid point is scored as a *preview* "
    "on the **validation** split, the best previews are re-run exactly and the best exact run wins "
    "(ties keep the paper's setting). The test split is not read unless you ask below."
)
c1, c2, c3, c4 = st.columns(4)
sizes = [n for n in settings.CAL_SIZES if n <= zoos.split_size(zoo, "calib")]
n = c1.select_slider("calibration examples per task", sizes, 64 if 64 in sizes else sizes[-1], key="tune_n")
grid_name = c2.selectbox(
    "grid",
    list(GRIDS),
    key="tune_grid",
    format_func=lambda name: (
        f"widened · {' × '.join(str(len(getattr(GRIDS[name], a))) for a in AXES)}" if name == WIDENED else name
    ),
)
search = c3.selectbox(
    "search",
    ["grid", "adaptive", "per_block"],
    key="tune_search",
    format_func=lambda v: "per block (TPE)" if v == "per_block" else v,
    help="adaptive: after the grid, refine twice around the three best previews; per block: a λ and α "
    "for each block, searched by TPE (seeded), each trial one preview (beyond the paper)",
)
per_block = search == "per_block"
n_confirm = c4.slider("exact confirmations", 0, 8, 4, key="tune_confirm")
n_val = zoos.split_size(zoo, "val") if "val" in zoos.splits_of(zoo) else 0
if n_val == 0:
    st.error("This zoo has no `val` split: tuning needs validation data apart from calibration and test.")
    st.stop()
val_sizes = sorted({min(50, n_val), min(100, n_val), n_val})
val_per_task = (
    st.select_slider("validation examples per task", val_sizes, min(100, n_val), key="tune_val")
    if len(val_sizes) > 1
    else n_val
)
trials = (
    st.select_slider("TPE trials", [20, 40, 80, 160], 40, key="tune_trials") if per_block else 40
)  # (unread off per block)
args = (source, fp, merger, int(n), GRIDS[grid_name], search, int(n_confirm), int(val_per_task), int(trials))

# 2. The sweep.
if st.button("Run sweep", type="primary"):
    st.session_state["tune_args"] = args
if st.session_state.get("tune_args") != args:
    what = f"{trials} TPE trials" if per_block else f"{len(GRIDS[grid_name].points())} grid points"
    st.info(f"{what}, {n_confirm} exact confirmations: press **Run sweep**.")
    st.stop()
with ui.progress_of("Sweeping: one exact run, previews of every point, exact confirmations"):
    res = state.memoized(_sweep, *args)
exact_runs = int(res.table.confirmed.sum())
st.caption(f"Sweep: {len(res.table)} points, {exact_runs} exact runs, {res.seconds:.1f} s of compute.")


def widen_grid(grid: Grid, axis: str, side: str) -> None:
    """Callback of an edge warning's button: the current grid with ``axis`` one step wider on
    ``side``, selected as the sweep's grid (the next "Run sweep" uses it)."""
    values = tune_figures.widen(
        getattr(grid, axis), side, log=axis == "lam", bounds=ALPHA_BOUNDS if axis == "alpha" else None
    )
    st.session_state["tune_widened"] = dataclasses.replace(grid, **{axis: values})
    st.session_state["tune_grid"] = WIDENED


def apply_to_calibrate(lam: float, rho: float, alpha: float, n: int) -> None:
    """Callback of "apply to Calibrate": the Calibrate page's widgets (URL-bound session
    values, :mod:`app.controls`) take every setting the sweep chose and ran at (λ, ρ, α on the
    sliders' steps and in their ranges, the calibration size), and the page says so."""
    values = {
        "log_lam": controls.on_slider("log_lam", math.log10(lam)),
        "rho": controls.on_slider("rho", rho),
        "alpha": controls.on_slider("alpha", alpha),
        "n_cal": int(n),
    }
    st.session_state.update(values)
    cal = settings.AppCal.from_widgets(values["log_lam"], values["rho"], values["alpha"], int(n), True, True)
    st.session_state[controls.APPLIED] = (
        f"Applied the Tune page's choice: {cal.point_label}, n={n} calibration examples per task"
        + ("" if math.isclose(cal.config.lam, lam, rel_tol=0.01) else f" (λ {lam:.3g} on the slider's step)")
        + "."
    )
    st.session_state["_tune_applied"] = True


# 3. Results.
b, unit = res.best, ("%" if res.score == "accuracy" else "")
kept = None if b["stage"] != "anchor" else "the paper's setting kept" + (": no schedule beat it on val" * per_block)
m1, m2, m3 = st.columns([2, 1, 1])  # the chosen setting's three values need the room
chosen = f"λ={b['lam']:.3g}, ρ={b['rho']:g}, α={b['alpha']:g}"
m1.metric("chosen" if per_block else "chosen setting", "per-block schedule" if b["schedule"] else chosen, kept)
m2.metric(
    f"val {res.score}, chosen", f"{b['score']:.3f}{unit}", f"{b['score'] - b['anchor_score']:+.3f} vs paper setting"
)
m3.metric(f"val {res.score}, paper setting", f"{b['anchor_score']:.3f}{unit}")
if per_block:  # the schedule and every trial
    if b["schedule"]:
        names = zoos.block_names(zoo)  # an encoder-decoder's blocks by name (encoder.block.3, decoder.block.0)
        rows = [
            {"block": blk if names is None else names[int(blk)], "λ": v["lam"], "ρ": b["rho"], "α": v["alpha"]}
            for blk, v in b["schedule"].items()
        ]
        ui.table(pd.DataFrame(rows), 4, index=False)
    st.subheader("Every trial")
    ui.table(res.table, 4, index=False)
    ui.downloads(res.table, "tune_table", "every trial (preview and exact scores)")
    st.subheader("Test split")
    if st.button("Score the paper's setting and the chosen schedule on the test split"):
        with st.spinner("Two exact runs and a full test evaluation…"):
            ui.table(_test(source, fp, args, res), 2, index=False)
    st.stop()
st.button(
    "Apply to Calibrate",
    type="primary",
    icon=":material/arrow_forward:",
    on_click=apply_to_calibrate,
    args=(float(b["lam"]), float(b["rho"]), float(b["alpha"]), int(n)),
    help="Set the Calibrate page's λ, ρ, α and calibration size to the chosen setting and open it.",
    key="tune_apply",
)
if st.session_state.pop("_tune_applied", False):
    st.switch_page("pages/calibrate.py")
grid = GRIDS[grid_name]
edges = tune_figures.grid_edges(b, {axis: getattr(grid, axis) for axis in AXES})
if b["stage"] == "refine":  # adaptive refinements can leave the grid: judge the points tried
    edges = tune_figures.grid_edges(b, {axis: res.table[axis].unique() for axis in AXES})
if edges:
    where = ", ".join(f"{AXES[a]} = {b[a]:.3g} (the {side}est value tried)" for a, side in edges.items())
    st.warning(
        f"The chosen point lies on the grid's edge: {where}. The best setting may lie beyond it; "
        "widen that axis and run the sweep again.",
        icon=":material/border_outer:",
    )
    cols = st.columns(len(edges) + 2)
    for col, (axis, side) in zip(cols, edges.items()):
        col.button(
            f"Widen {AXES[axis]} ({'lower' if side == 'low' else 'higher'})",
            on_click=widen_grid,
            args=(grid, axis, side),
            key=f"tune_widen_{axis}",
            disabled=axis == "alpha" and b[axis] == ALPHA_BOUNDS[0 if side == "low" else 1],
        )
left, right = st.columns(2)
left.plotly_chart(tune_figures.sweep_parallel(res.table, res.score), key="tune_parcoords")
lams = sorted(res.table["lam"].unique())
lam = min(lams, key=lambda v: abs(v - b["lam"]))
if len(lams) > 1:
    lam = right.select_slider("λ of the heatmap", lams, lam, format_func=lambda v: f"{v:.3g}", key="tune_heat_lam")
right.plotly_chart(tune_figures.sweep_heatmap(res.table, lam=lam, score=res.score), key="tune_heatmap")
right.caption(
    "The colours are the **previews** (every grid point, re-solved from one run's kept statistics); "
    "the circles are the points re-run **exactly**, and the star the best exact run: the chosen setting. "
    "The exact runs choose, so the star need not sit on the brightest cell."
)
st.subheader("Every point tried")
ui.table(res.table, 4, index=False)
ui.downloads(res.table, "tune_table", "every point tried (preview and exact scores)")

st.subheader("Test split")
if st.button("Score the paper's and the chosen setting on the test split"):
    with st.spinner("Two exact runs and a full test evaluation…"):
        ui.table(_test(source, fp, args, res), 2, index=False)

"""Tune page: sweep FeatCal's (lam, rho, alpha) with previews, confirm the best exactly,
choose on the validation split; the test split only on request, after the choice.

1. the sweep's settings (the merger comes from the Zoo page);
2. the sweep runs on "Run sweep" (cached per setting: :func:`featcal.tune.tune_zoo`);
3. the chosen setting, the table of every point, the parallel-coordinates plot and the
   (rho, alpha) heatmap at a chosen lambda; a button scores anchor and tuned on test.
"""

import pandas as pd
import streamlit as st

from app import compute, controls, settings, state, ui, workers
from featcal import tune_figures
from featcal.config import FeatCalConfig
from featcal.tune import Grid, holdout_report, tune_zoo

GRIDS = {
    "quick · 3 × 3 × 3": Grid(lam=(0.01, 0.05, 0.3), rho=(1.0, 2.0, 2.5), alpha=(0.15, 0.3, 0.5)),
    "default · 5 × 5 × 5": Grid(),
}

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()


@st.cache_data(max_entries=8, show_spinner=False)
def _sweep(
    source: str,
    fp: str,
    merger: settings.Merger,
    n: int,
    grid: Grid,
    search: str,
    n_confirm: int,
    val_per_task: int | None,
):
    z = state.active_zoo()
    with workers.torch_lock():
        return tune_zoo(
            z,
            method=merger.method,
            merge_params=merger.kwargs,
            n_calib=n,
            val_per_task=val_per_task,
            config=FeatCalConfig.clip(),
            grid=grid,
            search=search,
            n_confirm=n_confirm,
        )


@st.cache_data(max_entries=8, show_spinner=False)
def _test(source: str, fp: str, key: tuple, _result) -> pd.DataFrame:
    z = state.active_zoo()
    with workers.torch_lock():
        return holdout_report(z, _result)


# 1. Settings.
st.title("Tune")
st.caption(
    f"Merged model: **{merger.label}** (change it on the Zoo page). One exact FeatCal run at the paper's "
    "CLIP setting (λ=0.05, ρ=2, α=0.3) keeps its statistics; every grid point is scored as a *preview* "
    "on the **validation** split, the best previews are re-run exactly and the best exact run wins "
    "(ties keep the paper's setting). The test split is not read unless you ask below."
)
c1, c2, c3, c4 = st.columns(4)
sizes = [n for n in settings.CAL_SIZES if n <= compute.split_size(zoo, "calib")]
n = c1.select_slider("calibration examples per task", sizes, 64 if 64 in sizes else sizes[-1], key="tune_n")
grid_name = c2.selectbox("grid", list(GRIDS), key="tune_grid")
search = c3.selectbox(
    "search",
    ["grid", "adaptive"],
    key="tune_search",
    help="adaptive: after the grid, refine twice around the three best previews",
)
n_confirm = c4.slider("exact confirmations", 0, 8, 4, key="tune_confirm")
n_val = compute.split_size(zoo, "val") if "val" in compute.splits_of(zoo) else 0
if n_val == 0:
    st.error("This zoo has no `val` split: tuning needs validation data apart from calibration and test.")
    st.stop()
val_sizes = sorted({min(50, n_val), min(100, n_val), n_val})
val_per_task = (
    st.select_slider("validation examples per task", val_sizes, min(100, n_val), key="tune_val")
    if len(val_sizes) > 1
    else n_val
)
args = (source, fp, merger, int(n), GRIDS[grid_name], search, int(n_confirm), int(val_per_task))

# 2. The sweep.
if st.button("Run sweep", type="primary"):
    st.session_state["tune_args"] = args
if st.session_state.get("tune_args") != args:
    st.info(f"{len(GRIDS[grid_name].points())} grid points, {n_confirm} exact confirmations: press **Run sweep**.")
    st.stop()
with ui.status("Sweeping: one exact run, previews of every point, exact confirmations…") as s:
    res = _sweep(*args)
    s.update(
        label=f"Sweep done in {res.seconds:.1f} s: {len(res.table)} points, "
        f"{int(res.table.confirmed.sum())} exact runs",
        state="complete",
    )

# 3. Results.
b, unit = res.best, ("%" if res.score == "accuracy" else "")
m1, m2, m3 = st.columns(3)
m1.metric(
    "chosen setting",
    f"λ={b['lam']:.3g}, ρ={b['rho']:g}, α={b['alpha']:g}",
    "the paper's setting kept" if b["stage"] == "anchor" else None,
)
m2.metric(
    f"val {res.score}, chosen", f"{b['score']:.3f}{unit}", f"{b['score'] - b['anchor_score']:+.3f} vs paper setting"
)
m3.metric(f"val {res.score}, paper setting", f"{b['anchor_score']:.3f}{unit}")
left, right = st.columns(2)
left.plotly_chart(tune_figures.sweep_parallel(res.table, res.score), key="tune_parcoords")
lams = sorted(res.table["lam"].unique())
lam = min(lams, key=lambda v: abs(v - b["lam"]))
if len(lams) > 1:
    lam = right.select_slider("λ of the heatmap", lams, lam, format_func=lambda v: f"{v:.3g}", key="tune_heat_lam")
right.plotly_chart(tune_figures.sweep_heatmap(res.table, lam=lam, score=res.score), key="tune_heatmap")
st.subheader("Every point tried")
st.dataframe(res.table, hide_index=True, width="stretch")
st.download_button("table.csv", res.table.to_csv(index=False), "table.csv", "text/csv")

st.subheader("Test split")
if st.button("Score the paper's and the chosen setting on the test split"):
    with st.spinner("Two exact runs and a full test evaluation…"):
        st.dataframe(_test(source, fp, args, res).round(2), hide_index=True, width="stretch")

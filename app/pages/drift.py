"""Drift page: where the merged model's features leave the experts', block by block, and
how much of it the calibrated model removes (paper section 3).

Click a bar (a block) or a heatmap cell (a block and a task) to drill down; the
selectboxes below the charts do the same.
"""

import streamlit as st

from app import compute, controls, figures, state, ui
from app.settings import ModelRef

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()
cal = controls.current_calibration(compute.split_size(zoo, "calib"))
ALL = "mean over tasks"
METRICS = {
    "drift_rel": "relative drift |e| / |h_exp|",
    "drift": "drift |e|",
    "drift_sq_mismatch_share": "share of |e|² from local mismatch",
    "mismatch_rel": "relative local mismatch |m| / |h_exp|",
    "propagation_rel": "relative propagation |p| / |h_exp|",
}

st.title("Feature drift")
st.caption(
    f"Merged: **{merger.label}** (Zoo page) · calibrated: exact FeatCal, **{cal.label}** (Calibrate page). "
    f"Measured on {state.DIAG_N} held-out examples per task, every token. "
    "e = m + p per token: drift = local mismatch + upstream propagation; "
    "|e|² = ⟨e, m⟩ + ⟨e, p⟩ splits the squared drift exactly (bars), the norms do not add (lines)."
)

with ui.status(f"Measuring the drift of the merged model ({merger.label})…") as s:
    d_mer = state.drift(source, fp, ModelRef.merged(merger))
    s.update(label=f"Running exact FeatCal: {cal.label}…")
    state.calibrated(source, fp, merger, cal)
    s.update(label="Measuring the drift of the calibrated model…")
    d_cal = state.drift(source, fp, ModelRef.calibrated(merger, cal))
    s.update(label=f"Drift of merged and calibrated ({cal.label})", state="complete")
frames = {"merged": d_mer, "calibrated": d_cal}


def new_click(key: str) -> dict | None:
    """The first point of the newest click on chart ``key``; None when it has not changed."""
    try:
        points = list(st.session_state[key]["selection"]["points"])
    except (KeyError, TypeError):
        return None
    if not points:
        return None
    point = points[0]
    sig = (point.get("x"), point.get("y"))
    if st.session_state.get(f"_seen_{key}") == sig:
        return None
    st.session_state[f"_seen_{key}"] = sig
    return point


# A click since the last run moves the drill-down selectboxes (set before they are drawn).
blocks = sorted(int(b) for b in d_mer.block.unique() if b >= 0)
for name in frames:
    bar, cell = new_click(f"drift_dec_{name}"), new_click(f"drift_hm_{name}")
    if bar is not None and bar.get("x") in blocks:
        st.session_state["drill_block"] = int(bar["x"])
    if cell is not None:
        if cell.get("x") in zoo.tasks:
            st.session_state["drill_task"] = cell["x"]
        if cell.get("y") in blocks:
            st.session_state["drill_block"] = int(cell["y"])

top = st.columns([1, 1, 2])
task = top[0].selectbox("decomposition of", [ALL, *zoo.tasks], key="drift_task")
metric = top[1].selectbox("heatmap metric", list(METRICS), format_func=METRICS.get, key="drift_metric")
one = None if task == ALL else task
sq = figures.value_range(frames.values(), figures.SQUARED, one, stacked=True)
nm = figures.value_range(frames.values(), figures.NORMS, one)
zr = figures.heatmap_range(frames.values(), metric)
drill_block = st.session_state.get("drill_block")

cols = st.columns(2)
for col, (name, df) in zip(cols, frames.items()):
    with col:
        st.plotly_chart(
            figures.drift_decomposition(
                df, f"{name}: drift per block ({task})", one, sq, nm, selected_block=drill_block
            ),
            key=f"drift_dec_{name}",
            on_select="rerun",
            selection_mode="points",
        )
        st.plotly_chart(
            figures.drift_heatmap(df, f"{name}: {METRICS[metric]}", metric, zr),
            key=f"drift_hm_{name}",
            on_select="rerun",
            selection_mode="points",
        )

st.subheader("Drill down")
st.caption("Click a bar (block) or a heatmap cell (task and block) above, or pick here.")
d1, d2 = st.columns(2)
block = d1.selectbox("block", blocks, key="drill_block")
dtask = d2.selectbox("task", zoo.tasks, key="drill_task")
d1.plotly_chart(figures.block_by_task(frames, block, metric), key="drift_block")
d2.plotly_chart(figures.task_by_block(frames, dtask, metric), key="drift_taskfig")
with st.expander("tables"):
    st.dataframe(d_mer.assign(model="merged").pipe(lambda d: d[d.block == block]), hide_index=True)
    st.dataframe(d_cal.assign(model="calibrated").pipe(lambda d: d[d.block == block]), hide_index=True)

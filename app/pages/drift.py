"""Drift page: where the merged model's features leave the experts', block by block, and
how much of it the calibrated model removes (paper section 3).

Click a bar (a block) or a heatmap cell (a block and a task) to drill down; the
selectboxes below the charts do the same.
"""

import pandas as pd
import streamlit as st

from app import controls, figures, state, ui, zoos
from app.settings import ModelRef

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()
cal = controls.current_calibration(zoos.split_size(zoo, "calib"))
names = zoos.block_names(zoo)  # an encoder-decoder's blocks by name (encoder.block.3, decoder.block.0)
ALL = "mean over tasks"
METRICS = {
    k: figures.label(k) for k in ("drift_rel", "drift", "drift_sq_mismatch_share", "mismatch_rel", "propagation_rel")
}

st.title("Feature drift")
st.caption(
    f"Merged: **{merger.label}** (Zoo page) · calibrated: exact FeatCal, **{cal.label}** (Calibrate page). "
    f"Measured on {state.DIAG_N} held-out examples per task, every token."
)
st.markdown(
    "**Drift** $e$ = **local mismatch** $m$ (what block l alone gets wrong when fed the expert's own input) "
    "+ **propagation** $p$ (what it inherits from the blocks before), token by token."
)
with st.expander("What is plotted: the formulas"):
    st.markdown(
        "At block l, for task i, the **drift** is how far the model's block output is from expert i's, "
        "$e_l = h_{\\mathrm{mod},l} - h_{\\mathrm{exp},l}$. The **local mismatch** $m_l$ is what block l "
        "alone gets wrong when fed the expert's own input; the **propagation** $p_l$ is what it inherits "
        "from the blocks before (its own map applied to the drifted input):\n\n"
        "$$m_l = f_{\\mathrm{mod},l}(h_{\\mathrm{exp},l-1}) - f_{\\mathrm{exp},l}(h_{\\mathrm{exp},l-1}),\\qquad "
        "p_l = f_{\\mathrm{mod},l}(h_{\\mathrm{mod},l-1}) - f_{\\mathrm{mod},l}(h_{\\mathrm{exp},l-1}),"
        "\\qquad e_l = m_l + p_l.$$\n\n"
        "The bars split the squared drift exactly, $|e|^2 = \\langle e, m\\rangle + \\langle e, p\\rangle$ "
        "(one part can be negative); the lines are the norms $|e|, |m|, |p|$, which do not add. "
        f"The maths: `{zoos.REPO / 'docs' / 'maths.md'}`, section *Diagnostics*."
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
    sig = (point.get("x"), point.get("y"), str(point.get("customdata")))
    if st.session_state.get(f"_seen_{key}") == sig:
        return None
    st.session_state[f"_seen_{key}"] = sig
    return point


# A click since the last run moves the drill-down selectboxes (set before they are drawn).
blocks = sorted(int(b) for b in d_mer.block.unique() if b >= 0)


def cell_block(cell: dict) -> int | None:
    """The block of a clicked heatmap cell (its ``customdata`` is ``[block, value]``)."""
    data = cell.get("customdata")
    try:
        return int(data[0])
    except (TypeError, ValueError, IndexError, KeyError):
        return None


for key in [*(f"drift_dec_{n}" for n in frames), *(f"drift_hm_{n}" for n in [*frames, "diff"])]:
    point = new_click(key)
    if point is None:
        continue
    st.session_state["_drill_chosen"] = True  # from now on the chosen block is highlighted
    if key.startswith("drift_dec_") and point.get("x") in blocks:
        st.session_state["drill_block"] = int(point["x"])
    if key.startswith("drift_hm_"):
        if point.get("x") in zoo.tasks:
            st.session_state["drill_task"] = point["x"]
        if cell_block(point) in blocks:
            st.session_state["drill_block"] = cell_block(point)


def chose_drill() -> None:
    st.session_state["_drill_chosen"] = True


top = st.columns([1, 1, 2])
task = top[0].selectbox("decomposition of", [ALL, *zoo.tasks], key="drift_task")
metric = top[1].selectbox("heatmap metric", list(METRICS), format_func=METRICS.get, key="drift_metric")
one = None if task == ALL else task
sq = figures.value_range(frames.values(), figures.SQUARED, one, stacked=True)
nm = figures.value_range(frames.values(), figures.NORMS, one)
zr = figures.heatmap_range(frames.values(), metric)
# The drill-down block is highlighted only once the user chose one (a click or the selectbox).
drill_block = st.session_state.get("drill_block") if st.session_state.get("_drill_chosen") else None

cols = st.columns(2)
for col, (name, df) in zip(cols, frames.items()):
    with col:
        st.plotly_chart(
            figures.drift_decomposition(
                df, f"{name}: drift per block ({task})", one, sq, nm, selected_block=drill_block, names=names
            ),
            key=f"drift_dec_{name}",
            on_select="rerun",
            selection_mode="points",
        )
        st.plotly_chart(
            figures.drift_heatmap(df, f"{name}: {METRICS[metric]}", metric, zr, names),
            key=f"drift_hm_{name}",
            on_select="rerun",
            selection_mode="points",
        )

left, right = st.columns(2)
left.plotly_chart(
    figures.drift_difference_heatmap(d_cal, d_mer, f"calibrated minus merged: {METRICS[metric]}", metric, names),
    key="drift_hm_diff",
    on_select="rerun",
    selection_mode="points",
)
right.markdown(
    "**Where calibration helps or hurts.** Each cell is the calibrated model's value minus the merged "
    "model's, for that block and task: **blue** cells are where FeatCal brought the features closer to "
    "the expert's (the drift fell), **red** where they moved further away; white is no change. "
    "Click a cell to drill down."
)

st.subheader("Drill down")
st.caption("Click a bar (block) or a heatmap cell (task and block) above, or pick here.")
d1, d2 = st.columns(2)
block = d1.selectbox(
    "block", blocks, key="drill_block", on_change=chose_drill, format_func=lambda b: figures.block_label(b, names)
)
dtask = d2.selectbox("task", zoo.tasks, key="drill_task", on_change=chose_drill)
d1.plotly_chart(figures.block_by_task(frames, block, metric, names), key="drift_block")
d2.plotly_chart(figures.task_by_block(frames, dtask, metric, names), key="drift_taskfig")
tidy = pd.concat([d.assign(model=name) for name, d in frames.items()], ignore_index=True)
with st.expander("tables"):
    st.dataframe(tidy[tidy.block == block], hide_index=True)
ui.downloads(tidy, "drift", "the drift tables (every block, task, metric; merged and calibrated)")

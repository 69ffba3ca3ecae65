"""Weights page: the experts' task vectors per block and task (norm, cosine with the other
tasks, TIES's sign conflicts, the overlap of their top singular directions), next to the
merged model's feature drift of the same block, to see whether the drift arises where the
weights conflict. The maths is :mod:`diagnostics.weights`; the figures
:mod:`app.weight_figures`."""

import streamlit as st

from app import controls, figures, state, ui, zoos
from app import weight_figures as wf
from app.settings import ModelRef
from diagnostics.weights import DENSITY, TOP_K, beside_drift, correlations

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()
names = zoos.block_names(zoo)  # an encoder-decoder's blocks by name (encoder.block.3, decoder.block.0)

st.title("Weights")
st.caption(
    "Task vectors τ_i = θ_i − θ₀ of the experts, per block (weights only, no data), beside the feature drift "
    f"of **{merger.label}** from each expert at the same block (held-out data; the merger is set on the Zoo page). "
    f"Sign conflicts as TIES counts them: each τ_i trimmed to its top {DENSITY:.0%} entries by magnitude, the "
    f"elected sign that of their sum; spectral overlap ‖U_iᵀU_j‖²_F / k of the top k = {TOP_K} left singular "
    "directions of each weight matrix."
)
with ui.status("Reading the experts' task vectors and the merged model's drift…") as s:
    per_layer, per_block = state.weight_views(source, fp)
    drift = state.drift(source, fp, ModelRef.merged(merger))
    wide = beside_drift(per_block, drift)
    corr = correlations(wide)
    s.update(label="task vectors and drift read", state="complete")

views = list(wf.VIEWS)
metric = st.segmented_control(
    "weight view", views, default="sign_against", format_func=wf.view_label, key="w_view", **controls.BIND
)
metric = metric or "sign_against"
left, right = st.columns(2)
left.plotly_chart(wf.view_heatmap(per_block, metric, wf.view_title(metric), names), key="w_heat")
right.plotly_chart(figures.drift_heatmap(drift, "feature drift of the merged model", names=names), key="w_drift")
left, right = st.columns(2)
left.plotly_chart(wf.conflict_and_drift(per_block, drift, names=names), key="w_conflict")
right.plotly_chart(wf.view_vs_drift(wide, metric, names=names), key="w_scatter")
right.caption(
    "Spearman rank correlation of each weight view with the relative drift over every (task, block): "
    + ", ".join(f"{wf.view_label(r.view)} **{r.spearman:+.2f}**" for r in corr.itertuples())
    + f" ({int(corr.rows.max()) if len(corr) else 0} points). Drift also builds up from block to block, "
    "so a correlation is a hint, not a cause."
)

st.subheader("Per tensor")
blocks = sorted(int(b) for b in per_layer.block.unique())
block = st.selectbox("block", blocks, key="w_block", format_func=lambda b: figures.block_label(b, names))
sel = per_layer[per_layer.block == block]
layers = list(dict.fromkeys(sel.layer))
table = (
    sel[sel.metric == "sign_conflict"]
    .set_index("layer")["value"]
    .rename("sign conflicts, all tasks")
    .to_frame()
    .join(sel[sel.metric == metric].pivot(index="layer", columns="task", values="value")[list(zoo.experts)])
    .reindex(layers)
)
st.caption(
    f"Per tensor of {figures.block_label(block, names)}: TIES's sign-conflict share over every task, "
    f"then per task: {wf.view_title(metric)}."
)
ui.table(table, 4)

st.subheader("Tables")
ui.downloads(wide, "weights_vs_drift", "per task and block: every weight view beside the merged model's drift")
ui.downloads(per_block, "weights_per_block", "the weight views per block and task (tidy)")
ui.downloads(per_layer, "weights_per_tensor", "the weight views per tensor of every block (tidy)")
ui.downloads(corr, "weights_drift_correlation", "the rank correlation of each view with the drift")

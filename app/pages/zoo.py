"""Zoo page: the models, the tasks, the merger and per-task accuracy of base, experts, merged."""

import streamlit as st

from app import compute, controls, figures, state, ui, yours
from app.settings import ModelRef

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)

st.title(f"Zoo · {zoo.name}")
st.caption(f"Source `{source}` · format `{zoo.fmt}` · device `{state.device()}` · fingerprint `{fp}`")
yours.form()


models, tasks = state.zoo_tables(source, fp)
c1, c2 = st.columns([3, 2])
with c1:
    st.subheader("Models")
    st.dataframe(models, hide_index=True, width="stretch")
    m1, m2, m3 = st.columns(3)
    m1.metric("experts", len(zoo.experts))
    m2.metric("parameters per model", f"{models.parameters.iloc[0] / 1e6:.2f} M")
    m3.metric("size per model", f"{models.MB.iloc[0]:.1f} MB")
with c2:
    st.subheader("Tasks")
    st.dataframe(tasks, hide_index=True, width="stretch")

st.subheader("Merger")
left, right = st.columns([1, 2])
with left:
    merger = controls.merger_controls(given=zoo.given_merged is not None)
    full = st.toggle(
        "score on the full test split",
        key="zoo_full_eval",
        help="Off: the first test examples of each task (the live subset).",
    )
right.caption(state.live_note(zoo) if not full else "Full test split of every task." + state.accuracy_note(zoo))

limit = None if full else state.live_test(source)
with right, ui.status(f"Scoring base, experts and {merger.label}…") as status:
    base = state.scores(source, fp, ModelRef.base_model(), limit)
    merged = state.scores(source, fp, ModelRef.merged(merger), limit)
    status.update(label=f"Scored base, experts and {merger.label}", state="complete")

acc = compute.accuracy_frame({"base": base["output"], "merged": merged["output"]}, expert_from="merged")
wide = acc.groupby(["task", "model"])["accuracy"].mean().unstack("model")[["base", "expert", "merged"]]
wide = wide.loc[list(dict.fromkeys(acc.task))]
summary = compute.task_summary(merged)
with right:
    a, b, c = st.columns(3)
    a.metric("base, mean accuracy", f"{wide.base.mean():.1f}%")
    b.metric("experts, mean accuracy", f"{wide.expert.mean():.1f}%")
    c.metric(
        "merged, mean accuracy",
        f"{wide.merged.mean():.2f}%",
        f"{wide.merged.mean() - wide.expert.mean():+.2f} pp vs experts",
    )
    a, b, c = st.columns(3)
    a.metric("merged, KL(expert ‖ merged)", f"{summary.kl.mean():.4f}")
    b.metric("merged, top-1 agreement", f"{summary.agreement.mean():.2f}%")
    c.metric("merged, expert cosine", f"{summary.expert_cosine.mean():.4f}")

st.plotly_chart(figures.accuracy_bars(acc, f"accuracy per task (%): base, experts, {merger.label}"), key="zoo_acc")
table = wide.join(
    summary[["kl", "agreement", "expert_cosine"]].rename(
        columns={
            "kl": "merged: KL(expert ‖ merged)",
            "agreement": "merged: top-1 agreement (%)",
            "expert_cosine": "merged: expert cosine",
        }
    )
).rename(columns={"base": "base (%)", "expert": "expert (%)", "merged": "merged (%)"})
st.dataframe(table.round(3), width="stretch")
ui.downloads(acc, "accuracy", "the accuracy per task of base, experts and merged (tidy: task, model, accuracy)")

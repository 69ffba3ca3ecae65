"""Calibrate page: FeatCal's hyper-parameters, the instant preview, then the exact run.

Every change re-runs the exact forward-order FeatCal (cached per setting). When it takes
longer than ``settings.PREVIEW_AFTER_S`` (on a worker thread), the preview from the kept
statistics of the last exact run with the same calibration data and switches is scored and
shown meanwhile, labelled as such. A newer widget change stops this script and starts the
next one (Streamlit reruns), so the newest setting always wins.
"""

import pandas as pd
import streamlit as st

from app import compute, controls, figures, settings, state, ui, workers
from app.settings import ModelRef

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()

st.title("Calibrate")
st.caption(
    f"Merged model: **{merger.label}** (change it on the Zoo page). "
    "FeatCal re-solves every Linear and LayerNorm of every block in forward order, in closed form."
)
cal = controls.calibration_controls(compute.split_size(zoo, "calib"))
if source == "demo":  # measured on this zoo only
    gains = " · ".join(f"{n}: **{g:+.1f} pp** ({s:.2f} s of compute)" for n, (g, s) in settings.DEMO_N_GAINS.items())
    st.caption(
        "More calibration examples per task give FeatCal more of each expert's features to match, at the "
        f"cost of a slower exact run. On this demo zoo (default setting, vs merged, live test subset): {gains}. "
        f"{settings.DEFAULT_N} per task is the most that keeps the exact result within about 1 s of a slider "
        "change; the gain grows little beyond it here."
    )
note, full = st.columns([4, 1])
full = full.toggle(
    "full test split",
    key="cal_full_eval",
    help="Score the exact result on every test example (slower; the preview stays live).",
)
note.caption(state.live_note(zoo) if not full else "Exact result scored on the full test split of every task.")
limit = None if full else state.LIVE_TEST

status_slot = st.empty()
results_slot = st.empty()


def show(kind: str, sc: dict, ref_summary: pd.DataFrame, note: str):
    """Draw one result's numbers (``kind`` = ``preview`` or ``exact``) into the results slot;
    returns the slot below them for its drift chart (:func:`show_drift`)."""
    after = compute.task_summary(sc)
    before = ref_summary
    with results_slot.container():
        if kind == "preview":
            st.info(f"**Preview** · {note}", icon=":material/visibility:")
        else:
            st.success(f"**Exact FeatCal** · {note}", icon=":material/check_circle:")
        cols = st.columns(5)
        cols[0].metric(
            "mean accuracy",
            f"{after.accuracy.mean():.2f}%",
            f"{after.accuracy.mean() - before.accuracy.mean():+.2f} pp vs merged",
        )
        cols[1].metric(
            "expert cosine",
            f"{after.expert_cosine.mean():.4f}",
            f"{after.expert_cosine.mean() - before.expert_cosine.mean():+.4f}",
        )
        cols[2].metric(
            "task-vector cosine",
            f"{after.task_vector_cosine.mean():.4f}",
            f"{after.task_vector_cosine.mean() - before.task_vector_cosine.mean():+.4f}",
        )
        cols[3].metric(
            "KL(expert ‖ model)",
            f"{after.kl.mean():.4f}",
            f"{after.kl.mean() - before.kl.mean():+.4f}",
            delta_color="inverse",
        )
        cols[4].metric(
            "top-1 agreement",
            f"{after.agreement.mean():.2f}%",
            f"{after.agreement.mean() - before.agreement.mean():+.2f} pp",
        )
        st.markdown(figures.task_accuracy_table(before, after, "preview" if kind == "preview" else "calibrated"))
        box = st.expander(
            "per-task table (accuracy, KL, agreement, cosines)", key=f"cal_table_{kind}", on_change="rerun"
        )
        if box.open:  # drawn only when open: the browser's rendering is part of the 1 s
            box.dataframe(per_task_table(before, after, kind).round(4), width="stretch")
        # The charts are appended to this container when they are ready: until then the previous
        # run's charts stay where they are (greyed by Streamlit as stale), so the page does not jump.
        return st.container()


def per_task_table(before: pd.DataFrame, after: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Per task, every score of the merged and the ``kind`` model side by side."""
    table = pd.concat({"merged": before, kind: after}, axis=1).swaplevel(axis=1).sort_index(axis=1, level=0)
    table.columns = [f"{metric} ({model})" for metric, model in table.columns]
    return table


def show_drift(slot, kind: str, drift: pd.DataFrame) -> None:
    """The ``kind`` model's drift per block, the merged model's drawn over it on one scale
    (one chart: a second, unchanged one would be redrawn by the browser on every change;
    the Drift page has both side by side)."""
    rng = figures.value_range([merged_drift, drift], figures.SQUARED, stacked=True)
    nrng = figures.value_range([merged_drift, drift], figures.NORMS)
    slot.plotly_chart(
        figures.drift_decomposition(
            drift,
            f"calibrated ({kind}) vs merged: drift per block",
            sq_range=rng,
            norm_range=nrng,
            reference=("merged", merged_drift),
        ),
        key=f"cal_drift_{kind}",
    )


def show_cosines(slot, drift: pd.DataFrame, sc: dict) -> None:
    """Expert cosine per block and task, merged vs calibrated, and each model's task-vector
    cosine with every expert, each with the sentence that says what it measures."""
    left, right = slot.columns(2)
    left.plotly_chart(
        figures.expert_cosine_per_block(
            {"merged": merged_drift, "calibrated": drift}, "expert cosine per block and task (merged dotted)"
        ),
        key="cal_cos_blocks",
    )
    left.caption(
        "Cosine between the model's and the expert's block output (pooled over tokens, mean over "
        f"{state.DIAG_N} held-out examples per task): 1 means the block computes the expert's features."
    )
    right.plotly_chart(
        figures.task_vector_bars(
            {"merged": merged_scores["task_vector"], "calibrated": sc["task_vector"]},
            -1,
            "task-vector cosine with each expert (whole model)",
        ),
        key="cal_cos_tv",
    )
    right.caption(
        "Cosine between the model's displacement from the base, θ − θ₀, and the expert's, τ = θ_task − θ₀: "
        "a **weight-space** measure. It can fall while the features improve, since FeatCal moves the "
        "weights toward whatever reproduces the experts' outputs on the data, which need not be any "
        "expert's direction in weight space."
    )


# 1. The merged model's numbers (cached across every setting).
with ui.status(f"Scoring the merged model ({merger.label})…", status_slot) as s:
    merged_scores = state.scores(source, fp, ModelRef.merged(merger), limit)
    merged_drift = state.drift(source, fp, ModelRef.merged(merger))
    s.update(label="merged model scored", state="complete")
merged_summary = compute.task_summary(merged_scores)

# 2. The instant preview, when an exact run with the same data and switches exists: the
#    exact run starts first, on a worker thread; if it is not done within PREVIEW_AFTER_S,
#    the preview is scored beside it and shown meanwhile.
from_run = state.preview_from(source, fp, merger, cal)
exact_job, quick = None, True
if from_run is not None:
    exact_job = state.start_calibration(source, fp, merger, cal)
    with ui.status(f"Running exact forward-order FeatCal: {cal.label}…", status_slot):
        quick = workers.done_within(exact_job, settings.PREVIEW_AFTER_S)
if not quick:
    ref = ModelRef.preview(merger, from_run, cal)
    with ui.status(
        f"Preview of {cal.label} from the exact run at {from_run.point_label}; the exact run follows…", status_slot
    ):
        pv_scores = state.scores(source, fp, ref)
        live_merged = (
            merged_summary
            if limit == state.LIVE_TEST
            else compute.task_summary(state.scores(source, fp, ModelRef.merged(merger)))
        )
    show(
        "preview",
        pv_scores,
        live_merged,
        f"{cal.label}, re-solved from the kept statistics of the last exact run "
        f"({from_run.point_label}); it ignores how earlier blocks' changes move "
        "later features. Exact run in progress…",
    )

# 3. The exact forward-order run, then its output scores (here) beside its cosines and drift (worker,
#    in that order): the numbers are drawn as soon as both scores are in, the drift chart after.
with ui.status(f"Running exact forward-order FeatCal: {cal.label}…", status_slot) as s:
    run = exact_job.result() if exact_job is not None else state.calibrated(source, fp, merger, cal)
    ref = ModelRef.calibrated(merger, cal)
    heldout_job = state.start_heldout(source, fp, ref)
    cal_scores = state.scores(source, fp, ref, limit)
    charts = show("exact", cal_scores, merged_summary, f"{cal.label} · {run.report.summary()}")
    cal_drift = heldout_job.result()
    show_drift(charts, "exact", cal_drift)
    show_cosines(charts, cal_drift, cal_scores)
    # Written after the drift chart: benchmarks/app_latency.py stops its clock on "Exact FeatCal done".
    s.update(
        label=f"Exact FeatCal done: {cal.label} · {len(run.report.modules)} modules in "
        f"{len(run.report.blocks)} blocks, {run.seconds:.2f} s",
        state="complete",
    )

box = st.expander("relative residual per module (before → after)", key="cal_residuals_open", on_change="rerun")
if box.open:
    box.plotly_chart(figures.residuals(run.report.to_frame()), key="cal_residuals")
    for w in run.report.warnings:
        box.warning(w)

# 4. The experts' task vectors (constant for a zoo) and the tables to take away.
st.subheader("Task vectors of the experts")
tv = state.expert_task_vectors(source, fp)
c1, c2 = st.columns([2, 3])
blocks_tv = sorted(int(b) for b in tv.block.unique())
tv_block = c2.selectbox(
    "over",
    blocks_tv,
    format_func=lambda b: "the whole model" if b < 0 else f"block {b}",
    key="cal_tv_block",
)
c1.plotly_chart(
    figures.task_vector_matrix_heatmap(
        tv, tv_block, f"cos(τ_i, τ_j), {'whole model' if tv_block < 0 else f'block {tv_block}'}"
    ),
    key="cal_tv_matrix",
)
c2.markdown(
    "Each cell is the cosine between two experts' task vectors τ = θ_expert − θ₀ (weights only, no "
    "data). Near 0 the experts changed the base in unrelated directions and merging interferes little in "
    "weight space; larger cosines mean they pull the same weights the same way. Like the task-vector "
    "cosine above it is a weight-space measure: feature drift (Drift page) is what FeatCal repairs."
)

st.subheader("Tables")
scores_tidy = pd.concat(
    [
        compute.task_summary(merged_scores).assign(model="merged"),
        compute.task_summary(cal_scores).assign(model="calibrated"),
    ]
).reset_index(names="task")
ui.downloads(scores_tidy, "scores", "accuracy, KL, top-1 agreement and cosines per task (merged and calibrated)")
cos_tidy = pd.concat(
    [
        merged_drift[merged_drift.metric == "expert_cosine"].assign(model="merged"),
        cal_drift[cal_drift.metric == "expert_cosine"].assign(model="calibrated"),
        merged_scores["task_vector"].assign(model="merged"),
        cal_scores["task_vector"].assign(model="calibrated"),
    ],
    ignore_index=True,
)
ui.downloads(cos_tidy, "cosines", "expert cosine per block and task-vector cosines (tidy: task, block, metric)")
ui.downloads(tv, "expert_task_vectors", "the experts' task-vector cosine matrix, whole model and per block")

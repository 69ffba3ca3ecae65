"""Calibrate page: FeatCal's hyper-parameters, the instant preview, then the exact run.

Every change re-runs the exact forward-order FeatCal (cached per setting). When it takes
longer than ``settings.PREVIEW_AFTER_S`` (on a worker thread), the preview from the kept
statistics of the last exact run with the same calibration data and switches is scored and
shown meanwhile, labelled as such. A newer widget change stops this script and starts the
next one (Streamlit reruns), so the newest setting always wins. Once a result is drawn, the
settings one slider step away are computed while the page is idle (:mod:`app.ahead`), so a
one-step change on a small zoo draws its exact result at once.
"""

import pandas as pd
import streamlit as st

from app import ahead, compute, controls, figures, settings, state, tables, ui, zoos
from app.settings import AppCal, ModelRef

NOTES_AT = "listed under the residual per module, below"  # where the page shows an exact run's notes

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
merger = controls.current_merger()

st.title("Calibrate")
st.caption(
    f"Merged model: **{merger.label}** (change it on the Zoo page). "
    "FeatCal re-solves every Linear (and LayerNorm, when its switch below is on) of every block in forward "
    "order, in closed form."
)
applied = st.session_state.pop(controls.APPLIED, None)
if applied:
    st.toast(applied, icon=":material/arrow_forward:")  # a toast: the page's layout does not move
cal = controls.calibration_controls(zoos.split_size(zoo, "calib"))
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
full_note = "Exact result scored on the full test split of every task."
note.caption(state.live_note(zoo) if not full else full_note + state.accuracy_note(zoo))
limit = None if full else state.live_test(source)

# Replaced in place by every status (a caption, not an empty slot: the browser keeps the last run's meanwhile).
status_slot = st.container(key="cal_status").caption(":material/hourglass_top: Starting…")
slots = ui.Slots()  # every result element, drawn in place: the page never empties (see ui.Slots)


class Layout:
    """The containers of the results, made on first use in this run (in page order)."""

    def __init__(self):
        self.parts: dict[str, object] = {}

    def get(self, name: str, make):
        if name not in self.parts:
            self.parts[name] = make()
        return self.parts[name]


layout = Layout()
# The status and the banner above the results keep one height for all their texts, so that the
# results never move: the status one line (cut short with an ellipsis), the banner three (out of
# date, exact: two; preview: three at 1280 px; a longer one is cut at three).
st.html(
    "<style>.st-key-cal_status p { white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }"
    ".st-key-cal_banner { min-height: 6.5rem; }"
    ".st-key-cal_banner [data-testid='stMarkdownContainer'] p { display: -webkit-box; -webkit-line-clamp: 3;"
    " -webkit-box-orient: vertical; overflow: hidden; }</style>"
)


def banner(kind: str, text: str, icon: str) -> None:
    """The line that says what the results below are (``kind``: info, warning or success)."""
    where = layout.get("banner", lambda: st.container(key="cal_banner"))
    slots.draw("banner", where, kind, text, icon=icon)


def mark_out_of_date(label: str) -> None:
    """Say above the previous result that it is not the current setting's, until replaced."""
    shown = st.session_state.get("_cal_shown")
    if shown is None:
        banner("info", f"Computing {label}…", ":material/hourglass_top:")
    elif shown != label:
        text = f"**Out of date** · the results below are for {shown}; computing {label}…"
        banner("warning", text, ":material/history:")


def show(kind: str, sc: dict, ref_summary: pd.DataFrame, drift: pd.DataFrame, note: str, merged: tuple) -> None:
    """Draw one result (``kind`` = ``preview`` or ``exact``): banner, numbers, per-task
    accuracies, drift and cosine charts, each over the element it replaces; ``merged``: the
    merged model's (scores, drift), drawn beside it."""
    after, before = compute.task_summary(sc), ref_summary
    if kind == "preview":
        banner("info", f"**Preview** · {note}", ":material/visibility:")
    else:
        banner("success", f"**Exact FeatCal** · {note}", ":material/check_circle:")
    cols = layout.get("metrics", lambda: st.columns(5))
    for i, (label, value, delta, inverse) in enumerate(tables.summary_metrics(before, after)):
        slots.draw(f"metric{i}", cols[i], "metric", label, value, delta, delta_color="inverse" if inverse else "normal")
    name = "preview" if kind == "preview" else "calibrated"
    slots.draw("accuracy", st, "markdown", figures.task_accuracy_table(before, after, name))
    box = layout.get(
        "table",
        lambda: st.expander("per-task table (accuracy, KL, agreement, cosines)", key="cal_table", on_change="rerun"),
    )
    if box.open:  # drawn only when open: the browser's rendering is part of the 1 s
        slots.draw("table", box, "dataframe", tables.styled(per_task_table(before, after, kind)), width="stretch")
    show_drift(kind, drift, merged[1])
    show_cosines(kind, drift, sc, merged)


def per_task_table(before: pd.DataFrame, after: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Per task, every score of the merged and the ``kind`` model side by side."""
    table = pd.concat({"merged": before, kind: after}, axis=1).swaplevel(axis=1).sort_index(axis=1, level=0)
    table.columns = [f"{metric} ({model})" for metric, model in table.columns]
    return table


def show_drift(kind: str, drift: pd.DataFrame, merged_drift: pd.DataFrame) -> None:
    """The ``kind`` model's drift per block, the merged model's drawn over it on one scale
    (one chart: a second, unchanged one would be redrawn by the browser on every change;
    the Drift page has both side by side)."""
    rng = figures.value_range([merged_drift, drift], figures.SQUARED, stacked=True)
    nrng = figures.value_range([merged_drift, drift], figures.NORMS)
    fig = figures.drift_decomposition(
        drift,
        f"{'preview' if kind == 'preview' else 'calibrated (exact)'} vs merged: drift per block",
        sq_range=rng,
        norm_range=nrng,
        reference=("merged", merged_drift),
        names=zoos.block_names(zoo),
    )
    slots.draw("drift", st, "plotly_chart", fig)


def show_cosines(kind: str, drift: pd.DataFrame, sc: dict, merged: tuple) -> None:
    """Expert cosine per block and task, merged vs calibrated, and each model's task-vector
    cosine with every expert, each with the sentence that says what it measures."""
    merged_scores, merged_drift = merged
    left, right = layout.get("cosines", lambda: st.columns(2))
    name = "preview" if kind == "preview" else "calibrated"
    slots.draw(
        "cos_blocks",
        left,
        "plotly_chart",
        figures.expert_cosine_per_block(
            {"merged": merged_drift, name: drift},
            f"expert cosine per block<br><sup>{name} solid, merged dotted</sup>",
            zoos.block_names(zoo),
        ),
    )
    slots.draw(
        "cos_tv",
        right,
        "plotly_chart",
        figures.task_vector_bars(
            {"merged": merged_scores["task_vector"], name: sc["task_vector"]},
            -1,
            "task-vector cosine with each expert (whole model)",
        ),
    )
    if "cos_captions" not in layout.parts:
        layout.parts["cos_captions"] = True
        left.caption(
            "Cosine between the model's and the expert's block output (pooled over tokens, mean over "
            f"{state.DIAG_N} held-out examples per task): 1 means the block computes the expert's features."
        )
        right.caption(
            "Cosine between the model's displacement from the base, θ − θ₀, and the expert's, τ = θ_task − θ₀: "
            "a **weight-space** measure. It can fall while the features improve, since FeatCal moves the "
            "weights toward whatever reproduces the experts' outputs on the data, which need not be any "
            "expert's direction in weight space (the Weights page has it per block)."
        )


# 1. The merged model's numbers (cached across every setting); the previous result, if any,
#    stays on the page marked out of date until its replacement is drawn.
mark_out_of_date(cal.label)
with ui.status(f"Scoring the merged model ({merger.label})…", status_slot) as s:
    merged_scores = state.scores(source, fp, ModelRef.merged(merger), limit)
    merged_drift = state.drift(source, fp, ModelRef.merged(merger))
    s.update(label="merged model scored", state="complete")
merged_summary = compute.task_summary(merged_scores)

# 2. The instant preview, when an exact run with the same data and switches exists: the
#    exact run starts first, on a worker thread; if it is not done within PREVIEW_AFTER_S,
#    the preview (numbers and charts) is scored beside it and drawn meanwhile.


def draw_preview(from_run: AppCal) -> None:
    """Score the preview of ``cal`` from ``from_run``'s kept statistics, and draw it."""
    ref = ModelRef.preview(merger, from_run, cal)
    with ui.status(
        f"Preview of {cal.label} from the exact run at {from_run.point_label}; the exact run follows…", status_slot
    ):
        pv_scores = state.scores(source, fp, ref, settings.PREVIEW_TEST)
        pv_drift = state.drift(source, fp, ref)
        pv_merged = compute.task_summary(state.scores(source, fp, ModelRef.merged(merger), settings.PREVIEW_TEST))
    n_pv = min(settings.PREVIEW_TEST, zoos.split_size(zoo, "test"))
    show(
        "preview",
        pv_scores,
        pv_merged,
        pv_drift,
        f"{cal.label}, re-solved from the kept statistics of the last exact run "
        f"({from_run.point_label}); it ignores how earlier blocks' changes move "
        f"later features. Scored on the first {n_pv} test examples per task (merged too; the exact result: "
        f"{'all' if limit is None else min(limit, zoos.split_size(zoo, 'test'))}). Exact run in progress…",
        (merged_scores, merged_drift),
    )


exact_job = None
with state.preview_from(source, fp, merger, cal) as from_run:  # its statistics kept until the preview is drawn
    if from_run is not None:
        exact_job = state.start_calibration(source, fp, merger, cal)
        # No wait when the last exact run took longer than the deadline: the preview starts at once.
        slow = (state.last_seconds() or 0.0) > 2 * settings.PREVIEW_AFTER_S
        with ui.status(f"Running exact forward-order FeatCal: {cal.label}…", status_slot):
            quick = ui.done_within(exact_job, 0.0 if slow else settings.PREVIEW_AFTER_S)
        if not quick:
            draw_preview(from_run)

# 3. The exact forward-order run, then its output scores (here) beside its cosines and drift
#    (worker, in that order); drawn over the preview (or the out-of-date result) when all are in.
with ui.status(f"Running exact forward-order FeatCal: {cal.label}…", status_slot) as s:
    if exact_job is None and state.to_compute(source, fp, merger, cal):  # on the worker: its blocks are shown
        exact_job = state.start_calibration(source, fp, merger, cal)
    if exact_job is not None and not exact_job.done():
        ui.wait_with_progress(
            exact_job,
            s,
            f"Running exact forward-order FeatCal: {cal.label}",
            state.last_seconds(),
            blocks=lambda: state.blocks_done(source, fp, merger, cal),
        )
    run = exact_job.result() if exact_job is not None else state.calibrated(source, fp, merger, cal)
    ref = ModelRef.calibrated(merger, cal)
    heldout_job = state.start_heldout(source, fp, ref)
    cal_scores = state.scores(source, fp, ref, limit)
    cal_drift = heldout_job.result()
    show(
        "exact",
        cal_scores,
        merged_summary,
        cal_drift,
        f"{cal.label} · {run.report.summary(notes_at=NOTES_AT)}",
        (merged_scores, merged_drift),
    )
    st.session_state["_cal_shown"] = cal.label
    # Written after the charts: benchmarks/app_latency.py stops its clock on "Exact FeatCal done".
    s.update(
        label=f"Exact FeatCal done: {cal.label} · {len(run.report.modules)} modules in "
        f"{len(run.report.blocks)} blocks, {run.seconds:.2f} s",
        state="complete",
    )

box = st.expander("relative residual per module (before → after)", key="cal_residuals_open", on_change="rerun")
if box.open:
    box.plotly_chart(figures.residuals(run.report.to_frame(), names=zoos.block_names(zoo)), key="cal_residuals")
    for w in run.report.warnings:
        box.warning(w)
    for n in run.report.notes:
        box.caption(f"Note: {zoos.plain(n)}")

# 4. The experts' task vectors (constant for a zoo) and the tables to take away.
st.subheader("Task vectors of the experts")
tv = state.expert_task_vectors(source, fp)
c1, c2 = st.columns([1, 1])
blocks_tv = sorted(int(b) for b in tv.block.unique())


def tv_over(block: int) -> str:
    """What the task-vector cosines are taken over: the whole model, or one block."""
    return "the whole model" if block < 0 else figures.block_label(block, zoos.block_names(zoo))


tv_block = c2.selectbox("over", blocks_tv, format_func=tv_over, key="cal_tv_block")
c1.plotly_chart(
    figures.task_vector_matrix_heatmap(tv, tv_block, f"cos(τ_i, τ_j), {tv_over(tv_block)}"),
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

# 5. Work for the next change, started once the whole page is written, so that it does not
#    take the cores from the page's last elements and the browser drawing them: the next
#    preview's one-off work, then the settings one slider step away (app.ahead).
state.prepare_preview(run)
point = {key: float(st.session_state[key]) for key in controls.SLIDERS}
if ahead.worth_it(run.seconds, zoos.model_size(run.model)[1], limit):
    moved = ahead.last_move(st.session_state.get("_cal_point"), point)
    ahead.start(source, fp, merger, cal, ahead.neighbours(point, moved), limit)
st.session_state["_cal_point"] = point

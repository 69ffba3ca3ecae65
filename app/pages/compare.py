"""Compare page: mergers, and calibrators on top of a chosen merger, run on the zoo's
calibration split and shown side by side (:mod:`diagnostics.compare`; figures from
:mod:`diagnostics.compare_figures`). Each method's result is cached per setting for the
session's server, so adding a method runs only that one.
"""

import streamlit as st

from app import figures, state, tables, ui, zoos
from diagnostics import compare as cmp
from diagnostics import compare_figures as figs
from diagnostics.compare_table import model_kind
from featcal.baselines import registry
from featcal.util.progress import listening

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)
# The methods on offer come from the registry: every merger (data-free or data-using) and every
# calibrator, plus SVC followed by FeatCal (calibrators apply in order).
MERGER_NAMES = [cmp.method_name(m) for m in registry.names("merger", "data_merger")]
CALIBRATOR_NAMES = [*registry.names("calibrator", "trained"), "svc+featcal"]
SHORTER = 10  # a shorter schedule, when the user asks for one, starts at a tenth of the authors'
TRAINED_LABELS = ", ".join(registry.get(n).label for n in cmp.TRAINED)  # ESCal, Surgery, ...


@st.cache_resource(max_entries=2, show_spinner=False)
def _cache(source: str, fp: str) -> dict:
    """The per-method results of this zoo (see :data:`diagnostics.compare.CACHE`)."""
    return {}


def _run(methods: tuple, n: int, cal_params: dict, max_test: int | None) -> cmp.Comparison:
    """Run the methods, showing which one runs (of how many), its stage, step and time left."""
    bar = st.progress(0.0, text="Starting…")
    now = {"i": 0, "total": max(len(methods), 1), "name": ""}

    def step(i: int, total: int, name: str) -> None:
        now.update(i=i, total=total, name=name)
        bar.progress(i / total, text=f"Running {name} ({i + 1} of {total})…")

    def inner(p) -> None:  # the running method's own bars (calibration, training epochs)
        done = (now["i"] + p.fraction) / now["total"]
        bar.progress(min(done, 1.0), text=f"{now['name']} ({now['i'] + 1} of {now['total']}) · {p.describe()}")

    with listening(inner):
        result = state.on_shared_models(
            source,
            lambda: cmp.compare(
                zoo,
                list(methods),
                cmp.CompareOptions(n=n, calibrator_params=cal_params, max_test=max_test),
                cache=_cache(source, fp),
                progress=True,  # bars in the terminal, and on the page through `inner`
                on_method=step,
            ),
        )
    bar.empty()
    return result


st.title("Compare")
st.caption(
    "Mergers alone and post-merging calibrators on top of a merger, on the same calibration examples "
    "(the zoo's calib split); scored on the test split. FeatCal and SVC give one model for every task; "
    f"{TRAINED_LABELS} add trained modules per task (each task scored with its own, so the task "
    "must be known at inference). SVC's alpha is FusionBench's after the chosen merger (its row says it)."
)

c1, c2, c3 = st.columns([2, 1, 2])
mergers = c1.multiselect("mergers alone", MERGER_NAMES, ["ta", "ties", "iso_c"], key="cmp_mergers")
base_merger = c2.selectbox("calibrate on top of", MERGER_NAMES, MERGER_NAMES.index("ta"), key="cmp_base")
calibrators = c3.multiselect("calibrators", CALIBRATOR_NAMES, ["featcal"], key="cmp_cals")

n_calib = zoos.split_size(zoo, "calib")
d1, d2, d3 = st.columns(3)
budgets = [b for b in (8, 16, 32, 64, 128, 256) if b <= n_calib] or [n_calib]
n = d1.select_slider("calibration examples per task", budgets, min(64, budgets[-1]), key="cmp_n")
n_test = max(len(zoo.split(t, "test")[1]) for t in zoo.tasks)
test_sizes = [*(b for b in (50, 100, 200) if b < n_test), "all"]  # a limit only where it cuts a split
max_test = d2.select_slider(
    "test examples per task",
    test_sizes,
    100 if 100 in test_sizes else "all",
    key="cmp_test",
    help=f"The first examples of each task's test split; all: every example (at most {n_test} per task here).",
)
max_test = None if max_test == "all" else int(max_test)

cal_params: dict[str, dict] = {}
trained = [c.split("+")[-1] for c in calibrators if c.split("+")[-1] in cmp.TRAINED]
if trained:
    lengths = {cal: registry.get(cal).length for cal in trained}  # the authors' schedules: the defaults
    authors = ", ".join(f"{registry.get(cal).label} {n.default} {n.name}" for cal, n in lengths.items())
    st.info(
        f"{TRAINED_LABELS} train by gradient descent, here at their authors' schedules ({authors} "
        "per task): many minutes per method on a CPU (each step is a forward and backward pass). A shorter "
        "schedule runs faster and calibrates less; its row then says its length."
    )
    cols = st.columns(len(trained))
    for col, (cal, length) in zip(cols, lengths.items()):
        if col.checkbox(f"{cal}: shorter than the authors' {length.default} {length.name}", key=f"cmp_{cal}_short"):
            top, start = length.default - 1, max(1, length.default // SHORTER)
            value = col.number_input(f"{cal} {length.name}", 1, top, start, key=f"cmp_{cal}_{length.name}")
            cal_params[cal] = {length.name: int(value)}

methods = tuple(dict.fromkeys([*mergers, *(f"{base_merger}+{c}" for c in calibrators)]))
args = (methods, n, tuple((k, tuple(v.items())) for k, v in cal_params.items()), max_test)
if d3.button("Run", type="primary", key="cmp_run", disabled=not methods):
    st.session_state["cmp_args"] = args
if not methods:
    st.warning("Choose at least one merger or calibrator.")
    st.stop()
if st.session_state.get("cmp_args") != args:
    st.caption("Press **Run** to run the chosen methods (finished ones come from the cache).")
    st.stop()

result = _run(methods, n, cal_params, max_test)
summary = result.summary

st.subheader("Summary")
st.caption(
    f"{state.compare_score_note(zoo)}; gap closed = 100·(acc − start)/(experts − start), from Task Arithmetic and "
    "from the method's own merger; KL(expert ‖ model) and top-1 agreement with the experts. Cost: one model "
    "for every task or modules per task; n/task: calibration examples per task it read (blank: data-free); "
    "+trained / +stored / +/model: numbers added per task (counted), as a share of the model; fwd ×: forward "
    "time of what it produced over the merged model's on one test batch "
    "(measured, median of 5: on a shared machine, noise); seconds to merge and calibrate; the most memory "
    "they took above what was in use (MB)."
)
SCORES = {
    "label": "method",
    "accuracy": "avg acc (%)",
    "gap_closed": "gap closed vs TA (%)",
    "gap_closed_vs_merger": "gap closed vs merger (%)",
    "kl": "KL",
    "agreement": "top-1 agr. (%)",
}
COST = {
    "label": "method",
    "model": "model",
    "n_per_task": "n/task",
    "added_trained": "+trained",
    "added_stored": "+stored",
    "added_fraction": "+/model",
    "forward_ratio": "fwd ×",
    "merge_seconds": "merge s",
    "calib_seconds": "calib s",
    "peak_mb": "peak MB",
}
cost = summary.assign(model=summary["task_specific"].map(model_kind))
# every row, each method's name in full ("ta+svc+featcal (alpha 0.1)"); cost below: nothing cut at 1280 px
whole = dict(index=False, height="content", column_config={"method": st.column_config.TextColumn(width="medium")})
ui.table(summary[list(SCORES)].rename(columns=SCORES), 2, **whole)
ui.table(cost[list(COST)].rename(columns=COST), 2, **whole)
ui.downloads(summary, "compare_summary", "the summary (every column)")
ui.downloads(result.accuracy, "compare_accuracy", "the per-task accuracy (tidy)")
ui.downloads(result.drift, "compare_drift", "the drift per block (tidy)")

acc_tab, out_tab, drift_tab = st.tabs(["Accuracy per task", "Output drift", "Drift per block"])
with acc_tab:
    fig = figs.accuracy_bars(result.accuracy)
    st.plotly_chart(fig, key="cmp_acc")
    st.download_button("Figure (HTML)", figures.to_html(fig), "compare_accuracy.html", key="cmp_acc_html")
    table = result.accuracy.pivot(index="method", columns="task", values="accuracy").loc[summary["method"], zoo.tasks]
    ui.table(table.assign(avg=table.mean(axis=1)), 1)
with out_tab:
    fig = figs.output_scatter(summary)
    st.plotly_chart(fig, key="cmp_out")
    st.download_button("Figure (HTML)", figures.to_html(fig), "compare_output.html", key="cmp_out_html")
    out = result.output.pivot_table(index="method", columns=["metric", "task"], values="value")
    ui.table(out.loc[summary["method"]], 3)
with drift_tab:
    task = st.selectbox("task", zoo.tasks, key="cmp_task")
    fig = figs.drift_lines(result.drift, task, zoos.block_names(zoo))
    st.plotly_chart(fig, key="cmp_drift")
    st.download_button("Figure (HTML)", figures.to_html(fig), f"compare_drift_{task}.html")
    st.caption(
        "Relative drift |e|/|h_expert| of each block's output from the expert on the task's first "
        f"{result.settings['drift_n']} test examples; dotted: the local mismatch part (see the Drift page)."
    )
st.caption("Settings of this comparison")
st.dataframe(tables.settings_table(result.settings), hide_index=True, width=520)

"""Studies page: the paper's sample-efficiency and robustness studies on the open zoo.

Each study runs on its "Run" button (minutes on a CPU; cached per setting through
:mod:`featcal.sweep.studies`), or reads the ``rows.csv`` that ``featcal study ... --out DIR``
wrote. Both draw the same figures (:mod:`featcal.sweep.figures`) and summary table.
"""

import pandas as pd
import streamlit as st

from app import controls, settings, state, ui, zoos
from featcal.config import preset_config, preset_for_zoo
from featcal.sweep import figures as tune_figures
from featcal.sweep import studies

zoo, source = state.active_zoo(), state.active_source()
fp = state.fingerprint(source)


def _sample_efficiency(
    source: str, fp: str, merger: settings.Merger, budgets: tuple, seeds: tuple, max_test: int | None
) -> pd.DataFrame:
    z = state.active_zoo()
    # The plain mergers as baselines, the Zoo page's one (with its parameters) calibrated.
    mergers = {**{name: {} for name in studies.BASELINES}, merger.method: merger.kwargs}
    return state.on_shared_models(
        source,
        lambda: studies.sample_efficiency(
            z,
            budgets=budgets,
            seeds=seeds,
            mergers=mergers,
            calibrate_on=(merger.method,),
            config=preset_config(preset_for_zoo(z)),
            max_per_task=max_test,
            progress=True,  # the terminal's bars, and the page's through ui.progress_of
        ),
    )


def _robustness(
    source: str,
    fp: str,
    merger: settings.Merger,
    corruptions: tuple,
    severities: tuple,
    n: int,
    seeds: tuple,
    max_test: int | None,
) -> pd.DataFrame:
    z = state.active_zoo()
    return state.on_shared_models(
        source,
        lambda: studies.robustness(
            z,
            corruptions=corruptions,
            severities=severities,
            n_calib=n,
            seeds=seeds,
            merger=merger.method,
            merge_params=merger.kwargs,
            config=preset_config(preset_for_zoo(z)),
            max_per_task=max_test,
            progress=True,
        ),
    )


def _rows(kind: str, run, args: tuple) -> pd.DataFrame | None:
    """The study's rows: from the run button (kept for the session) or an uploaded rows.csv."""
    up = st.file_uploader(f"…or load a `rows.csv` written by `featcal study {kind}`", type="csv", key=f"{kind}_csv")
    if up is not None:
        return pd.read_csv(up)
    if st.button("Run", type="primary", key=f"{kind}_run"):
        st.session_state[f"{kind}_args"] = args
    if st.session_state.get(f"{kind}_args") != args:
        return None
    with ui.progress_of("Running the study (FeatCal once per cell, then the test split)"):
        return state.memoized(run, *args)


merger = controls.current_merger()
preset = preset_for_zoo(zoo)
anchor = preset_config(preset)
st.title("Studies")
st.caption(
    f"FeatCal at the paper's {preset} setting (λ={anchor.lam:g}, ρ={anchor.rho:g}, α={anchor.alpha:g}) on "
    f"**{merger.label}** (change it on the "
    "Zoo page); accuracies on the test split, task average, mean ± std over the seeds of the calibration draw."
)
n_calib = zoos.split_size(zoo, "calib")
max_test = st.select_slider("test examples per task", [50, 100, 200, "all"], 100, key="study_test")
max_test = None if max_test == "all" else int(max_test)
se_tab, rb_tab = st.tabs(["Sample efficiency", "Robustness"])

with se_tab:
    c1, c2 = st.columns([3, 1])
    budgets = c1.multiselect(
        "examples per task",
        [n for n in studies.BUDGETS if n <= n_calib],
        [n for n in (4, 16, 64, 256) if n <= n_calib],
        key="se_budgets",
    )
    n_seeds = c2.number_input("seeds", 1, 5, 3, key="se_seeds")
    args = (source, fp, merger, tuple(sorted(budgets)), tuple(range(int(n_seeds))), max_test)
    rows = _rows("sample-efficiency", _sample_efficiency, args) if budgets else None
    if rows is not None:
        st.plotly_chart(tune_figures.sample_efficiency_curve(rows), key="se_curve")
        ui.table(studies.summarize(rows, by=("method", "n")), 2, index=False)
        ui.downloads(rows, "sample_efficiency", "every row (method, n, seed, task, accuracy)")

with rb_tab:
    c1, c2, c3, c4 = st.columns(4)
    corruptions = c1.multiselect("corruptions", list(studies.CORRUPTIONS), list(studies.CORRUPTIONS), key="rb_kinds")
    severities = c2.multiselect("severities", [1, 2, 3, 4, 5], [1, 3, 5], key="rb_sev")
    n = c3.select_slider(
        "calibration examples per task", [n for n in settings.CAL_SIZES if n <= n_calib], min(64, n_calib), key="rb_n"
    )
    n_seeds = c4.number_input("seeds", 1, 5, 1, key="rb_seeds")
    args = (
        source,
        fp,
        merger,
        tuple(corruptions),
        tuple(float(s) for s in sorted(severities)),
        int(n),
        tuple(range(int(n_seeds))),
        max_test,
    )
    rows = _rows("robustness", _robustness, args) if corruptions and severities else None
    if rows is not None:
        st.plotly_chart(tune_figures.robustness_bars(rows), key="rb_bars")
        summary = studies.summarize(rows, by=("method", "corruption", "severity"))
        ui.table(summary, 2, index=False)
        ui.downloads(rows, "robustness", "every row (method, corruption, severity, seed, task, accuracy)")

"""The Compare page under AppTest on a tiny zoo: nothing runs before Run; Run shows every
chosen method beside the experts and base, with its costs, the charts and the CSV exports; the
trained calibrators at their authors' schedules unless a shorter one is chosen, and then labelled."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

from app.tables import MISSING
from featcal.baselines import registry

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")


def _page(tiny_zoo_dir) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=1800)
    at.query_params["zoo"] = "other (path)…"
    at.query_params["zoo_path"] = tiny_zoo_dir
    at.run()
    at.switch_page("pages/compare.py").run()
    assert not at.exception and not at.error
    return at


def test_trained_calibrators_default_to_their_authors_schedules(tiny_zoo_dir):
    at = _page(tiny_zoo_dir)
    at.multiselect(key="cmp_cals").set_value(["escal", "surgery", "surgery_v2"]).run()
    info = " ".join(i.value for i in at.info)
    for cal in ("escal", "surgery", "surgery_v2"):
        length = registry.get(cal).length  # the one copy of the authors' schedules
        assert f"{registry.get(cal).label} {length.default} {length.name}" in info
        assert not at.checkbox(key=f"cmp_{cal}_short").value  # a shorter schedule only when chosen
        assert not [w for w in at.number_input if w.key == f"cmp_{cal}_{length.name}"]
    at.checkbox(key="cmp_surgery_short").check().run()
    steps = at.number_input(key="cmp_surgery_steps")
    assert steps.value < registry.get("surgery").length.default


def test_test_examples_offered_are_limits_that_cut_a_split(tiny_zoo_dir):
    """Only limits below the largest test split are offered, then all (the default where 100 is not)."""
    from featcal.zoo import load_any

    zoo = load_any(tiny_zoo_dir, progress=False)
    largest = max(len(zoo.split(t, "test")[1]) for t in zoo.tasks)
    slider = _page(tiny_zoo_dir).select_slider(key="cmp_test")
    limits = [int(o) for o in slider.options[:-1]]
    assert slider.options[-1] == "all" and all(b < largest for b in limits)
    assert [b for b in (50, 100, 200) if b < largest] == limits
    assert slider.value == ("100" if 100 in limits else "all")


def test_compare_page_runs_the_chosen_methods(tiny_zoo_dir):
    at = _page(tiny_zoo_dir)
    assert not at.dataframe  # nothing runs before Run

    at.multiselect(key="cmp_mergers").set_value(["ta", "ties"]).run()
    at.multiselect(key="cmp_cals").set_value(["featcal", "svc", "surgery_v2"]).run()
    assert any("minutes" in i.value for i in at.info)  # trained calibrators: the user is told
    at.checkbox(key="cmp_surgery_v2_short").check().run()
    at.number_input(key="cmp_surgery_v2_steps").set_value(2).run()
    at.select_slider(key="cmp_n").set_value(16).run()
    at.button(key="cmp_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]

    scores, cost = at.dataframe[0].value, at.dataframe[1].value  # scores, then cost
    assert isinstance(scores, pd.DataFrame) and "avg acc (%)" in scores.columns
    shorter = "ta+surgery_v2 (2 steps)"  # a shorter schedule than the authors' says so
    svc = "ta+svc (alpha 0.1)"  # FusionBench's alpha after Task Arithmetic
    assert scores["method"].tolist() == ["experts", "base", "ta", "ties", "ta+featcal", svc, shorter]
    row = cost.set_index("method")
    assert row.loc["ta+featcal", "+trained"] == 0 and row.loc[shorter, "+trained"] > 0
    assert row.loc["ta+featcal", "model"] == "one for all tasks" and row.loc[shorter, "model"].startswith("per task")
    assert int(row.loc["ta+featcal", "n/task"]) == 16 == int(row.loc[shorter, "n/task"])
    assert row.loc["ta", "n/task"] == MISSING  # data-free: reads no example
    ratio = row.loc[shorter, "fwd ×"]
    assert float(ratio) > 0 and float(row.loc["ta+featcal", "peak MB"]) >= 0  # measured: finite, not asserted
    settings = at.dataframe[-1].value  # the settings as a small table, no raw dict
    assert list(settings.columns) == ["setting", "value"] and not any("{" in str(v) for v in settings.value)
    charts = [c for c in at.get("plotly_chart")]
    assert len(charts) == 3  # accuracy bars, output drift, drift per block
    labels = [b.label for b in at.get("download_button")]
    for name in ("compare_summary", "compare_accuracy", "compare_drift"):
        assert f"{name}.csv" in labels and f"{name}.parquet" in labels, labels

    at.selectbox(key="cmp_task").set_value("beta").run()  # another task's drift: from the cache
    assert not at.exception and not at.error


def test_compare_page_runs_the_bayesian_and_covariance_rivals(tiny_zoo_dir):
    """BMM (inner level, searched, data-free) and ACE-Merging come from the registry like every
    merger: chosen, run and scored beside the others."""
    at = _page(tiny_zoo_dir)
    rivals = ["bmm", "bmm_search", "bmm_datafree", "ace"]
    at.multiselect(key="cmp_mergers").set_value(rivals).run()
    at.multiselect(key="cmp_cals").set_value([]).run()
    at.select_slider(key="cmp_n").set_value(16).run()
    at.button(key="cmp_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    scores, cost = at.dataframe[0].value, at.dataframe[1].value
    assert scores["method"].tolist() == ["experts", "base", *rivals]
    row = cost.set_index("method")
    assert int(row.loc["bmm", "n/task"]) == 16 == int(row.loc["bmm_search", "n/task"])
    assert row.loc["bmm_datafree", "n/task"] == MISSING == row.loc["ace", "n/task"]  # data-free

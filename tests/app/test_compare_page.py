"""The Compare page under AppTest on a tiny zoo: nothing runs before Run; Run shows every
chosen method beside the experts and base, with the charts and the CSV exports."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")


def test_compare_page_runs_the_chosen_methods(tiny_zoo_dir):
    at = AppTest.from_file(APP, default_timeout=1800)
    at.query_params["zoo"] = "other (path)…"
    at.query_params["zoo_path"] = tiny_zoo_dir
    at.run()
    at.switch_page("pages/compare.py").run()
    assert not at.exception and not at.error
    assert not at.dataframe  # nothing runs before Run

    at.multiselect(key="cmp_mergers").set_value(["ta", "ties"]).run()
    at.multiselect(key="cmp_cals").set_value(["featcal", "surgery_v2"]).run()
    assert any("minutes" in i.value for i in at.info)  # trained calibrators: the user is told
    at.number_input(key="cmp_surgery_v2_steps").set_value(2).run()
    at.select_slider(key="cmp_n").set_value(16).run()
    at.button(key="cmp_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]

    scores, cost = at.dataframe[0].value, at.dataframe[1].value  # scores, then cost
    assert isinstance(scores, pd.DataFrame) and "avg acc (%)" in scores.columns
    assert scores["method"].tolist() == ["experts", "base", "ta", "ties", "ta+featcal", "ta+surgery_v2"]
    row = cost.set_index("method")
    assert row.loc["ta+featcal", "added (trained)"] == 0 and row.loc["ta+surgery_v2", "added (trained)"] > 0
    settings = at.dataframe[-1].value  # the settings as a small table, no raw dict
    assert list(settings.columns) == ["setting", "value"] and not any("{" in str(v) for v in settings.value)
    charts = [c for c in at.get("plotly_chart")]
    assert len(charts) == 3  # accuracy bars, output drift, drift per block
    labels = [b.label for b in at.get("download_button")]
    for name in ("compare_summary", "compare_accuracy", "compare_drift"):
        assert f"{name}.csv" in labels and f"{name}.parquet" in labels, labels

    at.selectbox(key="cmp_task").set_value("beta").run()  # another task's drift: from the cache
    assert not at.exception and not at.error

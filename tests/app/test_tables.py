"""How the app shows numbers (app.tables): a dash for missing values, never "None"; numbers
rounded; settings as a two-column table; the Calibrate page's five numbers."""

from __future__ import annotations

import math

import pandas as pd

from app import tables


def test_missing_numbers_become_a_dash_and_complete_columns_stay_numbers():
    df = pd.DataFrame({"method": ["a", "b"], "gap": [None, 0.5], "n": [1, 2], "kl": [math.nan, 1.23456]})
    out, texts = tables.dashed(df, 2)
    assert texts == ["gap", "kl"] and out.gap.tolist() == ["–", "0.50"] and out.kl.tolist() == ["–", "1.23"]
    assert out.n.tolist() == [1, 2] and "None" not in out.to_string()
    html = tables.styled(out, 2).to_html()
    assert "None" not in html and "nan" not in html


def test_settings_are_a_small_table_of_short_text():
    t = tables.settings_table({"n": 64, "lam": 0.0500001, "methods": ["ta", "ties"], "none": None, "d": {"x": 1}})
    assert list(t.columns) == ["setting", "value"]
    assert t.value.tolist() == ["64", "0.05", "ta, ties", "–", "x=1"]


def test_the_five_summary_numbers_compare_with_the_merged_model():
    cols = ["accuracy", "expert_cosine", "task_vector_cosine", "kl", "agreement"]
    before = pd.DataFrame([[60.0, 0.5, 0.4, 1.0, 70.0]], columns=cols)
    after = pd.DataFrame([[70.0, 0.6, 0.3, 0.5, 80.0]], columns=cols)
    rows = tables.summary_metrics(before, after)
    assert [r[0] for r in rows][0] == "mean accuracy" and rows[0][1:3] == ("70.00%", "+10.00 pp vs merged")
    assert rows[3] == ("KL(expert ‖ model)", "0.5000", "-0.5000", True)  # lower is better

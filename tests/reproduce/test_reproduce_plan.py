"""What a reproduction plans before it runs: rows as featcal methods, their forward passes, whether a
zoo is the table's setting, and the cells of the printed table."""

from __future__ import annotations

import dataclasses

import pytest

from featcal.reproduce import plan, report, setting
from featcal.reproduce.run import RowResult
from featcal.reproduce.tables import PaperRow, get_table


def test_methods_parse_as_the_registry_names_them():
    assert plan.parse_method("TA+FeatCal") == ("task_arithmetic", ("featcal",))
    assert plan.parse_method("ties+svc+featcal") == ("ties", ("svc", "featcal"))
    assert plan.parse_method("experts") == ("experts", ())
    assert plan.canonical("task_arithmetic", ("surgery",)) == "ta+surgery"
    with pytest.raises(ValueError, match="must come last"):
        plan.parse_method("ta+surgery+featcal")
    with pytest.raises(ValueError, match="unknown calibrator 'wemoe'"):
        plan.parse_method("ta+wemoe")


def test_a_row_featcal_lacks_is_planned_not_in_featcal():
    table = get_table("table1-b32")
    missing = PaperRow("WEMoE", None, {"avg": 89.4}, "none")
    unknown = PaperRow("TA + WEMoE", "ta+wemoe", {"avg": 89.4}, "none")
    assert not plan.plan_row(table, missing).runs
    planned = plan.plan_row(table, unknown)
    assert not planned.runs and "unknown calibrator 'wemoe'" in planned.why_not
    assert plan.row_passes(planned, 8, {"a": 100}).total == 0


def test_rows_take_the_table_params_then_their_own_then_the_command_lines():
    table = get_table("table1-b32")
    rows = plan.plan_table(table, n=8, only=["ta+featcal"], extra={"featcal": {"alpha": 0.5}})
    assert [r.method for r in rows] == ["ta+featcal"]
    assert rows[0].n == 8
    assert rows[0].params == {"task_arithmetic": {"scale": 0.3}, "featcal": {"lam": 0.05, "rho": 2.2, "alpha": 0.5}}
    with pytest.raises(ValueError, match="not a row of table1-b32"):
        plan.plan_table(table, only=["ties"])
    with pytest.raises(ValueError, match="featcal"):
        plan.plan_table(table, extra={"featcal": {"alpha": "high"}})


def test_forward_passes_follow_the_cost_model():
    table = get_table("table1-b32")
    sizes = {"a": 100, "b": 50, "c": 10}
    by_method = {r.method: r for r in plan.plan_table(table, n=16)}
    ta, fc, surgery = by_method["ta"], by_method["ta+featcal"], by_method["ta+surgery"]
    assert plan.row_passes(ta, 3, sizes) == plan.Passes(scoring=160)
    assert plan.row_passes(fc, 3, sizes) == plan.Passes(featcal=2 * 16 * 3, scoring=160)
    assert plan.row_passes(fc, 3, sizes).weighted == plan.FEATCAL_FWD * 96 + 160
    assert plan.row_passes(surgery, 3, sizes) == plan.Passes(calibration=96, scoring=160)  # steps: the module alone
    v2 = dataclasses.replace(surgery, chain=("surgery_v2",), params={"surgery_v2": {"steps": 10}})
    assert plan.row_passes(v2, 3, sizes).training == 10 * 16 * 3 * plan.TRAIN_STEP_PASSES  # steps x batch x T x 3


def test_the_setting_check_names_what_differs():
    s = get_table("table1-b32").setting
    ta8 = s.tasks
    assert setting.setting_problems(s, setting.ZooIdentity("x", "openai/clip-vit-base-patch32", ta8)) == []
    assert setting.setting_problems(s, setting.ZooIdentity("x", None, ta8)) == []  # a local base, the right tasks
    other = setting.setting_problems(s, setting.ZooIdentity("x", "openai/clip-vit-base-patch16", ta8[:6]))
    assert len(other) == 2 and "missing ['dtd', 'mnist']" in other[0] and "clip-vit-base-patch16" in other[1]
    assert "built-in zoo" in setting.setting_problems(s, setting.ZooIdentity("demo", None, None, builtin=True))[0]
    t5 = get_table("table3-base").setting  # GLUE's eight tasks by name, as the shipped spec has them
    glue = ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb")
    assert setting.setting_problems(t5, setting.ZooIdentity("x", "google/flan-t5-base", glue)) == []
    assert (
        "missing ['cola'"
        in setting.setting_problems(t5, setting.ZooIdentity("x", "google/flan-t5-base", tuple("abcdefgh")))[0]
    )
    llama = get_table("table4-3b").setting
    domains = ("instruction", "math", "coding", "multilingual", "safety")
    assert setting.setting_problems(llama, setting.ZooIdentity("x", "meta-llama/Llama-3.2-3B-Instruct", domains)) == []


def test_a_shipped_spec_is_read_without_loading():
    path = setting.resolve_zoo("clip-vit-b16-tall14")
    who = setting.zoo_identity(path)
    assert who.model == "openai/clip-vit-base-patch16" and len(who.tasks) == 14
    assert setting.setting_problems(get_table("table1-b16-tall14").setting, who) == []
    assert setting.setting_problems(get_table("table1-b16").setting, who)  # 14 tasks are not TA8
    with pytest.raises(FileNotFoundError, match="not in this checkout"):
        setting.resolve_zoo("no-such-zoo")


def test_the_printed_table_puts_ours_beside_the_paper():
    table = get_table("table1-b32")
    rows = plan.plan_table(table, n=8, only=["ta"]) + [
        plan.plan_row(table, PaperRow("Other", None, {"avg": 50.0}, "none"))
    ]
    results = [RowResult(rows[0], scores={"sun397": 60.0, "dtd": 50.0}), RowResult(rows[1])]
    records = report.row_records(table, results)
    assert records[0]["ours"]["avg"] == 55.0 and records[0]["diff"] == {
        "sun397": 60.0 - 57.01,
        "dtd": 50.0 - 47.13,
        "avg": 55.0 - 67.55,
    }
    assert records[1]["status"] == "not in featcal" and records[1]["diff"] == {}
    ctx = dict(zoo="z", tasks=2, n=8, seed=42, max_test=None, device="cpu", preset="clip", comparable=True, problems=[])
    text = report.markdown(table, records, ctx)
    assert "| Task Arithmetic | ta | 8 | 55.00 | 67.55 | -12.55 | readme |" in text
    assert "| Other | not in featcal |  |  | 50.0 |  | none |" in text
    assert "| sun397 | 60.00 | 57.01 | +2.99 |" in text
    assert "NOT COMPARABLE" not in text

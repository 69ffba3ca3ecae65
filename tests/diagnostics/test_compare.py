"""diagnostics.compare on a tiny zoo: the table agrees with running each method directly."""

from __future__ import annotations

import math

import pytest

from diagnostics import compare as cmp
from featcal import ESCalOptions, FeatCalConfig, calibrate, escal
from featcal.zoo import load_any
from featcal.zoo.core import evaluate
from featcal.zoo.score.scores import expert_accuracies

FAST = {"escal": {"epochs": 1, "rank": 4}, "surgery_v2": {"steps": 3}}


@pytest.fixture(scope="module")
def zoo(tiny_zoo_dir):
    return load_any(tiny_zoo_dir)


@pytest.fixture(scope="module")
def result(zoo):
    return cmp.compare(
        zoo,
        ["ta", "ties", "ta+featcal", "ta+escal", "ta+surgery_v2"],
        cmp.CompareOptions(n=16, calibrator_params=FAST),
        progress=False,
    )


def _row(result, method):
    return result.summary.set_index("method").loc[method]


def test_featcal_row_is_calibrate_then_evaluate(zoo, result):
    merged = zoo.merged("task_arithmetic")
    model, _ = calibrate(
        merged, base=zoo.base, experts=zoo.experts, calib_data=zoo.calib_data(16), config=FeatCalConfig.clip()
    )
    direct = evaluate(model, zoo)
    got = result.accuracy[result.accuracy["method"] == "ta+featcal"].set_index("task")["accuracy"].to_dict()
    assert got == pytest.approx(direct)
    assert _row(result, "ta+featcal")["accuracy"] == pytest.approx(sum(direct.values()) / len(direct))


def test_reference_rows(zoo, result):
    experts = result.accuracy[result.accuracy["method"] == "experts"].set_index("task")["accuracy"].to_dict()
    assert experts == pytest.approx(expert_accuracies(zoo))
    base = result.accuracy[result.accuracy["method"] == "base"].set_index("task")["accuracy"].to_dict()
    assert base == pytest.approx(evaluate(zoo.base, zoo))
    assert _row(result, "experts")["kl"] == pytest.approx(0.0, abs=1e-6)
    assert _row(result, "experts")["agreement"] == pytest.approx(100.0)


def test_added_parameters(zoo, result):
    assert _row(result, "ta+featcal")[["added_trained", "added_stored"]].tolist() == [0, 0]
    L, d, r = 2, 32, 4  # tiny zoo: 2 blocks of width 32; ESCal at rank 4
    row = _row(result, "ta+escal")
    assert row["added_trained"] == L * r * r
    assert row["added_stored"] == L * r * r + 2 * L * d * r
    # SurgeryV2: a module per block and one on the final embedding (the pooled 32-d class token), rank 16
    assert _row(result, "ta+surgery_v2")["added_trained"] == 2 * L * d * 16 + 2 * d * 16


def test_trained_rows_score_each_task_with_its_own_modules(zoo, result):
    opts = ESCalOptions(progress=False, **FAST["escal"])
    cal = escal(zoo.merged("task_arithmetic"), zoo.experts, zoo.calib_data(16), opts)
    direct = {t: evaluate(cal.for_task(t), zoo, tasks=[t])[t] for t in zoo.tasks}
    got = result.accuracy[result.accuracy["method"] == "ta+escal"].set_index("task")["accuracy"].to_dict()
    assert got == pytest.approx(direct)


def test_tables_cover_every_method_task_and_block(zoo, result):
    methods = ["experts", "base", "ta", "ties", "ta+featcal", "ta+escal", "ta+surgery_v2"]
    assert result.summary["method"].tolist() == methods
    assert len(result.accuracy) == len(methods) * len(zoo.tasks)
    counts = result.drift.groupby("method").size()
    assert (counts == len(zoo.tasks) * 2 * len(cmp.DRIFT_METRICS)).all() and set(counts.index) == set(methods)
    assert (result.drift.query("method == 'experts'")["value"].abs() < 1e-5).all()


def test_gap_closed(result):
    ta, experts = _row(result, "ta")["accuracy"], _row(result, "experts")["accuracy"]
    ties = _row(result, "ties")
    assert ties["gap_closed"] == pytest.approx(cmp.gap_closed(ties["accuracy"], ta, experts))
    assert cmp.gap_closed(80.0, 60.0, 100.0) == pytest.approx(50.0)
    assert math.isnan(cmp.gap_closed(70.0, 90.0, 90.0))
    assert math.isnan(ties["gap_closed_vs_merger"])


def test_cached_per_setting(zoo, result):
    cache = {}
    Options = cmp.CompareOptions
    a = cmp.run_method(zoo, "ta", Options(n=16), cache=cache)
    assert cmp.run_method(zoo, "ta", Options(n=16), cache=cache) is a
    assert cmp.run_method(zoo, "ta", Options(n=8), cache=cache) is not a
    b = cmp.run_method(zoo, "ta", Options(n=16, merger_params={"task_arithmetic": {"scale": 0.5}}), cache=cache)
    assert b is not a
    assert cmp.run_method(zoo, "ta", Options(n=16, merger_params={"ta": {"scale": 0.5}}), cache=cache) is b  # alias


def test_bad_methods_are_named():
    with pytest.raises(ValueError, match="unknown merge method 'tas'"):
        cmp.parse_method("tas+featcal")
    with pytest.raises(ValueError, match="unknown calibrator 'featcall'"):
        cmp.parse_method("ta+featcall")
    assert cmp.parse_method("TA+FeatCal") == ("task_arithmetic", "featcal")
    assert cmp.parse_method("ta+svc+featcal") == ("task_arithmetic", "svc+featcal")
    assert cmp.parse_method("fisher+svc+surgery") == ("fisher_merging", "svc+surgery")
    with pytest.raises(ValueError, match="must come last, once"):
        cmp.parse_method("ta+surgery+featcal")
    with pytest.raises(ValueError, match="appears twice"):
        cmp.parse_method("ta+svc+svc")


def test_figures_draw_every_method_and_the_reference_lines(zoo, result):
    from diagnostics import compare_figures as figs

    fig = figs.accuracy_bars(result.accuracy)
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert list(bars) == ["ta", "ties", "ta+featcal", "ta+escal", "ta+surgery_v2"]
    ta = result.accuracy.query("method == 'ta'").set_index("task")["accuracy"]
    assert bars["ta"] == [ta[t] for t in zoo.tasks]
    lines = {t.name: [y for y in t.y if y is not None] for t in fig.data if t.type == "scatter"}
    experts = result.accuracy.query("method == 'experts'").set_index("task")["accuracy"]
    assert lines["experts"] == [v for t in zoo.tasks for v in (experts[t], experts[t])]
    assert "base" in lines

    drift = figs.drift_lines(result.drift, zoo.tasks[1])
    names = {t.name for t in drift.data}
    assert {"ta", "ta+escal", "ta+escal (mismatch)", "base"} <= names and "experts" not in names
    assert all(list(t.x) == [0, 1] for t in drift.data)  # the tiny zoo's two blocks
    scatter = figs.output_scatter(result.summary)
    assert [t.name for t in scatter.data] == result.summary["method"].tolist()[1:]


def test_parameters_reach_the_method_and_bad_ones_fail_first(zoo):
    cache = {}
    tuned_options = cmp.CompareOptions(n=16, calibrator_params={"featcal": {"lam": 0.5}})
    tuned = cmp.run_method(zoo, "ta+featcal", tuned_options, cache=cache)
    config = FeatCalConfig.clip().with_(lam=0.5)
    model, _ = calibrate(
        zoo.merged("task_arithmetic"), base=zoo.base, experts=zoo.experts, calib_data=zoo.calib_data(16), config=config
    )
    assert tuned.accuracy == pytest.approx(evaluate(model, zoo))
    with pytest.raises(ValueError, match="surgery takes no parameter 'step'"):
        cmp.compare(zoo, ["ta+surgery"], cmp.CompareOptions(calibrator_params={"surgery": {"step": 2}}), cache=cache)
    with pytest.raises(ValueError, match="task_arithmetic takes no parameter 'density'"):
        cmp.compare(zoo, ["ta"], cmp.CompareOptions(merger_params={"task_arithmetic": {"density": 0.2}}), cache=cache)
    with pytest.raises(ValueError, match=r"featcal: parameter 'lam' takes a number in \[0, inf\]"):
        cmp.compare(zoo, ["ta+featcal"], cmp.CompareOptions(calibrator_params={"featcal": {"lam": -1}}), cache=cache)
    with pytest.raises(ValueError, match="ESCalOptions: rank, epochs and batch must be >= 1"):
        cmp.compare(zoo, ["ta+escal"], cmp.CompareOptions(calibrator_params={"escal": {"epochs": 0}}), cache=cache)
    assert list(cache) == [next(iter(cache))]  # nothing ran for the bad calls

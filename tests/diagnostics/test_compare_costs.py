"""What each method costs in diagnostics.compare's summary (diagnostics.compare_table) on a tiny
zoo: one model or modules per task, the numbers added (counted on what was produced), the
calibration examples per task read, the forward time over the merged model's, seconds and peak
memory; SVC's alpha FusionBench's after the merger, in the row's label."""

from __future__ import annotations

import math

import pytest
import torch

from diagnostics import compare as cmp
from diagnostics import compare_table as table
from featcal import SurgeryOptions, surgery, svc
from featcal.zoo import load_any
from featcal.zoo.core import evaluate

SHORT = {"surgery": {"steps": 3}}
METHODS = ["ta", "fisher", "ta+svc", "iso_cts+svc", "ta+featcal", "ta+surgery"]


@pytest.fixture(scope="module")
def zoo(tiny_zoo_dir):
    return load_any(tiny_zoo_dir)


@pytest.fixture(scope="module")
def summary(zoo):
    options = cmp.CompareOptions(n=16, calibrator_params=SHORT, repeats=2)
    return cmp.compare(zoo, METHODS, options, progress=False).summary.set_index("method")


def test_the_cost_columns_are_there_and_in_the_markdown(summary):
    assert set(table.SUMMARY_COLUMNS) == {"method", *summary.columns}
    md = cmp.markdown(summary.reset_index())
    for head in ("model", "n per task", "added per task", "forward time (x merged)", "calib s", "peak MB"):
        assert f"| {head}" in md.splitlines()[0], head
    assert "| ta+surgery (3 steps) | per task (needs the task) | 16 |" in md
    assert "| ta+featcal | one for all tasks | 16 |" in md
    assert "| ta | one for all tasks |  |" in md  # data-free: no n


def test_featcal_gives_one_model_and_adds_nothing(summary):
    row = summary.loc["ta+featcal"]
    assert not row["task_specific"] and row["n_per_task"] == 16
    assert (row["added_trained"], row["added_stored"], row["added_fraction"]) == (0, 0, 0.0)


def test_surgery_adds_modules_per_task_counted_on_them(zoo, summary):
    row = summary.loc["ta+surgery"]
    cal = surgery(zoo.merged("task_arithmetic"), zoo.experts, zoo.calib_data(16), SurgeryOptions(steps=3))
    counted = {t: sum(p.numel() for m in mods.values() for p in m.parameters()) for t, mods in cal.modules.items()}
    assert row["task_specific"] and row["n_per_task"] == 16
    assert row["added_trained"] == counted[zoo.tasks[0]] > 0
    assert row["label"] == "ta+surgery (3 steps)"  # not the authors' 1000 steps: said in the label


def test_examples_read_is_what_each_part_read(summary):
    assert summary["n_per_task"].isna()[["ta", "ta+svc", "iso_cts+svc"]].all()  # data-free
    assert summary.loc["fisher", "n_per_task"] == 16
    data = {"a": [torch.zeros(16, 3), torch.zeros(16, 3)], "b": [torch.zeros(32, 3)]}  # 32 examples per task
    assert table.examples_read({"fisher_merging": {"n_examples": 8}}, data) == 8  # Fisher's cap
    assert table.examples_read({"fisher_merging": {}}, data) == 32  # its 256 cap is above
    assert table.examples_read({"fisher_merging": {"n_examples": 8}, "featcal": {}}, data) == 32
    assert table.examples_read({"task_arithmetic": {}, "svc": {}}, data) is None


def test_measured_costs_are_finite(summary):
    methods = summary.loc[METHODS]
    assert (methods.loc[["ta", "fisher"], "forward_ratio"] == 1.0).all()  # a merger alone: the merged model
    for col in ("forward_ratio", "merge_seconds", "calib_seconds", "peak_mb"):
        assert methods[col].map(math.isfinite).all(), col
    assert (methods["forward_ratio"] > 0).all() and (methods["peak_mb"] >= 0).all()
    assert summary.loc[["experts", "base"], "forward_ratio"].isna().all()


def test_svc_runs_at_fusion_benchs_alpha_after_its_merger(zoo, summary):
    assert summary.loc["ta+svc", "label"] == "ta+svc (alpha 0.1)"
    assert summary.loc["iso_cts+svc", "label"] == "iso_cts+svc (alpha 0.2)"
    merged = zoo.merged("task_arithmetic")
    experts = {t: m.state_dict() for t, m in zoo.experts.items()}
    model = zoo.merged("task_arithmetic")
    model.load_state_dict(svc(merged.state_dict(), zoo.base.state_dict(), experts, alpha=0.1))
    assert summary.loc["ta+svc", "accuracy"] == pytest.approx(table.average(evaluate(model, zoo)))
    given = cmp.run_method(zoo, "ta+svc", cmp.CompareOptions(n=16, calibrator_params={"svc": {"alpha": 1.0}}))
    assert given.label == "ta+svc (alpha 1)"


def test_a_method_further_from_the_experts_than_the_base_is_flagged():
    """A merge no better than the pretrained model and far from the experts' outputs (ESM at its image
    recipe on SmolLM2: accuracy 9.0 as the base's, KL 18.1 against its 3.8) is named, so compare warns
    instead of reporting its scores as the method's."""
    import pandas as pd

    from diagnostics.compare_table import further_than_base

    summary = pd.DataFrame(
        {
            "method": ["experts", "base", "ta", "esm", "ta+featcal", "ta+svc"],
            "kl": [0.0, 3.8, 1.0, 18.1, 0.5, 8.0],
            "accuracy": [45.5, 9.0, 31.0, 9.0, 46.0, 30.0],
        }
    )
    assert [m.split(" ")[0] for m in further_than_base(summary)] == ["esm"]  # ta+svc: far, but better than base
    assert further_than_base(summary[summary["method"] != "base"]) == []  # no base row: nothing to hold to

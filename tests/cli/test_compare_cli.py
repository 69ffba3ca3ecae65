"""``featcal compare`` end to end on a tiny zoo directory."""

from __future__ import annotations

import pandas as pd
import pytest

from diagnostics import compare as cmp
from featcal.cli import commands as cli
from featcal.zoo import load_any
from featcal.zoo.score.scores import expert_accuracies


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_compare_prints_the_table_and_writes_csvs(tiny_zoo_dir, tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["compare", "--zoo", tiny_zoo_dir, "--methods", "ta,ta+featcal,ta+surgery", "--n", "16"]
    argv += ["--param", "surgery.steps=2", "--param", "ta.scale=0.4", "--out", str(out), "-q"]
    rc, stdout, _ = _run(capsys, *argv)
    assert rc == 0
    for method in ("| experts |", "| base |", "| ta |", "| ta+featcal |"):
        assert method in stdout
    assert "| ta+surgery (2 steps) | per task (needs the task) | 16 |" in stdout  # not the authors' schedule
    assert "| ta+featcal | one for all tasks | 16 |" in stdout
    summary = pd.read_csv(out / "summary.csv")
    assert summary["method"].tolist() == ["experts", "base", "ta", "ta+featcal", "ta+surgery"]
    assert {"label", "task_specific", "n_per_task", "forward_ratio", "peak_mb"} <= set(summary.columns)
    table = cmp.markdown(summary)  # the CSV read back (a reference's empty merger is NaN): the same table
    assert [line for line in table.splitlines() if line.startswith(("| experts", "| ta |"))] == [
        line for line in stdout.splitlines() if line.startswith(("| experts", "| ta |"))
    ]
    acc = pd.read_csv(out / "accuracy.csv")
    experts = acc[acc["method"] == "experts"].set_index("task")["accuracy"].to_dict()
    zoo = load_any(tiny_zoo_dir)
    assert experts == expert_accuracies(zoo)
    assert {"drift.csv", "output.csv", "settings.json", "figures.html"} <= {p.name for p in out.iterdir()}
    assert '"scale": 0.4' in (out / "settings.json").read_text()

    rc, _, err = _run(capsys, *argv)  # the same --out again: refused before any work
    assert rc == 2 and "already exists" in err and "--force" in err


def test_compare_names_a_bad_method(tiny_zoo_dir, capsys):
    rc, _, err = _run(capsys, "compare", "--zoo", tiny_zoo_dir, "--methods", "ta,ta+featcall", "-q")
    assert rc == 2 and "unknown calibrator 'featcall'" in err
    rc, _, err = _run(capsys, "compare", "--zoo", tiny_zoo_dir, "--methods", "ta,ta+featcal", "--param", "lam=3", "-q")
    assert rc == 2 and "METHOD.NAME=VALUE" in err  # several methods run: say whose
    rc, _, err = _run(capsys, "compare", "--zoo", tiny_zoo_dir, "--methods", "ta", "--param", "epochs=3", "-q")
    assert rc == 2 and "task_arithmetic takes no parameter 'epochs'" in err  # one method: a bare NAME is its
    rc, _, err = _run(capsys, "compare", "--zoo", tiny_zoo_dir, "--methods", "ta", "--param", "escal.epochs=3", "-q")
    assert rc == 2 and "escal does not run here" in err
    rc, _, err = _run(capsys, "compare", "--zoo", tiny_zoo_dir, "--methods", "ta+svc", "--param", "svc.alpha=high")
    assert rc == 2 and "svc: parameter 'alpha' takes a number, got 'high'" in err
    rc, _, err = _run(capsys, "compare", "--zoo", tiny_zoo_dir, "--methods", "ta+surgery", "--param", "surgery.step=2")
    assert rc == 2 and "surgery takes no parameter 'step'" in err and "steps" in err


def test_compare_composes_svc_adamerging_and_fisher(tiny_zoo_dir, tmp_path, capsys):
    """ta+svc, ta+svc+featcal and the data-using mergers run from the command line, each on the
    same calibration examples; SVC after TA is FusionBench's calibration of the TA merge, at its
    alpha (0.1) by default."""
    out = tmp_path / "cmp"
    argv = ["compare", "--zoo", tiny_zoo_dir, "--methods", "ta+svc,ta+svc+featcal,adamerging,fisher", "--n", "8"]
    argv += ["--param", "adamerging.steps=2", "--out", str(out), "-q"]
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 0, err
    summary = pd.read_csv(out / "summary.csv")
    assert summary["method"].tolist() == ["experts", "base", "ta+svc", "ta+svc+featcal", "adamerging", "fisher"]
    row = summary.set_index("method")
    assert row.loc["ta+svc+featcal", "calibrator"] == "svc+featcal"
    assert row.loc["ta+svc", "label"] == "ta+svc (alpha 0.1)" and "| ta+svc (alpha 0.1) |" in stdout
    assert pd.isna(row.loc["ta+svc", "n_per_task"])  # data-free
    assert row.loc[["ta+svc+featcal", "adamerging", "fisher"], "n_per_task"].tolist() == [8, 8, 8]


def test_help_lists_each_calibrators_parameters_from_the_registry(capsys):
    """``featcal compare --help`` lists every calibrator's parameters with their defaults, help,
    ranges and choices: the fields of their options (featcal.baselines.registry.describe)."""
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    out = capsys.readouterr().out
    assert "escal (ESCal):" in out and "epochs=200  passes over each task's examples" in out
    assert "pool='auto'  how the final embedding is compared [auto | example | mean | tokens]" in out
    assert "lam=0.05  lambda, the ridge strength toward the anchor [0 .. inf]" in out
    assert "after ta 0.1, ties 0.1" in out and "iso_cts 0.2, tsv 1.0" in out  # SVC's alpha per merger

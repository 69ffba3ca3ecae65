"""``featcal reproduce`` end to end: the list, the dry run's plan and estimates, a small real run
beside the paper's figures, and the refusals (all before any model loads, but the calib split's size)."""

from __future__ import annotations

import json
import re

import pytest

from featcal.cli import commands as cli
from featcal.reproduce.setting import SHIPPED_SPECS
from featcal.reproduce.tables import PAPER_TABLES


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _line(text: str, start: str) -> str:
    found = [line for line in text.splitlines() if line.startswith(start)]
    assert len(found) == 1, (start, text)
    return found[0]


def test_list_names_every_table(capsys):
    rc, out, _ = _run(capsys, "reproduce", "--list")
    assert rc == 0
    for name in ("table1-b32", "table1-l14-tall20", "table3-base", "table4-8b", "efficiency"):
        assert f"| {name} |" in out
    assert "| table1-b32 | openai/clip-vit-base-patch32 | 8 | clip-vit-b32-ta8 |" in out


@pytest.mark.demo_zoo
def test_dry_run_on_the_demo_zoo_prints_the_plan_passes_and_estimates(capsys, tmp_path):
    argv = ["reproduce", "table1-b32", "--zoo", "demo", "--any-zoo", "--dry-run", "--n", "8", "--max-test", "20", "-q"]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    assert "dry run: nothing is run" in out and "NOT COMPARABLE" in out
    # 7 tasks: FeatCal's reference 2 x 8 x 7 = 112 passes, scoring 7 x 20 = 140
    assert _line(out, "| Task Arithmetic + FeatCal |").startswith(
        "| Task Arithmetic + FeatCal | ta+featcal | 8 | 112 | 0 | 0 | 140 |"
    )
    assert _line(out, "| Task Arithmetic |").startswith("| Task Arithmetic | ta | 8 | 0 | 0 | 0 | 140 |")
    assert _line(out, "| Surgery |").startswith("| Surgery | ta+surgery | 8 | 0 | 112 | 0 | 140 |")
    assert "total: 896 forward passes; about " in out  # 140 + 252 + 252 + 252
    assert re.search(r"one forward pass \(an example through one model\) took \d+\.\d\d ms", out)
    assert re.search(r"\| \d+ s \| \d+\.\d\d GiB \|", _line(out, "| Task Arithmetic + FeatCal |"))
    assert "Estimates, not measurements" in out and "Room on the device now" in out
    assert not list(tmp_path.iterdir())


@pytest.mark.demo_zoo
def test_a_small_run_on_the_demo_zoo_prints_ours_beside_the_paper(capsys, tmp_path):
    from featcal.zoo import evaluate, load_any

    out_dir = tmp_path / "t1"
    argv = ["reproduce", "table1-b32", "--zoo", "demo", "--any-zoo", "--n", "8", "--max-test", "40"]
    argv += ["--rows", "ta,ta+featcal", "-q", "--out", str(out_dir)]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    assert "NOT COMPARABLE" in out and "FeatCal, arXiv 2605.13030v1, Table 1" in out
    cells = _line(out, "| Task Arithmetic | ta |").split("|")
    ours, paper, diff = float(cells[4]), float(cells[5]), float(cells[6])
    assert paper == 67.55 and diff == pytest.approx(ours - paper, abs=0.006)  # the diff is the run's
    zoo = load_any("demo", progress=False)
    accs = evaluate(zoo.merged("task_arithmetic", scale=0.3), zoo, max_per_task=40)
    assert ours == pytest.approx(sum(accs.values()) / len(accs), abs=0.5)  # one flipped example at most
    doc = json.loads((out_dir / "reproduce.json").read_text())
    fc = doc["rows"][1]
    assert fc["method"] == "ta+featcal" and fc["paper"]["avg"] == 85.47
    assert fc["diff"]["avg"] == pytest.approx(fc["ours"]["avg"] - 85.47)
    assert set(fc["ours"]) == set(zoo.tasks) | {"avg"} and fc["ours"]["avg"] != doc["rows"][0]["ours"]["avg"]
    assert (out_dir / "reproduce.md").read_text() in out
    assert doc["run"]["comparable"] is False and doc["sources"]["readme"]
    rc, _, err = _run(capsys, *argv)
    assert rc == 2 and "already exists" in err


def _tiny_tables(tmp_path) -> str:
    """A tables file of the shipped form whose setting is the tiny test zoo, with rows featcal lacks."""
    raw = json.loads(PAPER_TABLES.read_text())
    raw["tables"] = {
        "tiny": {
            "source": "a test table",
            "caption": "the tiny zoo",
            "setting": {
                "family": "clip",
                "model": "tiny/clip",
                "tasks": ["alpha", "beta", "gamma"],
                "zoo": "tiny",
                "n": 8,
                "preset": "clip",
                "metric": "score",
            },
            "rows": [
                {"label": "TA", "method": "ta", "source": "none", "cells": {"avg": 50.0}},
                {"label": "WEMoE", "method": None, "source": "none", "cells": {"alpha": 70.0, "avg": 70.0}},
                {"label": "TA + WEMoE", "method": "ta+wemoe", "source": "none", "cells": {}},
                {"label": "Individual", "method": "experts", "source": "none", "cells": {}},
            ],
        }
    }
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(raw))
    return str(path)


def test_rows_featcal_lacks_are_listed_not_dropped(capsys, tmp_path, tiny_zoo_dir):
    argv = ["reproduce", "tiny", "--tables", _tiny_tables(tmp_path), "--zoo", tiny_zoo_dir, "-q"]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0
    assert "NOT COMPARABLE" not in out  # the zoo's tasks are the table's, its base a local directory
    assert _line(out, "| WEMoE |") == "| WEMoE | not in featcal |  |  | 70.0 |  | none |"
    assert _line(out, "| TA + WEMoE |").startswith("| TA + WEMoE | not in featcal |")
    assert "- WEMoE: not in featcal (featcal has no such method)" in out
    assert "unknown calibrator 'wemoe'" in out
    assert re.match(r"\| TA \| ta \| 8 \| \d+\.\d\d \| 50\.0 \| [+-]\d+\.\d\d \| none \|", _line(out, "| TA |"))
    from featcal.zoo import load_any
    from featcal.zoo.score.scores import expert_accuracies

    experts = expert_accuracies(load_any(tiny_zoo_dir))  # each task's expert on its task, as the row
    cells = _line(out, "| Individual |").split("|")
    assert cells[2].strip() == "experts" and not cells[3].strip()  # a reference row draws no examples
    assert float(cells[4]) == pytest.approx(sum(experts.values()) / 3, abs=0.006)
    rc, _, err = _run(capsys, *argv, "--n", "100")  # the tiny zoo's calib split holds 64
    assert rc == 2 and "hold fewer" in err and "lower --n" in err


def _spec(tmp_path, old: str, new: str) -> str:
    text = (SHIPPED_SPECS / "clip-vit-b32-ta8.yaml").read_text()
    path = tmp_path / "spec.yaml"
    path.write_text(text.replace(old, new))
    return str(path)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["table1-b32", "--zoo", "demo"], ["not table1-b32's setting", "built-in zoo", "--any-zoo"]),
        (["table9"], ["unknown table 'table9'", "table1-b32"]),
        ([], ["name a table", "--list"]),
        (["table1-b32", "--zoo", "demo", "--any-zoo", "--rows", "ties"], ["--rows ties: not a row of table1-b32"]),
        (["table1-b32", "--zoo", "demo", "--any-zoo", "--param", "featcal.alpha=high"], ["'alpha' takes a number"]),
        (["table1-b32", "--zoo", "demo", "--any-zoo", "--param", "alpha=0.5"], ["METHOD.NAME=VALUE"]),
        (
            ["table1-b32", "--zoo", "demo", "--any-zoo", "--dry-run", "--out", "x"],
            ["--dry-run runs and writes nothing"],
        ),
        (["table1-b32", "--zoo", "no-such-zoo"], ["no such file, built-in zoo or shipped spec"]),
    ],
)
def test_refusals_come_before_any_work(capsys, argv, says):
    rc, out, err = _run(capsys, "reproduce", *argv)
    assert rc == 2 and not out
    for s in says:
        assert s in err


def test_a_zoo_of_another_setting_is_refused(capsys, tmp_path):
    other_base = _spec(tmp_path, "base: {id: openai/clip-vit-base-patch32}", "base: {id: openai/clip-vit-base-patch16}")
    rc, _, err = _run(capsys, "reproduce", "table1-b32", "--zoo", other_base)
    assert rc == 2 and "its base model is openai/clip-vit-base-patch16" in err
    rc, _, err = _run(capsys, "reproduce", "table1-b32-tall14", "--zoo", other_base)
    assert rc == 2 and "missing ['cifar100', 'fer2013'" in err

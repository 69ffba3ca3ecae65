"""``featcal reproduce`` on a zoo spec (YAML) that is a table's setting: the dry run loads only the
base and the first task's expert and sizes block 0 exactly; the run is comparable, its output
never lands among the zoo's inputs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from featcal.cli import commands as cli
from featcal.reproduce import estimate, plan
from featcal.reproduce.tables import PAPER_TABLES, load_tables

TASKS = ("red", "green", "blue")


@pytest.fixture
def spec_zoo(tmp_path, monkeypatch) -> Path:
    """A spec of a tiny HF CLIP vision zoo on local paths: base and three experts (save_pretrained
    directories, 2 blocks of width 32, 17 tokens), file heads, npz data; offline, own HF cache."""
    from safetensors.torch import save_file
    from transformers import CLIPVisionConfig, CLIPVisionModel

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    cfg = CLIPVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    base = CLIPVisionModel(cfg).eval()
    base.save_pretrained(tmp_path / "base")
    heads, rng = {}, np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    for t in TASKS:
        expert = copy.deepcopy(base)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.02 * torch.randn(p.shape))
        expert.save_pretrained(tmp_path / "experts" / t)
        heads[f"{t}.weight"] = torch.randn(3, 32)
        arrays = {}
        for split, n in (("train", 40), ("test", 12)):
            arrays[f"{split}_labels"] = np.arange(n) % 3
            arrays[f"{split}_inputs"] = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        np.savez(tmp_path / "data" / f"{t}.npz", **arrays)
    save_file(heads, str(tmp_path / "heads.safetensors"))
    spec = {
        "name": "tiny-spec",
        "base": "base",
        "experts": {t: f"experts/{t}" for t in TASKS},
        "heads": {"type": "file", "path": "heads.safetensors"},
        "features": "pooled",
        "data": {t: {"path": f"data/{t}.npz"} for t in TASKS},
        "splits": {"calib": 16, "val": 4, "seed": 3},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _tables(tmp_path: Path) -> str:
    """A tables file of the shipped form whose one table is the spec zoo's setting."""
    raw = json.loads(PAPER_TABLES.read_text())
    setting = {"family": "clip", "model": "local/tiny", "tasks": list(TASKS), "zoo": "tiny-spec", "n": 8}
    rows = [
        {"label": "TA", "method": "ta", "source": "none", "cells": {"red": 30.0, "avg": 40.0}},
        {"label": "TA + FeatCal", "method": "ta+featcal", "source": "none", "cells": {}},
    ]
    raw["tables"] = {"tiny": {"source": "a test table", "caption": "tiny", "setting": setting, "rows": rows}}
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _run(capsys, *argv):
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_probe_loads_one_task_and_reads_block_0(spec_zoo):
    from transformers import CLIPVisionModel

    zoo = estimate.probe_zoo(str(spec_zoo))
    assert zoo.tasks == ["red"]  # the base and one expert, not three
    p = estimate.probe(zoo)
    assert p.seconds_per_pass > 0 and p.examples == 16 and p.repeats == 3
    assert (p.seq_len, p.hidden, p.blocks) == (17, 32, 2)  # 4 x 4 patches and the class token
    # q, k, v, out: 32 -> 32; fc1 32 -> 64; fc2 64 -> 32
    assert p.widths == 4 * 64 + 96 + 96
    assert p.stats_elems == 4 * (32 * 32 + 32 * 32) + (32 * 32 + 32 * 64) + (64 * 64 + 64 * 32)
    base = CLIPVisionModel.from_pretrained(spec_zoo.parent / "base")
    assert p.model_bytes == sum(t.numel() * t.element_size() for t in [*base.parameters(), *base.buffers()])
    assert estimate.scored_sizes(zoo, list(TASKS), None) is None  # not decoded to be counted
    assert estimate.scored_sizes(zoo, list(TASKS), 5) == {t: 5 for t in TASKS}


def test_the_memory_estimate_adds_featcal_s_working_set(spec_zoo, tmp_path):
    zoo = estimate.probe_zoo(str(spec_zoo))
    p = estimate.probe(zoo)
    table = load_tables(_tables(tmp_path)).tables["tiny"]
    ta, fc = plan.plan_table(table)
    bare = estimate.memory_estimate(p, ta, 3)
    assert bare == {"models": 6 * p.model_bytes, "total": 6 * p.model_bytes}  # base, 3 experts, merged, calibrated
    full = estimate.memory_estimate(p, fc, 3)
    assert full["streams"] == 4 * (3 * 8 * 17) * 32 * p.elem  # 4 copies of every task's tokens x width
    assert full["total"] == sum(v for k, v in full.items() if k != "total") > bare["total"]


def test_a_dry_run_on_the_setting_is_comparable(spec_zoo, tmp_path, capsys):
    argv = ["reproduce", "tiny", "--tables", _tables(tmp_path), "--zoo", str(spec_zoo), "--dry-run", "-q"]
    rc, out, _ = _run(capsys, *argv)
    assert rc == 0 and "NOT COMPARABLE" not in out and "zoo tiny-spec (3 tasks)" in out
    assert "| TA + FeatCal | ta+featcal | 8 | 48 | 0 | 0 | not counted |" in out  # 2 x 8 x 3 reference passes
    assert "Scoring not counted" in out
    rc, out, _ = _run(capsys, *argv, "--max-test", "5")
    assert rc == 0 and "| TA | ta | 8 | 0 | 0 | 0 | 15 |" in out and "Scoring not counted" not in out


def test_a_run_on_the_setting_prints_ours_beside_the_paper(spec_zoo, tmp_path, capsys):
    argv = ["reproduce", "tiny", "--tables", _tables(tmp_path), "--zoo", str(spec_zoo), "-q"]
    inside = spec_zoo.parent / "experts" / "red" / "out"
    rc, out, err = _run(capsys, *argv, "--out", str(inside))
    assert rc == 2 and not out and "never writes over its inputs" in err and not inside.exists()
    rc, out, _ = _run(capsys, *argv, "--out", str(tmp_path / "rep"))
    assert rc == 0 and "NOT COMPARABLE" not in out
    doc = json.loads((tmp_path / "rep" / "reproduce.json").read_text())
    ta = doc["rows"][0]
    assert set(ta["ours"]) == {*TASKS, "avg"} and ta["ours"]["avg"] == pytest.approx(
        np.mean([ta["ours"][t] for t in TASKS])
    )
    assert ta["diff"] == pytest.approx({"red": ta["ours"]["red"] - 30.0, "avg": ta["ours"]["avg"] - 40.0})
    assert f"| TA | ta | 8 | {ta['ours']['avg']:.2f} | 40.0 | {ta['ours']['avg'] - 40.0:+.2f} | none |" in out
    assert doc["run"]["comparable"] is True and doc["rows"][1]["calib_seconds"] > 0

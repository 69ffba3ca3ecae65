"""benchmarks/device_check.py, the first GPU run's one command, runs its every part at toy sizes on
the CPU (``--quick --device cpu``): the table and the JSON name every part, every number is
finite and every exactness row within its tolerance. No timing is asserted."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("exactness", "headline", "streamed", "app", "distributed")
ARCHS = ("HF CLIP", "open_clip ViT", "T5", "BERT", "Llama")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check") / "dc.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "benchmarks/device_check.py", "--quick", "--device", "cpu", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return proc, json.loads(out.read_text()) if out.exists() else None


@pytest.mark.slow
def test_quick_cpu_run_has_every_part_with_finite_numbers(quick_run):
    proc, data = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| part | case | result |")
    for part in PARTS:
        assert any(line.startswith(f"| {part} |") for line in table), part
    assert data["quick"] is True
    rows = data["rows"]
    assert {r["part"] for r in rows} == set(PARTS)
    for r in rows:
        assert r["case"] != "error", r
        assert r["numbers"], r
        assert all(isinstance(v, float) and math.isfinite(v) for v in r["numbers"].values()), r
    ranks = [r["case"] for r in rows if r["part"] == "distributed"]
    assert [c.split(",")[1].strip() for c in ranks[:2]] == ["1 rank(s)", "2 rank(s)"]
    assert ranks[2].startswith("gloo, a 1-rank group on the CPU")  # the NCCL row's code, on gloo


@pytest.mark.slow
def test_quick_cpu_run_is_exact_on_every_architecture_and_dtype(quick_run):
    _, data = quick_run
    exact = [r for r in data["rows"] if r["part"] == "exactness"]
    assert len(exact) == 3 * len(ARCHS)
    for arch in ARCHS:
        for dtype, suffix in (("float32", ""), ("bfloat16", ""), ("float32", ", one block at a time on the device")):
            [r] = [r for r in exact if r["case"].startswith(arch) and r["case"].endswith(f"{dtype} model{suffix}")]
            assert r["ok"] is True, r
            assert r["numbers"]["max_rel_diff"] <= (1e-3 if dtype == "float32" else 5e-2), r
            # the float64 model's result is near too: the oracle itself is a FeatCal result
            assert r["numbers"]["vs_float64_model"] <= (1e-4 if dtype == "float32" else 5e-2), r


def _device_check(*args):
    return subprocess.run(
        [sys.executable, "benchmarks/device_check.py", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_official_with_a_folder_that_is_not_a_git_repository_fails_before_any_part(tmp_path):
    proc = _device_check("--official", str(tmp_path), "--quick", "--device", "cpu")
    assert proc.returncode == 2
    assert f"--official: {tmp_path} is not the FeatCal authors' code" in proc.stderr
    assert "git cannot read HEAD:src/featcal/featcal.py" in proc.stderr
    assert "| part |" not in proc.stdout  # refused before anything ran


def test_official_with_a_git_repository_of_other_code_names_what_is_missing(tmp_path):
    src = tmp_path / "src" / "featcal"
    src.mkdir(parents=True)
    (src / "featcal.py").write_text("class SomethingElse:\n    pass\n")
    (src / "solver.py").write_text("def merge_layer_parameters_with_featcal_stats(): ...\n")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "not theirs"], check=True)
    proc = _device_check("--official", str(tmp_path), "--parts", "exactness")
    assert proc.returncode == 2
    assert "is not the FeatCal authors' code" in proc.stderr
    assert "HEAD:src/featcal/featcal.py has no class CLIPFeatCalibrator" in proc.stderr


def test_the_comparison_groups_differences_by_kind_and_names_the_worst_block():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from featcal_vs_authors import diff_by_kind

    theirs = {
        "encoder.layers.0.mlp.fc1.weight": torch.ones(2, 2),
        "encoder.layers.1.mlp.fc1.weight": torch.full((2, 2), 2.0),
        "embeddings.class_embedding": torch.ones(3),
    }
    ours = {k: v.clone() for k, v in theirs.items()}
    ours["encoder.layers.1.mlp.fc1.weight"][0, 0] = 2.5  # 0.5 off a largest entry of 2
    ours["encoder.layers.0.mlp.fc1.weight"][1, 1] = 1.1
    got = diff_by_kind(ours, theirs)
    assert set(got) == {"mlp.fc1.weight", "outside the blocks"}
    assert got["mlp.fc1.weight"][0] == pytest.approx(0.25)
    assert got["mlp.fc1.weight"][1] == "block 1"
    assert got["outside the blocks"][0] == 0.0

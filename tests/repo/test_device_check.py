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


def test_the_official_hook_is_refused_not_ignored(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/device_check.py", "--official", str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    assert "--official is not implemented" in proc.stderr

"""``torchrun --nproc-per-node 2 -m featcal calibrate ...`` (both the --zoo and the --base/--expert/--data
forms): rank 0 alone writes and prints, and the model equals the single-process command's."""

from __future__ import annotations

import os
import subprocess
import sys

import distrib
import pytest
import torch

import tiny
from featcal.model.checkpoints import save_token_data
from featcal.zoo.io import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _featcal(args: list[str], nproc: int | None = None) -> subprocess.CompletedProcess:
    """``python -m featcal ARGS``, under torchrun when ``nproc`` (one thread a process, free port)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", FEATCAL_DIST_TIMEOUT="1800")
    launch = [sys.executable, "-m", "featcal"]
    if nproc:
        port = str(distrib.free_port())
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        launch += ["--master-addr", "127.0.0.1", "--master-port", port, "-m", "featcal"]
    return subprocess.run(launch + args, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)


def _max_rel(got: dict, want: dict) -> float:
    return max(
        float((got[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
        for k, w in want.items()
        if w.is_floating_point() and w.numel()
    )


@pytest.mark.slow
def test_torchrun_zoo_form(tiny_zoo_dir, tmp_path):
    common = ["calibrate", "--zoo", tiny_zoo_dir, "--n-per-task", "6", "--batch-size", "2", "--stats-dtype", "float64"]
    one = _featcal(common + ["--out", str(tmp_path / "one"), "-q"])
    assert one.returncode == 0, one.stderr
    two = _featcal(common + ["--out", str(tmp_path / "two")], nproc=2)
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("wrote") == 1  # rank 0 alone prints (and writes)
    zoo_base = __import__("featcal.zoo", fromlist=["load_any"]).load_any(tiny_zoo_dir).base
    a, b = (load_model(str(tmp_path / n), like=zoo_base).state_dict() for n in ("one", "two"))
    assert _max_rel(b, a) <= 1e-5  # default fast paths: the forward calls are pooled differently


@pytest.mark.slow
def test_torchrun_checkpoint_form(tmp_path):
    from transformers import LlamaForCausalLM

    base, experts, _, data = tiny.text_zoo(
        tiny.tiny_llama, lambda seed: tiny.text_batches(n=5, batch=5, vocab=50, seed=seed), n_tasks=2
    )
    base.save_pretrained(tmp_path / "base")
    for t, m in experts.items():
        m.save_pretrained(tmp_path / t)
    save_token_data(tmp_path / "data.safetensors", {t: d[0] for t, d in data.items()})
    common = ["calibrate", "--base", str(tmp_path / "base"), "--data", str(tmp_path / "data.safetensors")]
    common += [x for t in experts for x in ("--expert", f"{t}={tmp_path / t}")]
    common += ["--preset", "llama-3b", "--lam", "1e-3", "--batch-size", "2", "--stats-dtype", "float64", "-q"]
    one = _featcal(common + ["--out", str(tmp_path / "one")])
    assert one.returncode == 0, one.stderr
    three = _featcal(common + ["--out", str(tmp_path / "three")], nproc=3)
    assert three.returncode == 0, three.stderr
    a, b = (LlamaForCausalLM.from_pretrained(tmp_path / n).state_dict() for n in ("one", "three"))
    assert _max_rel(b, a) <= 1e-5
    assert not any(p.name.endswith(".featcal-partial") for p in tmp_path.iterdir())
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])

"""Pinned runs: the engine's results do not move when its code is reorganised.

Two calibrations are pinned, each saved once from the code as it stood (``python
tests/engine/test_pinned.py --write``): the demo zoo (Task Arithmetic 0.3, CLIP preset, 16
examples per task) and a tiny Llama with padded batches (the llama-3b preset, float64
statistics). Each saves the calibrated blocks' parameters, those of a preview at another
setting, the same run again through an :class:`~featcal.ExpertTrace` that already holds the
experts (its second call reads them back), and the numeric columns of a drift table.

On the machine that wrote the files (same CPU model, torch and thread count) every tensor must
be equal (``torch.equal``): a reorganisation that changes a single bit fails. Elsewhere the
BLAS kernels round differently, so the values are held to a small relative tolerance instead.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import pytest
import torch

PINNED = Path(__file__).resolve().parent / "pinned"
CROSS_MACHINE_RTOL = 1e-3  # largest ||got - want|| / ||want|| per tensor on another CPU


def fingerprint() -> dict:
    """What decides the rounding of a CPU run: the processor, torch's kernels, the threads."""
    info = Path("/proc/cpuinfo")
    names = [ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith("model name")]
    model = names[0] if info.exists() and names else platform.processor()
    return {
        "cpu": model,
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }


def _block_params(model, prefix: str) -> dict[str, torch.Tensor]:
    """Every parameter under the blocks (what calibration writes), as contiguous float copies."""
    return {
        f"{prefix}/{k}": v.detach().clone().contiguous()
        for k, v in model.state_dict().items()
        if ".layers." in k or ".layer." in k
    }


def _drift_tensor(model, experts, data) -> torch.Tensor:
    from diagnostics import drift_table

    frame = drift_table(model, experts, data, progress=False)
    numeric = frame.select_dtypes("number").sort_index(axis=1)
    return torch.tensor(numeric.to_numpy(dtype="float64")).contiguous()


def _three_runs(merged, base, experts, data, config, preview_at: dict) -> dict[str, torch.Tensor]:
    from featcal import ExpertTrace, calibrate

    out = {}
    model, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=config, keep_stats=True, progress=False
    )
    out.update(_block_params(model, "calibrated"))
    out.update(_block_params(report.preview(**preview_at), "preview"))
    out["drift"] = _drift_tensor(model, experts, data)
    trace = ExpertTrace()
    for _ in range(2):  # the second call reads the experts from the trace
        traced, _ = calibrate(
            merged, base=base, experts=experts, calib_data=data, config=config, expert_trace=trace, progress=False
        )
    out.update(_block_params(traced, "traced"))
    return out


def demo_run() -> dict[str, torch.Tensor]:
    from featcal import FeatCalConfig, merge_model
    from featcal.zoo import load_demo

    zoo = load_demo(progress=False)
    merged = merge_model("task_arithmetic", zoo.base, zoo.experts, scale=0.3)
    data = zoo.calib_data(16, seed=42)
    return _three_runs(merged, zoo.base, zoo.experts, data, FeatCalConfig.clip(), {"lam": 0.5, "alpha": 0.6})


def llama_run() -> dict[str, torch.Tensor]:
    from functools import partial

    from featcal.config import preset_config
    from tiny import text_batches, text_zoo, tiny_llama

    base, experts, merged, data = text_zoo(
        partial(tiny_llama, layers=2), partial(text_batches, n=6, batch=3, length=9, vocab=50), n_tasks=2
    )
    cfg = preset_config("llama-3b")
    return _three_runs(merged, base, experts, data, cfg, {"lam": 1e-3, "alpha": 0.4})


RUNS = {"demo": demo_run, "llama": llama_run}


def _single_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn()
    finally:
        torch.set_num_threads(threads)


def write() -> None:
    from safetensors.torch import save_file

    PINNED.mkdir(exist_ok=True)
    for name, fn in RUNS.items():
        tensors = _single_thread(fn)
        meta = _single_thread(fingerprint)
        save_file(tensors, str(PINNED / f"{name}.safetensors"), metadata={"fingerprint": json.dumps(meta)})
        print(f"wrote {name}: {len(tensors)} tensors, {meta}")


@pytest.mark.demo_zoo
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_pinned_run_is_unchanged(name):
    from safetensors import safe_open

    path = PINNED / f"{name}.safetensors"
    with safe_open(str(path), "pt") as f:
        want = {k: f.get_tensor(k) for k in f.keys()}
        pinned_on = json.loads(f.metadata()["fingerprint"])
    got = _single_thread(RUNS[name])
    assert sorted(got) == sorted(want)
    same_machine = _single_thread(fingerprint) == pinned_on
    for key, w in want.items():
        g = got[key]
        assert g.shape == w.shape and g.dtype == w.dtype, key
        if same_machine:
            assert torch.equal(g, w), f"{name}: {key} differs from the pinned run on the machine that pinned it"
        else:
            gap = float((g.double() - w.double()).norm() / w.double().norm().clamp_min(1e-30))
            assert gap <= CROSS_MACHINE_RTOL, f"{name}: {key} is {gap:.2e} (relative) from the pinned run"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/engine/test_pinned.py --write   (from the repository root)")
    sys.path[:1] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # tiny.py
    write()

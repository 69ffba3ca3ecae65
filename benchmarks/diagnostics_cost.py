"""What the diagnostics cost, against one plain forward pass.

For a tiny and a mid-size HF CLIP vision tower (random weights, N seeded
experts, a synthetic zoo), time each diagnostic and the whole ``diagnose``,
count block calls with forward hooks, and record the peak memory above the
baseline (CPU: resident set size sampled every millisecond, so allocator reuse
hides some of it; CUDA: ``max_memory_allocated``). The reference ``forward`` is
one pass of each task's drift data through the model and through its expert;
``x fwd`` is each row's time over it. Times are the fastest of ``--repeat`` runs
(the machine may be shared).

    .venv/bin/python benchmarks/diagnostics_cost.py [--device cuda] [--tasks 3] [--n 32]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys
import threading
import time
from typing import Callable, Iterator

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from diagnostics import diagnose, drift_table, expert_cosine, output_drift, task_vector_cosine
from featcal.model.arch import resolve_blocks
from featcal.util.memory import rss_mb
from featcal.zoo.core import TaskData, Zoo

SIZES = {  # name -> CLIPVisionConfig fields
    "tiny (d=32, L=2, T=5)": dict(
        image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    ),
    "mid (d=256, L=6, T=65)": dict(
        image_size=64, patch_size=8, hidden_size=256, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8
    ),
}


def _rss_bytes() -> int:
    return round(rss_mb() * 2**20)


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict]:
    """``{"mb": peak bytes above the start / 2**20}`` once the block ends."""
    out: dict = {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield out
        torch.cuda.synchronize(device)
        out["mb"] = (torch.cuda.max_memory_allocated(device) - start) / 2**20
        return
    start, peak, stop = _rss_bytes(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()
        out["mb"] = max(peak[0], _rss_bytes()) - start
        out["mb"] /= 2**20


@contextlib.contextmanager
def count_block_calls(models: list[nn.Module]) -> Iterator[dict]:
    """``{"calls": completed forward calls of any block of ``models``}``."""
    out = {"calls": 0}

    def hook(*_):
        out["calls"] += 1

    handles = [b.register_forward_hook(hook) for m in models for b in resolve_blocks(m)[1]]
    try:
        yield out
    finally:
        for h in handles:
            h.remove()


def synthetic_zoo(cfg: dict, n_tasks: int, n: int, device: torch.device) -> Zoo:
    """A random CLIP tower as base, experts a small seeded step away, random frozen heads."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    base = CLIPVisionModel(CLIPVisionConfig(**cfg)).eval().to(device)
    experts, heads, data = {}, {}, {}
    gen = torch.Generator().manual_seed(1)
    size = cfg["image_size"]
    for i in range(n_tasks):
        t = f"task{i}"
        experts[t] = copy.deepcopy(base)
        with torch.no_grad():
            for p in experts[t].parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen).to(device))
        heads[t] = nn.Linear(cfg["hidden_size"], 10).requires_grad_(False).to(device)
        data[t] = TaskData(
            t,
            [str(c) for c in range(10)],
            {
                s: (torch.randn(n, 3, size, size, generator=gen), torch.randint(0, 10, (n,), generator=gen))
                for s in ("calib", "test")
            },
        )
    return Zoo("bench", base, experts, heads, data, features=lambda m, x: m(pixel_values=x).pooler_output)


def measure(
    fn: Callable[[], object], models: list[nn.Module], device: torch.device, repeat: int
) -> tuple[float, int, float]:
    """``(fastest seconds, block calls per run, largest peak MB)`` over ``repeat`` runs."""
    best, calls_per_run, peak = float("inf"), 0, 0.0
    for _ in range(repeat):
        with count_block_calls(models) as calls, peak_memory(device) as mem:
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
        calls_per_run, peak = calls["calls"], max(peak, mem["mb"])
    return best, calls_per_run, peak


def bench(name: str, cfg: dict, n_tasks: int, n: int, batch: int, device: torch.device, repeat: int) -> list[tuple]:
    zoo = synthetic_zoo(cfg, n_tasks, n, device)
    model = zoo.merged("task_arithmetic")
    data = zoo.calib_data(n, batch_size=batch)
    models = [model, *zoo.experts.values()]

    @torch.no_grad()
    def forward():
        for t, batches in data.items():
            for b in batches:
                model(pixel_values=b.to(device))
                zoo.experts[t](pixel_values=b.to(device))

    forward()  # warm-up (allocator, kernels)
    runs = [
        ("forward (model + expert)", forward),
        ("drift_table (+cka)", lambda: drift_table(model, zoo.experts, data)),
        ("drift_table (no cka)", lambda: drift_table(model, zoo.experts, data, cka=False)),
        ("expert_cosine", lambda: expert_cosine(model, zoo.experts, data, features_fn=zoo.features)),
        ("task_vector_cosine", lambda: task_vector_cosine(model, zoo.base, zoo.experts)),
        ("output_drift (test split)", lambda: output_drift(model, zoo, batch_size=batch)),
        ("diagnose (all of the above)", lambda: diagnose(model, zoo, n_per_task=n, batch_size=batch)),
    ]
    rows, ref = [], None
    for label, fn in runs:
        s, calls, mb = measure(fn, models, device, repeat)
        ref = ref or s
        rows.append((name, label, s, s / ref, calls, mb))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tasks", type=int, default=3, help="N tasks (experts)")
    ap.add_argument("--n", type=int, default=32, help="examples per task (drift data and test split)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement (the fastest is reported)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"device {device}, {args.tasks} tasks, {args.n} examples per task, batch {args.batch}, "
        f"torch threads {args.threads}, fastest of {args.repeat} runs"
    )
    header = f"{'model':<24} {'what':<28} {'seconds':>8} {'x fwd':>6} {'block calls':>11} {'peak MB':>8}"
    print(header)
    print("-" * len(header))
    for name, cfg in SIZES.items():
        for row in bench(name, cfg, args.tasks, args.n, args.batch, device, args.repeat):
            print(f"{row[0]:<24} {row[1]:<28} {row[2]:>8.3f} {row[3]:>6.1f} {row[4]:>11d} {row[5]:>8.1f}")


if __name__ == "__main__":
    main()

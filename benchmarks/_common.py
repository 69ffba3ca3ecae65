"""Shared helpers of the benchmark scripts: random CLIP-format zoos, timers, memory
probes, the forward-pass reference and markdown tables.

Imports only torch and transformers (and featcal), so the scripts also run on a
machine that has those but not this repository's virtual environment. Every
script puts the repository root on ``sys.path`` itself (see :func:`setup_path`).
"""

from __future__ import annotations

import copy
import datetime as _dt
import gc
import os
import platform
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]
APP_SCRIPT = REPO_ROOT / "app" / "streamlit_app.py"  # what `streamlit run` serves

# HF ``CLIPVisionConfig`` fields of each model size the benchmarks use.
SIZES: dict[str, dict] = {
    # ViT-B/32 at 224 px: 12 blocks of width 768, 50 tokens per image, 88M parameters.
    "vit-b32": dict(
        image_size=224,
        patch_size=32,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
    ),
    # The embedded demo zoo's model (featcal.zoo.builtin.demo.Recipe.vision): 17 tokens per image.
    "demo": dict(
        image_size=32, patch_size=8, hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4
    ),
    # The tests' tiny HF CLIP (tests/tiny.py): 5 tokens per image.
    "tiny": dict(
        image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4
    ),
}


# Flags for Debian's chromium under Playwright (headless, no sandbox, nothing reaching the network).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def setup_path() -> None:
    """Put the repository root first on ``sys.path`` (``import featcal`` without installing)."""
    root = str(REPO_ROOT)
    if root not in sys.path:
        sys.path.insert(0, root)


def tokens_per_example(size: str) -> int:
    s = SIZES[size]
    return (s["image_size"] // s["patch_size"]) ** 2 + 1


# --------------------------------------------------------------------------- zoo


@dataclass
class Zoo:
    """A random CLIP-format zoo: base, perturbed experts, their Task Arithmetic merge, data."""

    size: str
    base: nn.Module
    experts: dict[str, nn.Module]
    merged: nn.Module
    data: dict[str, list[torch.Tensor]]  # {task: [(B, 3, H, W), ...]}
    n_examples: int
    batch: int

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.base.parameters())

    def with_examples(self, n_examples: int, batch: int | None = None) -> "Zoo":
        """The same models on the first ``n_examples`` examples of every task (in batches of
        ``batch``, default this zoo's)."""
        batch = batch or self.batch
        data = {t: list(torch.cat(bs)[:n_examples].split(batch)) for t, bs in self.data.items()}
        return Zoo(self.size, self.base, self.experts, self.merged, data, n_examples, batch)


@torch.no_grad()
def _perturbed(model: nn.Module, rel_std: float, seed: int) -> nn.Module:
    """A copy whose every parameter moves by Gaussian noise of ``rel_std`` times its own spread
    (times 1 for constant tensors such as LayerNorm weights)."""
    out = copy.deepcopy(model)
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for p in out.parameters():
        spread = float(p.float().std()) if p.numel() > 1 else 0.0
        noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
        p.add_((rel_std * (spread or 1.0) * noise).to(p.dtype))
    return out


@torch.no_grad()
def build_zoo(
    size: str,
    n_experts: int,
    n_examples: int,
    batch: int,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    rel_std: float = 0.05,
    seed: int = 0,
    layers: int | None = None,
) -> Zoo:
    """Random HF ``CLIPVisionModel`` of ``SIZES[size]`` (``layers`` overrides the depth), experts as
    seeded perturbations of it, Task Arithmetic (scale 0.3) as the merge, N(0, 1) pixels as data."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from featcal import merge

    fields = dict(SIZES[size])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    torch.manual_seed(seed)
    base = CLIPVisionModel(CLIPVisionConfig(**fields)).eval().to(device=device, dtype=dtype)
    experts = {f"task{i}": _perturbed(base, rel_std, seed + 1 + i) for i in range(n_experts)}
    sd = merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
    merged = copy.deepcopy(base)
    merged.load_state_dict(sd)
    gen = torch.Generator(device=device).manual_seed(seed + 1000)
    hw = fields["image_size"]
    data = {
        t: list(torch.randn(n_examples, 3, hw, hw, generator=gen, device=device).to(dtype).split(batch))
        for t in experts
    }
    return Zoo(size, base, experts, merged, data, n_examples, batch)


# ------------------------------------------------------------------- timing


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def device_of(zoo: Zoo) -> torch.device:
    return next(zoo.merged.parameters()).device


@dataclass(frozen=True)
class Timing:
    """Wall-clock seconds and the process's CPU seconds (all threads) of one call. On a shared,
    oversubscribed CPU the CPU seconds are the steadier measure of work (time stolen by other
    processes is not in them); threads that spin while waiting are."""

    wall: float
    cpu: float


class _Timer:
    def __init__(self, device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        self.t0, self.c0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.timing = Timing(time.perf_counter() - self.t0, time.process_time() - self.c0)


@torch.no_grad()
def forward_reference(zoo: Zoo) -> Timing:
    """ONE forward pass of the calibration data through the merged model and the experts:
    ``merged(x_i)`` and ``expert_i(x_i)`` for every task ``i``, the same batches."""
    with _Timer(device_of(zoo)) as t:
        for task, batches in zoo.data.items():
            for x in batches:
                zoo.merged(pixel_values=x)
                zoo.experts[task](pixel_values=x)
    return t.timing


@dataclass
class CalRun:
    """One timed ``calibrate`` call and its report's per-phase totals (seconds)."""

    seconds: float  # wall clock of the whole call (validation, model copy, stems included)
    cpu_seconds: float  # the process's CPU time over the call (all threads)
    stats: float
    solve: float
    advance: float
    peak_mem: float | None = None  # bytes above the start (see the memory probe used)

    @property
    def other(self) -> float:
        """Validation, the model copy and the stems: everything outside the per-block phases."""
        return self.seconds - self.stats - self.solve - self.advance


def calibrate_once(zoo: Zoo, config, *, keep_stats: bool = False, mem_probe: "MemProbe | None" = None):
    """Time one end-to-end ``featcal.calibrate``; returns ``(CalRun, model, report)``."""
    from featcal import calibrate

    if mem_probe is not None:
        mem_probe.start()
    with warnings.catch_warnings():  # few rows per input width is expected with few examples
        warnings.filterwarnings("ignore", message=".*fewer than its input width")
        with _Timer(device_of(zoo)) as t:
            model, report = calibrate(
                zoo.merged,
                base=zoo.base,
                experts=zoo.experts,
                calib_data=zoo.data,
                config=config,
                keep_stats=keep_stats,
                progress=False,
            )
    peak = mem_probe.stop() if mem_probe is not None else None
    b = report.blocks
    run = CalRun(
        t.timing.wall,
        t.timing.cpu,
        sum(r.stats_seconds for r in b),
        sum(r.solve_seconds for r in b),
        sum(r.advance_seconds for r in b),
        peak,
    )
    return run, model, report


def median_run(runs: list[CalRun]) -> CalRun:
    """The run of median wall-clock time (its phases stay consistent with its total)."""
    ordered = sorted(runs, key=lambda r: r.seconds)
    mid = ordered[(len(ordered) - 1) // 2]
    peaks = [r.peak_mem for r in runs if r.peak_mem is not None]
    return CalRun(mid.seconds, mid.cpu_seconds, mid.stats, mid.solve, mid.advance, max(peaks) if peaks else None)


# ------------------------------------------------------------------- memory


def _rss_bytes() -> int | None:
    from featcal.util.memory import rss_mb

    mb = rss_mb()
    return None if mb is None else round(mb * 2**20)


def release_free_memory() -> None:
    """``gc.collect()`` and glibc's ``malloc_trim(0)`` (hand freed heap pages back to the OS), so
    that a later RSS rise measures new allocations rather than reused free heap."""
    from featcal.util.memory import trim_heap

    gc.collect()
    trim_heap()


class MemProbe:
    """Peak memory of one call, above its start.

    CPU: the process's resident set size sampled every ``interval`` seconds from
    ``/proc/self/statm`` by a thread (after :func:`release_free_memory`); it misses
    spikes shorter than the interval and counts every allocation of the process
    (tensors and the rest). CUDA: ``torch.cuda.max_memory_allocated`` (tensors
    only, exact) minus the allocation at the start.
    """

    def __init__(self, device="cpu", interval: float = 0.002):
        self.cuda = torch.device(device).type == "cuda"
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            return
        release_free_memory()
        self.base = _rss_bytes() or 0
        self.peak = self.base
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes() or 0)
            time.sleep(self.interval)

    def stop(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return float(torch.cuda.max_memory_allocated() - self.base)
        self.peak = max(self.peak, _rss_bytes() or 0)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return float(self.peak - self.base)


# ------------------------------------------------------------------ output


def environment(device: torch.device | str = "cpu") -> str:
    """One paragraph: date, Python, torch, transformers, threads, CPU and device names."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU ({cpu})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    busy = (
        f"\nWARNING: load average {load:.1f} exceeds the {os.cpu_count()} CPUs: other processes share "
        "them, so CPU timings are noisy."
        if load > (os.cpu_count() or 1)
        else ""
    )
    return (
        f"{_dt.datetime.now().isoformat(timespec='minutes')}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}; "
        f"device {name}; {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"load average {load:.1f}{busy}"
    )


APP_TARGET_S = 1.0  # the app's target: slider release -> exact result drawn


def latency_stats(xs: list[float], target_s: float = APP_TARGET_S) -> dict[str, str]:
    """Median, max, count and how many of ``xs`` (seconds) are within ``target_s``: a latency row."""
    return {
        "median": f"{statistics.median(xs):.3f} s",
        "max": f"{max(xs):.3f} s",
        "n": str(len(xs)),
        f"<= {target_s:g} s": f"{sum(x <= target_s for x in xs)}/{len(xs)}",
    }


def markdown_table(rows: list[Mapping[str, object]]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def fmt_s(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.0f} MiB" if abs(n) >= 2**20 else f"{n / 2**10:.0f} KiB"


def cost_row(label: str, zoo: Zoo, ref: Timing, run: CalRun, *, cpu_ratio: bool = True, **extra) -> dict[str, object]:
    """A table row: the calibration time as a multiple of the forward reference, and its phases
    (wall clock; ``cpu_ratio`` adds the ratio of the process's CPU times)."""
    r = ref.wall

    def x(s):
        return f"{fmt_s(s)} ({s / r:.2f}x)"

    row = {"model": label, "experts": len(zoo.experts), "examples/task": zoo.n_examples, "batch": zoo.batch}
    row.update(extra)
    row.update(
        {"reference fwd": fmt_s(r), "calibrate": fmt_s(run.seconds), "calibrate / fwd": f"**{run.seconds / r:.2f}x**"}
    )
    if cpu_ratio:
        row["same, CPU time"] = f"{run.cpu_seconds / ref.cpu:.2f}x"
    row.update(
        {
            "stats": x(run.stats),
            "solve": x(run.solve),
            "advance": x(run.advance),
            "other": x(run.other),
            "peak mem": fmt_bytes(run.peak_mem),
        }
    )
    return row


# ---------------------------------------------------------------- profiling


def profile_ops(fn: Callable[[], object], device="cpu", rows: int = 15) -> str:
    """The top torch ops of one call by self time (``torch.profiler``; CUDA time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    table = prof.key_averages()
    busy = ""
    if cuda:
        attr = "self_device_time_total" if hasattr(table[0], "self_device_time_total") else "self_cuda_time_total"
        dev_us = sum(getattr(e, attr) for e in table)
        busy = f"GPU kernels busy {dev_us / 1e6:.2f} s in all\n"
    for key in (["self_device_time_total", "self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
        try:
            return busy + table.table(sort_by=key, row_limit=rows)
        except (AttributeError, KeyError, ValueError, RuntimeError):
            continue
    return str(table)


def profile_python(fn: Callable[[], object], rows: int = 25, only: str = "featcal") -> str:
    """The top Python functions of one call by cumulative time (``cProfile``), ``only`` those
    whose file path contains ``only`` (plus the torch ops they call, by total time)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("cumulative").print_stats(rf"{only}[/\\]", rows)
    buf.write("\n---- by own time (all functions) ----\n")
    st.strip_dirs().sort_stats("tottime").print_stats(rows)
    return buf.getvalue()

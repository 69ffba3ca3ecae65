"""The paper's setting on one GPU: ViT-B/32-sized CLIP, 8 experts, 256 examples per task.

Times one exact, end-to-end ``featcal.calibrate`` (model building excluded:
random weights, experts as seeded perturbations, Task Arithmetic merge, all
already on the device) and prints, per setting, a markdown row with the time,
its phases from the report (stats / solve / advance, plus ``other``:
validation, model copy, stems), the forward-pass reference (ONE pass of the
calibration data through the merged model and every expert on its own task,
same batches) and the peak GPU memory (``torch.cuda.max_memory_allocated``:
absolute, and above the start of the call, i.e. what calibration adds to the
resident models and data).

Target: 5 s on one H200 for fp32, batch 16 (paper: 53 s on one A800).

Runs from the repository root with a plain ``python3`` that has torch and
transformers (no install of featcal needed)::

    python3 benchmarks/gpu_calibration.py                                  # fp32, batch 16
    python3 benchmarks/gpu_calibration.py --dtype fp32,bf16 --batch 16,64 --offload-streams both
    python3 benchmarks/gpu_calibration.py --profile                        # + top CUDA ops of one run
    python3 benchmarks/gpu_calibration.py --tiny                           # CPU smoke test, seconds
    python3 benchmarks/gpu_calibration.py --streamed 1024                  # + the streamed path (below)

``--streamed WIDTH`` adds a second table: a Llama-architecture base and ``--experts`` experts of
that width (16 blocks, random weights, saved sharded to a temporary directory; see
benchmarks/streaming_memory.py) calibrated three ways: in memory with the models on the device,
in memory with the models on the CPU and ``device=`` the GPU (one block of each on it at a time),
and streamed from the checkpoints (``featcal.calibrate_checkpoints``); time, peak GPU memory and
the largest weight difference from the first way.

``--dtype bf16`` holds the models, data and streams in bfloat16; the statistics
and the solve stay in ``--stats-dtype`` (float32 by default). ``--tf32`` lets
float32 matrix products use TF32 tensor cores (off by default: the exact run).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

from featcal import FeatCalConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="vit-b32", choices=sorted(C.SIZES), help="model size")
    p.add_argument("--experts", type=int, default=8, help="number of experts (tasks)")
    p.add_argument("--examples", type=int, default=256, help="calibration examples per task")
    p.add_argument("--batch", default="16", help="examples per batch; comma-separated for several rows")
    p.add_argument("--dtype", default="fp32", help="model dtype, fp32 or bf16; comma-separated for several rows")
    p.add_argument(
        "--stats-dtype", default="fp32", choices=["fp32", "fp64"], help="dtype of the statistics and the solve"
    )
    p.add_argument(
        "--offload-streams",
        default="off",
        choices=["off", "on", "both"],
        help="keep the hidden-state streams on the CPU between blocks",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 for float32 matrix products")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="print the top CUDA ops (torch.profiler) and featcal functions (cProfile) of the first setting",
    )
    p.add_argument(
        "--streamed",
        type=int,
        default=0,
        metavar="WIDTH",
        help="also time the streamed path on a Llama of this width (0: not; e.g. 1024, about 800 MB per model)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="smoke test: tiny model, 3 experts, 16 examples, batch 8 (runs on a CPU)"
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.size, args.experts, args.examples, args.batch = "tiny", 3, 16, "8"
        args.streamed = args.streamed and 128
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def _setting(zoo: C.Zoo, cfg: FeatCalConfig, args, label: dict) -> dict:
    """Warm up, then ``--repeats`` interleaved (reference, calibration) pairs; one table row."""
    C.forward_reference(zoo.with_examples(zoo.batch))
    C.calibrate_once(zoo.with_examples(zoo.batch), cfg)
    refs, runs = [], []
    for _ in range(args.repeats):
        refs.append(C.forward_reference(zoo).wall)
        run, model, _ = C.calibrate_once(zoo, cfg, mem_probe=C.MemProbe(args.device))
        del model
        runs.append(run)
        print(
            f"    run: {run.seconds:.2f} s (stats {run.stats:.2f}, solve {run.solve:.2f}, advance "
            f"{run.advance:.2f}); reference {refs[-1]:.2f} s",
            file=sys.stderr,
            flush=True,
        )
    run = C.median_run(runs)
    ref = C.Timing(statistics.median(refs), float("nan"))
    row = C.cost_row(f"{zoo.size}", zoo, ref, run, cpu_ratio=False, **label)
    row["peak mem"] = f"+{C.fmt_bytes(run.peak_mem)}"
    if torch.device(args.device).type == "cuda":
        row["peak mem"] += f" ({C.fmt_bytes(torch.cuda.max_memory_allocated())} total)"
    row["runs"] = ", ".join(f"{r.seconds:.2f}" for r in runs)
    print(
        f"  {label}: calibrate {run.seconds:.2f} s = {run.seconds / ref.wall:.2f}x fwd {ref.wall:.2f} s",
        file=sys.stderr,
        flush=True,
    )
    return row


def _profile(zoo: C.Zoo, cfg: FeatCalConfig, args, label: dict) -> str:
    """Top device ops (torch.profiler) and featcal functions (cProfile) of one run of a setting."""
    head = f"{zoo.size}, batch {zoo.batch}, {label}"
    ops = C.profile_ops(lambda: C.calibrate_once(zoo, cfg), args.device, rows=20)
    py = C.profile_python(lambda: C.calibrate_once(zoo, cfg), rows=20)
    return f"\n### top ops of one run ({head})\n\n{ops}\n### featcal functions, cProfile ({head})\n\n{py}"


def _streamed_rows(args) -> list[dict]:
    """The three ways of ``--streamed`` (see the module's docstring), one row each."""
    import copy
    import shutil
    import tempfile
    import time

    from streaming_memory import PER_TASK, write_llama_zoo
    from transformers import LlamaForCausalLM

    from featcal import StreamOptions, calibrate, calibrate_checkpoints, merge
    from featcal.model.checkpoints import load_token_data

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    root = Path(tempfile.mkdtemp(prefix="featcal-gpu-stream-"))
    rows = []
    try:
        model_bytes = write_llama_zoo(root, args.streamed, args.experts)
        tasks = [f"task{i}" for i in range(args.experts)]
        data = load_token_data(root / "data.safetensors", batch_size=PER_TASK)
        cfg = FeatCalConfig.llama("8b")
        base = LlamaForCausalLM.from_pretrained(root / "base").eval()
        experts = {t: LlamaForCausalLM.from_pretrained(root / t).eval() for t in tasks}
        merged = copy.deepcopy(base)
        sds = {t: m.state_dict() for t, m in experts.items()}
        merged.load_state_dict(merge("task_arithmetic", base.state_dict(), sds, scale=0.3))
        results = {}

        def timed(label, fn):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            sd = fn()
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            results[label] = {k: v.detach().cpu() for k, v in sd.items()}
            ref = next(iter(results.values()))
            diff = max(
                float((results[label][k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
                for k, w in ref.items()
                if k in results[label]
            )
            rows.append(
                {
                    "way": label,
                    "models": f"{args.experts + 2} x {C.fmt_bytes(model_bytes)}",
                    "time": f"{seconds:.2f} s",
                    "peak GPU": C.fmt_bytes(torch.cuda.max_memory_allocated()) if cuda else "-",
                    "max rel diff": f"{diff:.1e}",
                }
            )
            print(f"  streamed table: {rows[-1]}", file=sys.stderr, flush=True)

        def on_device():
            moved = [m.to(device) for m in (merged, base, *experts.values())]
            model, _ = calibrate(
                moved[0],
                base=moved[1],
                experts=dict(zip(tasks, moved[2:])),
                calib_data=data,
                config=cfg,
                progress=False,
            )
            for m in (merged, base, *experts.values()):
                m.to("cpu")
            return model.state_dict()

        def one_block_at_a_time():
            model, _ = calibrate(
                merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, device=device
            )
            return model.state_dict()

        def streamed():
            out = root / "out"
            calibrate_checkpoints(
                root / "base",
                {t: root / t for t in tasks},
                merge=("task_arithmetic", {"scale": 0.3}),
                calib_data=data,
                config=cfg,
                out=out,
                options=StreamOptions(device=device, force=True, progress=False),
            )
            return LlamaForCausalLM.from_pretrained(out).state_dict()

        timed("in memory, models on the device", on_device)
        timed("in memory, models on the CPU, one block on the device", one_block_at_a_time)
        timed("streamed from checkpoints", streamed)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    print(C.environment(args.device), flush=True)
    print(f"TF32 {'on' if args.tf32 else 'off'}", flush=True)
    print(
        f"{args.size}: {args.experts} experts, {args.examples} examples per task, "
        f"{C.tokens_per_example(args.size)} tokens per example",
        flush=True,
    )
    offloads = {"off": [False], "on": [True], "both": [False, True]}[args.offload_streams]
    batches = [int(b) for b in args.batch.split(",")]
    rows: list[dict] = []
    profiled: list[str] = []
    for dname in args.dtype.split(","):
        base_zoo = C.build_zoo(
            args.size, args.experts, args.examples, batches[0], device=args.device, dtype=DTYPES[dname.strip()]
        )
        models_bytes = sum(
            p.numel() * p.element_size()
            for m in [base_zoo.base, base_zoo.merged, *base_zoo.experts.values()]
            for p in m.parameters()
        )
        print(
            f"  {dname}: {args.experts + 2} models, {C.fmt_bytes(models_bytes)} of parameters",
            file=sys.stderr,
            flush=True,
        )
        for batch, offload in itertools.product(batches, offloads):
            zoo = base_zoo.with_examples(args.examples, batch)
            cfg = FeatCalConfig.clip(stats_dtype=DTYPES[args.stats_dtype], offload_streams=offload)
            label = {"dtype": f"{dname}/{args.stats_dtype} stats", "offload": "yes" if offload else "no"}
            rows.append(_setting(zoo, cfg, args, label))
            if args.profile and not profiled:
                profiled.append(_profile(zoo, cfg, args, label))
                print(profiled[-1], flush=True)
        del base_zoo
    print()
    print(C.markdown_table(rows))
    if args.streamed:
        print(
            f"\nLlama width {args.streamed}, 16 blocks, {args.experts} experts, Task Arithmetic 0.3, llama-8b preset:\n"
        )
        print(C.markdown_table(_streamed_rows(args)))


if __name__ == "__main__":
    main()

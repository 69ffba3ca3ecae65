"""What one exact FeatCal run costs, as a multiple of one forward pass.

For each model size and examples-per-task setting, prints a markdown row with:

- ``reference fwd``: ONE forward pass of the calibration data through the merged
  model and the experts -- ``merged(x_i)`` and ``expert_i(x_i)`` for every task
  ``i``, the same batches (the least any method that looks at both must pay);
- ``calibrate``: the wall clock of one end-to-end ``featcal.calibrate`` (input
  validation, the model copy and the stems included; model building excluded);
- its phases from the report, summed over blocks (``stats``: merged and expert
  blocks on the streams plus the statistics; ``solve``; ``advance``: the
  calibrated block on the calibrating streams) and ``other`` (the rest:
  validation, model copy, stems), each in seconds and as a multiple of the
  reference;
- ``peak mem``: the peak memory of the call above its start -- on a CPU the
  process's resident set size sampled every 2 ms (after ``gc`` and
  ``malloc_trim``), on a GPU ``torch.cuda.max_memory_allocated``.

Models are random HF ``CLIPVisionModel``s (``_common.SIZES``); experts are seeded
perturbations of the base, merged by Task Arithmetic (scale 0.3); the setting is
``FeatCalConfig.clip()``. Each size is warmed up once (a one-block model of the
same widths) before timing. Small sizes report the median of ``--repeats`` runs,
each reference pass taken next to its calibration (interleaved, so that load
from other processes hits both alike); ViT-B/32 runs ``--repeats-big`` times the
same way (default once: then its reference is the mean of one pass before and one
after).

Target: ``calibrate / fwd`` at most 4x (the floor is about 2.6-3x for a ViT:
the snapshot pass costs one reference, the advance half of one, and the
statistics' Gram matrices about one more). The solve and the per-task products
are a fixed cost per block and task, so the ratio falls as examples grow;
``--examples 8,32`` shows both ends (ViT-B/32 with 4 experts x 8 examples: about
3.7x counting multiply-adds, the solve 0.7x of it).

    python benchmarks/calibration_cost.py                      # ViT-B/32, demo and tiny; 8 and 32 examples
    python benchmarks/calibration_cost.py --models tiny --repeats 9
    python benchmarks/calibration_cost.py --models vit-b32 --repeats-big 3   # medians on a noisy machine
    python benchmarks/calibration_cost.py --models vit-b32 --examples 32 --experts 4 --threads 2 --profile
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

from featcal import FeatCalConfig

BIG = {"vit-b32"}  # --repeats-big timed runs each (the rest: median of --repeats)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="vit-b32,demo,tiny", help=f"comma-separated sizes out of {sorted(C.SIZES)}")
    p.add_argument("--examples", default="8,32", help="examples per task, comma-separated")
    p.add_argument("--experts", type=int, default=4, help="number of experts (tasks)")
    p.add_argument("--batch", type=int, default=16, help="examples per batch")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of the small sizes (median)")
    p.add_argument(
        "--repeats-big",
        type=int,
        default=1,
        help="timed runs of ViT-B/32 (median; default 1: one run, minutes each on a CPU)",
    )
    p.add_argument(
        "--profile", action="store_true", help="also print the top torch ops and featcal functions of one run per size"
    )
    return p.parse_args(argv)


def _warm_up(size: str, args, cfg: FeatCalConfig) -> None:
    """One calibration of a one-block model of the same widths (kernels, allocator, thread pools)."""
    zoo = C.build_zoo(size, args.experts, args.batch, args.batch, device=args.device, layers=1)
    C.forward_reference(zoo)
    C.calibrate_once(zoo, cfg)


def _measure(zoo: C.Zoo, cfg: FeatCalConfig, repeats: int, device: str) -> tuple[C.Timing, C.CalRun]:
    """``(reference, calibration run)`` as the module docstring describes."""
    if repeats <= 1:
        before = C.forward_reference(zoo)
        run, model, _ = C.calibrate_once(zoo, cfg, mem_probe=C.MemProbe(device))
        del model
        after = C.forward_reference(zoo)
        return C.Timing((before.wall + after.wall) / 2, (before.cpu + after.cpu) / 2), run
    refs, runs = [], []
    for _ in range(repeats):
        refs.append(C.forward_reference(zoo))
        runs.append(C.calibrate_once(zoo, cfg)[0])
    mem, model, _ = C.calibrate_once(zoo, cfg, mem_probe=C.MemProbe(device))  # untimed
    del model
    run = C.median_run(runs)
    run.peak_mem = mem.peak_mem
    ref = C.Timing(statistics.median(r.wall for r in refs), statistics.median(r.cpu for r in refs))
    return ref, run


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = FeatCalConfig.clip()
    sizes = [s.strip() for s in args.models.split(",") if s.strip()]
    examples = sorted(int(n) for n in args.examples.split(","))
    print(C.environment(args.device), flush=True)
    rows = []
    for size in sizes:
        _warm_up(size, args, cfg)
        full = C.build_zoo(size, args.experts, max(examples), args.batch, device=args.device)
        label = f"{size} ({C.tokens_per_example(size)} tok, {full.n_params / 1e6:.1f}M params)"
        for n in examples:
            zoo = full.with_examples(n)
            repeats = args.repeats_big if size in BIG else args.repeats
            ref, run = _measure(zoo, cfg, repeats, args.device)
            rows.append(C.cost_row(label, zoo, ref, run, cpu_ratio=args.device == "cpu", repeats=repeats))
            print(
                f"  {size}, {n} examples/task: calibrate {run.seconds:.2f} s = "
                f"{run.seconds / ref.wall:.2f}x fwd {ref.wall:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        if args.profile:
            zoo = full.with_examples(max(examples))
            print(f"\n### {size}, {zoo.n_examples} examples/task: top torch ops\n")
            print(C.profile_ops(lambda: C.calibrate_once(zoo, cfg), args.device))
            print(f"\n### {size}: featcal functions (cProfile)\n")
            print(C.profile_python(lambda: C.calibrate_once(zoo, cfg)))
        del full
    print(f"\n(load average at the end {os.getloadavg()[0]:.1f})\n")
    print(C.markdown_table(rows))


if __name__ == "__main__":
    main()

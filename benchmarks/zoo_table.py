"""Per-task test accuracy on a zoo: base, experts, merges and Task Arithmetic + FeatCal.

    python benchmarks/zoo_table.py                      # the embedded demo zoo
    python benchmarks/zoo_table.py --zoo demo-fashion --n-per-task 128
    python benchmarks/zoo_table.py --zoo real-text --preset none

    python benchmarks/zoo_table.py --tuned 0.005,2.5,0.3   # plus a row at (lam, rho, alpha)

Prints one markdown table (rows: base, experts, simple average, Task
Arithmetic 0.3, TIES, TA + FeatCal with the ``--preset`` (one of featcal.config.PRESETS, default
CLIP) and, with ``--tuned``,
at the setting ``featcal tune --report`` chose) with the average and the
expert-normalised average, the share of the Task-Arithmetic-to-experts gap that
FeatCal closes, then the zoo's content hash, build time, size and the timings of
this run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's featcal, not an installed one
import torch

from featcal import FeatCalConfig, calibrate
from featcal.config import PRESETS
from featcal.zoo import load_any
from featcal.zoo.core import evaluate
from featcal.zoo.score.scores import average, expert_accuracies, normalized


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="demo")
    ap.add_argument("--n-per-task", type=int, default=256)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--split", default="test")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: fastest for this small model on a shared machine)",
    )
    ap.add_argument(
        "--preset",
        default="clip",
        choices=(*PRESETS, "default"),
        help="FeatCal preset (featcal.config.PRESETS): clip (the default), none (FeatCalConfig(): no token weights; "
        "'default' is its old name here), ...",
    )
    ap.add_argument(
        "--tuned",
        default=None,
        help="lam,rho,alpha: add a row at this setting (the preset's switches and token weights), "
        "e.g. the one `featcal tune --zoo demo --report` chose on the val split",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    zoo = load_any(args.zoo, progress=False)
    t_load = time.perf_counter() - t0
    data = zoo.calib_data(args.n_per_task, seed=args.seed)
    ta = zoo.merged("task_arithmetic", scale=0.3)
    rows, timings = {}, {}

    t0 = time.perf_counter()
    rows["base"] = evaluate(zoo.base, zoo, split=args.split)
    timings["evaluate one model"] = time.perf_counter() - t0
    rows["experts"] = expert_accuracies(zoo, split=args.split)
    rows["average"] = evaluate(zoo.merged("average"), zoo, split=args.split)
    rows["TA (0.3)"] = evaluate(ta, zoo, split=args.split)
    rows["TIES (0.2, 0.3)"] = evaluate(zoo.merged("ties", density=0.2, scale=0.3), zoo, split=args.split)
    preset = "none" if args.preset == "default" else args.preset
    settings = [(f"TA + FeatCal ({preset} preset)", FeatCalConfig.preset(preset))]
    if args.tuned and args.tuned != "none":
        tuned = dict(zip(("lam", "rho", "alpha"), (float(v) for v in args.tuned.split(","))))
        name = "TA + FeatCal (tuned on val: " + ", ".join(f"{k}={v:g}" for k, v in tuned.items()) + ")"
        settings.append((name, FeatCalConfig.preset(preset, **tuned)))
    for name, cfg in settings:
        t0 = time.perf_counter()
        model, _ = calibrate(ta, base=zoo.base, experts=zoo.experts, calib_data=data, config=cfg, progress=False)
        timings[f"calibrate {name}"] = time.perf_counter() - t0
        rows[name] = evaluate(model, zoo, split=args.split)

    print(_table(rows, rows["experts"]))
    print()
    ta_avg, expert_avg = average(rows["TA (0.3)"]), average(rows["experts"])
    for name, _ in settings:
        closed = (average(rows[name]) - ta_avg) / (expert_avg - ta_avg)
        print(f"- {name} closes {100 * closed:.0f}% of the gap from Task Arithmetic to the experts")
    meta = zoo.meta
    if "content_sha256" in meta:
        print(f"- zoo content sha256 {meta['content_sha256'][:16]}, at {meta.get('path', '?')}")
    facts = [
        f"zoo {zoo.name}: {len(zoo.tasks)} tasks, {args.split} split, "
        f"FeatCal on {args.n_per_task} calibration examples per task (seed {args.seed})"
    ]
    if "build_seconds" in meta:
        facts.append(f"build time {meta['build_seconds']:.0f} s, disk {meta['disk_bytes'] / 1e6:.1f} MB")
    facts.append(f"load from cache {t_load:.1f} s; {args.threads} torch thread(s)")
    facts += [f"{k} {v:.1f} s" for k, v in timings.items()]
    print("\n".join(f"- {f}" for f in facts))


def _table(rows: dict, experts: dict) -> str:
    tasks = list(experts)
    lines = ["| model | " + " | ".join(tasks) + " | avg | norm. avg |", "|---|" + "---:|" * (len(tasks) + 2)]
    for name, accs in rows.items():
        cells = " | ".join(f"{accs[t]:.1f}" for t in tasks)
        lines.append(f"| {name} | {cells} | {average(accs):.1f} | {average(normalized(accs, experts)):.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

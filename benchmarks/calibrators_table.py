"""Task Arithmetic and the trained post-merging calibrators on top of it, on a zoo.

    python benchmarks/calibrators_table.py --escal-epochs 50 --surgery-v2-steps 250 \
        --methods escal,escal@21,surgery,surgery_v2  # 2 CPU cores; r = 21: the paper's r / d
    python benchmarks/calibrators_table.py --device cuda  # the methods' defaults

Prints one markdown table: per task and on average, the test accuracy of the experts, TA (0.3),
TA + FeatCal (CLIP preset, on the same calibration examples), TA + ESCal, TA + Surgery and
TA + SurgeryV2 (each task scored with its own modules), with each calibrator's training time,
added numbers per task (trained / stored, and stored as a share of the model) and measured
inference overhead (one forward pass of a test batch, median of 15).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from featcal import ESCalOptions, FeatCalConfig, SurgeryOptions, calibrate, escal, surgery, surgery_v2  # noqa: E402
from featcal.zoo import load_any  # noqa: E402
from featcal.zoo.core import evaluate  # noqa: E402
from featcal.zoo.score.scores import average, expert_accuracies, normalized  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="demo")
    ap.add_argument("--n-per-task", type=int, default=64, help="calibration examples per task")
    ap.add_argument("--seed", type=int, default=42, help="calibration draw and training seed")
    ap.add_argument("--escal-rank", type=int, default=128)
    ap.add_argument("--escal-epochs", type=int, default=200)
    ap.add_argument("--escal-lr", type=float, default=None, help="default: escal's")
    ap.add_argument("--surgery-steps", type=int, default=1000, help="default: the authors' 1000 per task")
    ap.add_argument("--surgery-v2-steps", type=int, default=1000, help="default: the authors' 1000 per task")
    ap.add_argument("--tokens", default="all", help="the tokens ESCal's loss reads: all, or cls (the first)")
    ap.add_argument(
        "--methods", default="escal,surgery,surgery_v2", help="comma-separated; escal@R: ESCal at rank R (another row)"
    )
    ap.add_argument("--repeats", type=int, default=15, help="timed forward passes for the overhead (median)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--no-featcal", dest="featcal", action="store_false", help="leave out the TA + FeatCal row")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--overhead-batch", type=int, default=64, help="test images in the timed batch")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    zoo = load_any(args.zoo, progress=False)
    data = zoo.calib_data(args.n_per_task, seed=args.seed)
    ta = zoo.merged("task_arithmetic", scale=0.3)
    experts = expert_accuracies(zoo)
    rows = {"experts": (experts, None), "TA (0.3)": (evaluate(ta, zoo), None)}
    if args.featcal:
        t0 = time.perf_counter()
        cal, _ = calibrate(ta, base=zoo.base, experts=zoo.experts, calib_data=data, config=FeatCalConfig.clip())
        facts = (f"{time.perf_counter() - t0:.1f} s", "0 / 0", "+0%", "lam=0.05, rho=2, alpha=0.3")
        rows["TA + FeatCal (CLIP preset)"] = (evaluate(cal, zoo), facts)
    common = dict(seed=args.seed, device=args.device, progress=True)
    escal_lr = {} if args.escal_lr is None else {"lr": args.escal_lr}

    def run(method: str, rank: int | None):
        if method == "escal":
            rank = rank or args.escal_rank
            kw = dict(rank=rank, epochs=args.escal_epochs, tokens=args.tokens, **escal_lr, **common)
            return escal(ta, zoo.experts, data, ESCalOptions(**kw))
        if method == "surgery":
            return surgery(ta, zoo.experts, data, SurgeryOptions(steps=args.surgery_steps, **common))
        return surgery_v2(ta, zoo.experts, data, SurgeryOptions(steps=args.surgery_v2_steps, **common))

    names = {"escal": "TA + ESCal", "surgery": "TA + Surgery", "surgery_v2": "TA + SurgeryV2"}
    probe = zoo.split(zoo.tasks[0], "test")[0][: args.overhead_batch]
    for spec in args.methods.split(","):
        method, _, rank = spec.partition("@")
        t0 = time.perf_counter()
        cal = run(method, int(rank) if rank else None)
        wall = time.perf_counter() - t0
        accs = {t: evaluate(cal.for_task(t), zoo, tasks=[t])[t] for t in zoo.tasks}
        over = cal.measure_overhead(probe, repeats=args.repeats)
        added = cal.added_parameters
        t0task = added["per_task"][zoo.tasks[0]]
        facts = (
            f"{wall:.1f} s",
            f"{t0task['trained']:,} / {t0task['stored']:,} ({100 * added['stored_fraction']:.1f}%)",
            f"{100 * over['overhead']:+.0f}%",
            ", ".join(f"{k}={v}" for k, v in cal.settings.items() if k in ("rank", "epochs", "steps", "lr", "batch")),
        )
        rows[names[method] + (f" (r={cal.settings['rank']})" if rank else "")] = (accs, facts)
    print(_table(rows, experts))
    print()
    n_params = sum(p.numel() for p in ta.parameters())
    sha = str(zoo.meta.get("content_sha256", "?"))[:16]
    print(
        f"- zoo {zoo.name} (content sha256 {sha}): {len(zoo.tasks)} tasks, test split, model {n_params:,} parameters; "
        f"{args.n_per_task} calibration examples per task (seed {args.seed}); device {args.device}, "
        f"{args.threads} torch thread(s); ESCal's loss on {args.tokens} tokens; "
        f"overhead on a batch of {len(probe)} test images"
    )


def _table(rows: dict, experts: dict) -> str:
    tasks = list(experts)
    head = [
        "model",
        *tasks,
        "avg",
        "norm. avg",
        "train time",
        "added per task (trained / stored)",
        "overhead",
        "setting",
    ]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for name, (accs, facts) in rows.items():
        cells = [f"{accs[t]:.1f}" for t in tasks]
        cells += [f"{average(accs):.1f}", f"{average(normalized(accs, experts)):.1f}"]
        cells += list(facts) if facts else ["", "", "", ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

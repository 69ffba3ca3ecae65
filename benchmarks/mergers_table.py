"""Every merger featcal offers, on a zoo: per-task test accuracy and the time each merge took.

    python benchmarks/mergers_table.py                  # the embedded demo zoo, 1 torch thread
    python benchmarks/mergers_table.py --n-per-task 64  # RegMean / RegMean++ on fewer examples

Rows: the base and the experts for reference, then each merger of ``featcal.MERGERS`` and
``featcal.MERGERS_WITH_DATA`` at its default parameters (Task Arithmetic and TIES at the
README's 0.3), one run each. The data-using ones read ``--n-per-task`` examples per task
of the zoo's calib split (seed ``--seed``). "merge s" is the wall clock of the merge alone
(state dicts to a loaded model; evaluation not included).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

from featcal import merge_with_data
from featcal.zoo import load_any
from featcal.zoo.core import evaluate
from featcal.zoo.score.scores import average, expert_accuracies, normalized

# (row label, method, parameters): data-free first, then the data-using ones.
DATA_FREE = [
    ("average", "average", {}),
    ("Task Arithmetic (0.3)", "task_arithmetic", {"scale": 0.3}),
    ("TIES (0.2, 0.3)", "ties", {"density": 0.2, "scale": 0.3}),
    ("Iso-C (1.0)", "iso_c", {}),
    ("Iso-CTS (1.0, 0.8)", "iso_cts", {}),
    ("TSV (1.0)", "tsv", {}),
    ("WUDI (400 steps, lr 1e-5)", "wudi", {"progress": False}),
    # The learning rate is absolute: the demo zoo's task vectors are far larger than CLIP's.
    ("WUDI (400 steps, lr 1e-3)", "wudi", {"lr": 1e-3, "progress": False}),
]
WITH_DATA = [
    ("RegMean (0.95)", "regmean", {}),
    ("RegMean (0.1)", "regmean", {"reduce_nondiag": 0.1}),
    ("RegMean++ (0.95)", "regmean_plusplus", {}),
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="demo")
    ap.add_argument("--n-per-task", type=int, default=256, help="calibration examples per task (data-using mergers)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--split", default="test")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    zoo = load_any(args.zoo, progress=False)
    data = zoo.calib_data(args.n_per_task, seed=args.seed)
    experts = expert_accuracies(zoo, split=args.split)
    rows: dict[str, tuple[dict, float | None]] = {
        "base": (evaluate(zoo.base, zoo, split=args.split), None),
        "experts": (experts, None),
    }
    for label, method, params in DATA_FREE:
        t0 = time.perf_counter()
        model = zoo.merged(method, **params)
        seconds = time.perf_counter() - t0
        rows[label] = (evaluate(model, zoo, split=args.split), seconds)
    for label, method, params in WITH_DATA:
        t0 = time.perf_counter()
        model = merge_with_data(method, base=zoo.base, experts=zoo.experts, calib_data=data, progress=False, **params)
        seconds = time.perf_counter() - t0
        rows[label] = (evaluate(model, zoo, split=args.split), seconds)

    tasks = list(experts)
    print("| model | " + " | ".join(tasks) + " | avg | norm. avg | merge s |")
    print("|---|" + "---:|" * (len(tasks) + 3))
    for name, (accs, seconds) in rows.items():
        cells = " | ".join(f"{accs[t]:.1f}" for t in tasks)
        secs = "" if seconds is None else f"{seconds:.2f}"
        print(f"| {name} | {cells} | {average(accs):.1f} | {average(normalized(accs, experts)):.1f} | {secs} |")
    print()
    print(
        f"- zoo {zoo.name} (content sha256 {zoo.meta.get('content_sha256', '?')}), {args.split} split; "
        f"data-using mergers on {args.n_per_task} calib examples per task (seed {args.seed}); "
        f"{torch.get_num_threads()} torch thread(s)"
    )


if __name__ == "__main__":
    main()

"""How close the instant preview is to an exact FeatCal run, at settings near and far
from the one whose statistics it re-solves.

One exact run at the paper's CLIP setting (``FeatCalConfig.clip()``: lam 0.05, rho 2.0,
alpha 0.3) keeps its statistics. For every setting: the preview (re-solved from those
statistics, features of the anchor run) and an exact forward-order run; compared by

- ``rel. dist``: ``||theta_preview - theta_exact||_F / ||theta_exact||_F`` over every
  calibrated parameter, and the same per block (block 0 is always exact: its
  features do not depend on the setting);
- accuracy (percent, on ``--split``) per task and on average.

    python benchmarks/preview_vs_exact.py                       # demo zoo, n=64 per task, test split
    python benchmarks/preview_vs_exact.py --n-calib 256 --split val
    python benchmarks/preview_vs_exact.py --settings "0.05,2,0.3;1,0.5,0"
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

from featcal import FeatCalConfig, Setting, calibrate
from featcal.model import arch
from featcal.sweep.jobs import preview_distance
from featcal.zoo import load_any as load_zoo
from featcal.zoo.core import evaluate

# (label, lam, rho, alpha): the paper's setting first, then near and far from it.
SETTINGS = [
    ("paper CLIP (anchor)", 0.05, 2.0, 0.3),
    ("reference run", 0.05, 2.2, 0.25),
    ("lam x10", 0.5, 2.0, 0.3),
    ("lam /10", 0.005, 2.0, 0.3),
    ("rho 1 (merged anchor)", 0.05, 1.0, 0.3),
    ("alpha 0.6", 0.05, 2.0, 0.6),
    ("far: lam 1, rho 0.5, alpha 0", 1.0, 0.5, 0.0),
    ("far: lam 1e-3, rho 3, alpha 0.9", 1e-3, 3.0, 0.9),
]


def block_distances(preview, point, exact) -> list[float]:
    """Relative Frobenius distance of the preview to the exact run, per block."""
    _, blks = arch.resolve_blocks(exact, preview.blocks_path)
    num = [0.0] * len(blks)
    den = [0.0] * len(blks)
    for b, t, W, bias in preview.params(Setting(*point)):
        for p, e in zip((W, bias), arch.get_params(blks[b], t)):
            if p is not None and e is not None:
                num[b] += float((p.double() - e.double()).pow(2).sum())
                den[b] += float(e.double().pow(2).sum())
    return [math.sqrt(n / d) if d else 0.0 for n, d in zip(num, den)]


def parse_settings(text: str) -> list[tuple]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        lam, rho, alpha = (float(v) for v in part.split(","))
        out.append((f"lam {lam:g}, rho {rho:g}, alpha {alpha:g}", lam, rho, alpha))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="demo", help="'demo', a zoo YAML spec or a zoo directory")
    ap.add_argument("--n-calib", type=int, default=64, help="calibration examples per task (calib split, seed 42)")
    ap.add_argument("--split", default="test", help="split the accuracies are measured on")
    ap.add_argument("--settings", default=None, help="'lam,rho,alpha;...' (default: 8 settings, anchor first)")
    ap.add_argument("--device", default="cpu", help="torch device of the models (default: cpu)")
    args = ap.parse_args()

    zoo = load_zoo(args.zoo, progress=False, device=args.device)
    merged = zoo.merged("task_arithmetic", scale=0.3)
    data = zoo.calib_data(args.n_calib, seed=42)
    anchor_cfg = FeatCalConfig.clip()
    t0 = time.perf_counter()
    anchor, report = calibrate(
        merged, base=zoo.base, experts=zoo.experts, calib_data=data, config=anchor_cfg, keep_stats=True, progress=False
    )
    anchor_s = time.perf_counter() - t0
    pv = report.preview_state
    t0 = time.perf_counter()
    pv.prepare()
    prepare_s = time.perf_counter() - t0
    scratch = copy.deepcopy(anchor)
    acc_merged = evaluate(merged, zoo, split=args.split)

    settings = parse_settings(args.settings) if args.settings else SETTINGS
    summary, per_task = [], []
    for label, lam, rho, alpha in settings:
        point = (lam, rho, alpha)
        t0 = time.perf_counter()
        pv.load_into(scratch, *point)
        preview_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        exact, _ = calibrate(
            merged,
            base=zoo.base,
            experts=zoo.experts,
            calib_data=data,
            config=anchor_cfg.with_(lam=lam, rho=rho, alpha=alpha),
            progress=False,
        )
        exact_s = time.perf_counter() - t0
        acc_p, acc_e = evaluate(scratch, zoo, split=args.split), evaluate(exact, zoo, split=args.split)
        avg_p, avg_e = (sum(a.values()) / len(a) for a in (acc_p, acc_e))
        summary.append(
            {
                "setting": label,
                "λ": f"{lam:g}",
                "ρ": f"{rho:g}",
                "α": f"{alpha:g}",
                "rel. dist": f"{preview_distance(pv, point, exact):.4f}",
                "per block": " / ".join(f"{d:.3f}" for d in block_distances(pv, point, exact)),
                "avg acc preview": f"{avg_p:.2f}",
                "avg acc exact": f"{avg_e:.2f}",
                "Δ (pp)": f"{avg_p - avg_e:+.2f}",
                "preview": C.fmt_s(preview_s),
                "exact": C.fmt_s(exact_s),
            }
        )
        per_task.append(
            {
                "setting": label,
                **{t: f"{acc_p[t]:.1f} / {acc_e[t]:.1f}" for t in zoo.tasks},
                "avg": f"{avg_p:.2f} / {avg_e:.2f}",
            }
        )
        print(f"{label}: preview {avg_p:.2f} / exact {avg_e:.2f} ({exact_s:.1f} s)", file=sys.stderr, flush=True)

    print(
        f"## Preview vs exact FeatCal: {zoo.name} zoo, {len(zoo.tasks)} tasks, Task Arithmetic (0.3), "
        f"n={args.n_calib} per task, accuracy on `{args.split}`\n"
    )
    print(C.environment(args.device))
    print(f"\nZoo content sha256 {str(zoo.meta.get('content_sha256', '?'))[:16]}.")
    print(
        f"\nAnchor exact run (statistics kept) {C.fmt_s(anchor_s)}, eigendecompositions {C.fmt_s(prepare_s)}. "
        f"Merged model: avg {sum(acc_merged.values()) / len(acc_merged):.2f}%.\n"
    )
    print(C.markdown_table(summary))
    print("\nPer task, preview / exact accuracy (%):\n")
    print(C.markdown_table(per_task))


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()

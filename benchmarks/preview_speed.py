"""How fast the instant preview re-solves every module for a new (lam, rho, alpha).

For each model size: one exact run with ``keep_stats=True``, then

- ``prepare``: the one-off eigendecompositions (``Preview.prepare()``; median of
  3 fresh ``Preview`` objects over the same kept statistics);
- ``params``: ``report.preview_state.params(Setting(lam, rho, alpha))`` for ALL modules,
  median (and max) of 20 calls cycling through different settings, after
  ``prepare()`` -- what a slider move costs before the model is touched;
- ``load_into``: the same plus writing the parameters into a model (median of 20).

Target: ``params`` under 50 ms on a 2-core CPU for the demo-zoo-sized model.

    python benchmarks/preview_speed.py                      # tiny and demo sizes
    python benchmarks/preview_speed.py --models demo,vit-b32 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

from featcal import FeatCalConfig, Setting
from featcal.engine.preview import Preview

TASKS = {"tiny": 3, "demo": 7, "vit-b32": 8}  # experts per size (the demo zoo has 7 tasks)
# Settings the timed calls cycle through (lam, rho, alpha), so nothing is reused between calls.
GRID = list(itertools.product([1e-3, 0.05, 1.0], [0.5, 2.0], [0.0, 0.3, 0.6]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,demo", help=f"comma-separated sizes out of {sorted(C.SIZES)}")
    p.add_argument("--examples", type=int, default=16, help="examples per task of the exact run")
    p.add_argument("--calls", type=int, default=20, help="timed preview calls (median)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own)")
    return p.parse_args(argv)


def _times(fn, calls: int) -> list[float]:
    out = []
    for i in range(calls):
        lam, rho, alpha = GRID[i % len(GRID)]
        t0 = time.perf_counter()
        fn(lam, rho, alpha)
        out.append(time.perf_counter() - t0)
    return out


def measure(size: str, args) -> dict:
    zoo = C.build_zoo(size, TASKS[size], args.examples, 16)
    _, _, report = C.calibrate_once(zoo, FeatCalConfig.clip(), keep_stats=True)
    st = report.preview_state
    prep = []
    for _ in range(3):
        fresh = Preview(st.template, st.blocks_path, st.entries, st.config)
        t0 = time.perf_counter()
        fresh.prepare()
        prep.append(time.perf_counter() - t0)
    fresh.params(Setting(0.05, 2.0, 0.3))  # warm-up call
    params = _times(fresh.params, args.calls)
    target = copy.deepcopy(st.template)
    load = _times(lambda lam, rho, alpha: fresh.load_into(target, Setting(lam, rho, alpha)), args.calls)
    n_lin = sum(e[1].kind == "linear" for e in st.entries)
    return {
        "model": f"{size} ({zoo.n_params / 1e6:.2f}M params)",
        "tasks": TASKS[size],
        "modules": f"{len(st.entries)} ({n_lin} linear)",
        "prepare (one-off)": C.fmt_s(statistics.median(prep)),
        "params() median": f"**{C.fmt_s(statistics.median(params))}**",
        "params() max": C.fmt_s(max(params)),
        "load_into() median": C.fmt_s(statistics.median(load)),
        "under 50 ms": "yes" if statistics.median(params) < 0.05 else "no",
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(C.environment("cpu"), flush=True)
    rows = [measure(s.strip(), args) for s in args.models.split(",") if s.strip()]
    print(f"\n(load average at the end {os.getloadavg()[0]:.1f})\n")
    print(C.markdown_table(rows))


if __name__ == "__main__":
    main()

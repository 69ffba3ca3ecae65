"""Data-parallel FeatCal (featcal.engine.distributed): one process against N processes, in one run.

ViT-B/32-sized CLIP (random weights), 4 experts x 32 examples per task (batches of 8: 16 batches,
8 per rank on 2 ranks), the CLIP preset. Each configuration is timed over one ``featcal.calibrate``
call (model building excluded) in fresh processes: one process on one thread, then ``--ranks``
processes on one thread each (gloo on the CPU; NCCL, one GPU a rank, when the machine has that
many GPUs), solving each module on its owner rank and, for comparison, on every rank. Prints a
markdown table: time, speed-up over one process, the statistics' and the parameters' payload each
rank hands to the collectives per block, and each rank's peak memory (RSS on the CPU, peak
allocated on a GPU); also the load average.

    python3 benchmarks/distributed.py                    # ViT-B/32, 1 vs 2 processes
    python3 benchmarks/distributed.py --layers 2 --examples 8   # a quick smoke run
    python3 benchmarks/distributed.py --plan                     # the payload model: ViT-B/32, Llama-3.1-8B

``--plan`` prints, from the statistics forms the engine picks (``featcal.method.stats.cheapest_form``),
the elements each rank hands to the collectives per block and task (``C`` per input group, plus ``P``
or the modules' ``d x o`` sums); for ViT-B/32 it is checked against the measured payload.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import build_zoo, environment, fmt_bytes, markdown_table, setup_path  # noqa: E402

setup_path()


# (input width, output widths of the modules reading it) per block
GROUPS = {
    "vit-b32": [(768, [768, 768, 768]), (768, [768]), (768, [3072]), (3072, [768])],
    "llama-3.1-8b": [(4096, [4096, 1024, 1024]), (4096, [4096]), (4096, [14336, 14336]), (14336, [4096])],
}


def payload(groups, rows: int) -> int:
    """Elements per task and block each rank contributes (float32 matrices; the vectors and scalars
    are small): per group ``C``, and ``P`` or one ``d x o`` sum per module, by the form the engine picks
    at one alpha with every output seen."""
    from featcal.method.stats import cheapest_form

    total = 0
    for d, outs in groups:
        form = cheapest_form(d, outs, rows, 0, fixed_alpha=True)
        total += d * d + (d * d if form == "P" else sum(d * o for o in outs))
    return total


def _plan() -> None:
    rows = []
    for name, toks in (("vit-b32", 32 * 50), ("llama-3.1-8b", 32 * 2048), ("llama-3.1-8b", 256 * 2048)):
        n = payload(GROUPS[name], toks)
        rows.append({"model": name, "rows per task": toks, "payload per task and block": fmt_bytes(4 * n)})
    print(markdown_table(rows))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, args, solve: str, queue) -> None:
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = world > 1 or getattr(args, "group", False)  # device_check.py: a 1-rank NCCL group
    if group:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=600),
        )
    from featcal import FastPaths, FeatCalConfig, calibrate
    from featcal.engine import distributed
    from featcal.util.memory import peak_rss_mb

    zoo = build_zoo("vit-b32", args.experts, args.examples, args.batch, device=device, layers=args.layers)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    distributed.traffic.__init__()
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    cfg = FeatCalConfig.clip()
    _, report = calibrate(
        zoo.merged, base=zoo.base, experts=zoo.experts, calib_data=zoo.data, config=cfg,
        fast=FastPaths(dist_solve=solve), progress=False,
    )  # fmt: skip
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if world > 1:
        dist.barrier()
    tr = distributed.traffic
    blocks = max(tr.blocks, 1)
    peak = torch.cuda.max_memory_allocated(device) if cuda else peak_rss_mb() * 2**20
    queue.put((rank, seconds, tr.stats_bytes / blocks, tr.weight_bytes / blocks, peak, len(report.modules)))
    if group:
        dist.barrier()
        dist.destroy_process_group()


def _launch(world: int, args, solve: str) -> list[tuple]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, solve, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    return sorted(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--examples", type=int, default=32, help="examples per task")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=None, help="fewer blocks (a smoke run)")
    p.add_argument("--solve", default="owner,everywhere", help="the distributed solves to time")
    p.add_argument("--plan", action="store_true", help="only print the payload model")
    args = p.parse_args(argv)
    if args.plan:
        _plan()
        return 0
    args.device = "cuda" if torch.cuda.device_count() >= args.ranks else "cpu"
    os.environ["OMP_NUM_THREADS"] = "1"
    print(environment(args.device))
    rows = []
    one = _launch(1, args, "owner")[0]
    rows.append(_row("1 process", one[1], one[1], [one]))
    for solve in args.solve.split(","):
        res = _launch(args.ranks, args, solve)
        wall = max(r[1] for r in res)
        rows.append(_row(f"{args.ranks} processes, solve on {solve}", wall, one[1], res))
    blocks = args.layers or 12
    print(f"\nViT-B/32 ({blocks} blocks), {args.experts} experts x {args.examples} examples, batch {args.batch}")
    print(markdown_table(rows))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


def _row(label: str, wall: float, single: float, res: list[tuple]) -> dict:
    return {
        "run": label,
        "time": f"{wall:.1f} s",
        "speed-up": f"{single / wall:.2f}x",
        "statistics sent per block, per rank": " / ".join(fmt_bytes(r[2]) if r[2] else "0" for r in res),
        "parameters sent per block, per rank": " / ".join(fmt_bytes(r[3]) if r[3] else "0" for r in res),
        "peak memory per rank": " / ".join(fmt_bytes(r[4]) for r in res),
    }


if __name__ == "__main__":
    sys.exit(main())

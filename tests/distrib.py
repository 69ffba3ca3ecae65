"""Running a function on N gloo processes on this machine, for the distributed tests: free
ports, one torch thread a process, a timeout on every collective and on the whole run."""

from __future__ import annotations

import os
import socket
import sys
import traceback
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 1800  # stops a hang; a busy machine never waits this long
RUN_TIMEOUT_S = 1800


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str, fn, args, timeout_s: float) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except BaseException as err:  # the message goes to the parent, the process fails
        (Path(out) / f"rank{rank}.err").write_text(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        dist.destroy_process_group()  # (at once: the peers' next collective fails with it)
        raise
    # Every rank done before any tears its connections down: a rank that destroys its group while
    # a peer's gloo threads still talk to it may abort at exit (SIGABRT, seen in CI). A peer that
    # died (the fault tests) fails this barrier at once; that is no new error.
    try:
        dist.barrier()
    except RuntimeError:
        pass
    dist.destroy_process_group()


def run_ranks(world: int, fn, *args, tmp: Path, timeout_s: float = COLLECTIVE_TIMEOUT_S, check: bool = True):
    """``[fn(rank, *args) for rank in range(world)]``, each on its own process of one gloo group
    (``fn`` importable at top level; results through files in ``tmp``). With ``check``, a
    failed rank raises AssertionError with its message; else ``(results or None, errors)``."""
    tmp.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, str(tmp), fn, args, timeout_s), daemon=True)
        for r in range(world)
    ]
    # A spawned process first re-imports the parent's __main__; after an AppTest that is the app's
    # script (Streamlit runs it as __main__), which would run in every rank. Start them without one.
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        for p in procs:
            p.start()
    finally:
        sys.modules["__main__"] = main
    for p in procs:
        p.join(RUN_TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {r: (tmp / f"rank{r}.err").read_text() for r in range(world) if (tmp / f"rank{r}.err").exists()}
    results = [
        torch.load(tmp / f"rank{r}.pt", weights_only=True) if (tmp / f"rank{r}.pt").exists() else None
        for r in range(world)
    ]
    codes = [p.exitcode for p in procs]
    if check:
        assert all(c == 0 for c in codes), f"exit codes {codes}: {errors}"
        return results
    return results, errors, codes

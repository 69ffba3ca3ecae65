"""``featcal calibrate`` under ``torchrun``: one process per GPU (or CPU process), sharing each
task's batches (:mod:`featcal.engine.distributed`). Rank 0 alone prints, draws progress and
writes; the other ranks are quiet."""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch.distributed as dist

from featcal.engine import distributed

T = TypeVar("T")


@contextmanager
def process_group(device: str):
    """The process group a launcher describes (``WORLD_SIZE`` > 1; gloo on the CPU, NCCL on CUDA),
    for the command, and torn down after it; nothing without a launcher."""
    started = distributed.init_from_env(device)
    try:
        yield
        if started:  # every rank done before any tears its connections down (else gloo may abort at exit)
            dist.barrier()
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


def in_process_group(run: Callable[..., int]) -> Callable[..., int]:
    """A command's ``run(args)`` inside :func:`process_group` on ``args.device`` (the COMMANDS table
    wraps ``calibrate`` in it)."""

    @functools.wraps(run)
    def wrapped(args) -> int:
        with process_group(args.device):
            return run(args)

    return wrapped


def is_main() -> bool:
    """Whether this process prints and writes (rank 0, or the only process)."""
    return distributed.is_main()


def rank0_first(load: Callable[[], T]) -> T:
    """``load()`` on rank 0 first (it may build and cache what the others then read), then on
    the other ranks; just ``load()`` without a process group."""
    group = distributed.current()
    if group is None:
        return load()
    if group.rank == 0:
        out = load()
        group.barrier("rank 0 loading the zoo")
        return out
    group.barrier("rank 0 loading the zoo")
    return load()

"""Data-parallel FeatCal on ``torch.distributed`` (docs/distributed.md).

FeatCal's statistics are sums over each task's calibration tokens, so the work splits by data
exactly. Under an initialised process group of more than one process, :func:`featcal.calibrate`
(and :func:`featcal.calibrate_checkpoints`, which calls it) does, per block:

1. every rank runs **its share** of each task's batches (:func:`share`) through the block and
   keeps each task's running sums (:mod:`featcal.engine.blockstats`);
2. each task's sums are added across the ranks (:mod:`featcal.engine.dist_systems`) **before** anything
   divides by the task's totals: the task scale ``s_i = 1/||C_i||_F``, the means and the token
   weights' normalisation are taken over all of the task's tokens, never per rank;
3. each module is solved once, on the rank that owns its input group (groups spread over the
   ranks by the cost of their solve), and every rank receives the new parameters;
4. every rank advances its own streams through the calibrated block.

The share of rank ``r`` of ``W``: every task's batches listed in task order, then batch order,
cut into ``W`` contiguous runs as even as possible (``r``'s run is items ``[N r / W, N (r+1) / W)``
of the ``N`` batches); a rank may hold no batch of a task, or none at all.

Every collective runs under the process group's timeout: a rank that dies makes the others fail
at their next collective, one that hangs makes them fail after the timeout, each with a
:class:`DistributedError` naming the step. :func:`init_from_env` sets that timeout from
``FEATCAL_DIST_TIMEOUT`` (seconds, default :data:`DEFAULT_TIMEOUT_S`).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from featcal.model import validate

ENV_TIMEOUT = "FEATCAL_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600.0
SMALL = 1 << 16  # tensors up to this many elements are packed into one buffer per collective


class DistributedError(RuntimeError):
    """A collective failed or timed out: another rank stopped or hangs."""


def timeout_s() -> float:
    """The process-group timeout featcal uses, in seconds (``FEATCAL_DIST_TIMEOUT``, else the default)."""
    raw = os.environ.get(ENV_TIMEOUT)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{ENV_TIMEOUT}={raw!r}: give the timeout in seconds, a number > 0.")
    return value


def backend_for(device) -> str:
    """NCCL for CUDA devices, gloo otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_from_env(device="cpu") -> bool:
    """Initialise the process group a launcher (``torchrun``) describes in the environment, when
    it describes more than one process and none is initialised yet; True if this call did. On
    CUDA each process takes the GPU ``LOCAL_RANK``."""
    if not dist.is_available() or dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend_for(device), timeout=timedelta(seconds=timeout_s()))
    return True


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Whether this process writes output, reports and progress (rank 0, or no process group)."""
    return rank() == 0


def share(counts: Mapping[str, int], rank: int, size: int) -> dict[str, list[int]]:
    """``{task: [batch index, ...]}`` of rank ``rank`` of ``size``, for tasks of ``counts[task]``
    batches (see the module docstring; every task present, possibly with no batch)."""
    pairs = [(task, b) for task, n in counts.items() for b in range(n)]
    lo, hi = len(pairs) * rank // size, len(pairs) * (rank + 1) // size
    out: dict[str, list[int]] = {task: [] for task in counts}
    for task, b in pairs[lo:hi]:
        out[task].append(b)
    return out


@dataclass
class Traffic:
    """What this process sent to collectives (payload bytes: what it contributed), for the benchmark."""

    stats_bytes: int = 0  # the statistics' sums (reduced onto their owners)
    weight_bytes: int = 0  # the new parameters (broadcast by their owners)
    other_bytes: int = 0  # row counts, fingerprints, reports
    blocks: int = 0


traffic = Traffic()


@dataclass
class Dist:
    """This process's place in the process group and the collectives featcal runs on it."""

    rank: int
    size: int
    device: torch.device  # where the tensors handed to the collectives live
    solve: str = "owner"  # "owner": each module solved on one rank; "everywhere": on every rank
    owners: dict[str, int] = field(default_factory=dict)  # the last block's module -> owning rank

    @property
    def comm_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def run(self, what: str, fn: Callable):
        """``fn()`` with a failed collective turned into a :class:`DistributedError` naming ``what``."""
        try:
            return fn()
        except RuntimeError as err:  # DistBackendError and gloo's errors are RuntimeErrors
            raise DistributedError(
                f"featcal rank {self.rank} of {self.size}: {what} failed: another rank stopped or hangs "
                f"(its own log says why; a hang ends after the process-group timeout, {ENV_TIMEOUT}). {err}"
            ) from err

    # ---- tensors

    def _on_comm(self, tensors: list[torch.Tensor], op: Callable[[torch.Tensor], None]) -> None:
        """``op`` on the tensors (each contiguous, or the transpose of a contiguous one), the
        small ones packed into one float64 buffer; done in place."""
        small = [x for x in tensors if x.numel() <= SMALL]
        for x in tensors:
            if x.numel() > SMALL:
                y = x if x.is_contiguous() else x.mT
                if not y.is_contiguous():
                    raise ValueError("featcal.distributed: a non-contiguous tensor was handed to a collective.")
                moved = y.to(self.comm_device)
                op(moved)
                if moved is not y:
                    y.copy_(moved)
        if small:
            flat = torch.cat([x.detach().reshape(-1).to(self.comm_device, torch.float64) for x in small])
            op(flat)
            offset = 0
            for x in small:
                x.copy_(flat[offset : offset + x.numel()].reshape(x.shape))
                offset += x.numel()

    def sum_to(self, tensors: list[torch.Tensor], owner: int | None, what: str) -> int:
        """Add ``tensors`` across the ranks in place: onto rank ``owner`` (``reduce``), or onto
        every rank (``owner`` None: ``all_reduce``). Returns the payload bytes."""

        def op(x):
            if owner is None:
                dist.all_reduce(x)
            else:
                dist.reduce(x, dst=owner)

        self.run(what, lambda: self._on_comm(tensors, op))
        return sum(x.numel() * x.element_size() for x in tensors)

    def broadcast(self, tensors: list[torch.Tensor], src: int, what: str) -> int:
        """``tensors`` of rank ``src`` copied into every rank's, in place. Returns the payload bytes."""
        self.run(what, lambda: self._on_comm(tensors, lambda x: dist.broadcast(x, src=src)))
        return sum(x.numel() * x.element_size() for x in tensors)

    def gather_objects(self, obj, what: str) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        out = [None] * self.size
        self.run(what, lambda: dist.all_gather_object(out, obj))
        return out

    def barrier(self, what: str) -> None:
        """Wait for every rank (an object gather: it runs on either backend under the timeout)."""
        self.gather_objects(None, what)

    # ---- the run's inputs

    def check_same(self, digests: Mapping[str, str]) -> None:
        """Refuse inputs that differ between ranks (``digests``: ``{what: digest}``, e.g. the
        models, the config, the tasks), before any work; every rank raises the same error."""
        got = self.gather_objects(dict(digests), "comparing the ranks' inputs")
        bad = {k: [r for r, g in enumerate(got) if g.get(k) != got[0].get(k)] for k in digests}
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            where = "; ".join(f"{k} differ on rank(s) {v} from rank 0's" for k, v in bad.items())
            raise ValueError(
                f"the ranks were given different inputs ({where}); every rank must load the same models, "
                "config, tasks and calibration data (launch the same command on every node)."
            )

    def my_share(self, calib_data: Mapping[str, list]) -> dict[str, list]:
        """This rank's batches of every task (:func:`share`)."""
        mine = share({t: len(b) for t, b in calib_data.items()}, self.rank, self.size)
        return {t: [calib_data[t][i] for i in idx] for t, idx in mine.items()}


def current(device="cpu", solve: str = "owner") -> Dist | None:
    """The :class:`Dist` of an initialised process group of more than one process, else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    if solve not in ("owner", "everywhere"):
        raise ValueError(f"the distributed solve must be 'owner' or 'everywhere', got {solve!r}.")
    return Dist(dist.get_rank(), dist.get_world_size(), torch.device(device), solve)


def model_digest(model: nn.Module) -> str:
    """A digest of a model's parameter and buffer names, shapes, dtypes and (for tensors that
    hold data, not skeletons on ``meta``) a strided sample of their values: cheap for big
    models, and different for different checkpoints."""
    h = hashlib.sha256()
    for name, x in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}{tuple(x.shape)}{x.dtype}".encode())
        if not x.is_meta and x.numel():
            flat = x.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].contiguous().cpu()
            h.update(sample.view(torch.uint8).numpy().tobytes())  # the bytes: no rounding to differ by CPU
    return h.hexdigest()


def input_digests(merged: nn.Module, base: nn.Module, experts: Mapping, calib_data: Mapping, cfg, path: str) -> dict:
    """What every rank must agree on before any work: the models, the tasks, the config and the
    blocks, the calibration data (:meth:`Dist.check_same`)."""
    return {
        "models": model_digest(merged) + model_digest(base),
        "experts": "".join(model_digest(experts[t]) for t in calib_data),
        "tasks": repr(list(calib_data)),
        "config": repr(cfg.to_dict()) + path,
        "calibration data": validate.data_digest(calib_data),
    }

"""An up-front estimate of a streamed run's peak host memory, checked against the memory available
before any work (:func:`check_memory`): a run that would not fit is refused with the estimate, what
is available and the ways forward, instead of being killed by the system part-way with no message
(issue 40: 32,768 x 256 tokens per task in a 3 GB container ran 611 s and died, leaving its lock
and a partial directory). ``force=True`` (``--force``) turns the refusal into a warning.

The estimate (:func:`estimate_peak`) is a sum of terms, each an upper-leaning count of what a streamed
run holds at once (:mod:`featcal.streaming.run`'s docstring: one block of every model, the streams and
one block's statistics); the copy counts are measured on tiny Llamas (tests/streaming/test_memory_estimate.py).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

STREAM_COPIES = 4  # per task: the calibrating and the expert's streams, each beside its successor while a block runs
HOST_COPIES_ON_GPU = 2  # on a GPU the streams start on the host (the stems run there) and stay there if they do not fit
CALL_COPIES = 3  # per token of one call: every module's input and output, captured on the merged and the expert's call
GiB = 2**30


class NotEnoughMemoryError(ValueError):
    """The run's estimated peak memory exceeds the memory available (and ``force`` was not given)."""


@dataclass(frozen=True)
class RunSize:
    """The sizes the estimate is made of (:func:`run_size` reads them from a streamed run's inputs).

    Attributes:
        block_bytes: one block of every model held at once (base, experts, the merged model), in bytes.
        tokens: this process's calibration tokens (rows x sequence length) per task.
        hidden: the width of the hidden state (the streams' last axis).
        stream_bytes: bytes per element of the streams (the models' dtype).
        call_tokens: tokens of the largest call through a block (a batch, or the batches pooled into one).
        widths: over one block's calibrated modules, the sum of input plus output widths (``d_in + d_out``).
        stats_elems: over one block's calibrated modules, the sum of ``d_in^2 + d_in d_out`` (one task's sums).
        stats_bytes: bytes per element of the statistics (``FeatCalConfig.stats_dtype``).
        on_gpu: the blocks run on a GPU: the calls and the statistics are there, and the host holds
            the streams :data:`HOST_COPIES_ON_GPU` times (not :data:`STREAM_COPIES`).
    """

    block_bytes: int
    tokens: Mapping[str, int]
    hidden: int
    stream_bytes: int
    call_tokens: int
    widths: int
    stats_elems: int
    stats_bytes: int
    on_gpu: bool = False


def estimate_peak(size: RunSize) -> dict[str, int]:
    """The streamed run's peak host memory above what the process held before, in bytes, by term:

    - ``blocks``: one block of every model (:attr:`RunSize.block_bytes`);
    - ``streams``: per task, its tokens x ``hidden`` x ``stream_bytes``, :data:`STREAM_COPIES` times
      (the calibrating stream and the expert's, each beside the next block's while a block runs);
    - ``call``: the working memory of the largest call: ``call_tokens`` x ``widths`` x ``stream_bytes``,
      :data:`CALL_COPIES` times (the modules' inputs and outputs captured on the merged and the expert's call);
    - ``statistics``: every task's sums of one block (``stats_elems`` each) and the systems they are
      added into (one more set), in ``stats_bytes``;
    - ``total``: their sum.

    On a GPU (:attr:`RunSize.on_gpu`) the call and the statistics are the GPU's, not counted here.
    """
    host = 0 if size.on_gpu else 1
    copies = HOST_COPIES_ON_GPU if size.on_gpu else STREAM_COPIES
    terms = {
        "blocks": size.block_bytes,
        "streams": copies * sum(size.tokens.values()) * size.hidden * size.stream_bytes,
        "call": host * CALL_COPIES * size.call_tokens * size.widths * size.stream_bytes,
        "statistics": host * (len(size.tokens) + 1) * size.stats_elems * size.stats_bytes,
    }
    return terms | {"total": sum(terms.values())}


def _tokens(batch) -> int:
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    return int(ids.numel()) if torch.is_tensor(ids) else 0


def run_size(
    ckpts: dict, skel, path: str, calib_data: Mapping[str, list], stats_dtype, pool_rows: int, on_gpu: bool = False
) -> RunSize:
    """The :class:`RunSize` of a streamed run: block 0's tensors in every checkpoint (the merged
    model's too when merging on the fly; a block's modules are its 2-D ``weight`` tensors), the
    tokens of ``calib_data`` (this process's share), the merged skeleton's dtype and hidden width."""
    block0 = f"{path}.0."
    dtype = next(iter(skel.parameters())).dtype
    elem = torch.empty((), dtype=dtype).element_size()
    numels = {
        role: sum(math.prod(s.shape) for n, s in ck.specs.items() if n.startswith(block0)) for role, ck in ckpts.items()
    }
    models = len(ckpts) + ("merged" not in ckpts)
    shapes = [s.shape for n, s in ckpts["base"].specs.items() if n.startswith(block0) and n.endswith(".weight")]
    shapes = [s for s in shapes if len(s) == 2]
    tokens = {t: sum(_tokens(b) for b in batches) for t, batches in calib_data.items()}
    total = sum(tokens.values())
    largest = max((_tokens(b) for batches in calib_data.values() for b in batches), default=0)
    config = getattr(skel, "config", None)
    hidden = (
        getattr(config, "hidden_size", None)
        or getattr(config, "d_model", None)
        or max((s[1] for s in shapes), default=0)
    )
    return RunSize(
        block_bytes=models * max(numels.values(), default=0) * elem,
        tokens=tokens,
        hidden=int(hidden),
        stream_bytes=elem,
        call_tokens=total if total <= pool_rows else largest,  # the engine pools the calls only when all fit
        widths=sum(o + d for o, d in shapes),
        stats_elems=sum(d * d + d * o for o, d in shapes),
        stats_bytes=torch.empty((), dtype=stats_dtype).element_size(),
        on_gpu=on_gpu,
    )


def _cgroup_free(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """What this process's cgroup still allows (its limit less its memory in use, page cache not
    counted: the kernel reclaims it), or None without a limit. cgroup v2, else v1."""
    for limit, used, stat in (
        ("memory.max", "memory.current", "memory.stat"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat"),
    ):
        try:
            raw = (root / limit).read_text().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            cache = re.search(r"^(?:file|total_cache) (\d+)$", (root / stat).read_text(), re.M)
            return int(raw) - int((root / used).read_text()) + (int(cache.group(1)) if cache else 0)
        except (OSError, ValueError):
            continue
    return None


def available_bytes() -> int | None:
    """The memory this process may still take: the system's available memory (psutil, else
    ``MemAvailable`` of /proc/meminfo) and the cgroup's room (:func:`_cgroup_free`), whichever is
    less; None where neither tells."""
    found = []
    try:
        import psutil

        found.append(int(psutil.virtual_memory().available))
    except ImportError:
        try:
            text = Path("/proc/meminfo").read_text()
            found.append(int(re.search(r"^MemAvailable:\s+(\d+) kB", text, re.M).group(1)) * 1024)
        except (OSError, AttributeError):
            pass
    room = _cgroup_free()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def check_memory(estimate: Mapping[str, int], available: int | None, force: bool) -> None:
    """Refuse (:class:`NotEnoughMemoryError`) a run whose ``estimate`` (:func:`estimate_peak`)
    exceeds the ``available`` bytes (None: unknown, nothing checked), naming both, the largest terms
    and the ways forward; with ``force`` warn the same instead."""
    total = estimate["total"]
    if available is None or total <= available:
        return
    terms = ", ".join(
        f"{k} {v / GiB:.2f} GiB" for k, v in sorted(estimate.items(), key=lambda kv: -kv[1]) if k != "total"
    )
    msg = (
        f"this streamed run needs about {total / GiB:.2f} GiB of memory ({terms}), and {available / GiB:.2f} GiB "
        "is available (the system's available memory, or the container's limit); it would be killed part-way. "
        "Give fewer calibration examples or shorter sequences (the streams grow with the tokens per task), "
        "smaller batches (the call term), float32 statistics (--stats-dtype float32), more ranks (each holds its "
        "share of the streams), or pass --force (force=True) to run anyway."
    )
    if not force:
        raise NotEnoughMemoryError(msg)
    warnings.warn(msg, stacklevel=3)

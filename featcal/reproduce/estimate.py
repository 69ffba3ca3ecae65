"""How long and how much memory a reproduction will take on this device, told before it runs.

What is measured loads as little as it can (:func:`probe_zoo`): of a YAML spec only the base, the
first task's expert, its head and data (a 20-task ViT-L/14 zoo would hold 21 models); a zoo directory
or built-in zoo whole (they are small). Test splits decoded lazily are not decoded to be counted
(:func:`scored_sizes`): their scoring passes are then not counted, unless ``--max-test`` bounds them.

Time: :func:`probe` times a few forward passes of the zoo's base model on one calibration batch, on
the device the zoo is on (a warm-up call first, then the median of ``repeats`` calls; on CUDA
synchronised), giving the seconds one example takes through one model. Each row's forward passes
(:func:`featcal.reproduce.plan.row_passes`, FeatCal's weighted by its measured cost over its
reference) times that is the row's estimate. Merging (weights arithmetic), SVC's SVDs and the
trained calibrators' module-only steps are not counted; an LLM zoo scoring by generation costs more
than one pass per test example. The figures are estimates from a model of the cost, not measurements
of the run: the run prints what it took.

Memory (:func:`memory_estimate`): the models held at once (the base, every expert, the merged model
and one calibrated copy) plus FeatCal's working set, the terms of
:func:`featcal.streaming.memory.estimate_peak` (the calibrating and the experts' streams of every
task, the captured inputs and outputs of one call, one block's statistics of every task) on the
sizes :func:`probe` read from block 0, and for ESCal and SurgeryV2 the expert's block outputs they
keep for one task. The largest row's total is the run's.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from featcal.model.arch import LINEAR, block_targets, get_params, resolve_stacks
from featcal.model.streams import call_model, device_of
from featcal.model.validate import batch_len
from featcal.reproduce.plan import STEPS_RUN_THE_MODEL, PlannedRow, row_passes
from featcal.streaming.memory import RunSize, available_bytes, estimate_peak
from featcal.zoo import load_any
from featcal.zoo.formats import fusionbench
from featcal.zoo.load import from_spec as spec_mod
from featcal.zoo.spec.parsing import parse
from featcal.zoo.tokens import as_batch

GiB = 2**30


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` measured and read on a zoo: ``seconds_per_pass`` (one example through the
    base model), over ``examples`` examples and ``repeats`` calls on ``device``; block 0's input
    (``seq_len`` tokens per example, ``hidden`` wide), the model's ``blocks``, its bytes, element
    size, and block 0's Linear widths (``widths``: the sum of d_in + d_out; ``stats_elems``: of
    d_in^2 + d_in d_out)."""

    seconds_per_pass: float
    examples: int
    repeats: int
    device: str
    seq_len: int
    hidden: int
    blocks: int
    model_bytes: int
    elem: int
    widths: int
    stats_elems: int


def _model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _block0(model: nn.Module) -> tuple[nn.Module, int]:
    """The first block of the model's first stack, and how many blocks all its stacks hold."""
    stacks = resolve_stacks(model)
    return stacks[0][1][0], sum(len(blocks) for _, blocks in stacks)


def _linear_sizes(block: nn.Module) -> tuple[int, int]:
    """``(sum of d_in + d_out, sum of d_in^2 + d_in d_out)`` over the block's calibrated Linears."""
    shapes = [get_params(block, t)[0].shape for t in block_targets(block) if t.kind == LINEAR]
    return sum(o + i for o, i in shapes), sum(i * i + i * o for o, i in shapes)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def probe(zoo, examples: int = 16, repeats: int = 3) -> Probe:
    """Time the zoo's base model on ``examples`` calibration examples of its first task (see the
    module docstring) and read the sizes the memory estimate needs."""
    model = zoo.base
    device = device_of(model)
    first = zoo.tasks[0]
    size = min(examples, len(zoo.split(first, "calib")[1]))
    batch = as_batch(zoo.split(first, "calib")[0][:size])
    batch = {k: v.to(device) for k, v in batch.items()} if isinstance(batch, Mapping) else batch.to(device)
    block, n_blocks = _block0(model)
    seen: dict[str, tuple] = {}

    def catch(module, args, kwargs) -> None:  # block 0's hidden state, positional or by keyword
        hidden = args[0] if args else next((v for v in kwargs.values() if torch.is_tensor(v)), None)
        if hidden is not None:
            seen.setdefault("shape", tuple(hidden.shape))

    hook = block.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        call_model(model, batch)  # warm-up, and block 0's input shape
    finally:
        hook.remove()
    times = []
    for _ in range(max(repeats, 1)):
        _sync(device)
        t0 = time.perf_counter()
        call_model(model, batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    shape = seen.get("shape", (batch_len(batch), 1, 1))
    widths, stats_elems = _linear_sizes(block)
    elem = next(iter(model.parameters())).element_size()
    return Probe(
        seconds_per_pass=statistics.median(times) / batch_len(batch),
        examples=batch_len(batch),
        repeats=max(repeats, 1),
        device=str(device),
        seq_len=int(shape[1]) if len(shape) == 3 else 1,
        hidden=int(shape[-1]),
        blocks=n_blocks,
        model_bytes=_model_bytes(model),
        elem=elem,
        widths=widths,
        stats_elems=stats_elems,
    )


def memory_estimate(p: Probe, planned: PlannedRow, tasks: int, batch: int = 16, stats_bytes: int = 4) -> dict[str, int]:
    """Bytes ``planned`` holds at its peak on a zoo of ``tasks`` tasks (see the module docstring), by
    term: ``models``, FeatCal's ``streams``, ``call`` and ``statistics`` (when it runs FeatCal),
    ``trained targets`` (ESCal, SurgeryV2) and ``total``."""
    terms = {"models": (tasks + 3) * p.model_bytes}
    if "featcal" in planned.chain:
        size = RunSize(
            block_bytes=0,
            tokens={str(t): planned.n * p.seq_len for t in range(tasks)},
            hidden=p.hidden,
            stream_bytes=p.elem,
            call_tokens=min(batch, planned.n) * p.seq_len,
            widths=p.widths,
            stats_elems=p.stats_elems,
            stats_bytes=stats_bytes,
        )
        found = estimate_peak(size)
        terms.update({k: found[k] for k in ("streams", "call", "statistics")})
    if any(c in STEPS_RUN_THE_MODEL for c in planned.chain):
        terms["trained targets"] = planned.n * p.seq_len * p.hidden * p.blocks * p.elem
    return terms | {"total": sum(terms.values())}


@dataclass(frozen=True)
class RowEstimate:
    """One row's forward passes, estimated seconds and peak bytes (by term)."""

    planned: PlannedRow
    passes: object
    seconds: float
    memory: dict[str, int]


def estimate_rows(
    planned: list[PlannedRow], p: Probe, tasks: int, sizes: Mapping[str, int] | None, stats_bytes: int = 4
) -> list[RowEstimate]:
    """Every planned row's passes, seconds and memory on a zoo of ``tasks`` tasks with ``sizes`` test
    examples per task (None: unknown), measured by ``p``; FeatCal's statistics ``stats_bytes`` per element."""
    out = []
    for row in planned:
        passes = row_passes(row, tasks, sizes)
        memory = memory_estimate(p, row, tasks, stats_bytes=stats_bytes) if row.runs else {"total": 0}
        out.append(RowEstimate(row, passes, passes.weighted * p.seconds_per_pass, memory))
    return out


def probe_zoo(zoo: str, device: str = "cpu", progress: bool = True):
    """The zoo to measure: of a YAML spec (featcal's or a FusionBench pool) the base, the first task's
    expert, head and data only; any other zoo whole (:func:`featcal.zoo.load_any`)."""
    path = Path(os.path.expandvars(zoo)).expanduser()
    if path.suffix.lower() not in (".yaml", ".yml"):
        return load_any(zoo, progress=progress, device=device)
    spec = fusionbench.pool_spec(path) if fusionbench.is_pool(path) else parse(path)
    first = spec.tasks[0]
    reduced = dataclasses.replace(spec, experts={first: spec.experts[first]}, data={first: spec.data[first]})
    return spec_mod.load(reduced, device=device)


def scored_sizes(zoo, tasks: list[str], max_test: int | None) -> dict[str, int] | None:
    """Test examples scored per task: counted where the zoo holds them (every task loaded, its test
    split decoded or held in memory), at most ``max_test``; else ``max_test`` each (an upper bound),
    or None when nothing bounds them (decoding every test split to count it costs as much as scoring)."""
    counted = {}
    for t in tasks:
        splits = zoo.data[t].splits if t in zoo.data else None
        lazy = splits is None or (hasattr(splits, "loaded") and "test" not in splits.loaded())
        if lazy:
            if max_test is None:
                return None
            counted[t] = max_test
            continue
        n = len(zoo.split(t, "test")[1])
        counted[t] = n if max_test is None else min(n, max_test)
    return counted


def device_room(device: str) -> int | None:
    """Bytes free where the models live: the GPU's free memory on CUDA, else the host's available
    memory (:func:`featcal.streaming.memory.available_bytes`); None where neither tells."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(dev)
        return int(free)
    return available_bytes()

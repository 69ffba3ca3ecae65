"""The FeatCal engine: visit the blocks in forward order and replace each
calibrated module by its closed-form solution (docs/maths.md, 'Forward order').

Per task i two streams are kept at the input of the current block l: the
calibrating model's ``h_cal[i]`` and expert i's ``h_exp[i]``. For each block:

1. run the still-merged block on ``h_cal[i]`` and the expert's block on
   ``h_exp[i]``, reducing every module's inputs into running statistics as the
   batches pass (the expert's outputs are its next stream);
2. solve every module of the block from that one snapshot, then load them all;
3. advance ``h_cal[i]`` through the calibrated block.

No block before l is ever re-run, and the base and the experts are touched one
block at a time. When the calibrating batches of every task can run as one call
(:func:`featcal.model.streams.pool_spans`: few rows, no padding mask, no tensor argument),
the still-merged block of step 1 and the calibrated block of step 3 see them in one
call, and step 1's captures are cut back into each task's batches; when, moreover, each
task is one batch of one shape, every task's statistics are reduced as one stack
(:mod:`featcal.engine.snapshot`; the statistics themselves: :mod:`featcal.engine.blockstats`). These and the
other fast paths are switched by the :class:`~featcal.config.FastPaths` passed in.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from typing import Callable, Mapping

import torch
from torch import nn

from featcal.config import FastPaths, FeatCalConfig
from featcal.engine import distributed, snapshot
from featcal.engine.blocksource import BlockSource, DeviceBlocks, check_device, to_host
from featcal.engine.blockstats import Context
from featcal.engine.dist_systems import share_solutions
from featcal.engine.notes import Notes
from featcal.engine.preview import Kept, Preview
from featcal.engine.report import BlockRecord, CalibrationReport, ModuleRecord
from featcal.engine.state import RunState, Stream
from featcal.engine.trace import ExpertTrace
from featcal.method import solve
from featcal.method.kernels import Kernels
from featcal.model import arch, validate
from featcal.model import loading as sources
from featcal.model.capture import sequence_first
from featcal.model.modes import to_eval
from featcal.model.streams import (
    BlockCall,
    block_output,
    catch_block_inputs,
    device_of,
    pooled,
    run_block,
)
from featcal.util.progress import bar as progress_bar

log = logging.getLogger(__name__)


def _prepare_streams(
    model: nn.Module,
    blocks: nn.ModuleList,
    experts: Mapping[str, nn.Module],
    expert_blocks: Mapping[str, nn.ModuleList],
    calib_data: Mapping[str, list],
    offload: bool,
    trace: ExpertTrace | None = None,
    path: str = "",
) -> dict[str, Stream]:
    """Run every stem once per batch: the calibrating model's and expert i's on D_i (the
    latter from ``trace`` when it has them, kept under the stack's ``path``). The stem of a
    later stack is the model's forward up to it: a decoder's streams read the calibrating
    model's (calibrated) encoder output and each expert's own."""
    streams = {}
    for task, batches in calib_data.items():
        cal = [catch_block_inputs(model, blocks[0], b) for b in batches]
        kept = None if trace is None else trace.stream(path)
        exp = None if kept is None else [kept.get(task, 0, b) for b in range(len(batches))]
        if exp is None or any(c is None for c in exp):
            exp = [catch_block_inputs(experts[task], expert_blocks[task][0], b) for b in batches]
            if offload:
                exp = [c.with_hidden(to_host(c.hidden)) for c in exp]
            for b, call in enumerate(exp if kept is not None else []):
                if trace.room_for(call):
                    kept.put(task, 0, b, call)
        if offload:
            cal = [c.with_hidden(to_host(c.hidden)) for c in cal]
        streams[task] = Stream(cal, list(exp))
    return streams


def _solve_block(run: RunState, block: int, blk: nn.Module, targets, systems: dict) -> None:
    """Solve every target of ``block`` from the snapshot, then load them all (the merged
    parameters are read as views until then; copied only when ``run.keep`` holds on to
    them). The factorisations' buffers come from the kernels' scratch and go back to it, and so
    do the systems' ``S`` unless ``run.keep`` holds on to them."""
    cfg, kernels, keep = run.ctx.cfg, run.ctx.kernels, run.keep
    setting = cfg.setting
    new_params = []
    for t in targets:
        t0 = time.perf_counter()
        W_mer, b_mer = arch.get_params(blk, t)
        if keep is not None:
            W_mer, b_mer = W_mer.clone(), None if b_mer is None else b_mer.clone()
        W_0, b_0 = arch.get_params(run.base_blocks[block], t)
        ends = solve.Endpoints(W_mer, b_mer, W_0.to(W_mer.device), None if b_0 is None else b_0.to(W_mer.device))
        sysm = systems[t.name]
        if t.kind == arch.LINEAR:
            W, b, SWt = solve.solve_linear(sysm, ends, setting, eps=cfg.eps, bias=cfg.bias, kernels=kernels)
            before, after = solve.linear_residuals(
                sysm, cfg.alpha, (W_mer, b_mer, None, sysm.res.k_mm), (W, b, SWt, None)
            )
            d_in, d_out, rows = W.shape[1], W.shape[0], sysm.min_rows
        else:
            W, b = solve.solve_norm(sysm, ends, setting, eps=cfg.eps, kernels=kernels)
            before = solve.norm_residual(sysm, W_mer, b_mer)
            after = solve.norm_residual(sysm, W, b)
            d_in = d_out = W.shape[0]
            rows = 0
        run.notes.solved(f"block {block} {t.name}", *kernels.said())
        # The residual after is a sum of products with every entry of W and b: any NaN/Inf there
        # makes it NaN or Inf (inf * 0 is NaN), so it checks them without another pass.
        if not math.isfinite(after):
            raise FloatingPointError(f"block {block}, module {t.name!r}: the solve gave NaN/Inf; raise lam or eps.")
        new_params.append((t, W, b))
        run.report.modules.append(
            ModuleRecord(run.offset + block, t.name, t.kind, d_in, d_out, rows, before, after, time.perf_counter() - t0)
        )
        if keep is not None:
            keep.append(Kept(run.offset + block, t, sysm, ends))
    for t, W, b in new_params:
        arch.set_params(blk, t, W, b)
    kernels.end_block()
    if keep is None:
        kernels.give([s.S for s in systems.values() if isinstance(s, solve.LinearSystem) and s.owns_S])


def _advance(run: RunState, block: int, blk: nn.Module, pool) -> None:
    """Step 3: move the calibrating streams through the calibrated block (in one call when
    ``pool``, from :func:`featcal.engine.snapshot.pool` before step 1: the calibrating streams have not moved since)."""
    device, offload = run.ctx.device, run.offload
    outs: dict[tuple[str, int], BlockCall] = {}
    if pool is not None:
        keys, calls, spans = pool
        h = run_block(blk, pooled(calls), device)
        h = to_host(h) if offload else h
        outs = {key: c.with_hidden(h[lo:hi]) for key, c, (lo, hi) in zip(keys, calls, spans)}
    else:
        for task, st in run.streams.items():
            for b, cc in enumerate(st.cal):
                nxt = cc.after(block_output(blk, cc, device))  # carried outputs handed on
                outs[task, b] = nxt.with_hidden(to_host(nxt.hidden)) if offload else nxt
    for task, st in run.streams.items():
        calls = [outs[task, b] for b in range(len(st.cal))]
        if not calls:  # a rank may hold no batch of a task
            continue
        seq = sequence_first(blk)  # (T, B, d) streams: the mask is (B, T)
        finite = [
            _finite_unpadded(c.hidden.transpose(0, 1) if seq and c.hidden.dim() == 3 else c.hidden, cc.mask)
            for c, cc in zip(calls, st.cal)
        ]
        if not bool(torch.stack(finite).all()):  # one sync per task
            raise FloatingPointError(
                f"block {block}: the calibrated block's output on task {task!r} "
                "holds NaN or Inf; raise lam or check the data."
            )
        st.cal = calls


def _finite_unpadded(h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Whether the hidden state ``h`` is finite outside padding (a 0-dim bool tensor): padded
    tokens are never read by the statistics, so a NaN there (e.g. from the data) is harmless."""
    if mask is None or h.dim() != 3 or tuple(mask.shape) != tuple(h.shape[:2]):
        return torch.isfinite(h).all()
    return (torch.isfinite(h).all(-1) | (mask.to(h.device) == 0)).all()


def _calibrate_stack(
    run: RunState,
    model: nn.Module,
    path: str,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    progress: bool,
    block_source: BlockSource | None = None,
) -> None:
    """Steps 1-3 of the module docstring for every block of the stack at ``path``, its block
    numbers in the report following those of the stacks calibrated before it. The blocks are
    visited where ``block_source`` puts them (default: where they are, or one block of each model
    at a time on the run's device when the models are elsewhere)."""
    ctx, cfg, report = run.ctx, run.ctx.cfg, run.report
    blks = arch.resolve_blocks(model, path)[1]
    run.path, run.offset = path, len(report.blocks)
    run.base_blocks = arch.resolve_blocks(base, path)[1]
    run.expert_blocks = {t: arch.resolve_blocks(experts[t], path)[1] for t in calib_data}
    ctx.n_blocks = len(blks)  # token weights name blocks within the stack ("the last block")
    untouched = arch.untouched_norms(blks[0]) if cfg.layernorm else []
    if untouched:  # say so: their affine stays the merged one
        msg = f"{path}: norms featcal does not calibrate keep their merged values: {', '.join(untouched)}."
        run.notes.said.append(msg)
    source = block_source
    if source is None and ctx.device != device_of(model):  # one block of each model on the device at a time
        source = DeviceBlocks(ctx.device, blks, [run.base_blocks, *run.expert_blocks.values()])
    source = source or BlockSource()
    try:
        _visit_blocks(run, source, model, blks, experts, calib_data, progress)
    finally:
        source.close()


def _visit_blocks(run: RunState, source: BlockSource, model, blks, experts, calib_data, progress: bool) -> None:
    """The forward-order loop over one stack's blocks, each where ``source`` puts it."""
    ctx, fast, cfg, report, path = run.ctx, run.ctx.fast, run.ctx.cfg, run.report, run.path
    # The streams at the input of the source's first block (block 0 unless a run resumes).
    streams = source.streams(
        lambda: _prepare_streams(
            model, blks, experts, run.expert_blocks, calib_data, cfg.offload_streams, run.trace, path
        )
    )
    run.streams, run.offload = streams, cfg.offload_streams or source.offload(streams)
    desc = "FeatCal" if path == report.blocks_path else f"FeatCal {path}"
    show = progress and (run.dist is None or run.dist.rank == 0)  # one bar: rank 0's
    bar = progress_bar(range(source.first, len(blks)), desc=desc, unit="block", show=show)
    run.blocks_done += source.first  # (a resumed run's earlier blocks are done)
    for block in bar:
        source.enter(block)  # block `block` of every model where it runs
        blk = blks[block]
        targets = arch.block_targets(blk, linear=cfg.linear, layernorm=cfg.layernorm, only=cfg.modules)
        # 1. Snapshot statistics of the still-merged block (and advance the experts).
        t0 = time.perf_counter()
        # the calibrating batches as one call, for steps 1 and 3 (not for sequence-first streams:
        # they would be joined along their token axis)
        pool = None if sequence_first(blk) else snapshot.pool(streams, fast.pool_rows)
        systems = snapshot.block_systems(run, block, blk, targets, pool)
        ctx.kernels.trim()  # big Gram buffers go before the solve (kept, they add to its peak)
        t1 = time.perf_counter()
        # 2. Solve all modules of the block, then load them together.
        first_record = len(report.modules)  # (this rank's share of the modules, under a process group)
        _solve_block(run, block, blk, [t for t in targets if t.name in systems], systems)
        if run.dist is not None:  # every rank gets every module's new parameters
            share_solutions(run.dist, report, blk, targets, first_record)
        ctx.kernels.trim()  # and big systems and factors before the advance
        t2 = time.perf_counter()
        # 3. Advance the calibrating streams through the calibrated block.
        _advance(run, block, blk, pool)
        report.blocks.append(BlockRecord(run.offset + block, t1 - t0, t2 - t1, time.perf_counter() - t2))
        source.leave(block, streams, report)
        bar.set_postfix_str(f"block {block}: {len(targets)} modules")
        run.blocks_done += 1
        if run.on_block is not None:  # (raising stops the run here, between two blocks)
            rec = report.blocks[-1]
            info = {
                "done": run.blocks_done,
                "blocks": run.blocks_total,
                "seconds": rec.stats_seconds + rec.solve_seconds + rec.advance_seconds,
            }
            run.on_block(rec.block, info)


def _checked_models(merged, base, experts, calib_data, blocks, block_source):
    """``(tasks, base, experts, path)``: the tasks checked against the data, base and experts as
    models (a state dict or a model directory loaded into a copy of ``merged``, a LoRA adapter
    merged onto ``base``), and the blocks' path(s) after checking that every model has ``merged``'s architecture."""
    tasks = validate.check_tasks(experts, calib_data)
    base = sources.as_model(base, merged, "base")
    experts = {t: sources.as_model(experts[t], merged, f"expert {t!r}", base=base) for t in tasks}  # LoRA: on base

    def stacks_of(m: nn.Module) -> str:
        return arch.STACK_SEP.join(p for p, _ in arch.resolve_stacks(m, blocks))

    if block_source is None or block_source.loaded:
        others = [("base", base)] + [(f"expert {t!r}", experts[t]) for t in tasks]
        return tasks, base, experts, validate.check_models(merged, others, stacks_of)
    return tasks, base, experts, stacks_of(merged)  # skeletons: the source checks each block as it loads it


def _bound_trace(expert_trace, experts, calib_data, tasks, path, cfg, device) -> ExpertTrace | None:
    """``expert_trace`` bound to this run's experts, batches and the settings its captures depend
    on (what it holds from another run is dropped when any of them differ); None without one."""
    if expert_trace is None:
        return None
    what = (path, cfg.linear, cfg.layernorm, tuple(cfg.modules or ()), cfg.offload_streams, str(device))
    return expert_trace.bind(experts, calib_data, tasks, what)


def _report_notes(notes: Notes, report: CalibrationReport, dist) -> None:
    """The run's warnings and notes (under a process group: every rank's, gathered) into the
    report, each kind said once (by rank 0); then a warning when calibration raised a residual
    (:meth:`CalibrationReport.check_residuals`). ``stacklevel`` points at :func:`calibrate`'s caller."""
    if dist is not None:  # the notes of the modules other ranks solved
        notes.gather(dist)
    notes.publish(report, say=dist is None or dist.rank == 0, stacklevel=4)
    rose = report.check_residuals()
    if rose is not None:
        warnings.warn(rose, stacklevel=4)


@torch.no_grad()
def calibrate(
    merged: nn.Module,
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    config: FeatCalConfig | None = None,
    blocks: str | None = None,
    inplace: bool = False,
    keep_stats: bool = False,
    progress: bool = True,
    expert_trace: ExpertTrace | None = None,
    fast: FastPaths | None = None,
    device: str | torch.device | None = None,
    block_source: BlockSource | None = None,
    on_block: Callable[[int, dict], None] | None = None,
) -> tuple[nn.Module, CalibrationReport]:
    """Calibrate a merged model toward its experts with FeatCal.

    Args:
        merged: the merged model ``M_mer``; left untouched unless ``inplace=True``.
        base: the pretrained model ``M_0`` (the anchor's second end).
        experts: ``{task: M_i}``, same architecture as ``merged``. ``base`` and each expert may
            also be a state dict, a checkpoint file or a local model directory (Hugging Face
            ``save_pretrained`` layout), loaded strictly into a copy of ``merged``
            (:mod:`featcal.model.loading`); an expert may be a PEFT LoRA adapter directory on
            ``base`` (:mod:`featcal.model.lora`).
        calib_data: ``{task: [batch, ...]}``; a batch is a tensor (``model(batch)``) or a
            dict (``model(**batch)``; an ``attention_mask`` in it marks padding).
        config: hyper-parameters and switches (:class:`FeatCalConfig`).
        blocks: dotted path of the ``nn.ModuleList`` of blocks; optional for known architectures
            (an encoder-decoder without it: its encoder's blocks, then its decoder's).
        inplace: calibrate ``merged`` itself (saves one model copy for big models).
        keep_stats: keep each module's system in the report for ``report.preview(...)``.
        progress: show a progress bar per block.
        expert_trace: an :class:`ExpertTrace` to keep what is computed of the experts (their
            blocks' captures and streams) and reuse it on the next call with the same experts
            and batches (repeated calibrations of one zoo, e.g. an app's sliders).
        fast: which of the engine's faster, equivalent paths it may take (:class:`FastPaths`;
            default: every one where it pays; ``FastPaths.plainest()``: none).
        device: where the blocks run (default: the merged model's device). Models on the CPU
            with ``device="cuda"`` have one block of each on the GPU at a time
            (:class:`featcal.engine.blocksource.DeviceBlocks`).
        block_source: where the blocks come from while they are visited
            (:class:`featcal.engine.blocksource.BlockSource`; :func:`featcal.calibrate_checkpoints`
            passes one that reads them from checkpoint shards, with ``device``).
        on_block: called as ``on_block(block, {"done", "blocks", "seconds"})`` after each
            block (its number in the report; blocks done and blocks in all, over every stack;
            its seconds), e.g. for a progress bar of one's own. An exception it raises stops the run
            between two blocks and propagates (``merged`` is untouched unless ``inplace``; an
            ``expert_trace`` keeps the blocks done). Under a process group every rank calls it,
            and all must stop alike.

    Returns:
        ``(model, report)``: the calibrated model (new unless ``inplace``) and a
        :class:`CalibrationReport`.
    """
    cfg = config or FeatCalConfig()
    fast = FastPaths() if fast is None else fast
    if not isinstance(fast, FastPaths):
        raise TypeError(f"fast must be a featcal.FastPaths (or None for the defaults), got {type(fast).__name__}.")
    t_start = time.perf_counter()
    # 1. Validate before touching anything.
    tasks, base, experts, path = _checked_models(merged, base, experts, calib_data, blocks, block_source)
    firsts = [arch.resolve_blocks(merged, s)[1][0] for s in path.split(arch.STACK_SEP)]
    validate.check_modules(firsts, cfg.modules, cfg.linear, cfg.layernorm)  # a typo would calibrate nothing

    # 2. The model to calibrate, and its stacks of blocks (an encoder-decoder's two, in forward order).
    device = device_of(merged) if device is None else check_device(device)
    dist = distributed.current(device, "everywhere" if keep_stats else fast.dist_solve)
    if dist is not None:  # the same inputs on every rank, then this rank's share of the batches
        dist.check_same(distributed.input_digests(merged, base, experts, {t: calib_data[t] for t in tasks}, cfg, path))
        calib_data = dist.my_share({t: calib_data[t] for t in tasks})
    model = merged if inplace else copy.deepcopy(merged)
    stacks = path.split(arch.STACK_SEP)
    if block_source is not None and len(stacks) > 1:
        raise ValueError(f"block_source works on one stack of blocks; {path!r} has {len(stacks)}.")
    restore_modes = to_eval(model, base, *experts.values())  # each submodule's flag comes back exactly
    report = CalibrationReport(cfg, path, tasks)
    trace = _bound_trace(expert_trace, experts, calib_data, tasks, path, cfg, device)
    ctx = Context(cfg, fast, 0, device, None if keep_stats else cfg.alpha, Kernels.of(fast))
    run = RunState(ctx, Notes(), report, [] if keep_stats else None, trace, dist=dist, on_block=on_block)
    run.blocks_total = sum(len(arch.resolve_blocks(model, s)[1]) for s in stacks)
    try:
        # 3. Each stack in forward order, block by block.
        for stack in stacks:
            _calibrate_stack(
                run, model, stack, base, experts, {t: calib_data[t] for t in tasks}, progress, block_source
            )
        # 4. What the solves warned of, said once, and a check of the residuals.
        _report_notes(run.notes, report, dist)
    except BaseException:
        if inplace:
            log.error("calibration failed part-way with inplace=True: the model is partly calibrated.")
        raise
    finally:
        restore_modes()
    if keep_stats:
        report.preview_state = Preview(model, path, run.keep, cfg.eps, cfg.bias)
    report.seconds = time.perf_counter() - t_start
    return model, report

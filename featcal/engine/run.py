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
(:func:`_batchable`; the statistics themselves: :mod:`featcal.engine.blockstats`). These and the
other fast paths are switched by the :class:`~featcal.config.FastPaths` passed in.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from featcal.config import FastPaths, FeatCalConfig
from featcal.engine.blocksource import BlockSource, DeviceBlocks, check_device, to_host
from featcal.engine.blockstats import BlockStats, BlockSystems, Context
from featcal.engine.report import BlockRecord, CalibrationReport, ModuleRecord
from featcal.engine.trace import ExpertTrace
from featcal.method import solve
from featcal.model import arch, validate
from featcal.model import loading as sources
from featcal.model.capture import Captured, capture, per_task, sequence_first, sliced, stacked
from featcal.model.modes import to_eval
from featcal.model.streams import (
    BlockCall,
    block_output,
    catch_block_inputs,
    device_of,
    pool_spans,
    pooled,
    run_block,
)
from featcal.util.progress import bar as progress_bar

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One task's batches at the input of the current block."""

    cal: list[BlockCall]
    exp: list[BlockCall]


@dataclass
class _Run:
    """What the steps of every block of one :func:`calibrate` call share."""

    ctx: Context  # config, fast paths, scratch, warnings (featcal.engine.blockstats)
    report: CalibrationReport
    keep: list | None  # each solved module's system and parameters, for a preview
    trace: ExpertTrace | None
    # the stack being calibrated (an encoder-decoder has two, calibrated one after the other)
    path: str = ""
    offset: int = 0  # its first block's number in the report (blocks of earlier stacks before it)
    base_blocks: nn.ModuleList | None = None
    expert_blocks: Mapping[str, nn.ModuleList] | None = None
    streams: dict[str, _Stream] | None = None
    offload: bool = False  # the streams go to the host between blocks


def _prepare_streams(
    model: nn.Module,
    blocks: nn.ModuleList,
    experts: Mapping[str, nn.Module],
    expert_blocks: Mapping[str, nn.ModuleList],
    calib_data: Mapping[str, list],
    offload: bool,
    trace: ExpertTrace | None = None,
    path: str = "",
) -> dict[str, _Stream]:
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
                kept.put(task, 0, b, call)
        if offload:
            cal = [c.with_hidden(to_host(c.hidden)) for c in cal]
        streams[task] = _Stream(cal, list(exp))
    return streams


def _solve_block(run: _Run, block: int, blk: nn.Module, targets, systems: dict) -> None:
    """Solve every target of ``block`` from the snapshot, then load them all (the merged
    parameters are read as views until then; copied only when ``run.keep`` holds on to
    them). The factorisations' buffers come from the scratch and go back to it, and so do
    the systems' ``S`` unless ``run.keep`` holds on to them."""
    cfg, scratch, keep = run.ctx.cfg, run.ctx.scratch, run.keep
    new_params = []
    factors = solve.Factors(run.ctx.fast.lapack_min_d, take=scratch.take)  # one per shared S (q/k/v)
    for t in targets:
        t0 = time.perf_counter()
        W_mer, b_mer = arch.get_params(blk, t)
        if keep is not None:
            W_mer, b_mer = W_mer.clone(), None if b_mer is None else b_mer.clone()
        W_0, b_0 = arch.get_params(run.base_blocks[block], t)
        W_0 = W_0.to(W_mer.device)
        b_0 = None if b_0 is None else b_0.to(W_mer.device)
        sysm = systems[t.name]
        if t.kind == arch.LINEAR:
            W, b, SWt = solve.solve_linear(
                sysm,
                W_mer,
                b_mer,
                W_0,
                b_0,
                lam=cfg.lam,
                rho=cfg.rho,
                alpha=cfg.alpha,
                eps=cfg.eps,
                bias=cfg.bias,
                what=f"block {block} {t.name}",
                with_swt=True,
                factors=factors,
            )
            before, after = solve.linear_residuals(
                sysm, cfg.alpha, (W_mer, b_mer, None, sysm.res.k_mm), (W, b, SWt, None)
            )
            d_in, d_out, rows = W.shape[1], W.shape[0], sysm.min_rows
        else:
            W, b = solve.solve_norm(sysm, W_mer, b_mer, W_0, b_0, lam=cfg.lam, rho=cfg.rho, eps=cfg.eps)
            before = solve.norm_residual(sysm, W_mer, b_mer)
            after = solve.norm_residual(sysm, W, b)
            d_in = d_out = W.shape[0]
            rows = 0
        # The residual after is a sum of products with every entry of W and b: any NaN/Inf there
        # makes it NaN or Inf (inf * 0 is NaN), so it checks them without another pass.
        if not math.isfinite(after):
            raise FloatingPointError(f"block {block}, module {t.name!r}: the solve gave NaN/Inf; raise lam or eps.")
        new_params.append((t, W, b))
        run.report.modules.append(
            ModuleRecord(run.offset + block, t.name, t.kind, d_in, d_out, rows, before, after, time.perf_counter() - t0)
        )
        if keep is not None:
            keep.append((run.offset + block, t, sysm, W_mer, b_mer, W_0, b_0))
    for t, W, b in new_params:
        arch.set_params(blk, t, W, b)
    run.ctx.fallbacks.extend(factors.notes)
    scratch.give(factors.close())
    if keep is None:
        scratch.give([s.S for s in systems.values() if isinstance(s, solve.LinearSystem) and s.owns_S])


def _pool(streams: dict[str, _Stream], max_rows: int) -> tuple[list[tuple[str, int]], list, list] | None:
    """``(keys, calls, spans)`` to run every task's calibrating batches as one call (fewer,
    larger calls: small models are dominated by per-call costs), or None (see
    :func:`featcal.model.streams.pool_spans`; ``max_rows``: :attr:`FastPaths.pool_rows`)."""
    keys = [(task, b) for task, st in streams.items() for b in range(len(st.cal))]
    calls = [streams[task].cal[b] for task, b in keys]
    spans = pool_spans(calls, max_rows)
    return None if spans is None else (keys, calls, spans)


def _pooled_capture(blk, targets, pool, device) -> Captured | None:
    """The still-merged block's captures of every (task, batch) from one pooled call (``pool``
    from :func:`_pool`, whose spans cut them back; None: nothing pooled here)."""
    if pool is None:
        return None
    with capture(blk, targets, outputs=True) as cs:
        run_block(blk, pooled(pool[1]), device)
    return cs


def _batchable(streams: dict[str, _Stream], pool, widths: list[int], max_elems: int) -> bool:
    """Whether every task's statistics can be reduced as one stack (one call per operation,
    not one per task: small models are dominated by per-call costs): the calibrating batches
    are pooled, each task has one batch, all of one shape (the expert batches too), and the
    stacked Gram matrices stay small (``max_elems``: :attr:`FastPaths.stack_max`)."""
    sts = list(streams.values())
    if pool is None or not widths or any(len(st.cal) != 1 for st in sts):
        return False
    cal, exp = sts[0].cal[0].hidden.shape, sts[0].exp[0].hidden.shape
    if any(st.cal[0].hidden.shape != cal or st.exp[0].hidden.shape != exp for st in sts):
        return False
    return len(sts) * max(widths) ** 2 <= max_elems


def _stack_params(params: list[tuple[torch.Tensor, torch.Tensor | None]]):
    """Every task's ``(W_i, b_i)`` of one target, stacked: ``((T, o, d), (T, o) or None)``."""
    W, b = zip(*params)
    return torch.stack(W), None if b[0] is None else torch.stack(b)


def _advance(run: _Run, block: int, blk: nn.Module, pool) -> None:
    """Step 3: move the calibrating streams through the calibrated block (in one call when
    ``pool``, from :func:`_pool` before step 1: the calibrating streams have not moved since)."""
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


def _expert_step(run: _Run, eblk: nn.Module, targets, st: _Stream, b: int, key: tuple | None) -> Captured:
    """Run expert i's block on its batch ``b`` with the targets' inputs captured, and move
    that batch of its stream on to the block's output (both from the trace at ``key`` when
    it has them; ``key`` None: the trace is not used)."""
    ec = st.exp[b]
    trace = None if key is None else run.trace
    ce = nxt = None
    if trace is not None:
        path, block, task, _ = key
        ce, nxt = trace.captures.get(key), trace.stream(path).get(task, block + 1, b)
    if ce is None or nxt is None:
        with capture(eblk, targets, outputs=True) as ce:
            nxt = ec.after(block_output(eblk, ec, run.ctx.device))
        nxt = nxt.with_hidden(to_host(nxt.hidden)) if run.offload else nxt
        if trace is not None:
            trace.captures[key] = ce
            trace.stream(path).put(task, block + 1, b, nxt)
    st.exp[b] = nxt
    return ce


def _add_stacked(run: _Run, block: int, targets, merged_params: dict, merged_cap: Captured, into: BlockSystems) -> None:
    """Step 1 with every task reduced as one stack (:func:`_batchable`): the expert blocks'
    captures and parameters stacked on a leading task axis (or from the trace), the pooled
    merged captures seen with one."""
    streams, trace = run.streams, run.trace
    tasks = list(streams)
    kept = None if trace is None else trace.stream(run.path)
    hit = None if trace is None else trace.stacked.get((run.path, block))
    outs = None if kept is None else [kept.get(task, block + 1, 0) for task in tasks]
    if hit is None or any(o is None for o in outs):
        eblks = [run.expert_blocks[task][block] for task in tasks]
        ces = [_expert_step(run, eblk, targets, streams[task], 0, None) for task, eblk in zip(tasks, eblks)]
        params = {t.name: _stack_params([arch.get_params(eblk, t) for eblk in eblks]) for t in targets}
        hit, outs = (stacked(ces), params), [streams[task].exp[0] for task in tasks]
        if trace is not None:
            trace.stacked[run.path, block] = hit
            for task, out in zip(tasks, outs):
                kept.put(task, block + 1, 0, out)
    ce_stack, expert_params = hit
    for task, out in zip(tasks, outs):
        streams[task].exp[0] = out
    rows = streams[tasks[0]].cal[0].hidden.shape[:-1].numel()
    acc = BlockStats(run.ctx, block, targets, expert_params, merged_params, rows, lead=1)
    acc.add(per_task(merged_cap, len(tasks)), ce_stack, None)
    into.add(acc, expert_params, tasks[0])
    acc.release()


def _add_each_task(
    run: _Run,
    block: int,
    blk: nn.Module,
    targets,
    merged_params: dict,
    merged_cap: Captured | None,
    pool,
    into: BlockSystems,
) -> None:
    """Step 1 task by task, batch by batch: the still-merged block's captures cut from the
    pooled call (``merged_cap``) or from a call of their own, the expert's from its block."""
    device = run.ctx.device
    caps = None if merged_cap is None else {key: sliced(merged_cap, lo, hi) for key, (lo, hi) in zip(pool[0], pool[2])}
    for task, st in run.streams.items():
        eblk = run.expert_blocks[task][block]
        expert_params = {t.name: arch.get_params(eblk, t) for t in targets}
        rows = sum(c.hidden.shape[:-1].numel() for c in st.cal)
        acc = BlockStats(run.ctx, block, targets, expert_params, merged_params, rows, one_batch=len(st.cal) == 1)
        for b, cc in enumerate(st.cal):
            if caps is not None:
                cs = caps.pop((task, b))
            else:
                with capture(blk, targets, outputs=True) as cs:
                    run_block(blk, cc, device)
            ce = _expert_step(run, eblk, targets, st, b, (run.path, block, task, b))
            acc.add(cs, ce, cc.mask_for)  # each input's padding mask: the decoder's or the encoder's tokens
        into.add(acc, expert_params, task)
        acc.release()


def _block_systems(run: _Run, block: int, blk: nn.Module, targets, pool) -> dict:
    """Step 1 for ``block``: the snapshot statistics of every task, reduced task by task
    (or all tasks at once, :func:`_batchable`) into each target's system. Advances the expert
    streams as a side effect. With ``run.ctx.alpha`` set, systems for that alpha only
    (cheaper; no preview from them; their ``S`` then come from the scratch, as do the
    statistics' buffers in any case: kept from task to task and block to block)."""
    merged_params = {t.name: arch.get_params(blk, t) for t in targets}
    into = BlockSystems(run.ctx, block, targets)
    merged_cap = _pooled_capture(blk, targets, pool, run.ctx.device)
    widths = [p[0].shape[-1] for t, p in zip(targets, merged_params.values()) if t.kind == arch.LINEAR]
    if _batchable(run.streams, pool, widths, run.ctx.fast.stack_max):
        _add_stacked(run, block, targets, merged_params, merged_cap, into)
    else:
        _add_each_task(run, block, blk, targets, merged_params, merged_cap, pool, into)
    return into.finish()


def _calibrate_stack(
    run: _Run,
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
        warnings.warn(msg, stacklevel=4)
        report.warnings.append(msg)
    source = block_source
    if source is None and ctx.device != device_of(model):  # one block of each model on the device at a time
        source = DeviceBlocks(ctx.device, blks, [run.base_blocks, *run.expert_blocks.values()])
    source = source or BlockSource()
    try:
        _visit_blocks(run, source, model, blks, experts, calib_data, progress)
    finally:
        source.close()


def _visit_blocks(run: _Run, source: BlockSource, model, blks, experts, calib_data, progress: bool) -> None:
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
    bar = progress_bar(range(source.first, len(blks)), desc=desc, unit="block", show=progress)
    for block in bar:
        source.enter(block)  # block `block` of every model where it runs
        blk = blks[block]
        targets = arch.block_targets(blk, linear=cfg.linear, layernorm=cfg.layernorm, only=cfg.modules)
        # 1. Snapshot statistics of the still-merged block (and advance the experts).
        t0 = time.perf_counter()
        # the calibrating batches as one call, for steps 1 and 3 (not for sequence-first streams:
        # they would be joined along their token axis)
        pool = None if sequence_first(blk) else _pool(streams, fast.pool_rows)
        systems = _block_systems(run, block, blk, targets, pool)
        ctx.scratch.trim(fast.scratch_keep)  # big Gram buffers go before the solve (kept, they add to its peak)
        t1 = time.perf_counter()
        # 2. Solve all modules of the block, then load them together.
        _solve_block(run, block, blk, targets, systems)
        ctx.scratch.trim(fast.scratch_keep)  # and big systems and factors before the advance
        t2 = time.perf_counter()
        # 3. Advance the calibrating streams through the calibrated block.
        _advance(run, block, blk, pool)
        report.blocks.append(BlockRecord(run.offset + block, t1 - t0, t2 - t1, time.perf_counter() - t2))
        source.leave(block, streams, report)
        bar.set_postfix_str(f"block {block}: {len(targets)} modules")


def _summarised(notes: list[str], first: int = 3) -> list[str]:
    """The first ``first`` of ``notes`` and one line counting the rest (one per module could be hundreds)."""
    if len(notes) <= first:
        return list(notes)
    return notes[:first] + [f"... and {len(notes) - first} more modules re-solved the same way."]


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
) -> tuple[nn.Module, CalibrationReport]:
    """Calibrate a merged model toward its experts with FeatCal.

    Args:
        merged: the merged model ``M_mer``; left untouched unless ``inplace=True``.
        base: the pretrained model ``M_0`` (the anchor's second end).
        experts: ``{task: M_i}``, same architecture as ``merged``. ``base`` and each expert may
            also be a state dict, a checkpoint file or a local model directory (Hugging Face
            ``save_pretrained`` layout), loaded strictly into a copy of ``merged``
            (:mod:`featcal.model.loading`).
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
    tasks = validate.check_tasks(experts, calib_data)
    base = sources.as_model(base, merged, "base")  # a state dict or a model directory: into a copy of merged
    experts = {t: sources.as_model(experts[t], merged, f"expert {t!r}") for t in tasks}

    def stacks_of(m: nn.Module) -> str:
        return arch.STACK_SEP.join(p for p, _ in arch.resolve_stacks(m, blocks))

    if block_source is None or block_source.loaded:
        path = validate.check_models(
            merged, [("base", base)] + [(f"expert {t!r}", experts[t]) for t in tasks], stacks_of
        )
    else:  # skeletons: the source checks each block as it loads it
        path = stacks_of(merged)

    # 2. The model to calibrate, and its stacks of blocks (an encoder-decoder's two, in forward order).
    model = merged if inplace else copy.deepcopy(merged)
    stacks = path.split(arch.STACK_SEP)
    device = device_of(model) if device is None else check_device(device)
    if block_source is not None and len(stacks) > 1:
        raise ValueError(f"block_source works on one stack of blocks; {path!r} has {len(stacks)}.")
    restore_modes = to_eval(model, base, *experts.values())  # each submodule's flag comes back exactly
    report = CalibrationReport(cfg, path, tasks)
    trace = None
    if expert_trace is not None:
        what = (path, cfg.linear, cfg.layernorm, tuple(cfg.modules or ()), cfg.offload_streams, str(device))
        trace = expert_trace.bind(experts, calib_data, tasks, what)
    ctx = Context(cfg, fast, 0, device, alpha=None if keep_stats else cfg.alpha)
    run = _Run(ctx, report, [] if keep_stats else None, trace)
    try:
        # 3. Each stack in forward order, block by block.
        for stack in stacks:
            _calibrate_stack(
                run, model, stack, base, experts, {t: calib_data[t] for t in tasks}, progress, block_source
            )
        for msg in ctx.warn_rows + _summarised(ctx.fallbacks):
            warnings.warn(msg, stacklevel=3)
            report.warnings.append(msg)
        rose = report.check_residuals()
        if rose is not None:
            warnings.warn(rose, stacklevel=3)
    except BaseException:
        if inplace:
            log.error("calibration failed part-way with inplace=True: the model is partly calibrated.")
        raise
    finally:
        restore_modes()
    if keep_stats:
        from featcal.engine.preview import Preview

        report.preview_state = Preview(model, path, run.keep, cfg.eps, cfg.bias)
    report.seconds = time.perf_counter() - t_start
    return model, report

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
(:func:`featcal.streams.pool_spans`: few rows, no padding mask, no tensor argument),
the still-merged block of step 1 and the calibrated block of step 3 see them in one
call, and step 1's captures are cut back into each task's batches; when, moreover, each
task is one batch of one shape, every task's statistics are reduced as one stack
(:func:`_batchable`; the statistics themselves: :mod:`featcal.blockstats`). These and the
other fast paths are switched by the :class:`~featcal.config.FastPaths` passed in.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from featcal import arch, solve, validate
from featcal.blockstats import BlockStats, BlockSystems, Context
from featcal.capture import Captured, capture, per_task, sliced, stacked
from featcal.config import FastPaths, FeatCalConfig
from featcal.modes import to_eval
from featcal.progress import bar as progress_bar
from featcal.report import BlockRecord, CalibrationReport, ModuleRecord
from featcal.streams import BlockCall, catch_block_inputs, device_of, pool_spans, pooled, run_block

log = logging.getLogger(__name__)


class ExpertTrace:
    """What :func:`calibrate` computes of the experts, kept for the next call on the same
    experts and calibration data: their stems' outputs, and per block their captures, stacked
    parameters and next streams. None of it depends on the merged model or the
    hyper-parameters, so an app that re-runs the exact calibration for every slider move
    (the merged model, lam, rho or alpha changed) runs no expert block again.

    Bound to the very expert modules, batches, blocks and modules of its first use (held by
    weak references; dict batches, which take none, by plain ones): any other ones clear it.
    The experts and the batches must not be changed in place while it is used. It holds every
    block's expert captures (about one forward pass of activations per task), so keep it for
    small models.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: list = []
        self.stems: dict[str, list[BlockCall]] = {}
        self.steps: dict[tuple, tuple[Captured, torch.Tensor]] = {}  # (block, task, batch) -> (captures, output)
        # block -> (stacked captures, stacked params, each task's output): all tasks reduced as one stack
        self.stacked: dict[int, tuple[Captured, dict, list[torch.Tensor]]] = {}

    def bind(
        self, experts: Mapping[str, nn.Module], calib_data: Mapping[str, list], tasks: list[str], key: tuple
    ) -> "ExpertTrace":
        """Clear the trace unless it was made with these experts, batches and ``key`` (the
        blocks' path and what decides the captured modules)."""
        objs = [experts[t] for t in tasks] + [b for t in tasks for b in calib_data[t]]
        key = (key, tuple(tasks), tuple(len(calib_data[t]) for t in tasks))
        alive = [r() for r in self._refs]
        if self._key != key or len(alive) != len(objs) or any(a is not o for a, o in zip(alive, objs)):
            self.__init__()
            self._key = key
            self._refs = [_ref(o) for o in objs]
        return self


def _ref(obj):
    """A weak reference to ``obj``; a plain dict batch takes none, so it is held as it is
    (its tensors are the caller's anyway)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


@dataclass
class _Stream:
    """One task's batches at the input of the current block."""

    cal: list[BlockCall]
    exp: list[BlockCall]


@dataclass
class _Run:
    """What the steps of every block of one :func:`calibrate` call share."""

    ctx: Context  # config, fast paths, scratch, warnings (featcal.blockstats)
    base_blocks: nn.ModuleList
    expert_blocks: Mapping[str, nn.ModuleList]
    streams: dict[str, _Stream]
    report: CalibrationReport
    keep: list | None  # each solved module's system and parameters, for a preview
    trace: ExpertTrace | None


def _prepare_streams(
    model: nn.Module,
    blocks: nn.ModuleList,
    experts: Mapping[str, nn.Module],
    expert_blocks: Mapping[str, nn.ModuleList],
    calib_data: Mapping[str, list],
    offload: bool,
    trace: ExpertTrace | None = None,
) -> dict[str, _Stream]:
    """Run every stem once per batch: the calibrating model's and expert i's on D_i (the
    latter from ``trace`` when it has them)."""
    streams = {}
    for task, batches in calib_data.items():
        cal = [catch_block_inputs(model, blocks[0], b) for b in batches]
        exp = None if trace is None else trace.stems.get(task)
        if exp is None:
            exp = [catch_block_inputs(experts[task], expert_blocks[task][0], b) for b in batches]
            if offload:
                exp = [c.with_hidden(c.hidden.cpu()) for c in exp]
            if trace is not None:
                trace.stems[task] = exp
        if offload:
            cal = [c.with_hidden(c.hidden.cpu()) for c in cal]
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
            ModuleRecord(block, t.name, t.kind, d_in, d_out, rows, before, after, time.perf_counter() - t0)
        )
        if keep is not None:
            keep.append((block, t, sysm, W_mer, b_mer, W_0, b_0))
    for t, W, b in new_params:
        arch.set_params(blk, t, W, b)
    scratch.give(factors.close())
    if keep is None:
        scratch.give([s.S for s in systems.values() if isinstance(s, solve.LinearSystem) and s.owns_S])


def _pool(streams: dict[str, _Stream], max_rows: int) -> tuple[list[tuple[str, int]], list, list] | None:
    """``(keys, calls, spans)`` to run every task's calibrating batches as one call (fewer,
    larger calls: small models are dominated by per-call costs), or None (see
    :func:`featcal.streams.pool_spans`; ``max_rows``: :attr:`FastPaths.pool_rows`)."""
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
    device, offload = run.ctx.device, run.ctx.cfg.offload_streams
    outs: dict[tuple[str, int], torch.Tensor] = {}
    if pool is not None:
        keys, calls, spans = pool
        h = run_block(blk, pooled(calls), device)
        h = h.cpu() if offload else h
        outs = {key: h[lo:hi] for key, (lo, hi) in zip(keys, spans)}
    else:
        for task, st in run.streams.items():
            for b, cc in enumerate(st.cal):
                h = run_block(blk, cc, device)
                outs[task, b] = h.cpu() if offload else h
    for task, st in run.streams.items():
        hs = [outs[task, b] for b in range(len(st.cal))]
        if not bool(torch.stack([torch.isfinite(x).all() for x in hs]).all()):  # one sync per task
            raise FloatingPointError(
                f"block {block}: the calibrated block's output on task {task!r} "
                "holds NaN or Inf; raise lam or check the data."
            )
        st.cal = [cc.with_hidden(x) for cc, x in zip(st.cal, hs)]


def _expert_step(run: _Run, eblk: nn.Module, targets, st: _Stream, b: int, key: tuple | None) -> Captured:
    """Run expert i's block on its batch ``b`` with the targets' inputs captured, and move
    that batch of its stream on to the block's output (both from the trace at ``key`` when
    it has them; ``key`` None: the trace is not used)."""
    ec = st.exp[b]
    trace = None if key is None else run.trace
    hit = None if trace is None else trace.steps.get(key)
    if hit is None:
        with capture(eblk, targets, outputs=True) as ce:
            out = run_block(eblk, ec, run.ctx.device)
        hit = (ce, out.cpu() if run.ctx.cfg.offload_streams else out)
        if trace is not None:
            trace.steps[key] = hit
    st.exp[b] = ec.with_hidden(hit[1])
    return hit[0]


def _add_stacked(run: _Run, block: int, targets, merged_params: dict, merged_cap: Captured, into: BlockSystems) -> None:
    """Step 1 with every task reduced as one stack (:func:`_batchable`): the expert blocks'
    captures and parameters stacked on a leading task axis (or from the trace), the pooled
    merged captures seen with one."""
    streams, trace = run.streams, run.trace
    tasks = list(streams)
    hit = None if trace is None else trace.stacked.get(block)
    if hit is None:
        eblks = [run.expert_blocks[task][block] for task in tasks]
        ces = [_expert_step(run, eblk, targets, streams[task], 0, None) for task, eblk in zip(tasks, eblks)]
        params = {t.name: _stack_params([arch.get_params(eblk, t) for eblk in eblks]) for t in targets}
        hit = (stacked(ces), params, [streams[task].exp[0].hidden for task in tasks])
        if trace is not None:
            trace.stacked[block] = hit
    ce_stack, expert_params, outs = hit
    for task, out in zip(tasks, outs):
        streams[task].exp[0] = streams[task].exp[0].with_hidden(out)
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
            ce = _expert_step(run, eblk, targets, st, b, (block, task, b))
            acc.add(cs, ce, cc.mask if cc.mask is None else cc.mask.to(device))
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
) -> tuple[nn.Module, CalibrationReport]:
    """Calibrate a merged model toward its experts with FeatCal.

    Args:
        merged: the merged model ``M_mer``; left untouched unless ``inplace=True``.
        base: the pretrained model ``M_0`` (the anchor's second end).
        experts: ``{task: M_i}``, same architecture as ``merged``.
        calib_data: ``{task: [batch, ...]}``; a batch is a tensor (``model(batch)``) or a
            dict (``model(**batch)``; an ``attention_mask`` in it marks padding).
        config: hyper-parameters and switches (:class:`FeatCalConfig`).
        blocks: dotted path of the ``nn.ModuleList`` of blocks; optional for known architectures.
        inplace: calibrate ``merged`` itself (saves one model copy for big models).
        keep_stats: keep each module's system in the report for ``report.preview(...)``.
        progress: show a progress bar per block.
        expert_trace: an :class:`ExpertTrace` to keep what is computed of the experts (their
            blocks' captures and streams) and reuse it on the next call with the same experts
            and batches (repeated calibrations of one zoo, e.g. an app's sliders).
        fast: which of the engine's faster, equivalent paths it may take (:class:`FastPaths`;
            default: every one where it pays; ``FastPaths.plainest()``: none).

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
    path = validate.check_models(
        merged,
        [("base", base)] + [(f"expert {t!r}", experts[t]) for t in tasks],
        lambda m: arch.resolve_blocks(m, blocks)[0],
    )

    # 2. The model to calibrate, and every model's blocks.
    model = merged if inplace else copy.deepcopy(merged)
    _, blks = arch.resolve_blocks(model, path)
    _, base_blks = arch.resolve_blocks(base, path)
    exp_blks = {t: arch.resolve_blocks(experts[t], path)[1] for t in tasks}
    device = device_of(model)
    restore_modes = to_eval(model, base, *experts.values())  # each submodule's flag comes back exactly
    report = CalibrationReport(cfg, path, tasks)
    trace = None
    if expert_trace is not None:
        what = (path, cfg.linear, cfg.layernorm, tuple(cfg.modules or ()), cfg.offload_streams, str(device))
        trace = expert_trace.bind(experts, calib_data, tasks, what)
    ctx = Context(cfg, fast, len(blks), device, alpha=None if keep_stats else cfg.alpha)
    try:
        # 3. The streams at the input of block 0.
        streams = _prepare_streams(
            model, blks, experts, exp_blks, {t: calib_data[t] for t in tasks}, cfg.offload_streams, trace
        )
        run = _Run(ctx, base_blks, exp_blks, streams, report, [] if keep_stats else None, trace)
        bar = progress_bar(range(len(blks)), desc="FeatCal", unit="block", show=progress)
        for block in bar:
            blk = blks[block]
            targets = arch.block_targets(blk, linear=cfg.linear, layernorm=cfg.layernorm, only=cfg.modules)
            # 3a. Snapshot statistics of the still-merged block (and advance the experts).
            t0 = time.perf_counter()
            pool = _pool(streams, fast.pool_rows)  # the calibrating batches as one call, for steps 1 and 3
            systems = _block_systems(run, block, blk, targets, pool)
            ctx.scratch.trim(fast.scratch_keep)  # big Gram buffers go before the solve (kept, they add to its peak)
            t1 = time.perf_counter()
            # 3b. Solve all modules of the block, then load them together.
            _solve_block(run, block, blk, targets, systems)
            ctx.scratch.trim(fast.scratch_keep)  # and big systems and factors before the advance
            t2 = time.perf_counter()
            # 3c. Advance the calibrating streams through the calibrated block.
            _advance(run, block, blk, pool)
            report.blocks.append(BlockRecord(block, t1 - t0, t2 - t1, time.perf_counter() - t2))
            bar.set_postfix_str(f"block {block}: {len(targets)} modules")
        for msg in ctx.warn_rows:
            warnings.warn(msg, stacklevel=3)
            report.warnings.append(msg)
    except BaseException:
        if inplace:
            log.error("calibration failed part-way with inplace=True: the model is partly calibrated.")
        raise
    finally:
        restore_modes()
    if keep_stats:
        from featcal.preview import Preview

        report.preview_state = Preview(model, path, run.keep, cfg.eps, cfg.bias)
    report.seconds = time.perf_counter() - t_start
    return model, report

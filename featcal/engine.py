"""The FeatCal engine: visit the blocks in forward order and replace each
calibrated module by its closed-form solution (``../shared/FEATCAL_SPEC.md``).

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
(:func:`_batchable`; the statistics themselves: :mod:`featcal.blockstats`).
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
from tqdm.auto import tqdm

from featcal import arch, solve, validate
from featcal.blockstats import SCRATCH_KEEP, BlockStats, BlockSystems, Scratch
from featcal.capture import Captured, capture, per_task, sliced, stacked
from featcal.config import FeatCalConfig
from featcal.modes import to_eval
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
    weak references): any other ones clear it. The experts and the batches must not be
    changed in place while it is used. It holds every block's expert captures (about one
    forward pass of activations per task), so keep it for small models.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: list = []
        self.stems: dict[str, list[BlockCall]] = {}
        self.steps: dict[tuple, tuple[Captured, torch.Tensor]] = {}   # (block, task, batch) -> (captures, output)
        # block -> (stacked captures, stacked params, each task's output): all tasks reduced as one stack
        self.stacked: dict[int, tuple[Captured, dict, list[torch.Tensor]]] = {}

    def bind(self, experts: Mapping[str, nn.Module], calib_data: Mapping[str, list], tasks: list[str],
             key: tuple) -> "ExpertTrace":
        """Clear the trace unless it was made with these experts, batches and ``key`` (the
        blocks' path and what decides the captured modules)."""
        objs = [experts[t] for t in tasks] + [b for t in tasks for b in calib_data[t]]
        key = (key, tuple(tasks), tuple(len(calib_data[t]) for t in tasks))
        alive = [r() for r in self._refs]
        if self._key != key or len(alive) != len(objs) or any(a is not o for a, o in zip(alive, objs)):
            self.__init__()
            self._key = key
            self._refs = [weakref.ref(o) for o in objs]
        return self


@dataclass
class _Stream:
    """One task's batches at the input of the current block."""

    cal: list[BlockCall]
    exp: list[BlockCall]


def _prepare_streams(model: nn.Module, blocks: nn.ModuleList, experts: Mapping[str, nn.Module],
                     expert_blocks: Mapping[str, nn.ModuleList], calib_data: Mapping[str, list],
                     offload: bool, trace: ExpertTrace | None = None) -> dict[str, _Stream]:
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


def _solve_block(l: int, targets, systems, blk, base_blk, cfg: FeatCalConfig, report: CalibrationReport,
                 keep: list | None, scratch: Scratch) -> None:
    """Solve every target of block ``l`` from the snapshot, then load them all (the merged
    parameters are read as views until then; copied only when ``keep`` holds on to them).
    The factorisations' buffers come from ``scratch`` and go back to it, and so do the
    systems' ``S`` unless ``keep`` holds on to them."""
    new_params = []
    factors: dict = {}                      # one factorisation per shared S (q/k/v)
    taken: list[torch.Tensor] = []

    def take(*args, **kwargs) -> torch.Tensor:
        taken.append(scratch.take(*args, **kwargs))
        return taken[-1]

    for t in targets:
        t0 = time.perf_counter()
        W_mer, b_mer = arch.get_params(blk, t)
        if keep is not None:
            W_mer, b_mer = W_mer.clone(), None if b_mer is None else b_mer.clone()
        W_0, b_0 = arch.get_params(base_blk, t)
        W_0 = W_0.to(W_mer.device)
        b_0 = None if b_0 is None else b_0.to(W_mer.device)
        sysm = systems[t.name]
        if t.kind == arch.LINEAR:
            W, b, SWt = solve.solve_linear(sysm, W_mer, b_mer, W_0, b_0, lam=cfg.lam, rho=cfg.rho,
                                           alpha=cfg.alpha, eps=cfg.eps, bias=cfg.bias,
                                           what=f"block {l} {t.name}", with_swt=True, factors=factors,
                                           take=take)
            before, after = solve.linear_residuals(sysm, cfg.alpha, (W_mer, b_mer, None, sysm.k_mm),
                                                   (W, b, SWt, None))
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
            raise FloatingPointError(f"block {l}, module {t.name!r}: the solve gave NaN/Inf; raise lam or eps.")
        new_params.append((t, W, b))
        report.modules.append(ModuleRecord(l, t.name, t.kind, d_in, d_out, rows, before, after,
                                           time.perf_counter() - t0))
        if keep is not None:
            keep.append((l, t, sysm, W_mer, b_mer, W_0, b_0))
    for t, W, b in new_params:
        arch.set_params(blk, t, W, b)
    factors.clear()
    scratch.give(taken)
    if keep is None:
        scratch.give([s.S for s in systems.values() if isinstance(s, solve.LinearSystem) and s.owns_S])


def _pool(streams: dict[str, _Stream]) -> tuple[list[tuple[str, int]], list, list] | None:
    """``(keys, calls, spans)`` to run every task's calibrating batches as one call (fewer,
    larger calls: small models are dominated by per-call costs), or None (see
    :func:`featcal.streams.pool_spans`)."""
    keys = [(task, b) for task, st in streams.items() for b in range(len(st.cal))]
    calls = [streams[task].cal[b] for task, b in keys]
    spans = pool_spans(calls)
    return None if spans is None else (keys, calls, spans)


def _pooled_capture(blk, targets, pool, device) -> Captured | None:
    """The still-merged block's captures of every (task, batch) from one pooled call (``pool``
    from :func:`_pool`, whose spans cut them back; None: nothing pooled here)."""
    if pool is None:
        return None
    with capture(blk, targets, outputs=True) as cs:
        run_block(blk, pooled(pool[1]), device)
    return cs


BATCH_TASKS_MAX = 1 << 22   # tasks x (widest input)^2 elements up to which all tasks reduce as one stack


def _batchable(streams: dict[str, _Stream], pool, widths: list[int]) -> bool:
    """Whether every task's statistics can be reduced as one stack (one call per operation,
    not one per task: small models are dominated by per-call costs): the calibrating batches
    are pooled, each task has one batch, all of one shape (the expert batches too), and the
    stacked Gram matrices stay small (``BATCH_TASKS_MAX``)."""
    sts = list(streams.values())
    if pool is None or not widths or any(len(st.cal) != 1 for st in sts):
        return False
    cal, exp = sts[0].cal[0].hidden.shape, sts[0].exp[0].hidden.shape
    if any(st.cal[0].hidden.shape != cal or st.exp[0].hidden.shape != exp for st in sts):
        return False
    return len(sts) * max(widths) ** 2 <= BATCH_TASKS_MAX


def _stack_params(params: list[tuple[torch.Tensor, torch.Tensor | None]]):
    """Every task's ``(W_i, b_i)`` of one target, stacked: ``((T, o, d), (T, o) or None)``."""
    W, b = zip(*params)
    return torch.stack(W), None if b[0] is None else torch.stack(b)


def _advance(blk, streams: dict[str, _Stream], pool, device, offload: bool, l: int) -> None:
    """Step 3: move the calibrating streams through the calibrated block (in one call when
    ``pool``, from :func:`_pool` before step 1: the calibrating streams have not moved since)."""
    outs: dict[tuple[str, int], torch.Tensor] = {}
    if pool is not None:
        keys, calls, spans = pool
        h = run_block(blk, pooled(calls), device)
        h = h.cpu() if offload else h
        outs = {key: h[lo:hi] for key, (lo, hi) in zip(keys, spans)}
    else:
        for task, st in streams.items():
            for b, cc in enumerate(st.cal):
                h = run_block(blk, cc, device)
                outs[task, b] = h.cpu() if offload else h
    for task, st in streams.items():
        hs = [outs[task, b] for b in range(len(st.cal))]
        if not bool(torch.stack([torch.isfinite(x).all() for x in hs]).all()):   # one sync per task
            raise FloatingPointError(f"block {l}: the calibrated block's output on task {task!r} "
                                     "holds NaN or Inf; raise lam or check the data.")
        st.cal = [cc.with_hidden(x) for cc, x in zip(st.cal, hs)]


def _expert_step(eblk, targets, st: _Stream, b: int, device, offload: bool,
                 trace: ExpertTrace | None = None, key: tuple = ()) -> Captured:
    """Run expert i's block on its batch ``b`` with the targets' inputs captured, and move
    that batch of its stream on to the block's output (both from ``trace`` at ``key`` when
    it has them)."""
    ec = st.exp[b]
    hit = None if trace is None else trace.steps.get(key)
    if hit is None:
        with capture(eblk, targets, outputs=True) as ce:
            out = run_block(eblk, ec, device)
        hit = (ce, out.cpu() if offload else out)
        if trace is not None:
            trace.steps[key] = hit
    st.exp[b] = ec.with_hidden(hit[1])
    return hit[0]


def _block_systems(l: int, n_blocks: int, targets, blk, exp_blocks, streams, pool, cfg: FeatCalConfig,
                   device, warn_rows: list, alpha: float | None, scratch: Scratch,
                   trace: ExpertTrace | None = None) -> dict:
    """Step 1 for block ``l``: the snapshot statistics of every task, reduced task by task
    (or all tasks at once, :func:`_batchable`) into each target's system. Advances the expert
    streams as a side effect. ``alpha`` given: systems for that alpha only (cheaper; no
    preview from them; their ``S`` then come from ``scratch``, as do the statistics' buffers
    in any case: kept from task to task and block to block, fresh ones cost page faults)."""
    merged_params = {t.name: arch.get_params(blk, t) for t in targets}
    into = BlockSystems(cfg, l, targets, device, warn_rows, alpha, take=None if alpha is None else scratch.take)
    merged_cap = _pooled_capture(blk, targets, pool, device)
    widths = [p[0].shape[-1] for t, p in zip(targets, merged_params.values()) if t.kind == arch.LINEAR]
    if _batchable(streams, pool, widths):
        tasks = list(streams)
        hit = None if trace is None else trace.stacked.get(l)
        if hit is None:
            ces = [_expert_step(exp_blocks[task][l], targets, streams[task], 0, device, cfg.offload_streams)
                   for task in tasks]
            hit = (stacked(ces), {t.name: _stack_params([arch.get_params(exp_blocks[task][l], t) for task in tasks])
                                  for t in targets}, [streams[task].exp[0].hidden for task in tasks])
            if trace is not None:
                trace.stacked[l] = hit
        ce_stack, expert_params, outs = hit
        for task, out in zip(tasks, outs):
            streams[task].exp[0] = streams[task].exp[0].with_hidden(out)
        rows = streams[tasks[0]].cal[0].hidden.shape[:-1].numel()
        acc = BlockStats(cfg, l, n_blocks, targets, expert_params, merged_params, rows, alpha, scratch, lead=1)
        acc.add(per_task(merged_cap, len(tasks)), ce_stack, None)
        into.add(acc, expert_params, tasks[0])
        acc.release()
        return into.finish()
    caps = None if merged_cap is None else {key: sliced(merged_cap, lo, hi)
                                            for key, (lo, hi) in zip(pool[0], pool[2])}
    for task, st in streams.items():
        eblk = exp_blocks[task][l]
        expert_params = {t.name: arch.get_params(eblk, t) for t in targets}
        rows = sum(c.hidden.shape[:-1].numel() for c in st.cal)
        acc = BlockStats(cfg, l, n_blocks, targets, expert_params, merged_params, rows, alpha, scratch,
                         one_batch=len(st.cal) == 1)
        for b, cc in enumerate(st.cal):
            if caps is not None:
                cs = caps.pop((task, b))
            else:
                with capture(blk, targets, outputs=True) as cs:
                    run_block(blk, cc, device)
            ce = _expert_step(eblk, targets, st, b, device, cfg.offload_streams, trace, (l, task, b))
            acc.add(cs, ce, cc.mask if cc.mask is None else cc.mask.to(device))
        into.add(acc, expert_params, task)
        acc.release()
    return into.finish()


@torch.no_grad()
def calibrate(merged: nn.Module, *, base: nn.Module, experts: Mapping[str, nn.Module],
              calib_data: Mapping[str, list], config: FeatCalConfig | None = None,
              blocks: str | None = None, inplace: bool = False, keep_stats: bool = False,
              progress: bool = True, expert_trace: ExpertTrace | None = None
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

    Returns:
        ``(model, report)``: the calibrated model (new unless ``inplace``) and a
        :class:`CalibrationReport`.
    """
    cfg = config or FeatCalConfig()
    t_start = time.perf_counter()
    # 1. Validate before touching anything.
    tasks = validate.check_tasks(experts, calib_data)
    path = validate.check_models(merged, [("base", base)] + [(f"expert {t!r}", experts[t]) for t in tasks],
                                 lambda m: arch.resolve_blocks(m, blocks)[0])

    # 2. The model to calibrate, and every model's blocks.
    model = merged if inplace else copy.deepcopy(merged)
    _, blks = arch.resolve_blocks(model, path)
    _, base_blks = arch.resolve_blocks(base, path)
    exp_blks = {t: arch.resolve_blocks(experts[t], path)[1] for t in tasks}
    device = device_of(model)
    restore_modes = to_eval(model, base, *experts.values())   # each submodule's flag comes back exactly
    report = CalibrationReport(cfg, path, tasks)
    keep: list | None = [] if keep_stats else None
    trace = None
    if expert_trace is not None:
        what = (path, cfg.linear, cfg.layernorm, tuple(cfg.modules or ()), cfg.offload_streams, str(device))
        trace = expert_trace.bind(experts, calib_data, tasks, what)
    try:
        # 3. The streams at the input of block 0.
        streams = _prepare_streams(model, blks, experts, exp_blks, {t: calib_data[t] for t in tasks},
                                   cfg.offload_streams, trace)
        warn_rows: list[str] = []
        n = len(blks)
        bar = tqdm(range(n), desc="FeatCal", unit="block", disable=not progress)
        scratch = Scratch()
        for l in bar:
            blk = blks[l]
            targets = arch.block_targets(blk, linear=cfg.linear, layernorm=cfg.layernorm, only=cfg.modules)
            # 3a. Snapshot statistics of the still-merged block (and advance the experts).
            t0 = time.perf_counter()
            pool = _pool(streams)            # the calibrating batches as one call, for steps 1 and 3
            systems = _block_systems(l, n, targets, blk, exp_blks, streams, pool, cfg, device, warn_rows,
                                     None if keep_stats else cfg.alpha, scratch, trace)
            scratch.trim(SCRATCH_KEEP)       # big Gram buffers go before the solve (kept, they add to its peak)
            t1 = time.perf_counter()
            # 3b. Solve all modules of the block, then load them together.
            _solve_block(l, targets, systems, blk, base_blks[l], cfg, report, keep, scratch)
            scratch.trim(SCRATCH_KEEP)       # and big systems and factors before the advance
            t2 = time.perf_counter()
            # 3c. Advance the calibrating streams through the calibrated block.
            _advance(blk, streams, pool, device, cfg.offload_streams, l)
            report.blocks.append(BlockRecord(l, t1 - t0, t2 - t1, time.perf_counter() - t2))
            bar.set_postfix_str(f"block {l}: {len(targets)} modules")
        for msg in warn_rows:
            warnings.warn(msg, stacklevel=3)
            report.warnings.append(msg)
    except BaseException:
        if inplace:
            log.error("calibration failed part-way with inplace=True: the model is partly calibrated.")
        raise
    finally:
        restore_modes()
    if keep is not None:
        from featcal.preview import Preview

        report.preview_state = Preview(model, path, keep, cfg.eps, cfg.bias)
    report.seconds = time.perf_counter() - t_start
    return model, report

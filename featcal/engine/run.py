"""The FeatCal engine: visit the blocks in forward order and replace each calibrated module by its
closed-form solution (docs/maths.md, 'Forward order'). Read :func:`calibrate` first: its numbered
steps are the whole run.

Per task i two streams are kept at the input of the current block l: the calibrating model's
``h_cal[i]`` and expert i's ``h_exp[i]``. For each block (:func:`_visit_blocks`):

1. run the still-merged block on ``h_cal[i]`` and the expert's block on ``h_exp[i]``, reducing
   every module's inputs into running statistics as the batches pass (the expert's outputs are
   its next stream): :func:`featcal.engine.snapshot.block_systems`, the statistics in
   :mod:`featcal.engine.blockstats`, the experts' side (and the :class:`~featcal.ExpertTrace`) in
   :mod:`featcal.engine.trace`;
2. solve every module of the block from that one snapshot, then load them all
   (:func:`_solve_block`, the maths in :mod:`featcal.method.solve`);
3. advance ``h_cal[i]`` through the calibrated block (:func:`_advance`).

No block before l is ever re-run, and the base and the experts are touched one block at a time.
What one call carries is frozen (:class:`featcal.engine.state.Run`, and per stack of blocks a
:class:`~featcal.engine.state.Stack`); the streams are the block loop's own; what the run has to
say is collected in :class:`featcal.engine.report.Notes` and said once at the end. When the
calibrating batches of every task can run as one call (:func:`featcal.model.streams.pool_spans`:
few rows, no padding mask, no tensor argument), steps 1 and 3 run them in one call; when, moreover,
each task is one batch of one shape, every task's statistics are reduced as one stack. These and
the kernels' choices (:class:`featcal.method.kernels.Kernels`) are switched by the
:class:`~featcal.config.FastPaths` passed in.
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
from featcal.engine.dist_systems import share_solutions
from featcal.engine.preview import Kept, Preview
from featcal.engine.report import BlockRecord, CalibrationReport, ModuleRecord, Notes
from featcal.engine.state import Run, Stack, Stream
from featcal.engine.trace import ExpertCache, ExpertTrace
from featcal.method import solve
from featcal.method.kernels import Kernels
from featcal.model import arch, compat, validate
from featcal.model import loading as sources
from featcal.model.capture import sequence_first
from featcal.model.modes import to_eval
from featcal.model.streams import BlockCall, block_output, catch_block_inputs, device_of, pooled, run_block
from featcal.util.progress import bar as progress_bar

log = logging.getLogger(__name__)


def _first_streams(run: Run, model: nn.Module, stack: Stack, experts, calib_data, offload: bool) -> dict[str, Stream]:
    """Run every stem once per batch: the calibrating model's and expert i's on D_i (the latter
    through the run's expert cache). The stem of a later stack is the model's forward up to it: a
    decoder's streams read the calibrating model's (calibrated) encoder output and each expert's own."""
    streams = {}
    for task, batches in calib_data.items():
        cal = [catch_block_inputs(model, stack.blocks[0], b) for b in batches]

        def run_stem(task=task, batches=batches) -> list[BlockCall]:
            eblk = stack.expert_blocks[task][0]
            exp = [catch_block_inputs(experts[task], eblk, b) for b in batches]
            return [c.with_hidden(to_host(c.hidden)) for c in exp] if offload else exp

        exp = run.experts.stem(stack.path, task, len(batches), run_stem)
        if offload:
            cal = [c.with_hidden(to_host(c.hidden)) for c in cal]
        streams[task] = Stream(cal, exp)
    return streams


def _solve_block(run: Run, stack: Stack, block: int, targets, systems: dict) -> None:
    """Step 2: solve every target of ``block`` from the snapshot, then load them all (the merged
    parameters are read as views until then; copied only when ``run.keep`` holds on to them).
    The factorisations' buffers come from the kernels' scratch and go back to it, and so do the
    systems' ``S`` unless ``run.keep`` holds on to them."""
    cfg, kernels, keep, blk = run.cfg, run.kernels, run.keep, stack.blocks[block]
    at = cfg.setting_at(stack.offset + block)  # the global setting, or the schedule's for this block
    new_params = []
    for t in targets:
        t0 = time.perf_counter()
        W_mer, b_mer = arch.get_params(blk, t)
        if keep is not None:
            W_mer, b_mer = W_mer.clone(), None if b_mer is None else b_mer.clone()
        W_0, b_0 = arch.get_params(stack.base_blocks[block], t)
        ends = solve.Endpoints(W_mer, b_mer, W_0.to(W_mer.device), None if b_0 is None else b_0.to(W_mer.device))
        sysm = systems[t.name]
        if t.kind == arch.LINEAR:
            W, b, SWt = solve.solve_linear(sysm, ends, at, eps=cfg.eps, bias=cfg.bias, kernels=kernels)
            merged, solved = (W_mer, b_mer, None, sysm.res.k_mm), (W, b, SWt, None)
            before, after = solve.linear_residuals(sysm, at.alpha, merged, solved)
            d_in, d_out, rows = W.shape[1], W.shape[0], sysm.min_rows
        else:
            W, b = solve.solve_norm(sysm, ends, at, eps=cfg.eps, kernels=kernels)
            before, after = solve.norm_residual(sysm, W_mer, b_mer), solve.norm_residual(sysm, W, b)
            d_in, d_out, rows = W.shape[0], W.shape[0], 0
        run.notes.solved(f"block {block} {t.name}", *kernels.said())
        # The residual after is a sum of products with every entry of W and b: any NaN/Inf there
        # makes it NaN or Inf (inf * 0 is NaN), so it checks them without another pass.
        if not math.isfinite(after):
            raise FloatingPointError(f"block {block}, module {t.name!r}: the solve gave NaN/Inf; raise lam or eps.")
        new_params.append((t, W, b))
        seconds = time.perf_counter() - t0
        n = stack.offset + block
        run.report.modules.append(ModuleRecord(n, t.name, t.kind, d_in, d_out, rows, before, after, seconds))
        if keep is not None:
            keep.append(Kept(n, t, sysm, ends))
    for t, W, b in new_params:
        arch.set_params(blk, t, W, b)
    kernels.end_block()
    if keep is None:
        kernels.give([s.S for s in systems.values() if isinstance(s, solve.LinearSystem) and s.owns_S])


def _advance(run: Run, block: int, blk: nn.Module, streams: dict[str, Stream], pool, offload: bool) -> None:
    """Step 3: move the calibrating streams through the calibrated block (in one call when
    ``pool``, from :func:`featcal.engine.snapshot.pool` before step 1: the calibrating streams
    have not moved since; ``offload``: to the host)."""
    outs: dict[tuple[str, int], BlockCall] = {}
    if pool is not None:
        keys, calls, spans = pool
        h = run_block(blk, pooled(calls), run.device)
        h = to_host(h) if offload else h
        outs = {key: c.with_hidden(h[lo:hi]) for key, c, (lo, hi) in zip(keys, calls, spans)}
    else:
        for task, st in streams.items():
            for b, cc in enumerate(st.cal):
                nxt = cc.after(block_output(blk, cc, run.device))  # carried outputs handed on
                outs[task, b] = nxt.with_hidden(to_host(nxt.hidden)) if offload else nxt
    for task, st in streams.items():
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


def _stack(run: Run, model: nn.Module, base: nn.Module, experts: Mapping[str, nn.Module], path: str) -> Stack:
    """The stack of blocks at ``path`` of every model, numbered in the report after the blocks so far."""
    expert_blocks = {t: arch.resolve_blocks(experts[t], path)[1] for t in experts}
    base_blocks = arch.resolve_blocks(base, path)[1]
    return Stack(path, len(run.report.blocks), arch.resolve_blocks(model, path)[1], base_blocks, expert_blocks)


def _calibrate_stack(
    run: Run, model: nn.Module, stack: Stack, experts, calib_data, progress: bool, block_source: BlockSource | None
) -> None:
    """Steps 1-3 of the module docstring for every block of ``stack``. The blocks are visited where
    ``block_source`` puts them (default: where they are, or one block of each model at a time on
    the run's device when the models are elsewhere)."""
    untouched = arch.untouched_norms(stack.blocks[0]) if run.cfg.layernorm else []
    if untouched:  # say so: their affine stays the merged one
        msg = f"{stack.path}: norms featcal does not calibrate keep their merged values: {', '.join(untouched)}."
        run.notes.said.append(msg)
    source = block_source
    if source is None and run.device != device_of(model):  # one block of each model on the device at a time
        source = DeviceBlocks(run.device, stack.blocks, [stack.base_blocks, *stack.expert_blocks.values()])
    source = source or BlockSource()
    try:
        _visit_blocks(run, stack, source, model, experts, calib_data, progress)
    finally:
        source.close()


def _visit_blocks(run: Run, stack: Stack, source: BlockSource, model, experts, calib_data, progress: bool) -> None:
    """The forward-order loop over one stack's blocks, each where ``source`` puts it; the streams
    (at the input of the source's first block: block 0 unless a run resumes) are the loop's."""
    cfg, fast, report = run.cfg, run.fast, run.report
    streams = source.streams(lambda: _first_streams(run, model, stack, experts, calib_data, cfg.offload_streams))
    offload = cfg.offload_streams or source.offload(streams)  # the streams go to the host between blocks
    desc = "FeatCal" if stack.path == report.blocks_path else f"FeatCal {stack.path}"
    show = progress and (run.dist is None or run.dist.rank == 0)  # one bar: rank 0's
    bar = progress_bar(range(source.first, stack.n_blocks), desc=desc, unit="block", show=show)
    for block in bar:
        source.enter(block)  # block `block` of every model where it runs
        blk = stack.blocks[block]
        targets = arch.block_targets(blk, linear=cfg.linear, layernorm=cfg.layernorm, only=cfg.modules)
        # 1. Snapshot statistics of the still-merged block (and advance the experts).
        t0 = time.perf_counter()
        # the calibrating batches as one call, for steps 1 and 3 (not for sequence-first streams:
        # they would be joined along their token axis)
        pool = None if sequence_first(blk) else snapshot.pool(streams, fast.pool_rows)
        systems = snapshot.block_systems(run, stack, block, targets, streams, pool, offload)
        run.kernels.trim()  # big Gram buffers go before the solve (kept, they add to its peak)
        t1 = time.perf_counter()
        # 2. Solve all modules of the block, then load them together.
        first_record = len(report.modules)  # (this rank's share of the modules, under a process group)
        _solve_block(run, stack, block, [t for t in targets if t.name in systems], systems)
        if run.dist is not None:  # every rank gets every module's new parameters
            share_solutions(run.dist, report, blk, targets, first_record)
        run.kernels.trim()  # and big systems and factors before the advance
        t2 = time.perf_counter()
        # 3. Advance the calibrating streams through the calibrated block.
        _advance(run, block, blk, streams, pool, offload)
        report.blocks.append(BlockRecord(stack.offset + block, t1 - t0, t2 - t1, time.perf_counter() - t2))
        source.leave(block, streams, report)
        bar.set_postfix_str(f"block {block}: {len(targets)} modules")
        if run.on_block is not None:  # (raising stops the run here, between two blocks)
            rec = report.blocks[-1]
            seconds = rec.stats_seconds + rec.solve_seconds + rec.advance_seconds
            run.on_block(rec.block, {"done": rec.block + 1, "blocks": run.blocks_total, "seconds": seconds})


def _checked_models(merged, base, experts, calib_data, blocks, block_source):
    """``(tasks, base, experts, path)``: the tasks checked against the data, base and experts as
    models (a state dict or a model directory loaded into a copy of ``merged``, a LoRA adapter
    merged onto ``base``), and the blocks' path(s) after checking that every model has ``merged``'s architecture."""
    tasks = validate.check_tasks(experts, calib_data)
    given = {"base": base} | {f"expert {t!r}": experts[t] for t in tasks}  # as given: their dtypes and directories
    base = sources.as_model(base, merged, "base")
    experts = {t: sources.as_model(experts[t], merged, f"expert {t!r}", base=base) for t in tasks}  # LoRA: on base

    def stacks_of(m: nn.Module) -> str:
        return arch.STACK_SEP.join(p for p, _ in arch.resolve_stacks(m, blocks))

    if block_source is None or block_source.loaded:
        others = [("base", base)] + [(f"expert {t!r}", experts[t]) for t in tasks]
        path = validate.check_models(merged, others, stacks_of)
        loaded = dict(others)
        compat.check_experts(
            {role: compat.stored_dtype(obj) for role, obj in given.items()},
            lambda role: compat.block0_weights(dict(loaded[role].named_parameters()), path),
            {role: compat.model_dir(obj) for role, obj in given.items()},
            calib_data,
            warn=distributed.is_main(),  # under a process group, rank 0 warns
        )
        return tasks, base, experts, path
    return tasks, base, experts, stacks_of(merged)  # skeletons: the source checks each block as it loads it


def _fast_paths(fast: FastPaths | None) -> FastPaths:
    """``fast``, checked (None: the defaults)."""
    if fast is not None and not isinstance(fast, FastPaths):
        raise TypeError(f"fast must be a featcal.FastPaths (or None for the defaults), got {type(fast).__name__}.")
    return FastPaths() if fast is None else fast


def _checked_stacks(merged: nn.Module, path: str, cfg: FeatCalConfig, block_source) -> list[str]:
    """The stacks' paths in ``path``, after checking that ``cfg.modules`` names modules in them
    (a typo would calibrate nothing), that ``cfg.schedule`` names blocks they have, and that a
    ``block_source`` gets one stack."""
    stacks = path.split(arch.STACK_SEP)
    if block_source is not None and len(stacks) > 1:
        raise ValueError(f"block_source works on one stack of blocks; {path!r} has {len(stacks)}.")
    blocks = [arch.resolve_blocks(merged, s)[1] for s in stacks]
    validate.check_modules([b[0] for b in blocks], cfg.modules, cfg.linear, cfg.layernorm)
    n = sum(len(b) for b in blocks)
    beyond = [block for block, _ in cfg.schedule if block >= n]
    if beyond:
        raise ValueError(
            f"FeatCalConfig.schedule sets block(s) {beyond}, but {path!r} has {n} blocks (0 to {n - 1}, "
            "numbered as in the report); drop those entries."
        )
    return stacks


def _bound_trace(expert_trace, experts, calib_data, tasks, path, cfg, device) -> ExpertTrace | None:
    """``expert_trace`` bound to this run's experts, batches and the settings its captures depend
    on (what it holds from another run is dropped when any of them differ); None without one."""
    if expert_trace is None:
        return None
    what = (path, cfg.linear, cfg.layernorm, tuple(cfg.modules or ()), cfg.offload_streams, str(device))
    return expert_trace.bind(experts, calib_data, tasks, what)


def _report_notes(run: Run) -> None:
    """What the run has to say (under a process group: every rank's, gathered) into the report,
    each kind said once (by rank 0); then a warning when calibration raised a residual
    (:meth:`CalibrationReport.check_residuals`). ``stacklevel`` points at :func:`calibrate`'s caller."""
    if run.dist is not None:  # the notes of the modules other ranks solved
        run.notes.gather(run.dist)
    run.notes.publish(run.report, say=run.dist is None or run.dist.rank == 0, stacklevel=4)
    rose = run.report.check_residuals()
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
    cfg, fast = config or FeatCalConfig(), _fast_paths(fast)
    t_start = time.perf_counter()
    # 1. Validate before touching anything.
    tasks, base, experts, path = _checked_models(merged, base, experts, calib_data, blocks, block_source)
    stacks = _checked_stacks(merged, path, cfg, block_source)  # an encoder-decoder's two, in forward order

    # 2. Where it runs (and with which processes, each then given its share of the batches).
    device = device_of(merged) if device is None else check_device(device)
    dist = distributed.current(device, "everywhere" if keep_stats else fast.dist_solve)
    calib_data = {t: calib_data[t] for t in tasks}
    if dist is not None:  # the same inputs on every rank, then this rank's share of the batches
        dist.check_same(distributed.input_digests(merged, base, experts, calib_data, cfg, path))
        calib_data = dist.my_share(calib_data)

    # 3. The model to calibrate, and the run's frozen state.
    model = merged if inplace else copy.deepcopy(merged)
    restore_modes = to_eval(model, base, *experts.values())  # each submodule's flag comes back exactly
    report = CalibrationReport(cfg, path, tasks)
    trace = _bound_trace(expert_trace, experts, calib_data, tasks, path, cfg, device)
    keep = [] if keep_stats else None
    n_blocks = sum(len(arch.resolve_blocks(model, s)[1]) for s in stacks)
    kernels, cache = Kernels.of(fast), ExpertCache(trace, device)
    run = Run(cfg, fast, device, dist, kernels, cache, report, Notes(), keep, on_block, n_blocks)
    try:
        # 4. Each stack in forward order, block by block (steps 1-3 of the module docstring).
        for s in stacks:
            stack = _stack(run, model, base, experts, s)
            _calibrate_stack(run, model, stack, experts, calib_data, progress, block_source)
        # 5. What the run has to say, said once, and a check of the residuals.
        _report_notes(run)
    except BaseException:
        if inplace:
            log.error("calibration failed part-way with inplace=True: the model is partly calibrated.")
        raise
    finally:
        restore_modes()
    if keep_stats:  # 6. The kept systems, to re-solve any setting (report.preview)
        report.preview_state = Preview(model, path, keep, cfg)
    report.seconds = time.perf_counter() - t_start
    return model, report

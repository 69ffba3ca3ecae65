"""Step 1 of every block (docs/maths.md, 'Forward order'): the snapshot statistics of the still-merged
block and of each expert's block on their streams, reduced into every target module's system.

One path in three shapes, chosen by what the streams allow (each switched by :class:`FastPaths`):

- task by task, batch by batch (:func:`_add_each_task`): the general case;
- the calibrating batches of every task run through the still-merged block as one pooled call
  (:func:`pool`), its captures cut back into each task's batches;
- every task reduced as one stack on a leading task axis (:func:`_add_stacked`, when
  :func:`_batchable`): pooled, one batch per task, one shape.

The experts' side goes through :func:`_expert_step`, the one place that reads and fills the
:class:`~featcal.engine.trace.ExpertTrace` (what is kept of the experts between calls).
"""

from __future__ import annotations

import torch
from torch import nn

from featcal.engine.blocksource import to_host
from featcal.engine.blockstats import BlockStats, BlockSystems
from featcal.engine.dist_systems import DistBlockSystems
from featcal.engine.state import RunState, Stream
from featcal.model import arch
from featcal.model.capture import Captured, capture, per_task, sliced, stacked
from featcal.model.streams import block_output, pool_spans, pooled, run_block


def pool(streams: dict[str, Stream], max_rows: int) -> tuple[list[tuple[str, int]], list, list] | None:
    """``(keys, calls, spans)`` to run every task's calibrating batches as one call (fewer,
    larger calls: small models are dominated by per-call costs), or None (see
    :func:`featcal.model.streams.pool_spans`; ``max_rows``: :attr:`FastPaths.pool_rows`)."""
    keys = [(task, b) for task, st in streams.items() for b in range(len(st.cal))]
    calls = [streams[task].cal[b] for task, b in keys]
    spans = pool_spans(calls, max_rows) if calls else None  # (a rank may hold no batch)
    return None if spans is None else (keys, calls, spans)


def _pooled_capture(blk, targets, pool, device) -> Captured | None:
    """The still-merged block's captures of every (task, batch) from one pooled call (``pool``
    from :func:`pool`, whose spans cut them back; None: nothing pooled here)."""
    if pool is None:
        return None
    with capture(blk, targets, outputs=True) as cs:
        run_block(blk, pooled(pool[1]), device)
    return cs


def _batchable(streams: dict[str, Stream], pool, widths: list[int], max_elems: int) -> bool:
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


def _expert_step(run: RunState, eblk: nn.Module, targets, st: Stream, b: int, key: tuple | None) -> Captured:
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
        if trace is not None and trace.room_for(ce, nxt):  # both or neither (ExpertTrace.max_bytes)
            trace.captures[key] = ce
            trace.stream(path).put(task, block + 1, b, nxt)
    st.exp[b] = nxt
    return ce


def _add_stacked(
    run: RunState, block: int, targets, merged_params: dict, merged_cap: Captured, into: BlockSystems
) -> None:
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
        if trace is not None and trace.room_for(hit, outs):
            trace.stacked[run.path, block] = hit
            for task, out in zip(tasks, outs):
                kept.put(task, block + 1, 0, out)
    ce_stack, expert_params = hit
    for task, out in zip(tasks, outs):
        streams[task].exp[0] = out
    rows = streams[tasks[0]].cal[0].hidden.shape[:-1].numel()
    acc = BlockStats(run.ctx, block, targets, expert_params, merged_params, rows, lead=1)
    acc.add(per_task(merged_cap, len(tasks)), ce_stack, None)
    into.add(acc, expert_params, tasks[0])  # (which hands the sums' buffers back)


def _add_each_task(
    run: RunState,
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
        rows = into.task_rows(task, sum(c.hidden.shape[:-1].numel() for c in st.cal))  # all ranks' rows
        one_batch = len(st.cal) == 1 and into.direct_ok
        acc = BlockStats(run.ctx, block, targets, expert_params, merged_params, rows, one_batch=one_batch)
        for b, cc in enumerate(st.cal):
            if caps is not None:
                cs = caps.pop((task, b))
            else:
                with capture(blk, targets, outputs=True) as cs:
                    run_block(blk, cc, device)
            ce = _expert_step(run, eblk, targets, st, b, (run.path, block, task, b))
            acc.add(cs, ce, cc.mask_for)  # each input's padding mask: the decoder's or the encoder's tokens
        into.add(acc, expert_params, task)  # (which hands the sums' buffers back)


def block_systems(run: RunState, block: int, blk: nn.Module, targets, pool) -> dict:
    """Step 1 for ``block``: the snapshot statistics of every task, reduced task by task
    (or all tasks at once, :func:`_batchable`) into each target's system. Advances the expert
    streams as a side effect. With ``run.ctx.alpha`` set, systems for that alpha only
    (cheaper; no preview from them; their ``S`` then come from the scratch, as do the
    statistics' buffers in any case: kept from task to task and block to block)."""
    merged_params = {t.name: arch.get_params(blk, t) for t in targets}
    if run.dist is None:
        into = BlockSystems(run.ctx, block, targets, run.notes)
    else:  # each task's sums added across the ranks before its systems are built
        rows = {task: sum(c.hidden.shape[:-1].numel() for c in st.cal) for task, st in run.streams.items()}
        into = DistBlockSystems(run.ctx, block, targets, run.notes, run.dist, rows)
    merged_cap = _pooled_capture(blk, targets, pool, run.ctx.device)
    widths = [p[0].shape[-1] for t, p in zip(targets, merged_params.values()) if t.kind == arch.LINEAR]
    if run.dist is None and _batchable(run.streams, pool, widths, run.ctx.fast.stack_max):
        _add_stacked(run, block, targets, merged_params, merged_cap, into)
    else:
        _add_each_task(run, block, blk, targets, merged_params, merged_cap, pool, into)
    return into.finish()

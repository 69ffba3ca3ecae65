"""Step 1 of every block (docs/maths.md, 'Forward order'): the snapshot statistics of the still-merged
block and of each expert's block on their streams, reduced into every target module's system.

One loop over the block's task batches (:func:`block_systems`), in one of two shapes:

- task by task, batch by batch: the general case;
- every task as one stack on a leading task axis, when :func:`_batchable` (the calibrating
  batches pooled, one batch per task, one shape): one call per operation instead of one per
  task, which is what small models are dominated by.

The still-merged block runs every task's calibrating batches as one pooled call when they
allow it (:func:`pool`), its captures cut back into each task's batches (or seen whole, with a
leading task axis, in the stacked shape). The experts' side, and what the run's
:class:`~featcal.ExpertTrace` keeps of it, is :class:`featcal.engine.trace.ExpertCache`'s.
Each shape and path is switched by :class:`~featcal.config.FastPaths`.
"""

from __future__ import annotations

from typing import Iterator

from torch import nn

from featcal.engine.blockstats import BlockStats, BlockSystems
from featcal.engine.dist_systems import DistBlockSystems
from featcal.engine.state import Run, Stack, Stream
from featcal.model import arch
from featcal.model.capture import Captured, capture, per_task, sliced
from featcal.model.streams import pool_spans, pooled, run_block


def pool(streams: dict[str, Stream], max_rows: int) -> tuple[list[tuple[str, int]], list, list] | None:
    """``(keys, calls, spans)`` to run every task's calibrating batches as one call (fewer,
    larger calls: small models are dominated by per-call costs), or None (see
    :func:`featcal.model.streams.pool_spans`; ``max_rows``: :attr:`FastPaths.pool_rows`)."""
    keys = [(task, b) for task, st in streams.items() for b in range(len(st.cal))]
    calls = [streams[task].cal[b] for task, b in keys]
    spans = pool_spans(calls, max_rows) if calls else None  # (a rank may hold no batch)
    return None if spans is None else (keys, calls, spans)


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


def _merged_captures(run: Run, blk: nn.Module, targets, streams, tasks, pooled_caps, lead: int) -> Iterator:
    """The still-merged block's ``(captures, mask)`` of each batch of ``tasks``: cut from the pooled
    call's captures (``pooled_caps``; with ``lead``: seen whole, every task on a leading axis), or
    from a call of its own."""
    if lead:
        yield per_task(pooled_caps[0], len(tasks)), None
        return
    for task in tasks:
        for b, cc in enumerate(streams[task].cal):
            if pooled_caps is not None:
                cs = pooled_caps[1].pop((task, b))
            else:
                with capture(blk, targets, outputs=True) as cs:
                    run_block(blk, cc, run.device)
            yield cs, cc.mask_for  # each input's padding mask: the decoder's or the encoder's tokens


def _pooled_captures(run: Run, blk: nn.Module, targets, pool) -> tuple[Captured, dict] | None:
    """The still-merged block's captures from one pooled call (``pool`` from :func:`pool`): whole,
    and cut back into each ``(task, batch)``'s by the pool's spans (None: nothing pooled here)."""
    if pool is None:
        return None
    with capture(blk, targets, outputs=True) as cs:
        run_block(blk, pooled(pool[1]), run.device)
    return cs, {key: sliced(cs, lo, hi) for key, (lo, hi) in zip(pool[0], pool[2])}


def block_systems(run: Run, stack: Stack, block: int, targets, streams: dict[str, Stream], pool, offload: bool) -> dict:
    """Step 1 for ``block`` of ``stack``: the snapshot statistics of every task, reduced task by
    task (or all tasks at once, :func:`_batchable`) into each target's system, the experts'
    streams moved past the block as they go (``offload``: to the host). With
    ``run.alpha_only(block)``, systems for that alpha only (cheaper; no preview from them; their ``S``
    then come from the kernels' scratch, as do the statistics' buffers in any case: kept from
    task to task and block to block)."""
    blk = stack.blocks[block]
    merged_params = {t.name: arch.get_params(blk, t) for t in targets}
    rows = {task: sum(c.hidden.shape[:-1].numel() for c in st.cal) for task, st in streams.items()}
    if run.dist is None:
        into = BlockSystems(run, block, targets)
    else:  # each task's sums added across the ranks before its systems are built
        into = DistBlockSystems(run, block, targets, rows)
    pooled_caps = _pooled_captures(run, blk, targets, pool)
    widths = [p[0].shape[-1] for t, p in zip(targets, merged_params.values()) if t.kind == arch.LINEAR]
    lead = int(run.dist is None and _batchable(streams, pool, widths, run.fast.stack_max))
    for tasks in [list(streams)] if lead else [[task] for task in streams]:  # reduced together
        eblks = {task: stack.expert_blocks[task][block] for task in tasks}
        expert_params, expert_caps = run.experts.block(stack.path, block, eblks, targets, streams, offload, lead)
        one_batch = len(streams[tasks[0]].cal) == 1 and into.direct_ok
        task_rows = into.task_rows(tasks[0], rows[tasks[0]])  # (under a process group: all ranks')
        acc = BlockStats(run, stack, block, targets, expert_params, merged_params, task_rows, lead, one_batch)
        for (cs, mask), ce in zip(_merged_captures(run, blk, targets, streams, tasks, pooled_caps, lead), expert_caps):
            acc.add(cs, ce, mask)
        into.add(acc, expert_params, tasks[0])  # (which hands the sums' buffers back)
    return into.finish()

"""Feature drift of a model against its experts, block by block (paper section 3).

The quantities (``e``, ``m``, ``p`` per token) and their sums: :mod:`diagnostics.decomposition`.

One pass per task: a model stream and an expert stream start at block 0
(:func:`featcal.model.streams.catch_block_inputs`, one stem run each per batch) and
move one block at a time (:func:`featcal.model.streams.run_block`); no prefix is ever
re-run. Per batch and block the model's block runs twice (``f_mod,l`` on its own
stream, and the one extra call ``f_mod,l(h_exp,l-1)``) and the expert's once.
Everything is reduced into running sums as the batches pass; only the current
block input of each batch is kept.

A model of several stacks (an encoder-decoder) is diagnosed stack by stack in forward order,
its blocks numbered on (:func:`featcal.model.arch.block_names`: the decoder's after the
encoder's); a later stack's streams start from each model's own forward up to it, so the
decoder's drift includes what it reads of the model's drifted encoder output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pandas as pd
import torch
from torch import nn

from diagnostics.decomposition import COLUMNS, BlockSums, drift_tokens
from diagnostics.drift_ranks import add_across_ranks, my_share
from diagnostics.similarity import TOKENS
from featcal.engine.distributed import current
from featcal.model.arch import STACK_SEP, resolve_blocks, resolve_stacks
from featcal.model.modes import eval_mode
from featcal.model.streams import (
    BlockCall,
    ExpertStreams,
    advance,
    block_call,
    catch_block_inputs,
    device_of,
)
from featcal.model.validate import architecture, batch_len, check_same_params, check_tasks
from featcal.util.progress import bar as progress_bar

# ----------------------------------------------------------------------------- the pass


def _keeper(offload: bool):
    """What a stream keeps of a hidden state between blocks: a CPU copy when ``offload``."""
    return (lambda h: h.cpu()) if offload else (lambda h: h)


@dataclass(frozen=True)
class _Stack:
    """One stack of blocks as the drift pass visits it: the model's blocks and each expert's,
    and the table's number of its first block (where it starts in kept streams, whose per-task
    lists hold each stack's ``blocks + 1`` calls after the previous stack's: :func:`_kept_calls`)."""

    path: str
    blocks: nn.ModuleList
    expert_blocks: dict[str, nn.ModuleList]
    first_block: int  # the number of its block 0 in the table: the blocks of the stacks before it


def _stacks(model: nn.Module, experts: Mapping[str, nn.Module], tasks: list, blocks: str | None) -> list[_Stack]:
    """The model's stacks in forward order (:func:`featcal.model.arch.resolve_stacks`), with the
    experts' blocks at the same paths."""
    out, first = [], 0
    for path, blks in resolve_stacks(model, blocks):
        out.append(_Stack(path, blks, {t: resolve_blocks(experts[t], path)[1] for t in tasks}, first))
        first += len(blks)
    return out


def _kept_calls(streams: ExpertStreams | None, stack: _Stack, stacks: list[_Stack], task: str):
    """``stack``'s part of ``task``'s kept streams (``blocks + 1`` calls), or None when
    ``streams`` is None or does not hold that stack (:func:`streams_while` on a function that
    never runs it, such as an encoder-decoder's encoder features)."""
    held = [] if streams is None else streams.blocks.split(STACK_SEP)
    if stack.path not in held:
        return None
    lengths = {s.path: len(s.blocks) + 1 for s in stacks}
    start = sum(lengths[p] for p in held[: held.index(stack.path)])
    return streams.calls[task][start : start + lengths[stack.path]]


def _expert_calls(expert: nn.Module, eblks: nn.ModuleList, batches: list, keep) -> list[BlockCall]:
    """Expert i's stem, once per batch: its block-0 inputs."""
    return [c.with_hidden(keep(c.hidden)) for c in (catch_block_inputs(expert, eblks[0], b) for b in batches)]


def _task_rows(
    task: str,
    model: nn.Module,
    expert: nn.Module,
    blks: nn.ModuleList,
    eblks: nn.ModuleList,
    batches: list,
    tokens: str,
    cka: bool,
    offload: bool,
    bar,
    cached: list[list[BlockCall]] | None = None,
    own: list[list[BlockCall]] | None = None,
    sums: list | None = None,
    first_block: int = 0,
) -> list[tuple]:
    """Steps 1-3 for one task and stack: catch both streams at the stack's block 0, then per
    block reduce every batch's drift and advance both streams (the expert's from ``cached``,
    the model's from ``own``, when given: this stack's part of :attr:`ExpertStreams.calls` of
    this task); rows numbered from ``first_block``; with ``sums``, the blocks' sums are
    appended to it instead of made into rows (to be added across ranks first)."""
    device = device_of(model)
    keep = _keeper(offload)
    sizes = [batch_len(b) for b in batches]
    # 1. Both stems, once per batch.
    mod = (
        list(own[0])
        if own is not None
        else [c.with_hidden(keep(c.hidden)) for c in (catch_block_inputs(model, blks[0], b) for b in batches)]
    )
    exp = cached[0] if cached is not None else _expert_calls(expert, eblks, batches, keep)
    rows: list[tuple] = []
    for l, (blk, eblk) in enumerate(zip(blks, eblks)):
        acc: BlockSums | None = None
        for j, (cm, ce) in enumerate(zip(mod, exp)):
            # 2. Three block calls (two with cached expert streams), reduced at once.
            dt = drift_tokens(
                blk,
                eblk,
                cm,
                ce,
                device,
                None if cached is None else cached[l + 1][j].hidden,
                None if own is None else own[l + 1][j].hidden,
            )
            if acc is None:
                acc = BlockSums.zeros(dt.e.shape[-1], dt.e.device, cka)
            acc.add(dt, sizes[j], tokens, cm.mask)
            # 3. Advance both streams; nothing else of this batch is kept.
            mod[j] = own[l + 1][j] if own is not None else dt.next_mod.with_hidden(keep(dt.h_mod))
            if cached is None:
                exp[j] = dt.next_exp.with_hidden(keep(dt.h_exp))
        if cached is not None:
            exp = cached[l + 1]
        if sums is not None:  # the sums, to be added across ranks first (diagnostics.drift_ranks)
            sums.append(acc)
        else:
            rows += [(task, first_block + l, k, v) for k, v in acc.metrics().items()]
        bar.update()
    return rows


@torch.no_grad()
def expert_streams(
    experts: Mapping[str, nn.Module], data: Mapping[str, list], blocks: str | None = None, offload: bool = False
) -> ExpertStreams:
    """Run each expert once over its data, one block at a time, keeping every block's
    input (for :func:`drift_table`'s ``expert_cache``: diagnosing several models against
    the same experts then runs no expert block again). Every stack in forward order (an
    encoder-decoder: ``blocks`` the two paths joined by :data:`~featcal.model.arch.STACK_SEP`,
    each task's calls the encoder's ``blocks + 1`` then the decoder's)."""
    tasks = check_tasks(experts, data, name="data")
    keep = _keeper(offload)
    calls = {}
    paths = None
    with eval_mode(*experts.values()):
        for t in tasks:
            if paths is None:  # the first expert's stacks; the others' at the same paths
                paths = [p for p, _ in resolve_stacks(experts[t], blocks)]
            stacks = [resolve_blocks(experts[t], p) for p in paths]
            calls[t] = []
            for _, eblks in stacks:
                per_block = [_expert_calls(experts[t], eblks, data[t], keep)]
                for eblk in eblks:
                    nxt = [advance(eblk, c, device_of(experts[t])) for c in per_block[-1]]
                    per_block.append([c.with_hidden(keep(c.hidden)) for c in nxt])
                calls[t] += per_block
    return ExpertStreams(STACK_SEP.join(paths or ()), calls)


@torch.no_grad()
def _recording_hooks(stacks, seen: dict) -> list:
    """Hooks that record, for each stack ``s``, its first block's call as ``seen[s, "call"]``
    (``(args, kwargs)``, the first of a batch) and block ``l``'s output as ``seen[s, l]``."""

    def first(s: int):
        def hook(_mod, args, kwargs):
            seen.setdefault((s, "call"), (args, kwargs))

        return hook

    def after(s: int, l: int):
        def hook(_mod, _args, out):
            seen[s, l] = out

        return hook

    handles = []
    for s, (_, blks) in enumerate(stacks):
        handles.append(blks[0].register_forward_pre_hook(first(s), with_kwargs=True))
        handles += [blk.register_forward_hook(after(s, l)) for l, blk in enumerate(blks)]
    return handles


def streams_while(
    model: nn.Module, data: Mapping[str, list], fn, blocks: str | None = None, offload: bool = False
) -> tuple[dict[str, list], ExpertStreams]:
    """Call ``fn(model, batch)`` on every batch of ``data`` (reading its features, say) and
    keep the model's stream at every block on the way: ``({task: [fn's result per batch]},
    streams)``, the streams as :func:`expert_streams` keeps an expert's. Given to
    :func:`drift_table` as ``model_cache``, they spare the diagnosed model's blocks their
    pass over its own stream (one block call in three). ``fn`` must run every block of a
    stack once; the streams hold the stacks it ran (an encoder-decoder's encoder features run
    its encoder alone: :func:`drift_table` runs the decoder's own stream itself)."""
    stacks = resolve_stacks(model, blocks)
    keep = _keeper(offload)
    results: dict[str, list] = {}
    calls: dict[str, dict[int, list[list[BlockCall]]]] = {}  # task -> stack -> its calls per block
    seen: dict = {}  # one batch's block-0 call and block outputs of each stack, from the hooks
    handles = _recording_hooks(stacks, seen)
    ran = None  # the stacks fn runs through, the same on every batch
    try:
        with eval_mode(model):
            for task, batches in data.items():
                outs, per_stack = [], {}
                for batch in batches:
                    seen.clear()
                    outs.append(fn(model, batch))
                    whole = [s for s, (_, b) in enumerate(stacks) if all((s, l) in seen for l in range(len(b)))]
                    if not whole or (ran is not None and whole != ran):
                        raise RuntimeError(
                            f"fn(model, batch) did not run every block of {STACK_SEP.join(p for p, _ in stacks)!r} "
                            "(of one stack at least, the same on every batch); streams_while needs a function "
                            "that runs the whole model."
                        )
                    ran = whole
                    for s in whole:
                        blks = stacks[s][1]
                        per_block = per_stack.setdefault(s, [[] for _ in range(len(blks) + 1)])
                        call = block_call(*seen[s, "call"], batch, blks[0])
                        per_block[0].append(call.with_hidden(keep(call.hidden)))
                        for l in range(len(blks)):
                            call = call.after(seen[s, l])  # what block l hands on, as the forward did
                            per_block[l + 1].append(call.with_hidden(keep(call.hidden)))
                results[task], calls[task] = outs, per_stack
    finally:
        for h in handles:
            h.remove()
    ran = ran or list(range(len(stacks)))  # (no batch at all: every stack, each empty)

    def joined(per_stack: dict) -> list[list[BlockCall]]:
        """A task's calls, the stacks one after the other (a task without batches: empty lists)."""
        return [c for s in ran for c in per_stack.get(s, [[] for _ in range(len(stacks[s][1]) + 1)])]

    held = ExpertStreams(STACK_SEP.join(stacks[s][0] for s in ran), {t: joined(p) for t, p in calls.items()})
    return results, held


def _checked_inputs(model, experts, data, blocks, tokens, expert_cache, model_cache) -> tuple[list, list[_Stack]]:
    """:func:`drift_table`'s arguments checked (tokens, tasks, architectures, caches of the same
    blocks and batches); ``(tasks, the stacks in forward order)``."""
    if tokens not in TOKENS:
        raise ValueError(f"tokens={tokens!r}; choose one of {TOKENS}.")
    tasks = check_tasks(experts, data, name="data")
    model_arch = architecture(model)  # read once for every expert
    for t in tasks:
        check_same_params(model, experts[t], f"expert {t!r}", model_arch)
    stacks = _stacks(model, experts, tasks, blocks)
    for cache, name, fix in (
        (expert_cache, "expert_cache", "expert_streams(experts, data)"),
        (model_cache, "model_cache", "streams_while(model, data, fn)"),
    ):
        if cache is not None:
            _check_cached(cache, stacks, data, name, fix)
    return tasks, stacks


@torch.no_grad()
def drift_table(
    model: nn.Module,
    experts: Mapping[str, nn.Module],
    data: Mapping[str, list],
    blocks: str | None = None,
    tokens: str = "all",
    progress: bool = False,
    cka: bool = True,
    offload: bool = False,
    model_name: str | None = None,
    expert_cache: ExpertStreams | None = None,
    model_cache: ExpertStreams | None = None,
) -> pd.DataFrame:
    """Per task and block, the drift of ``model`` from expert i and its split into local
    mismatch and upstream propagation, plus the cosine and CKA of block outputs.

    Args:
        model: the diagnosed model (merged, calibrated, ...).
        experts: ``{task: M_i}``, same architecture as ``model`` and on its device.
        data: ``{task: [batch, ...]}`` (D_i); a batch is a tensor (``model(batch)``) or a dict
            (``model(**batch)``; an ``attention_mask`` in it marks padding).
        blocks: dotted path of the blocks' ``nn.ModuleList``; optional for known architectures
            (an encoder-decoder without it: both stacks, the decoder's blocks numbered after
            the encoder's, as :func:`featcal.model.arch.block_names` names them).
        tokens: ``"all"`` (every non-padding token is a row) or ``"cls"`` (the first token only).
            Also chooses the per-example pooling of ``expert_cosine`` and ``cka``: mean over
            non-padding tokens, or the first token.
        progress: show a progress bar over tasks x blocks.
        cka: also compute linear CKA per block (keeps three ``d x d`` float64 Gram sums for
            the current block).
        offload: keep the streams on the CPU between blocks (for long data on a GPU).
        model_name: when given, a leading ``model`` column holding it.
        expert_cache: :func:`expert_streams` of ``experts`` on ``data`` (same blocks): the
            experts' blocks are then not run (one block call in three saved; same table).
        model_cache: the model's own streams on ``data`` (:func:`streams_while`): its blocks
            then run only on the experts' streams (one block call in three saved) in the
            stacks it holds.

    Returns:
        A tidy DataFrame, one row per task x block (0-based, forward order over every stack)
        x metric: ``task``, ``block``,
        ``metric``, ``value``. Metrics: see :func:`drift_metrics` and :meth:`BlockSums.metrics`.
    """
    tasks, stacks = _checked_inputs(model, experts, data, blocks, tokens, expert_cache, model_cache)
    group = current(device_of(model))
    if group is not None:  # each rank reduces its share of the batches (featcal.engine.distributed)
        data, expert_cache, model_cache = my_share(group, data, expert_cache, model_cache)
    kept = {t: [] for t in tasks} if group is not None else {}
    rows: list[tuple] = []
    n_blocks = sum(len(s.blocks) for s in stacks)
    with (
        eval_mode(model, *experts.values()),
        progress_bar(total=len(tasks) * n_blocks, desc="drift", unit="block", show=progress) as bar,
    ):
        for t in tasks:
            if not data[t]:  # (this rank holds no batch of it)
                bar.update(n_blocks)
                continue
            for s in stacks:  # in forward order; the sums kept in the same order
                rows += _task_rows(
                    t,
                    model,
                    experts[t],
                    s.blocks,
                    s.expert_blocks[t],
                    data[t],
                    tokens,
                    cka,
                    offload,
                    bar,
                    _kept_calls(expert_cache, s, stacks, t),
                    _kept_calls(model_cache, s, stacks, t),
                    kept.get(t),
                    s.first_block,
                )
    if group is not None:
        added = add_across_ranks(group, kept, BlockSums)
        rows = [
            (t, l, k, v) for t, sums in added.items() for l, acc in enumerate(sums) for k, v in acc.metrics().items()
        ]
    df = pd.DataFrame(rows, columns=COLUMNS)
    if model_name is not None:
        df.insert(0, "model", model_name)
    return df


def _check_cached(
    cached: ExpertStreams,
    stacks: list[_Stack],
    data: Mapping[str, list],
    name: str = "expert_cache",
    how: str = "expert_streams(experts, data)",
) -> None:
    """``cached`` must hold some of these stacks, in forward order, of these tasks and batches
    (else its streams would be wrong)."""
    fix = f"compute {how} for this data and these blocks."
    paths = [s.path for s in stacks]
    held = cached.blocks.split(STACK_SEP)
    if held != [p for p in paths if p in held] or set(cached.calls) != set(data):
        raise ValueError(
            f"{name} holds blocks {cached.blocks!r} and tasks {sorted(cached.calls)}, "
            f"not {STACK_SEP.join(paths)!r} and {sorted(data)}; {fix}"
        )
    n_calls = sum(len(s.blocks) + 1 for s in stacks if s.path in held)
    for t, batches in data.items():
        per_block = cached.calls[t]
        if len(per_block) != n_calls or len(per_block[0]) != len(batches):
            raise ValueError(
                f"{name} does not match task {t!r}'s batches or the model's {n_calls - len(held)} blocks; {fix}"
            )


def drift_tables(
    models: Mapping[str, nn.Module],
    experts: Mapping[str, nn.Module],
    data: Mapping[str, list],
    blocks: str | None = None,
    tokens: str = "all",
    progress: bool = False,
    cka: bool = True,
    offload: bool = False,
) -> pd.DataFrame:
    """:func:`drift_table` of several models (``{"merged": m1, "calibrated": m2}``),
    concatenated with a leading ``model`` column."""
    return pd.concat(
        [
            drift_table(
                m,
                experts,
                data,
                blocks=blocks,
                tokens=tokens,
                progress=progress,
                cka=cka,
                offload=offload,
                model_name=name,
            )
            for name, m in models.items()
        ],
        ignore_index=True,
    )

"""Feature drift of a model against its experts, block by block (paper section 3).

For task i and block l (0-based), ``h_mod,l`` is the diagnosed model's block-l
output and ``h_exp,l`` expert i's, both on task i's data D_i; ``f_mod,l`` and
``f_exp,l`` are the two block maps, and ``h_.,-1`` is each model's own stem
output (the input of block 0). Per token:

    e_l = h_mod,l - h_exp,l                               drift
    m_l = f_mod,l(h_exp,l-1) - f_exp,l(h_exp,l-1)         local mismatch
    p_l = f_mod,l(h_mod,l-1) - f_mod,l(h_exp,l-1)         upstream propagation

so ``e_l = m_l + p_l`` exactly, and ``|e_l|^2 = <e_l, m_l> + <e_l, p_l>`` splits
the squared drift additively (the norms themselves do not add).

One pass per task: a model stream and an expert stream start at block 0
(:func:`featcal.model.streams.catch_block_inputs`, one stem run each per batch) and
move one block at a time (:func:`featcal.model.streams.run_block`); no prefix is ever
re-run. Per batch and block the model's block runs twice (``f_mod,l`` on its own
stream, and the one extra call ``f_mod,l(h_exp,l-1)``) and the expert's once.
Everything is reduced into running sums as the batches pass; only the current
block input of each batch is kept.

Rows r are the tokens of every example of the block output (``tokens="all"``;
padding, ``attention_mask == 0``, excluded) or the first token of each example
(``tokens="cls"``, CLIP's class token; dropped where the mask marks it padding).
A block output without a token axis (``(B, d)``) gives one row per example.
Block outputs are taken as batch-first ``(B, T, d)``; a ``(T, B, d)`` output is
recognised by its second axis matching the batch size (when ``T != B``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pandas as pd
import torch
from torch import nn

from diagnostics.similarity import TOKENS, CKASums, accumulate_cka, cosine_rows, linear_cka, pool_examples
from featcal.model.arch import resolve_blocks
from featcal.model.modes import eval_mode
from featcal.model.streams import (
    BlockCall,
    ExpertStreams,
    advance,
    block_call,
    block_output,
    catch_block_inputs,
    device_of,
    run_block,
)
from featcal.model.validate import architecture, batch_len, check_same_params, check_tasks
from featcal.util.progress import bar as progress_bar

COLUMNS = ["task", "block", "metric", "value"]

# Running sums over rows r, in this order (one float64 vector per block and task).
SUMS = (
    "drift",
    "mismatch",
    "propagation",
    "drift_sq",
    "drift_sq_mismatch",
    "drift_sq_propagation",
    "expert_norm",
    "expert_sq",
)


# ----------------------------------------------------------------------------- one block, one batch


@dataclass
class DriftTokens:
    """Per-token drift of one block on one batch; every tensor has the block output's shape.

    ``e``, ``m``, ``p`` are taken in float64 from the block outputs, so ``e = m + p``
    holds to float64 rounding whatever the model's dtype (float16 and bfloat16 too).
    """

    e: torch.Tensor  # h_mod,l - h_exp,l                         float64
    m: torch.Tensor  # f_mod,l(h_exp,l-1) - f_exp,l(h_exp,l-1)    float64
    p: torch.Tensor  # f_mod,l(h_mod,l-1) - f_mod,l(h_exp,l-1)    float64
    h_mod: torch.Tensor  # h_mod,l, the model stream's next input (model dtype)
    h_exp: torch.Tensor  # h_exp,l, the expert stream's next input (model dtype)
    # the streams' next block calls (h_mod / h_exp and what the blocks hand on, e.g. T5's
    # position biases); None where the output was given rather than computed
    next_mod: BlockCall | None = None
    next_exp: BlockCall | None = None


@torch.no_grad()
def drift_tokens(
    block_mod: nn.Module,
    block_exp: nn.Module | None,
    call_mod: BlockCall,
    call_exp: BlockCall,
    device: torch.device | None = None,
    h_exp: torch.Tensor | None = None,
    h_mod: torch.Tensor | None = None,
) -> DriftTokens:
    """Run block l of the model and of the expert on their own streams, plus the one
    extra call ``f_mod,l(h_exp,l-1)`` (the model's block, with the model's other block
    arguments, on the expert's stream), and return ``e``, ``m``, ``p`` per token.

    Three block calls: model twice, expert once (none when its output ``h_exp`` is given,
    e.g. from :func:`expert_streams`; the model once when its own output ``h_mod`` is, e.g.
    from :func:`streams_while`).
    """
    next_mod = next_exp = None
    if h_mod is None:
        next_mod = call_mod.after(block_output(block_mod, call_mod, device))
        h_mod = next_mod.hidden  # f_mod,l(h_mod,l-1)
    elif device is not None:
        h_mod = h_mod.to(device)
    if h_exp is None:
        next_exp = call_exp.after(block_output(block_exp, call_exp, device))
        h_exp = next_exp.hidden  # f_exp,l(h_exp,l-1)
    h_exp = h_exp.to(h_mod.device)
    cross = run_block(block_mod, call_mod.with_hidden(call_exp.hidden), device)  # f_mod,l(h_exp,l-1)
    a, b, c = h_mod.double(), h_exp.double(), cross.double()
    return DriftTokens(e=a - b, m=c - b, p=a - c, h_mod=h_mod, h_exp=h_exp, next_mod=next_mod, next_exp=next_exp)


# ----------------------------------------------------------------------------- pure reductions


def batch_first(h: torch.Tensor, n: int) -> torch.Tensor:
    """``(T, B, d)`` -> ``(B, T, d)`` when the first axis is not the batch and the second is."""
    if h.dim() == 3 and h.shape[0] != n and h.shape[1] == n:
        return h.transpose(0, 1)
    return h


def select_rows(h: torch.Tensor, tokens: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The rows r of a batch-first block output: ``(B, T, d)`` or ``(B, d)`` -> ``(rows, d)``.

    ``tokens="all"``: every token with ``mask != 0``; ``"cls"``: the first token of each
    example whose first token is not padding. A ``(B, d)`` output gives its B rows.
    """
    if h.dim() == 2:
        return h
    if h.dim() != 3:
        raise ValueError(f"block outputs must be (B, T, d) or (B, d); got shape {tuple(h.shape)}.")
    if mask is not None and tuple(mask.shape) != tuple(h.shape[:2]):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but the block output is "
            f"{tuple(h.shape)}; the mask must be (B, T)."
        )
    if tokens == "cls":
        keep = None if mask is None else mask[:, 0].to(h.device) != 0  # (B,)
        h = h[:, 0]  # (B, d)
    else:
        keep = None if mask is None else mask.reshape(-1).to(h.device) != 0  # (B*T,)
        h = h.reshape(-1, h.shape[-1])  # (B*T, d)
    return h if keep is None else h[keep]


def row_sums(e: torch.Tensor, m: torch.Tensor, p: torch.Tensor, h_exp: torch.Tensor) -> torch.Tensor:
    """Sums over rows of ``(rows, d)`` tensors, in the order of :data:`SUMS` -> ``(8,)`` float64:
    ``|e|, |m|, |p|, |e|^2, <e, m>, <e, p>, |h_exp|, |h_exp|^2``."""
    e, m, p, h = e.double(), m.double(), p.double(), h_exp.double()  # no copy when float64 already
    e_sq = (e * e).sum(-1)  # (rows,)
    h_sq = (h * h).sum(-1)
    return torch.stack(
        [
            e_sq.sqrt().sum(),
            m.norm(dim=-1).sum(),
            p.norm(dim=-1).sum(),
            e_sq.sum(),
            (e * m).sum(),
            (e * p).sum(),
            h_sq.sqrt().sum(),
            h_sq.sum(),
        ]
    )


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def drift_metrics(sums: torch.Tensor, rows: int) -> dict[str, float]:
    """The block's metrics from the :data:`SUMS` vector over ``rows`` rows.

    Means over rows r: ``drift`` = mean|e_r|, ``mismatch`` = mean|m_r|, ``propagation``
    = mean|p_r|, ``drift_sq`` = mean|e_r|^2, ``drift_sq_mismatch`` = mean<e_r, m_r>,
    ``drift_sq_propagation`` = mean<e_r, p_r> (these two add up to ``drift_sq``),
    ``expert_norm`` = mean|h_exp,r|.

    Relative versions are ratios of means (not means of ratios):
    ``drift_rel`` = mean|e| / mean|h_exp| (and ``mismatch_rel``, ``propagation_rel``
    alike), ``drift_sq_rel`` = mean|e|^2 / mean|h_exp|^2, and the shares of the squared
    drift ``drift_sq_mismatch_share`` = mean<e, m> / mean|e|^2 and
    ``drift_sq_propagation_share`` = mean<e, p> / mean|e|^2 (they add up to 1; NaN at
    zero drift).
    """
    mean = dict(zip(SUMS, (sums / max(rows, 1)).tolist()))
    out = {k: mean[k] for k in SUMS if k != "expert_sq"}
    for k in ("drift", "mismatch", "propagation"):
        out[f"{k}_rel"] = _ratio(mean[k], mean["expert_norm"])
    out["drift_sq_rel"] = _ratio(mean["drift_sq"], mean["expert_sq"])
    out["drift_sq_mismatch_share"] = _ratio(mean["drift_sq_mismatch"], mean["drift_sq"])
    out["drift_sq_propagation_share"] = _ratio(mean["drift_sq_propagation"], mean["drift_sq"])
    return out


@dataclass
class BlockSums:
    """Everything one block keeps for one task while the batches pass."""

    sums: torch.Tensor  # (8,) float64, see SUMS
    rows: int
    cos_sum: torch.Tensor  # ()   sum over examples of cos(pool(h_mod), pool(h_exp))
    examples: int
    cka: CKASums | None  # Gram sums of pooled (model, expert) features

    @classmethod
    def zeros(cls, d: int, device, cka: bool) -> "BlockSums":
        def z(*s):
            return torch.zeros(*s, dtype=torch.float64, device=device)

        return cls(z(len(SUMS)), 0, z(()), 0, CKASums.zeros(d, d, device) if cka else None)

    def add(self, dt: DriftTokens, n: int, tokens: str, mask: torch.Tensor | None) -> None:
        e, m, p, h_mod, h_exp = (batch_first(t, n) for t in (dt.e, dt.m, dt.p, dt.h_mod, dt.h_exp))
        rows = [select_rows(t, tokens, mask) for t in (e, m, p, h_exp)]  # each (rows, d)
        self.sums += row_sums(*rows)
        self.rows += rows[0].shape[0]
        pm, pe = pool_examples(h_mod, tokens, mask), pool_examples(h_exp, tokens, mask)  # (B, d)
        self.cos_sum += cosine_rows(pm, pe).sum()
        self.examples += pm.shape[0]
        if self.cka is not None:
            accumulate_cka(self.cka, pm, pe)

    def metrics(self) -> dict[str, float]:
        """:func:`drift_metrics` plus ``expert_cosine`` (mean over examples of the cosine of
        the pooled block outputs, see :func:`pool_examples`) and ``cka`` (linear CKA of
        the pooled outputs over examples)."""
        out = drift_metrics(self.sums, self.rows)
        out["expert_cosine"] = float(self.cos_sum) / max(self.examples, 1)
        if self.cka is not None:
            out["cka"] = linear_cka(self.cka)
        return out


# ----------------------------------------------------------------------------- the pass


def _keeper(offload: bool):
    """What a stream keeps of a hidden state between blocks: a CPU copy when ``offload``."""
    return (lambda h: h.cpu()) if offload else (lambda h: h)


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
) -> list[tuple]:
    """Steps 1-3 for one task: catch both streams at block 0, then per block reduce every
    batch's drift and advance both streams (the expert's from ``cached``, the model's from
    ``own``, when given: :attr:`ExpertStreams.calls` of this task)."""
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
        rows += [(task, l, k, v) for k, v in acc.metrics().items()]
        bar.update()
    return rows


@torch.no_grad()
def expert_streams(
    experts: Mapping[str, nn.Module], data: Mapping[str, list], blocks: str | None = None, offload: bool = False
) -> ExpertStreams:
    """Run each expert once over its data, one block at a time, keeping every block's
    input (for :func:`drift_table`'s ``expert_cache``: diagnosing several models against
    the same experts then runs no expert block again)."""
    tasks = check_tasks(experts, data, name="data")
    keep = _keeper(offload)
    calls = {}
    path = None
    with eval_mode(*experts.values()):
        for t in tasks:
            path, eblks = resolve_blocks(experts[t], blocks if path is None else path)
            per_block = [_expert_calls(experts[t], eblks, data[t], keep)]
            for eblk in eblks:
                nxt = [advance(eblk, c, device_of(experts[t])) for c in per_block[-1]]
                per_block.append([c.with_hidden(keep(c.hidden)) for c in nxt])
            calls[t] = per_block
    return ExpertStreams(path, calls)


@torch.no_grad()
def streams_while(
    model: nn.Module, data: Mapping[str, list], fn, blocks: str | None = None, offload: bool = False
) -> tuple[dict[str, list], ExpertStreams]:
    """Call ``fn(model, batch)`` on every batch of ``data`` (reading its features, say) and
    keep the model's stream at every block on the way: ``({task: [fn's result per batch]},
    streams)``, the streams as :func:`expert_streams` keeps an expert's. Given to
    :func:`drift_table` as ``model_cache``, they spare the diagnosed model's blocks their
    pass over its own stream (one block call in three). ``fn`` must run every block once."""
    path, blks = resolve_blocks(model, blocks)
    keep = _keeper(offload)
    results: dict[str, list] = {}
    calls: dict[str, list[list[BlockCall]]] = {}
    seen: dict = {}  # one batch's block-0 call and block outputs, from the hooks

    def first(_mod, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    def after(l: int):
        def hook(_mod, _args, out):
            seen[l] = out

        return hook

    handles = [blks[0].register_forward_pre_hook(first, with_kwargs=True)]
    handles += [blk.register_forward_hook(after(l)) for l, blk in enumerate(blks)]
    try:
        with eval_mode(model):
            for task, batches in data.items():
                outs, per_block = [], [[] for _ in range(len(blks) + 1)]
                for batch in batches:
                    seen.clear()
                    outs.append(fn(model, batch))
                    if "call" not in seen or any(l not in seen for l in range(len(blks))):
                        raise RuntimeError(
                            f"fn(model, batch) did not run every block of {path!r}; "
                            "streams_while needs a function that runs the whole model."
                        )
                    call = block_call(*seen["call"], batch, blks[0])
                    per_block[0].append(call.with_hidden(keep(call.hidden)))
                    for l in range(len(blks)):
                        call = call.after(seen[l])  # what block l hands on, as the forward did
                        per_block[l + 1].append(call.with_hidden(keep(call.hidden)))
                results[task], calls[task] = outs, per_block
    finally:
        for h in handles:
            h.remove()
    return results, ExpertStreams(path, calls)


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
        blocks: dotted path of the blocks' ``nn.ModuleList``; optional for known architectures.
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
            then run only on the experts' streams (one block call in three saved).

    Returns:
        A tidy DataFrame, one row per task x block (0-based) x metric: ``task``, ``block``,
        ``metric``, ``value``. Metrics: see :func:`drift_metrics` and :meth:`BlockSums.metrics`.
    """
    if tokens not in TOKENS:
        raise ValueError(f"tokens={tokens!r}; choose one of {TOKENS}.")
    tasks = check_tasks(experts, data, name="data")
    model_arch = architecture(model)  # read once for every expert
    for t in tasks:
        check_same_params(model, experts[t], f"expert {t!r}", model_arch)
    path, blks = resolve_blocks(model, blocks)
    eblks = {t: resolve_blocks(experts[t], path)[1] for t in tasks}
    for cache, name, fix in (
        (expert_cache, "expert_cache", "expert_streams(experts, data)"),
        (model_cache, "model_cache", "streams_while(model, data, fn)"),
    ):
        if cache is not None:
            _check_cached(cache, path, data, len(blks), name, fix)
    rows: list[tuple] = []
    with (
        eval_mode(model, *experts.values()),
        progress_bar(total=len(tasks) * len(blks), desc="drift", unit="block", show=progress) as bar,
    ):
        for t in tasks:
            rows += _task_rows(
                t,
                model,
                experts[t],
                blks,
                eblks[t],
                data[t],
                tokens,
                cka,
                offload,
                bar,
                None if expert_cache is None else expert_cache.calls[t],
                None if model_cache is None else model_cache.calls[t],
            )
    df = pd.DataFrame(rows, columns=COLUMNS)
    if model_name is not None:
        df.insert(0, "model", model_name)
    return df


def _check_cached(
    cached: ExpertStreams,
    path: str,
    data: Mapping[str, list],
    n_blocks: int,
    name: str = "expert_cache",
    how: str = "expert_streams(experts, data)",
) -> None:
    """``cached`` must be of these blocks, tasks and batches (else its streams would be wrong)."""
    fix = f"compute {how} for this data and these blocks."
    if cached.blocks != path or set(cached.calls) != set(data):
        raise ValueError(
            f"{name} holds blocks {cached.blocks!r} and tasks {sorted(cached.calls)}, "
            f"not {path!r} and {sorted(data)}; {fix}"
        )
    for t, batches in data.items():
        per_block = cached.calls[t]
        if len(per_block) != n_blocks + 1 or len(per_block[0]) != len(batches):
            raise ValueError(f"{name} does not match task {t!r}'s batches or the model's {n_blocks} blocks; {fix}")


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

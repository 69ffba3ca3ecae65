"""The drift decomposition e = m + p of one block, as running sums over rows (paper section 3;
docs/maths.md, 'Drift decomposition'). :mod:`diagnostics.drift` runs it over a model's blocks.

For task i and block l (0-based), ``h_mod,l`` is the diagnosed model's block-l
output and ``h_exp,l`` expert i's, both on task i's data D_i; ``f_mod,l`` and
``f_exp,l`` are the two block maps, and ``h_.,-1`` is each model's own stem
output (the input of block 0). Per token:

    e_l = h_mod,l - h_exp,l                               drift
    m_l = f_mod,l(h_exp,l-1) - f_exp,l(h_exp,l-1)         local mismatch
    p_l = f_mod,l(h_mod,l-1) - f_mod,l(h_exp,l-1)         upstream propagation

so ``e_l = m_l + p_l`` exactly, and ``|e_l|^2 = <e_l, m_l> + <e_l, p_l>`` splits
the squared drift additively (the norms themselves do not add).

Rows r are the tokens of every example of the block output (``tokens="all"``;
padding, ``attention_mask == 0``, excluded) or the first token of each example
(``tokens="cls"``, CLIP's class token; dropped where the mask marks it padding).
A block output without a token axis (``(B, d)``) gives one row per example.
Block outputs are taken as batch-first ``(B, T, d)``; a ``(T, B, d)`` output is
recognised by its second axis matching the batch size (when ``T != B``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diagnostics.similarity import CKASums, accumulate_cka, cosine_rows, linear_cka, pool_examples
from featcal.model.streams import BlockCall, block_output, run_block

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

"""FeatCal written out plainly, in float64: the path the fast engine is tested against.

Each maths function below is one formula of ``docs/maths.md`` (its section named in the
docstring), and :func:`calibrate_reference` is the forward order of 'Forward order', step by
step. Nothing here is fast: every module's input rows are kept for the block being solved,
each task's statistics are computed from them directly, and every system is solved on its
own. Use it on tiny models (the tests do); :func:`featcal.calibrate` computes the same thing
with running sums, pooled calls and shared factorisations ('How the engine computes it').

Only plumbing comes from the library: where the blocks are and which parameters they hold
(:mod:`featcal.model.arch`), the input hooks (:mod:`featcal.model.capture`) and the block-by-block
streams (:mod:`featcal.model.streams`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from featcal.config import FeatCalConfig
from featcal.model.arch import LINEAR, Target, block_targets, get_params, resolve_blocks, resolve_stacks, set_params
from featcal.model.capture import capture, target_site
from featcal.model.streams import BlockCall, advance, catch_block_inputs, run_block

# ---------------------------------------------------------------------------- the maths


def anchor(mer: torch.Tensor, base: torch.Tensor, rho: float) -> torch.Tensor:
    """``W_anc = rho W_mer + (1 - rho) W_0`` ('Linear weight'); biases and LayerNorm affines alike."""
    return rho * mer + (1.0 - rho) * base


def task_statistics(xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor, alpha: float):
    """``(C_i, X_i, mu_s, mu_t)`` of one module on task i ('Statistics'): w-weighted means
    over the rows ``xs``, ``xe`` ``(rows, d)`` (calibrating model, expert i), ``w`` ``(rows,)``."""
    p = w / w.sum()  # (rows,)  E[f] = sum_r p_r f_r
    xt = alpha * xe + (1.0 - alpha) * xs  # (rows, d)  the interpolated target input
    xs_p = p[:, None] * xs  # (rows, d)
    return xs_p.T @ xs, xs_p.T @ xt, p @ xs, p @ xt  # (d, d), (d, d), (d,), (d,)


def task_scale(C: torch.Tensor, eps: float) -> torch.Tensor:
    """``s_i = 1 / max(||C_i||_F, eps)`` ('Statistics')."""
    return 1.0 / torch.linalg.matrix_norm(C).clamp(min=eps)


def linear_weight(Cs, Xs, scales, W_experts, W_anc: torch.Tensor, lam: float, eps: float) -> torch.Tensor:
    """The minimiser of ``sum_i s_i E|W xs - W_i xt|^2 + lam |W - W_anc|_F^2 + eps |W|_F^2``
    ('Linear weight'), ``W`` out x in::

        W^T = (sum_i s_i C_i + (lam + eps) I)^-1 (sum_i s_i X_i W_i^T + lam W_anc^T)
    """
    eye = torch.eye(W_anc.shape[1], dtype=W_anc.dtype, device=W_anc.device)
    A = sum(s * C for s, C in zip(scales, Cs)) + (lam + eps) * eye  # (d, d)
    B = sum(s * X @ W_i.T for s, X, W_i in zip(scales, Xs, W_experts)) + lam * W_anc.T  # (d, o)
    return torch.cholesky_solve(B, torch.linalg.cholesky(A)).T  # (o, d)


def linear_bias(
    W: torch.Tensor, mus_s, mus_t, scales, W_experts, b_experts, b_anc: torch.Tensor, lam: float
) -> torch.Tensor:
    """The best bias for the new ``W`` ('Linear bias'), each task weighted by its scale
    ``s_i``, pulled toward the anchor's bias by ``lam``::

        b = [sum_i s_i (b_i + W_i mu_t,i - W mu_s,i) + lam b_anc] / (sum_i s_i + lam)
    """
    num = sum(
        s * (b_i + W_i @ mu_t - W @ mu_s) for s, mu_s, mu_t, W_i, b_i in zip(scales, mus_s, mus_t, W_experts, b_experts)
    )
    return (num + lam * b_anc) / (sum(scales) + lam)


def layernorm_moments(
    x: torch.Tensor, w: torch.Tensor, ln_eps: float, centred: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e_i, m_i) = (E[z*z], E[z])`` per channel, ``z`` the LayerNorm of the rows ``x``
    ``(rows, d)`` without its affine, or with ``centred=False`` their RMS norm without its
    scale, ``z = x / sqrt(mean(x^2) + eps)`` ('LayerNorm affine')."""
    p = w / w.sum()
    if centred:
        z = F.layer_norm(x, x.shape[-1:], eps=ln_eps)  # (rows, d)
    else:
        z = x / (x.square().mean(-1, keepdim=True) + ln_eps).sqrt()  # (rows, d)
    return p @ (z * z), p @ z


def norm_scale(es, gammas, g_anc: torch.Tensor, lam: float, eps: float) -> torch.Tensor:
    """The scale alone ('LayerNorm affine', no shift: an RMS norm or a bias-free LayerNorm),
    the 1x1 system per channel, tasks unweighted::

        gamma = (sum_i e_i gamma_i + lam gamma_anc) / max(sum_i e_i + lam, eps)
    """
    return (sum(e * g for e, g in zip(es, gammas)) + lam * g_anc) / (sum(es) + lam).clamp(min=eps)


def layernorm_affine(
    es, ms, gammas, betas, g_anc: torch.Tensor, b_anc: torch.Tensor | None, lam: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(gamma, beta)`` per channel from the 2x2 system of 'LayerNorm affine' (tasks
    unweighted, determinant clamped below at ``eps``); ``gamma`` alone when ``betas`` is None."""
    E, M, n = sum(es), sum(ms), len(es)
    if betas is None:  # no beta: the scale alone
        return norm_scale(es, gammas, g_anc, lam, eps), None
    r1 = sum(e * g + m * b for e, m, g, b in zip(es, ms, gammas, betas)) + lam * g_anc
    r2 = sum(m * g + b for m, g, b in zip(ms, gammas, betas)) + lam * b_anc
    a11, a12, a22 = E + lam, M, n + lam
    det = (a11 * a22 - a12 * a12).clamp(min=eps)
    return (a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det


# ---------------------------------------------------------------------------- the forward order


def _rows(
    x: torch.Tensor, mask: torch.Tensor | None, weighted: bool, other: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One captured input ``(B, T, d)`` or ``(B, d)`` as float64 rows ``(rows, d)`` and their
    token weights ``(rows,)``: ``other`` for every token but the first where ``weighted``;
    padding (mask 0 in the mask of the tokens this input reads) dropped."""
    w = torch.ones(x.shape[:-1], dtype=torch.float64, device=x.device)  # (B, T) or (B,)
    if weighted and x.dim() == 3:
        w[:, 1:] = other
    keep = torch.ones_like(w, dtype=torch.bool)
    if mask is not None and x.dim() == 3:
        keep = mask.to(x.device) != 0  # (B, T); a mask of other tokens fails here
    return x[keep].double(), w[keep]


def _snapshot(
    blk: nn.Module,
    eblk: nn.Module,
    targets: list[Target],
    cal: list[BlockCall],
    exp: list[BlockCall],
    weighted: dict[str, bool],
    other: float,
) -> dict[str, tuple]:
    """Step 1 for one task: ``{target: (xs, xe, w)}``, the rows every target of the still-merged
    block reads on the calibrating stream and of expert i's block on its own. Moves the
    expert stream ``exp`` on to the expert block's outputs (step 3 for it)."""
    parts: dict[str, list] = {t.name: [] for t in targets}
    for b, (cc, ec) in enumerate(zip(cal, exp)):
        with capture(blk, targets, outputs=False) as cs:
            run_block(blk, cc)
        with capture(eblk, targets, outputs=False) as ce:
            exp[b] = advance(eblk, ec)
        for t in targets:
            site = target_site(t)
            xs, w = _rows(cs.inputs[site], cc.mask_for(site), weighted[t.name], other)
            xe, _ = _rows(ce.inputs[site], ec.mask_for(site), weighted[t.name], other)
            parts[t.name].append((xs, xe, w))
    return {name: tuple(torch.cat(col) for col in zip(*p)) for name, p in parts.items()}


def _params64(blk: nn.Module, t: Target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W, b)`` or ``(gamma, beta)`` of target ``t`` in ``blk``, as float64 copies."""
    W, b = get_params(blk, t)
    return W.double(), None if b is None else b.double()


def _solve(t: Target, snaps: list[tuple], blk, base_blk, expert_blks, cfg: FeatCalConfig):
    """Step 2 for one target: its new ``(W, b)`` or ``(gamma, beta)`` from every task's rows."""
    (W_mer, b_mer), (W_0, b_0) = _params64(blk, t), _params64(base_blk, t)
    W_experts, b_experts = zip(*(_params64(eb, t) for eb in expert_blks))
    b_anc = None if b_mer is None else anchor(b_mer, b_0, cfg.rho)
    if t.kind != LINEAR:
        es, ms = zip(*(layernorm_moments(xs, w, t.ln_eps, t.centred) for xs, _, w in snaps))
        return layernorm_affine(
            es,
            ms,
            W_experts,
            None if b_mer is None else b_experts,
            anchor(W_mer, W_0, cfg.rho),
            b_anc,
            cfg.lam,
            cfg.eps,
        )
    Cs, Xs, mus_s, mus_t = zip(*(task_statistics(xs, xe, w, cfg.alpha) for xs, xe, w in snaps))
    scales = [task_scale(C, cfg.eps) for C in Cs]
    W = linear_weight(Cs, Xs, scales, W_experts, anchor(W_mer, W_0, cfg.rho), cfg.lam, cfg.eps)
    if b_mer is None or not cfg.bias:
        return W, b_mer
    return W, linear_bias(W, mus_s, mus_t, scales, W_experts, b_experts, b_anc, cfg.lam)


@torch.no_grad()
def calibrate_reference(
    merged: nn.Module,
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    config: FeatCalConfig,
    blocks: str | None = None,
) -> nn.Module:
    """FeatCal of ``merged`` toward ``experts`` as docs/maths.md states it, every sum in float64.

    Same arguments as :func:`featcal.calibrate` (``config.stats_dtype`` and
    ``config.offload_streams`` are not read: everything is float64 and stays where the model
    is). Returns a new model, in eval mode; the inputs are left untouched. Keeps every row of
    one block's inputs: for tiny models only.
    """
    cfg, tasks = config, list(calib_data)
    model = copy.deepcopy(merged).eval()
    experts = {t: copy.deepcopy(experts[t]).eval() for t in tasks}  # eval mode without touching the caller's
    for path, blks in resolve_stacks(model, blocks):  # an encoder-decoder: the encoder, then the decoder
        _calibrate_stack(model, blks, resolve_blocks(base, path)[1], experts, path, calib_data, cfg)
    return model


def _calibrate_stack(model, blks, base_blks, experts, path, calib_data, cfg: FeatCalConfig) -> None:
    tasks = list(calib_data)
    exp_blks = {t: resolve_blocks(experts[t], path)[1] for t in tasks}
    # The two streams of every task at the input of block 0, one call per batch (a decoder's:
    # after the calibrated encoder in the calibrating model, after its own in expert i).
    cal = {t: [catch_block_inputs(model, blks[0], b) for b in calib_data[t]] for t in tasks}
    exp = {t: [catch_block_inputs(experts[t], exp_blks[t][0], b) for b in calib_data[t]] for t in tasks}
    tw = cfg.token_weights
    for idx, blk in enumerate(blks):
        targets = block_targets(blk, linear=cfg.linear, layernorm=cfg.layernorm, only=cfg.modules)
        weighted = {t.name: tw is not None and tw.applies(idx, len(blks), t.name) for t in targets}
        # 1. Snapshot: every target's input rows, before any of them changes.
        snaps = {
            task: _snapshot(
                blk, exp_blks[task][idx], targets, cal[task], exp[task], weighted, 1.0 if tw is None else tw.other
            )
            for task in tasks
        }
        # 2. Solve every target from the snapshot, then load them together.
        new = [
            (
                t,
                *_solve(
                    t,
                    [snaps[task][t.name] for task in tasks],
                    blk,
                    base_blks[idx],
                    [exp_blks[task][idx] for task in tasks],
                    cfg,
                ),
            )
            for t in targets
        ]
        for t, W, b in new:
            set_params(blk, t, W, b)
        # 3. Advance the calibrating streams through the new block (the experts' moved in step 1),
        # handing on what each block passes to the next (T5's position biases).
        cal = {task: [advance(blk, c) for c in cal[task]] for task in tasks}

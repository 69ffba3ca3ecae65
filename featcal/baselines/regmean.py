"""RegMean and RegMean++: mergers that read each expert's layer inputs on calibration data.

For every Linear inside the blocks (open_clip's packed q/k/v projection as three Linears,
as FeatCal sees them: :func:`featcal.model.arch.block_targets`), with ``G_i`` the Gram matrix of
the Linear's inputs in expert i on task i's data (a mean over tokens, padding excluded, so
a task with more data weighs no more) and ``G'_i`` the same with its off-diagonal entries
scaled by ``reduce_nondiag``::

    W^T = (sum_i G'_i)^-1 sum_i G'_i W_i^T

the weight that best reproduces every expert's outputs on its own inputs. Every other entry
(Linear biases, LayerNorms, embeddings, heads outside the blocks) is the experts' plain mean.

- ``regmean`` (Jin et al. 2023): expert i's inputs are its own hidden states.
- ``regmean_plusplus`` (Nguyen et al. 2025): in forward order, expert i's own block l is run
  on the *partially merged* model's input to block l (blocks before it already merged), so
  the Grams see the inputs the merged model will actually give; block l is merged, loaded,
  and the merged model's output of it is the next block's input.

The per-module inputs come from the FeatCal engine's plumbing: the blocks and their Linears
(:mod:`featcal.model.arch`), the input hooks (:mod:`featcal.model.capture`), the block-by-block streams
with their padding masks (:mod:`featcal.model.streams`), the token weights
(:func:`featcal.engine.blockstats.token_weights`), the Gram accumulation (:mod:`featcal.method.stats`) and
the Cholesky solve (:func:`featcal.method.linalg.spd_factor`, which warns if it must fall back to LU).
Nothing passed in is modified; the result is a new model in eval mode.

Usage::

    merged = featcal.merge_with_data("regmean_plusplus", base=zoo.base, experts=zoo.experts,
                                     calib_data=zoo.calib_data(256), reduce_nondiag=0.95)
"""

from __future__ import annotations

import copy
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from featcal.baselines.merging import average
from featcal.config import FastPaths
from featcal.engine.blockstats import token_weights
from featcal.method.linalg import add_rows_gram, gram_blocks, spd_factor, symmetric
from featcal.method.stats import as_rows, rms_normalise
from featcal.model.arch import LINEAR, block_targets, get_params, resolve_blocks, set_params
from featcal.model.capture import capture, target_site
from featcal.model.modes import eval_mode
from featcal.model.streams import BlockCall, block_output, catch_block_inputs, device_of, run_block
from featcal.util.progress import bar

# The ridge added to sum_i G'_i, relative to its mean diagonal entry: only there to keep a
# Gram matrix with a dead input channel (a zero row and column) solvable.
RIDGE = 1e-6

# ---------------------------------------------------------------------------- the maths


def reduce_off_diagonal(G: torch.Tensor, ratio: float) -> torch.Tensor:
    """``G'``: ``G`` with its off-diagonal entries times ``ratio`` (``ratio G + (1 - ratio) diag(G)``,
    positive semi-definite for ``G`` so and ratio in [0, 1])."""
    out = ratio * G
    out.diagonal().copy_(G.diagonal())
    return out


def regmean_solver(
    grams: list[torch.Tensor], ratio: float, ridge: float = RIDGE, what: str = "regmean"
) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.Tensor]]:
    """``(solve, [G'_i])``: ``solve(B) = (sum_i G'_i + eps I)^-1 B`` by Cholesky, for the Gram
    matrices ``G_i`` (in x in, symmetric) with their off-diagonal entries times ``ratio``;
    ``eps = ridge * mean(diag(sum_i G'_i))``. Modules reading one input (q/k/v) share it."""
    reduced = [reduce_off_diagonal(G, ratio) for G in grams]
    A = sum(reduced)  # (d, d)
    eps = ridge * float(A.diagonal().mean().clamp(min=torch.finfo(A.dtype).tiny))
    return spd_factor(A, eps, what, lapack_min_d=FastPaths.lapack_min_d), reduced


def regmean_weight(
    grams: list[torch.Tensor], weights: list[torch.Tensor], ratio: float, ridge: float = RIDGE, what: str = "regmean"
) -> torch.Tensor:
    """``W = ((sum_i G'_i + eps I)^-1 sum_i G'_i W_i^T)^T`` (out x in) for the experts' weights
    ``W_i`` (out x in) and their Gram matrices ``G_i`` (:func:`regmean_solver`), in the Grams' dtype."""
    solve, reduced = regmean_solver(grams, ratio, ridge, what)
    return regmean_apply(solve, reduced, weights)


def regmean_apply(
    solve: Callable[[torch.Tensor], torch.Tensor], reduced: list[torch.Tensor], weights: list[torch.Tensor]
) -> torch.Tensor:
    """``(solve(sum_i G'_i W_i^T))^T`` (out x in): :func:`regmean_weight` from a shared solver."""
    B = sum(G @ W.to(G.dtype).T for G, W in zip(reduced, weights))  # (d, o)
    return solve(B).T  # (o, d)


# ---------------------------------------------------------------------------- the plumbing


def _norm_energy(x: torch.Tensor, t, w: torch.Tensor | None) -> tuple[torch.Tensor, float]:
    """``(sum_rows w z*z, sum w)`` per channel for a norm target's input rows ``x`` ``(rows, d)``:
    ``z`` its LayerNorm without affine (an RMS norm's ``x / rms(x)`` when not ``t.centred``)."""
    z = F.layer_norm(x, x.shape[-1:], eps=t.ln_eps) if t.centred else rms_normalise(x, t.ln_eps)
    zz = z * z if w is None else z * z * w.unsqueeze(-1)
    return zz.sum(0), float(x.shape[0] if w is None else w.sum())


def block_input_stats(
    blk: nn.Module, targets, calls: list[BlockCall], device, advance: bool
) -> dict[str, torch.Tensor]:
    """``{site: G}``: the mean over tokens (padding excluded) of ``x x^T`` for the input of every
    Linear target of ``blk`` over ``calls``, in float64; modules reading one tensor (q/k/v)
    share one accumulation. For a norm target (LayerNorm, RMS norm), at its site: the mean of
    ``z * z`` per channel, ``z`` its normalised input (LOT Merging's weights). With ``advance``,
    each call moves on to the next block's call (``blk``'s outputs handed on)."""
    sums: dict[str, torch.Tensor] = {}  # first site of an input -> sum of w x x^T (upper triangle), or w z*z
    counts: dict[str, float] = {}  # first site of an input -> sum of w
    alias: dict[str, str] = {}  # every site -> the first site that saw the same tensor
    for b, call in enumerate(calls):
        with capture(blk, targets, outputs=False) as cap:
            out = block_output(blk, call, device)
        if advance:
            calls[b] = call.after(out)
        seen: list[tuple[torch.Tensor, str]] = []
        for t in targets:
            site = target_site(t)
            x = cap.inputs[site]  # (B, T, d) or (B, d)
            first = next((k for y, k in seen if y is x), None) if t.kind == LINEAR else None
            alias[site] = first or site
            if first is not None:
                continue
            seen.append((x, site))
            w = token_weights(x, False, 1.0, call.mask_for(site), torch.float64)  # (rows,), or None: all ones
            rows = as_rows(x, torch.float64)  # (rows, d)
            if t.kind != LINEAR:
                zz, n = _norm_energy(rows, t, w)
                sums[site], counts[site] = sums.get(site, 0.0) + zz, counts.get(site, 0.0) + n
                continue
            Z = rows if w is None else rows * w.sqrt().unsqueeze(-1)
            d = rows.shape[-1]
            if site not in sums:
                sums[site] = torch.zeros(d, d, dtype=torch.float64, device=rows.device)
                counts[site] = 0.0
            add_rows_gram(sums[site], Z.contiguous(), 1.0, gram_blocks(d, FastPaths.gram_block))
            counts[site] += float(rows.shape[0] if w is None else w.sum())
    for site, n in counts.items():
        if n <= 0:
            raise ValueError(f"no calibration tokens reach {site!r} (every token padding?); check calib_data.")
    means = {site: (symmetric(S) if S.dim() == 2 else S) / counts[site] for site, S in sums.items()}
    return {site: means[first] for site, first in alias.items()}


def check_calib(experts: Mapping[str, nn.Module], calib_data: Mapping[str, list], method: str) -> None:
    """A ``ValueError`` naming the problem unless there are experts and ``calib_data`` has batches
    for each: ``method`` (its label) reads every expert's inputs on its own task's data."""
    if not experts:
        raise ValueError(f"{method} needs at least one expert; got none.")
    missing = [t for t in experts if t not in calib_data or len(calib_data[t]) == 0]
    if missing:
        raise ValueError(
            f"calib_data has no batches for task(s) {missing}; {method} reads every expert's inputs on its own "
            "task's data: give calib_data one entry per expert (e.g. zoo.calib_data(n))."
        )


def _check(base: nn.Module, experts: Mapping[str, nn.Module], calib_data: Mapping[str, list], ratio: float) -> None:
    check_calib(experts, calib_data, "RegMean")
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"reduce_nondiag must be in [0, 1] (the off-diagonal scale), got {ratio}.")


@torch.no_grad()
def _regmean(
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    ratio: float,
    plus_plus: bool,
    blocks: str | None,
    progress: bool,
) -> nn.Module:
    _check(base, experts, calib_data, ratio)
    tasks = list(experts)
    # 1. Every entry the experts' mean (the stem, LayerNorms, biases, heads); a new model.
    model = copy.deepcopy(base)
    model.load_state_dict(average(base.state_dict(), {t: m.state_dict() for t, m in experts.items()}))
    model.eval()
    path, blks = resolve_blocks(model, blocks)
    exp_blks = {t: resolve_blocks(experts[t], path)[1] for t in tasks}
    with eval_mode(*experts.values()):
        # 2. The streams at block 0: the merged model's (RegMean++) or each expert's own (RegMean).
        first = {t: (model, blks[0]) if plus_plus else (experts[t], exp_blks[t][0]) for t in tasks}
        calls = {t: [catch_block_inputs(*first[t], b) for b in calib_data[t]] for t in tasks}
        name = "regmean_plusplus" if plus_plus else "regmean"
        for idx in bar(range(len(blks)), desc=name, unit="block", show=progress):
            blk = blks[idx]
            targets = block_targets(blk, layernorm=False)
            # 3. Each expert's block on its stream: the Grams of its Linears' inputs.
            grams = {
                t: block_input_stats(exp_blks[t][idx], targets, calls[t], device_of(experts[t]), advance=not plus_plus)
                for t in tasks
            }
            # 4. Solve every Linear from the Grams, then load them together (biases stay the mean).
            new, solvers = [], {}
            for tg in targets:
                G = [grams[t][target_site(tg)].to(device_of(model)) for t in tasks]
                key = id(grams[tasks[0]][target_site(tg)])  # one solver per distinct input (q/k/v share one)
                if key not in solvers:
                    solvers[key] = regmean_solver(G, ratio, what=f"{name} block {idx} {tg.name}")
                W = [get_params(exp_blks[t][idx], tg)[0].to(G[0].device) for t in tasks]
                new.append((tg, regmean_apply(*solvers[key], W)))
            for tg, W in new:
                set_params(blk, tg, W.to(device_of(model)), None)
            # 5. RegMean++: the merged block moves the streams on.
            if plus_plus:
                calls = {t: [c.with_hidden(run_block(blk, c)) for c in calls[t]] for t in tasks}
    return model


def regmean(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    reduce_nondiag: float = 0.95,
    blocks: str | None = None,
    progress: bool = True,
) -> nn.Module:
    """RegMean: every Linear in the blocks from the Grams of each expert's own inputs on its
    own task's ``calib_data`` batches; every other entry the experts' mean. ``reduce_nondiag``
    scales the Grams' off-diagonal entries: default 0.95, FusionBench's CLIP setting, so that
    results compare with its tables (the original paper tunes it on validation data, often
    near 0.1; 0 gives each input feature's Gram-weighted mean). ``blocks``: the dotted path
    of the blocks when featcal does not find them."""
    return _regmean(base, experts, calib_data, reduce_nondiag, False, blocks, progress)


def regmean_plusplus(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    reduce_nondiag: float = 0.95,
    blocks: str | None = None,
    progress: bool = True,
) -> nn.Module:
    """RegMean++: RegMean in forward order, each expert's block l run on the merged model's
    input to block l (earlier blocks already merged). ``reduce_nondiag`` default 0.95: the
    setting of the RegMean++ paper's CLIP results in FusionBench (84.4 on ViT-B/32 TA8).
    The stem and the final LayerNorm are the experts' mean."""
    return _regmean(base, experts, calib_data, reduce_nondiag, True, blocks, progress)

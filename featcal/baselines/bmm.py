"""Bayesian Model Merging (BMM; Li, Su, Han, Ji, arXiv 2605.12843, May 2026): the inner level,
a Bayesian regression per Linear under a Gaussian prior centred on an anchor merge.

No code of the authors is public and only the paper's abstract could be read here; what follows is
OUR READING of it (docs/comparison.md says point by point where it may differ). The abstract says:
the inner level is "an activation-based Bayesian regression under a strong prior induced by an
anchor model" with a closed form; the outer level searches "module-specific hyperparameters" by
Bayesian optimisation on a small validation set (:mod:`featcal.baselines.bmm_search`); a data-free
variant "estimates the Gram matrix for regression" from the task vectors; the anchors are
plug-and-play mergers (TA, WUDI-Merging, TSV).

The regression, per Linear ``y = W x`` of the blocks: expert i's outputs on its own inputs are the
observations, ``Y_i = X_i W_i^T`` (``X_i`` the rows expert i's layer reads on task i's data),
with Gaussian noise; the prior is ``W ~ N(W_a, s^2 I)``, ``W_a`` the anchor merge's weight. The
posterior mean (the MAP) minimises::

    sum_i ||X_i W^T - X_i W_i^T||^2 / n_i  +  s~ ||W - W_a||_F^2

and setting its gradient to zero gives, with ``G_i = X_i^T X_i / n_i`` (a mean over task i's
tokens, padding excluded, as RegMean and LOT Merging take it: a task with more tokens weighs no
more)::

    (sum_i G_i + s~ I) W^T = sum_i G_i W_i^T + s~ W_a^T
    W^T = (sum_i G_i + s~ I)^-1 (sum_i G_i W_i^T + s~ W_a^T)                      (:func:`bmm_solve`)

solved in task-vector coordinates (``W = W_0 + tau``: ``W_0`` cancels, so directions no input
reaches keep the anchor's task vector exactly). Limits: ``s~ -> 0`` is RegMean (without its
off-diagonal reduction), ``s~ -> inf`` the anchor.

How ``s~`` is scaled (our choice): ``s~ = sigma * tr(sum_i G_i) / d``, ``sigma`` times the mean
eigenvalue of the summed Gram. Activations differ in scale by orders of magnitude between modules
(a LayerNorm's output against an MLP's hidden activation), so an absolute ``s~`` would be strong in
one module and nothing in the next; relative to the mean eigenvalue, ``sigma`` is dimensionless,
one global value means the same balance in every module and architecture, and a search range in
decades around it makes sense everywhere. ``sigma = 1``: the prior weighs as much as an average
direction of the data. Default 0.1 (our choice, untuned): the data decide the directions the inputs
really use, the anchor the weak rest.

Data-free variant (:func:`bmm_datafree`; OUR READING of "a key alignment between activation
statistics and task vectors"): ``G_i ~ tau_i^T tau_i / ||tau_i||_F^2`` for expert i's task vector
``tau_i = W_i - W_0`` (the rows of a fine-tuning update lie in the span of the inputs it saw,
WUDI-Merging's observation). With that Gram the data term is exactly WUDI-Merging's objective
``sum_i ||(tau - tau_i) tau_i^T||^2 / ||tau_i||^2`` (:func:`featcal.baselines.spectral.wudi_objective`),
so ``sigma -> 0`` solves in closed form what WUDI approaches by Adam steps.

What is merged: the data-using :func:`bmm` solves every Linear weight in the blocks (open_clip's
packed q/k/v as three, every stack of an encoder-decoder) and keeps the anchor's value for every
other entry (biases, norms, embeddings, heads: no data term, so the posterior mean is the prior's).
:func:`bmm_datafree` works on state dicts, as the anchors do: every 2-D entry solved, every other
entry the anchor's. Nothing passed in is modified; the result is new.

Usage::

    merged = featcal.merge_with_data("bmm", base=zoo.base, experts=zoo.experts,
                                     calib_data=zoo.calib_data(64), anchor="tsv", sigma=0.1)
    merged_sd = featcal.merge("bmm_datafree", base_sd, expert_sds, anchor="ta")
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from featcal.baselines import merging
from featcal.baselines.regmean import RIDGE, block_input_stats, check_calib
from featcal.config import FastPaths
from featcal.method.linalg import spd_factor
from featcal.model.arch import block_targets, get_params, resolve_blocks, resolve_stacks, set_params
from featcal.model.capture import target_site
from featcal.model.modes import eval_mode
from featcal.model.streams import catch_block_inputs, device_of
from featcal.util.progress import bar

# The anchor merges the prior is centred on, each with its registry defaults (TA's scale 0.3, TSV's
# 1.0, WUDI's 400 Adam steps): the three the paper names.
ANCHORS: dict[str, Callable] = {"ta": merging.task_arithmetic, "tsv": merging.tsv, "wudi": merging.wudi}
SIGMA = 0.1  # the prior's strength relative to the mean eigenvalue of sum_i G_i (see the docstring)

# ---------------------------------------------------------------------------- the maths


def prior_strength(A: torch.Tensor, sigma: float) -> float:
    """``s~ = max(sigma, RIDGE) * tr(A) / d`` for the summed Gram ``A`` (d x d): ``sigma`` times
    its mean eigenvalue; never below RegMean's ridge, so ``sigma = 0`` (RegMean) stays solvable."""
    return max(float(sigma), RIDGE) * float(A.diagonal().sum()) / A.shape[0]


Solver = tuple  # (solve: B -> (sum_i G_i + s~ I)^-1 B, or None without data; s~)


def bmm_solver(grams: list[torch.Tensor], sigma: float) -> Solver:
    """``(solve, s~)``: ``solve(B) = (sum_i G_i + s~ I)^-1 B`` by Cholesky for the input Grams ``G_i``
    (in x in), ``s~`` :func:`prior_strength`; ``(None, 0)`` without data (``sum_i G_i = 0``).
    Modules reading one input (q/k/v) share it."""
    A = sum(grams)  # (d, d)
    if float(A.diagonal().sum()) <= 0:
        return None, 0.0
    s = prior_strength(A, sigma)
    return spd_factor(A, s, "bmm", lapack_min_d=FastPaths.lapack_min_d), s


def bmm_apply(
    solver: Solver, grams: list[torch.Tensor], deltas: list[torch.Tensor], anchor: torch.Tensor
) -> torch.Tensor:
    """The posterior mean's task vector ``tau`` (out x in) of one Linear:
    ``tau^T = (sum_i G_i + s~ I)^-1 (sum_i G_i tau_i^T + s~ tau_a^T)`` for the experts' task vectors
    ``deltas`` ``tau_i`` and the anchor's ``tau_a`` (out x in), ``solver`` :func:`bmm_solver`'s of
    the ``grams``. Without data, the prior's mean ``tau_a``. In the Grams' dtype."""
    solve, s = solver
    if solve is None:
        return anchor.to(grams[0].dtype).clone()
    B = sum(G @ D.to(G.dtype).T for G, D in zip(grams, deltas)) + s * anchor.to(grams[0].dtype).T  # (d, o)
    return solve(B).T  # (o, d)


def bmm_solve(
    grams: list[torch.Tensor], deltas: list[torch.Tensor], anchor: torch.Tensor, sigma: float
) -> torch.Tensor:
    """:func:`bmm_apply` with the solver of ``grams`` at ``sigma``: one Linear's posterior mean."""
    return bmm_apply(bmm_solver(grams, sigma), grams, deltas, anchor)


def task_vector_gram(tau: torch.Tensor) -> torch.Tensor:
    """The data-free Gram estimate ``tau^T tau / ||tau||_F^2`` (in x in) of a task vector (out x in),
    trace 1; zero for a zero task vector (a task that did not move this entry adds no data)."""
    norm2 = tau.square().sum()
    G = tau.T @ tau
    return G / norm2 if norm2 > 0 else G


def datafree_task_vector(taus: torch.Tensor, anchor: torch.Tensor, sigma: float) -> torch.Tensor:
    """Data-free BMM of one 2-D entry: :func:`bmm_solve` with ``G_i = task_vector_gram(tau_i)``,
    ``taus`` ``(T, m, n)``, ``anchor`` ``tau_a`` ``(m, n)``; in float64, returned in ``taus``' dtype."""
    t64 = taus.double()
    return bmm_solve([task_vector_gram(t) for t in t64], list(t64), anchor.double(), sigma).to(taus.dtype)


# ---------------------------------------------------------------------------- the plumbing


def check_anchor(anchor: str, sigma: float, method: str = "bmm") -> None:
    """A ``ValueError`` naming the problem unless ``anchor`` is one of :data:`ANCHORS` and ``sigma >= 0``."""
    if anchor not in ANCHORS:
        raise ValueError(
            f"{method}: anchor must be one of {', '.join(ANCHORS)} (the merge the prior is centred on), got {anchor!r}."
        )
    if not sigma >= 0:
        raise ValueError(f"{method}: sigma must be >= 0 (the prior's strength), got {sigma!r}.")


def anchor_model(base: nn.Module, experts: Mapping[str, nn.Module], anchor: str, progress: bool) -> nn.Module:
    """A new model (a copy of ``base``, in eval mode) holding the ``anchor`` merge of the experts."""
    sds = {t: m.state_dict() for t, m in experts.items()}
    kw = {"progress": progress} if anchor == "wudi" else {}
    model = copy.deepcopy(base)
    model.load_state_dict(ANCHORS[anchor](base.state_dict(), sds, **kw))
    return model.eval()


def block_stats(
    model: nn.Module, base: nn.Module, experts, calib_data, blocks: str | None, desc: str, progress: bool
) -> Iterator[tuple]:
    """Every block of every stack of ``model`` in forward order, with what BMM reads of it:
    ``(path, idx, blk, base_blk, exp_blks, stats)``; ``stats[task][site]`` the Gram of the inputs
    expert ``task``'s own block reads on its own task's batches (RegMean's streams: each expert's
    stem, then its own blocks; :func:`featcal.baselines.regmean.block_input_stats`)."""
    tasks = list(experts)
    with eval_mode(base, *experts.values()):
        for path, blks in resolve_stacks(model, blocks):
            base_blks = resolve_blocks(base, path)[1]
            exp_blks = {t: resolve_blocks(experts[t], path)[1] for t in tasks}
            calls = {t: [catch_block_inputs(experts[t], exp_blks[t][0], b) for b in calib_data[t]] for t in tasks}
            for idx in bar(range(len(blks)), desc=f"{desc} {path}", unit="block", show=progress):
                stats = {}
                for t in tasks:
                    blk = exp_blks[t][idx]
                    targets = block_targets(blk, layernorm=False)
                    stats[t] = block_input_stats(blk, targets, calls[t], device_of(experts[t]), True)
                yield path, idx, blks[idx], base_blks[idx], {t: exp_blks[t][idx] for t in tasks}, stats


def linear_problem(blk, base_blk, exp_blks: dict, stats: dict, tg) -> tuple:
    """``(W_0, [G_i], [tau_i], tau_a)`` of Linear target ``tg`` of ``blk`` (which holds the anchor),
    in float64 on the statistics' device."""
    S = [stats[t][target_site(tg)] for t in exp_blks]
    W0 = get_params(base_blk, tg)[0].to(S[0].device, torch.float64)
    D = [get_params(exp_blks[t], tg)[0].to(S[0].device, torch.float64) - W0 for t in exp_blks]
    return W0, S, D, get_params(blk, tg)[0].to(S[0].device, torch.float64) - W0


@torch.no_grad()
def bmm(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    anchor: str = "ta",
    sigma: float = SIGMA,
    blocks: str | None = None,
    progress: bool = True,
) -> nn.Module:
    """BMM's inner level with one global ``sigma``: every Linear weight in the blocks the posterior
    mean under the ``anchor`` merge's prior (``"ta"``, ``"tsv"`` or ``"wudi"``), from the inputs each
    expert's layer reads on its own task's ``calib_data`` batches; every other entry the anchor's.
    ``sigma``: the prior's strength relative to the mean eigenvalue of the summed Gram (0: RegMean,
    large: the anchor). ``blocks``: the dotted path of the blocks when featcal does not find them.
    The outer level's per-module search: :func:`featcal.baselines.bmm_search.bmm_search`."""
    check_calib(experts, calib_data, "BMM")
    check_anchor(anchor, sigma)
    model = anchor_model(base, experts, anchor, progress)
    for path, idx, blk, base_blk, exp_blks, stats in block_stats(
        model, base, experts, calib_data, blocks, "bmm", progress
    ):
        new, solvers = [], {}
        for tg in block_targets(blk, layernorm=False):
            W0, S, D, Da = linear_problem(blk, base_blk, exp_blks, stats, tg)
            key = id(S[0])  # one solver per distinct input (q/k/v share one)
            if key not in solvers:
                solvers[key] = bmm_solver(S, sigma)
            tau = bmm_apply(solvers[key], S, D, Da)
            if not bool(torch.isfinite(tau).all()):
                raise FloatingPointError(f"bmm: {path} block {idx} {tg.name}: the solve gave non-finite values.")
            new.append((tg, W0 + tau))
        for tg, W in new:  # after every solve: the anchor's q/k/v are read before any is replaced
            set_params(blk, tg, W.to(device_of(blk)), None)
    return model


def bmm_datafree(
    base: Mapping[str, torch.Tensor],
    experts: Mapping[str, Mapping[str, torch.Tensor]],
    anchor: str = "ta",
    sigma: float = SIGMA,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """Data-free BMM on state dicts: every 2-D entry the posterior mean with the Gram of each task
    estimated from its task vector (:func:`datafree_task_vector`), under the ``anchor`` merge's prior;
    every other entry the anchor's. A progress bar over the 2-D entries with ``progress``."""
    check_anchor(anchor, sigma, "bmm_datafree")
    kw = {"progress": progress} if anchor == "wudi" else {}
    out = ANCHORS[anchor](base, experts, **kw)  # also checks the experts against the base, and finiteness
    keys = [k for k, v in base.items() if torch.is_floating_point(v) and v.dim() == 2]
    for key in bar(keys, desc="bmm_datafree", unit="matrix", show=progress):
        theta0 = base[key].double()
        taus = torch.stack([sd[key].double() - theta0 for sd in experts.values()])  # (T, m, n)
        out[key] = (theta0 + datafree_task_vector(taus, out[key].double() - theta0, sigma)).to(base[key].dtype)
    return out

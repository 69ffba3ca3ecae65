"""BMM's outer level (Li, Su, Han, Ji, arXiv 2605.12843): the prior's strength searched per module by
Bayesian optimisation on a small validation split, around the inner level of :mod:`featcal.baselines.bmm`.

OUR READING of the abstract ("the outer level leverages a Bayesian optimization procedure to search
module-specific hyperparameters globally based on a small validation set"); the search space, the
sampler, the score and the split below are our choices, said here and in docs/comparison.md:

1. the validation split: the last ``val_fraction`` of each task's ``calib_data`` examples (a data
   merger is given no other data); the Grams are read from the rest;
2. the statistics are kept: per distinct input of a Linear the eigendecomposition
   ``sum_i G_i = Q diag(lam) Q^T``, per Linear ``Q^T (sum_i G_i tau_i^T)`` and ``Q^T tau_a^T``, so
   that every trial re-solves every module exactly, ``tau^T = Q diag(1 / (lam + s~)) Q^T (...)``,
   in two matrix products (the streams are each expert's own, so they do not depend on sigma).
   It holds a d x d matrix per distinct input of every block: on a large model, prefer ``bmm``;
3. the space: ``log10(sigma)`` per module (``granularity="module"``: each Linear of each block,
   the paper's "module-specific") or per block (``"block"``), blocks cut into ``groups`` runs of
   consecutive blocks as FeatCal's per-block tuner does (:func:`featcal.util.tpe.block_groups`),
   within :data:`SIGMA_DECADES` decades of the global ``sigma``;
4. the sampler: optuna's TPE, seeded, started from the global ``sigma`` everywhere (told as a finished
   trial), ``trials`` trials (:func:`featcal.util.tpe.tpe_maximise`, the per-block tuner's);
5. the score, higher is better, on the validation examples, no labels needed: with ``logits`` (a
   zoo's frozen heads) ``-mean_task KL(expert || merged)`` of the class probabilities, as
   ``featcal tune --score kl`` scores; without (a language model), minus the relative squared
   distance of the merged model's output to the expert's, ``||o - o_e||^2 / ||o_e||^2``;
6. the best trial wins; the global sigma is kept unless a trial beats it.

Usage::

    from featcal.baselines.registry import zoo_logits

    merged = featcal.merge_with_data("bmm_search", base=zoo.base, experts=zoo.experts,
                                     calib_data=zoo.calib_data(64), logits=zoo_logits(zoo))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from featcal.baselines.bmm import SIGMA, anchor_model, block_stats, check_anchor, linear_problem
from featcal.baselines.regmean import RIDGE, check_calib
from featcal.model.arch import block_targets, resolve_stacks, set_params
from featcal.model.modes import eval_mode
from featcal.model.streams import call_model, device_of, dtype_of, to_device
from featcal.model.validate import batch_len
from featcal.util.metrics import kl_rows
from featcal.util.tpe import block_groups, group_name, tpe_maximise

SIGMA_DECADES = 2.0  # how far (decades) a module's sigma may go from the global one
GRANULARITIES = ("module", "block")

# ---------------------------------------------------------------------------- the maths


@dataclass
class Kept:
    """One Linear's kept problem: ``Q``, ``lam`` (the eigendecomposition of ``sum_i G_i``, shared by
    the modules reading one input), ``C = Q^T sum_i G_i tau_i^T`` and ``D = Q^T tau_a^T`` (in x out),
    ``W0`` (out x in), where it lives (``blk``, ``target``) and its search dimension ``dim``."""

    Q: torch.Tensor
    lam: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor
    W0: torch.Tensor
    blk: nn.Module
    target: object
    dim: str


def kept_problem(grams: list[torch.Tensor], deltas: list[torch.Tensor], anchor: torch.Tensor, eig=None) -> tuple:
    """``(Q, lam, C, D)`` of one Linear (see :class:`Kept`); ``eig``: ``(Q, lam)`` of the same Grams
    when already decomposed (q/k/v). Eigenvalues below 0 (rounding) are set to 0."""
    if eig is None:
        lam, Q = torch.linalg.eigh(sum(grams))  # (d,), (d, d)
        eig = (Q, lam.clamp(min=0))
    Q, lam = eig
    B = sum(G @ D.T for G, D in zip(grams, deltas))  # (d, o)
    return Q, lam, Q.T @ B, Q.T @ anchor.T


def eigen_solve(k: Kept, sigma: float) -> torch.Tensor:
    """The posterior mean's task vector (out x in) from a kept problem at ``sigma``:
    ``Q diag(1 / (lam + s~)) (C + s~ D)``, ``s~ = max(sigma, RIDGE) mean(lam)`` (the same
    :func:`featcal.baselines.bmm.prior_strength` as the Cholesky path); the anchor's ``tau_a``
    without data."""
    mean = float(k.lam.mean())
    if mean <= 0:
        return (k.Q @ k.D).T
    s = max(float(sigma), RIDGE) * mean
    return (k.Q @ ((k.C + s * k.D) / (k.lam + s).unsqueeze(1))).T


# ---------------------------------------------------------------------------- the plumbing


def split_off(calib_data: Mapping[str, list], fraction: float) -> tuple[dict, dict]:
    """``(fit, val)``: each task's batches with the last ``fraction`` of its examples (at least one)
    moved to ``val``; a ``ValueError`` when a task would keep none to fit on."""
    fit, val = {}, {}
    for task, batches in calib_data.items():
        sizes = [batch_len(b) for b in batches]
        n_val = max(1, round(fraction * sum(sizes)))
        if n_val >= sum(sizes):
            raise ValueError(
                f"bmm_search: task {task!r} has {sum(sizes)} calibration example(s); val_fraction={fraction} "
                "leaves none to read the Grams from: give more examples per task (e.g. --n-per-task 32)."
            )
        cut, fit[task], val[task] = sum(sizes) - n_val, [], []
        for b, n in zip(batches, sizes):
            keep = min(max(cut, 0), n)
            if keep:
                fit[task].append(_rows(b, 0, keep, n))
            if keep < n:
                val[task].append(_rows(b, keep, n, n))
            cut -= n
    return fit, val


def _rows(batch, a: int, b: int, n: int):
    """Examples ``a:b`` of a batch of ``n`` (a tensor, or a dict whose ``n``-row tensors are cut)."""
    if torch.is_tensor(batch):
        return batch[a:b]
    return {k: v[a:b] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v for k, v in batch.items()}


def outputs(model: nn.Module, task: str, batch, logits: Callable | None) -> torch.Tensor:
    """What the score compares: ``logits(model, task, batch)`` (class logits), or without it the
    model's own output (its first field: an LM's logits, an encoder's last hidden state), float64."""
    with torch.no_grad():
        if logits is not None:
            out = logits(model, task, batch)
        else:
            out = call_model(model, to_device(batch, device_of(model), dtype_of(model)))
            out = out if torch.is_tensor(out) else out[0]
    return out.detach().double().cpu()


def score(model: nn.Module, val: dict, refs: dict, logits: Callable | None) -> float:
    """The mean over tasks of ``-KL(expert || model)`` (with ``logits``) or of minus the relative
    squared distance of the outputs: higher is better, 0 for the experts themselves."""
    per_task = []
    for task, batches in val.items():
        got = [outputs(model, task, b, logits) for b in batches]
        if logits is not None:
            per_task.append(-float(torch.cat([kl_rows(r, g) for r, g in zip(refs[task], got)]).mean()))
        else:
            num = sum(float((g - r).square().sum()) for g, r in zip(got, refs[task]))
            per_task.append(-num / max(sum(float(r.square().sum()) for r in refs[task]), 1e-300))
    return sum(per_task) / len(per_task)


def _dim_names(stacks: list[tuple[str, int]], groups: int | None) -> dict[tuple[str, int], str]:
    """``{(stack path, block): its group's name}``, prefixed by the stack's number where there are several."""
    out = {}
    for s, (path, n_blocks) in enumerate(stacks):
        for group in block_groups(list(range(n_blocks)), groups):
            for idx in group:
                out[(path, idx)] = (f"s{s}:" if len(stacks) > 1 else "") + group_name(group)
    return out


def keep_problems(model, base, experts, fit, blocks, granularity, groups, progress) -> list[Kept]:
    """Every Linear of every block of ``model`` (holding the anchor) as a :class:`Kept` problem,
    its Grams read from the ``fit`` batches; its search dimension the block group's name
    (``"/<module>"`` added per module)."""
    names = _dim_names([(p, len(b)) for p, b in resolve_stacks(model, blocks)], groups)
    kept = []
    for path, idx, blk, base_blk, exp_blks, stats in block_stats(model, base, experts, fit, blocks, "bmm", progress):
        eigs = {}
        for tg in block_targets(blk, layernorm=False):
            W0, S, D, Da = linear_problem(blk, base_blk, exp_blks, stats, tg)
            Q, lam, C, Dk = kept_problem(S, D, Da, eigs.get(id(S[0])))
            eigs[id(S[0])] = (Q, lam)
            dim = names[(path, idx)] + (f"/{tg.name}" if granularity == "module" else "")
            kept.append(Kept(Q, lam, C, Dk, W0, blk, tg, dim))
    return kept


def load(kept: list[Kept], sigmas: Mapping[str, float]) -> None:
    """Every kept Linear re-solved at its dimension's sigma and written into its block."""
    for k in kept:
        tau = eigen_solve(k, sigmas[k.dim])
        if not bool(torch.isfinite(tau).all()):
            raise FloatingPointError(f"bmm_search: {k.target.name} at sigma={sigmas[k.dim]:g} gave non-finite values.")
        set_params(k.blk, k.target, (k.W0 + tau).to(device_of(k.blk)), None)


def _check(anchor, sigma, trials, granularity, groups, val_fraction) -> None:
    check_anchor(anchor, sigma, "bmm_search")
    if not sigma > 0:
        raise ValueError(f"bmm_search: sigma must be > 0 (its log10 is searched), got {sigma!r}.")
    if not (isinstance(trials, int) and trials >= 0):
        raise ValueError(f"bmm_search: trials must be a whole number >= 0, got {trials!r}.")
    if granularity not in GRANULARITIES:
        raise ValueError(f"bmm_search: granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}.")
    if groups is not None and not (isinstance(groups, int) and groups >= 1):
        raise ValueError(f"bmm_search: groups must be None or a whole number >= 1, got {groups!r}.")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"bmm_search: val_fraction must be in (0, 1), got {val_fraction!r}.")


@torch.no_grad()
def search_bmm(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    logits: Callable | None = None,
    anchor: str = "ta",
    sigma: float = SIGMA,
    trials: int = 40,
    granularity: str = "module",
    groups: int | None = None,
    val_fraction: float = 0.25,
    seed: int = 0,
    blocks: str | None = None,
    progress: bool = True,
) -> tuple[nn.Module, list[dict]]:
    """:func:`bmm_search`, with the trials: ``(model, rows)``, one row per trial (``trial``,
    ``stage`` start/tpe, ``score``, ``sigma/<dim>`` each), the chosen one marked ``chosen``."""
    check_calib(experts, calib_data, "BMM")
    _check(anchor, sigma, trials, granularity, groups, val_fraction)
    fit, val = split_off(calib_data, val_fraction)
    model = anchor_model(base, experts, anchor, progress)
    kept = keep_problems(model, base, experts, fit, blocks, granularity, groups, progress)
    with eval_mode(*experts.values()):
        refs = {t: [outputs(experts[t], t, b, logits) for b in val[t]] for t in experts}
    dims = sorted({k.dim for k in kept}, key=[k.dim for k in kept].index)

    def objective(params: dict) -> float:
        load(kept, {d: 10.0 ** params[f"log10_sigma/{d}"] for d in dims})
        value = score(model, val, refs, logits)
        rows.append({"trial": len(rows), "stage": "tpe", "score": value, **_sigmas(params)})
        return value

    start = {f"log10_sigma/{d}": math.log10(sigma) for d in dims}
    rows: list[dict] = []
    objective(start)
    rows[0]["stage"] = "start"
    from optuna.distributions import FloatDistribution

    lo, hi = math.log10(sigma) - SIGMA_DECADES, math.log10(sigma) + SIGMA_DECADES
    space = {name: FloatDistribution(lo, hi) for name in start}
    tried = tpe_maximise(space, objective, trials, seed, (start, rows[0]["score"]), progress, desc="bmm trials")
    points = [start] + [params for params, _ in tried]
    best = max(range(len(rows)), key=lambda i: (_finite(rows[i]["score"]), -i))  # ties: the earlier (start first)
    rows[best]["chosen"] = True
    load(kept, {d: 10.0 ** points[best][f"log10_sigma/{d}"] for d in dims})
    return model, rows


def _sigmas(params: dict) -> dict:
    return {f"sigma/{k.removeprefix('log10_sigma/')}": 10.0**v for k, v in params.items()}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -math.inf


def bmm_search(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    logits: Callable | None = None,
    anchor: str = "ta",
    sigma: float = SIGMA,
    trials: int = 40,
    granularity: str = "module",
    groups: int | None = None,
    val_fraction: float = 0.25,
    seed: int = 0,
    blocks: str | None = None,
    progress: bool = True,
) -> nn.Module:
    """BMM with its outer level: :func:`featcal.baselines.bmm.bmm`'s posterior mean with the prior's
    strength searched per module (``granularity="module"``) or per block (``"block"``), blocks in
    ``groups`` runs, by ``trials`` TPE trials (seeded by ``seed``) from the global ``sigma``, scored on
    the last ``val_fraction`` of each task's ``calib_data`` examples (the rest read for the Grams):
    against the experts' class probabilities through ``logits`` (a zoo's heads) when given, else
    against their outputs. ``trials=0``: the inner level at ``sigma`` (Grams from the fit part only).
    See the module docstring for what is our choice."""
    return search_bmm(
        base=base,
        experts=experts,
        calib_data=calib_data,
        logits=logits,
        anchor=anchor,
        sigma=sigma,
        trials=trials,
        granularity=granularity,
        groups=groups,
        val_fraction=val_fraction,
        seed=seed,
        blocks=blocks,
        progress=progress,
    )[0]

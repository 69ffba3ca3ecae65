"""Model mergers as pure functions over state dicts.

Every merger takes the base state dict ``theta_0`` and a mapping of expert
state dicts ``theta_i`` and returns a *new* state dict; nothing passed in is
modified. Floating-point entries are merged in float32 (or float64 when the
inputs are) and cast back to the base dtype; integer entries and buffers that
are not floating point are copied from the base.

The matrix mergers (``iso_c``, ``iso_cts``, ``tsv``, ``wudi``, ``ace``) follow FusionBench's
conventions so that their numbers compare with its tables: their rule (the maths, in
:mod:`featcal.baselines.spectral`) applies to every 2-D entry of the state dict (on a CLIP ViT the
position embedding too, not only Linear weights), and every other floating entry gets the
mean task vector ``mean_i tau_i`` (times the method's scale where it has one).

The registry (:mod:`featcal.baselines.registry`) names them; ``featcal.merge`` dispatches on it.
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Callable, Mapping

import torch

from featcal.baselines import ace as ace_rule
from featcal.baselines import spectral
from featcal.util.progress import bar

StateDict = Mapping[str, torch.Tensor]


def _check_compatible(base: StateDict, experts: Mapping[str, StateDict]) -> None:
    if not experts:
        raise ValueError("merge needs at least one expert state dict; got none.")
    for task, sd in experts.items():
        missing = [k for k in base if k not in sd]
        extra = [k for k in sd if k not in base]
        if missing or extra:
            first = (missing or extra)[0]
            where = "missing from" if missing else "not in the base but in"
            raise ValueError(
                f"expert {task!r}: parameter {first!r} is {where} the expert state dict; "
                "all experts must share the base architecture (same parameter names)."
            )
        for k, v in base.items():
            if sd[k].shape != v.shape:
                raise ValueError(
                    f"expert {task!r}: parameter {k!r} has shape {tuple(sd[k].shape)}, "
                    f"the base has {tuple(v.shape)}; experts must be fine-tuned from this base."
                )


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _task_vectors(base: StateDict, experts: Mapping[str, StateDict], key: str) -> torch.Tensor:
    """Stacked task vectors ``tau_i = theta_i - theta_0`` for one entry: (n_tasks, *shape)."""
    b = base[key].to(_work_dtype(base[key]))
    return torch.stack([sd[key].to(b.dtype) - b for sd in experts.values()])


def _check_finite(base: StateDict, experts: Mapping[str, StateDict], key: str, taus: torch.Tensor) -> None:
    """NaN or Inf in an entry's task vectors is blamed on the base or the expert holding it."""
    if bool(torch.isfinite(taus).all()):
        return
    who = "the base" if not bool(torch.isfinite(base[key]).all()) else None
    if who is None:
        who = next((f"expert {t!r}" for t, sd in experts.items() if not bool(torch.isfinite(sd[key]).all())), None)
    raise FloatingPointError(
        f"merge: {who or 'a task vector'}: parameter {key!r} holds NaN or Inf values; "
        "merge only finite checkpoints (check that expert's file)."
    )


def _merge_each(
    base: StateDict, experts: Mapping[str, StateDict], combine: Callable[[str, torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Apply ``theta = theta_0 + combine(key, taus)`` to every floating entry (NaN/Inf in an
    input refused, naming whose)."""
    _check_compatible(base, experts)
    out: dict[str, torch.Tensor] = {}
    for key, theta0 in base.items():
        if not torch.is_floating_point(theta0):
            out[key] = theta0.clone()
            continue
        taus = _task_vectors(base, experts, key)  # (n_tasks, *shape)
        _check_finite(base, experts, key, taus)
        merged = theta0.to(taus.dtype) + combine(key, taus)
        out[key] = merged.to(theta0.dtype)
    return out


def average(base: StateDict, experts: Mapping[str, StateDict]) -> dict[str, torch.Tensor]:
    """Simple averaging: ``theta = mean_i theta_i``."""
    return _merge_each(base, experts, lambda _k, taus: taus.mean(0))


def per_task(value, experts: Mapping, what: str) -> list[float]:
    """A number, or ``{task: number}`` with every task of ``experts``, as one value per expert
    (in ``experts``' order): how a merger takes per-model weights and densities."""
    if isinstance(value, Mapping):
        missing, extra = [t for t in experts if t not in value], [t for t in value if t not in experts]
        if missing or extra:
            raise ValueError(f"{what}: give one value per task; missing {missing}, unknown tasks {extra}.")
        values = {t: float(value[t]) for t in experts}
    else:
        values = {t: float(value) for t in experts}
    bad = {t: v for t, v in values.items() if not math.isfinite(v)}
    if bad:  # a NaN or Inf weight makes every merged entry NaN or Inf
        raise ValueError(f"{what}: {bad} is not a finite number; give one per task.")
    return list(values.values())


def _column(values: list[float], taus: torch.Tensor) -> torch.Tensor:
    """Per-task values shaped to broadcast against ``taus`` (n_tasks, *shape)."""
    return torch.tensor(values, dtype=taus.dtype, device=taus.device).reshape(-1, *([1] * (taus.dim() - 1)))


def task_arithmetic(
    base: StateDict, experts: Mapping[str, StateDict], scale: float = 0.3, weights: Mapping | None = None
) -> dict[str, torch.Tensor]:
    """Task Arithmetic: ``theta = theta_0 + scale * sum_i w_i (theta_i - theta_0)``, ``w_i = 1``
    unless ``weights={task: w_i}``."""
    w = per_task(1.0 if weights is None else weights, experts, "task_arithmetic: weights")
    return _merge_each(base, experts, lambda _k, taus: scale * (_column(w, taus) * taus).sum(0))


def _trim_top(taus: torch.Tensor, density: float | list[float]) -> torch.Tensor:
    """Keep the top ``density`` fraction of each task vector by magnitude (per entry tensor;
    one density for all tasks or one per task); ``floor(density * numel)`` entries, at least one,
    as mergekit counts them (its ``magnitude`` sparsification), so a mergekit TIES recipe merges the same."""
    ds = density if isinstance(density, list) else [density] * taus.shape[0]
    if all(d >= 1.0 for d in ds):
        return taus
    flat = taus.reshape(taus.shape[0], -1)  # (n_tasks, numel)
    mask = torch.zeros_like(flat, dtype=torch.bool)
    for i, d in enumerate(ds):
        k = flat.shape[1] if d >= 1.0 else max(1, int(d * flat.shape[1]))
        mask[i, flat[i].abs().topk(k).indices] = True
    return (flat * mask).reshape(taus.shape)


def _elect_disjoint(weighted: torch.Tensor, w: torch.Tensor, disjoint: str) -> torch.Tensor:
    """TIES' steps 2-3 on weighted task vectors ``w_i tau_i`` (n_tasks, *shape): the entrywise sign
    of their sum, then the sum (``disjoint="sum"``) or the ``w``-weighted mean (``"mean"``) of the
    nonzero entries that agree with it."""
    sign = torch.sign(weighted.sum(0))
    agree = (torch.sign(weighted) == sign) & (weighted != 0)
    total = (weighted * agree).sum(0)
    if disjoint == "sum":
        return total
    count = (w * agree).sum(0)
    return total / torch.where(count == 0, torch.ones_like(count), count)


def _check_disjoint(method: str, disjoint: str) -> None:
    if disjoint not in ("mean", "sum"):
        raise ValueError(f"{method}: disjoint must be 'mean' or 'sum', got {disjoint!r}.")


def ties(
    base: StateDict,
    experts: Mapping[str, StateDict],
    density: float | Mapping = 0.2,
    scale: float = 0.3,
    disjoint: str = "mean",
    weights: Mapping | None = None,
) -> dict[str, torch.Tensor]:
    """TIES merging (Yadav et al. 2023).

    1. trim: keep the top ``density`` fraction of each task vector by magnitude
       (per parameter tensor; ``density`` may be ``{task: density}``);
    2. elect: the sign of the summed (``weights``-weighted) trimmed vectors, entrywise;
    3. disjoint merge: the (weighted) mean (``disjoint="mean"``) or sum (``"sum"``) of the
       entries that agree with the elected sign;
    then ``theta = theta_0 + scale * tau``.
    """
    ds = per_task(density, experts, "ties: density")
    if not all(0.0 < d <= 1.0 for d in ds):
        raise ValueError(f"ties: density must be in (0, 1], got {density}.")
    _check_disjoint("ties", disjoint)
    w = per_task(1.0 if weights is None else weights, experts, "ties: weights")

    def combine(_key: str, taus: torch.Tensor) -> torch.Tensor:
        wc = _column(w, taus)
        return scale * _elect_disjoint(wc * _trim_top(taus, ds), wc, disjoint)

    return _merge_each(base, experts, combine)


def _l1_rescaled(taus: torch.Tensor, kept: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """Each task's kept entries scaled back to its whole vector's L1 norm (left as they are where
    either norm is below ``eps``)."""
    before = taus.abs().reshape(taus.shape[0], -1).sum(1)
    after = kept.abs().reshape(kept.shape[0], -1).sum(1)
    ratio = torch.where((before < eps) | (after < eps), torch.ones_like(before), before / after.clamp(min=eps))
    return kept * ratio.reshape(-1, *([1] * (taus.dim() - 1)))


def dare(
    base: StateDict,
    experts: Mapping[str, StateDict],
    drop: float | Mapping = 0.9,
    scale: float = 0.3,
    seed: int = 0,
    weights: Mapping | None = None,
    rescale: str = "inverse",
    elect: bool = False,
    disjoint: str = "sum",
) -> dict[str, torch.Tensor]:
    """DARE (Yu et al. 2024) on top of Task Arithmetic: drop each task-vector entry with
    probability ``drop`` (or ``{task: drop}``), rescale the rest by ``1 / (1 - drop)``
    (``rescale="l1"``: back to the vector's L1 norm, as mergekit does; ``"none"``: not at all), then
    ``theta = theta_0 + scale * sum_i w_i tau_i``; with ``elect``, TIES' sign election and disjoint
    merge (:func:`ties`) instead of the sum (DARE-TIES). Seeded: the same seed gives the same merge."""
    ps = per_task(drop, experts, "dare: drop")
    if not all(0.0 <= p < 1.0 for p in ps):
        raise ValueError(f"dare: drop must be in [0, 1), got {drop}.")
    if rescale not in ("inverse", "l1", "none"):
        raise ValueError(f"dare: rescale must be 'inverse', 'l1' or 'none', got {rescale!r}.")
    _check_disjoint("dare", disjoint)
    w = per_task(1.0 if weights is None else weights, experts, "dare: weights")
    gen = torch.Generator().manual_seed(seed)

    def combine(_key: str, taus: torch.Tensor) -> torch.Tensor:
        coins = torch.rand(taus.shape, generator=gen).to(taus.device)  # drawn on the CPU: the same masks on any device
        kept = taus * (coins >= _column(ps, taus)).to(taus.dtype)
        if rescale == "inverse":
            kept = kept / _column([1.0 - p for p in ps], taus)
        elif rescale == "l1":
            kept = _l1_rescaled(taus, kept)
        wc = _column(w, taus)
        return scale * (_elect_disjoint(wc * kept, wc, disjoint) if elect else (wc * kept).sum(0))

    return _merge_each(base, experts, combine)


def _merge_matrices(
    base: StateDict,
    experts: Mapping[str, StateDict],
    rule: Callable[[torch.Tensor], torch.Tensor],
    scale: float = 1.0,
    desc: str = "",
    progress: bool = False,
    averaged: Callable[[str], bool] = lambda _key: False,
) -> dict[str, torch.Tensor]:
    """``theta = theta_0 + scale * rule(taus)`` for every 2-D entry (``taus``: ``(T, m, n)``) but
    those whose name ``averaged`` picks, and ``theta_0 + scale * mean_i tau_i`` for every other
    floating entry; a progress bar over the 2-D entries with ``progress``."""
    _check_compatible(base, experts)
    n_matrices = sum(1 for k, v in base.items() if torch.is_floating_point(v) and v.dim() == 2 and not averaged(k))
    with bar(total=n_matrices, desc=desc, unit="matrix", show=progress) as b:

        def combine(key: str, taus: torch.Tensor) -> torch.Tensor:
            if taus.dim() != 3 or averaged(key):
                return scale * taus.mean(0)
            b.update()
            return scale * rule(taus)

        return _merge_each(base, experts, combine)


def _check_scale(method: str, scale: float) -> None:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"{method}: scale must be a number, got {scale!r}.")


def iso_c(base: StateDict, experts: Mapping[str, StateDict], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Iso-C (isotropic merging in the common subspace, Marczak et al. 2025): per 2-D entry the
    summed task vector with its spectrum flattened to the mean singular value
    (:func:`featcal.baselines.spectral.iso_c_task_vector`), ``theta = theta_0 + scale * tau``;
    other entries ``theta_0 + scale * mean_i tau_i``. Default scale 1.0 (FusionBench's)."""
    _check_scale("iso_c", scale)
    return _merge_matrices(base, experts, spectral.iso_c_task_vector, scale)


def iso_cts(
    base: StateDict, experts: Mapping[str, StateDict], scale: float = 1.0, common_space_fraction: float = 0.8
) -> dict[str, torch.Tensor]:
    """Iso-CTS (isotropic merging in common and task-specific subspaces, Marczak et al. 2025):
    per 2-D entry the top ``common_space_fraction`` of the summed task vector's spectrum plus
    each task's own top directions outside it, orthogonalised and flattened
    (:func:`featcal.baselines.spectral.iso_cts_task_vector`); ``theta = theta_0 + scale * tau``,
    other entries as in :func:`iso_c`. Defaults scale 1.0, fraction 0.8 (FusionBench's)."""
    _check_scale("iso_cts", scale)
    if not 0.0 <= common_space_fraction <= 1.0:
        raise ValueError(f"iso_cts: common_space_fraction must be in [0, 1], got {common_space_fraction}.")
    rule = functools.partial(spectral.iso_cts_task_vector, common_space_fraction=common_space_fraction)
    return _merge_matrices(base, experts, rule, scale)


def tsv(base: StateDict, experts: Mapping[str, StateDict], scale: float = 1.0) -> dict[str, torch.Tensor]:
    """TSV-Merge (task singular vectors, Gargiulo et al. 2025): per 2-D entry each task's top
    ``k // T`` singular triplets, their singular vectors orthogonalised across tasks
    (:func:`featcal.baselines.spectral.tsv_task_vector`); ``theta = theta_0 + scale * tau``,
    other entries ``theta_0 + scale * mean_i tau_i``. Default scale 1.0 (FusionBench's).
    An entry with fewer singular values than tasks keeps nothing of them (``k // T = 0``):
    a warning says so."""
    _check_scale("tsv", scale)
    small = [k for k, v in base.items() if v.is_floating_point() and v.dim() == 2 and min(v.shape) < len(experts)]
    if small:
        warnings.warn(
            f"tsv: {len(small)} 2-D entries (first {small[0]!r}) have fewer singular values than there "
            f"are tasks ({len(experts)}); they keep no rank per task and stay at the base.",
            stacklevel=3,
        )
    return _merge_matrices(base, experts, spectral.tsv_task_vector, scale)


def wudi(
    base: StateDict,
    experts: Mapping[str, StateDict],
    iters: int = 400,
    lr: float = 1e-5,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """WUDI merging (Cheng et al. 2025): per 2-D entry, ``iters`` Adam steps from ``sum_i tau_i``
    on the interference objective :func:`featcal.baselines.spectral.wudi_objective`;
    ``theta = theta_0 + tau`` (no scale), other entries ``theta_0 + mean_i tau_i``. Defaults
    400 steps at learning rate 1e-5 (FusionBench's). The optimisation draws nothing at random;
    it runs under torch's generator seeded with ``seed`` (restored afterwards), so that the
    same call gives the same merge. A progress bar over the 2-D entries with ``progress``."""
    if not isinstance(iters, int) or isinstance(iters, bool) or iters < 0:
        raise ValueError(f"wudi: iters must be a non-negative integer, got {iters!r}.")
    if not lr > 0:
        raise ValueError(f"wudi: lr must be positive, got {lr!r}.")
    rule = functools.partial(spectral.wudi_task_vector, iters=iters, lr=lr)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _merge_matrices(base, experts, rule, 1.0, desc="wudi", progress=progress)


def ace(
    base: StateDict,
    experts: Mapping[str, StateDict],
    scale: float = 1.0,
    eps: float = ace_rule.EPS,
    k_frac: float = ace_rule.K_FRAC,
    threshold: float = ace_rule.THRESHOLD,
    progress: bool = True,
) -> dict[str, torch.Tensor]:
    """ACE-Merging (Xu et al., CVPR 2026) as its authors run it: per 2-D entry the closed form
    ``(sum_t C_t Sigma_t)(sum_t Sigma_t + prior)^-1`` with each task's input covariance estimated
    from its centred task vector ``C_t``, trace-normalised and followed by spectral refinement when
    the tasks' update sizes are heterogeneous (``gamma > threshold``)
    (:func:`featcal.baselines.ace.ace_task_vector`); ``theta = theta_0 + scale * tau``. Every other
    entry, and any 2-D one named ``*text_projection*`` (theirs), ``theta_0 + scale * mean_i tau_i``.
    Defaults theirs: ``scale`` 1.0 (their ``scaling_coefficient``), ``eps`` 0.01, ``k_frac`` 0.3,
    ``threshold`` 0.3. A progress bar over the 2-D entries with ``progress``."""
    _check_scale("ace", scale)
    if not (eps > 0 and 0.0 <= k_frac <= 1.0 and math.isfinite(threshold)):
        raise ValueError(
            f"ace: eps must be > 0, k_frac in [0, 1] and threshold finite, got eps={eps}, k_frac={k_frac}, "
            f"threshold={threshold}."
        )
    rule = functools.partial(ace_rule.ace_task_vector, eps=eps, k_frac=k_frac, threshold=threshold)
    return _merge_matrices(
        base, experts, rule, scale, desc="ace", progress=progress, averaged=ace_rule.averaged_by_name
    )

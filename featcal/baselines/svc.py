"""SVC, Singular Value Calibration (arXiv 2602.05536): a data-free post-merging calibrator.

A merge adds up what several task vectors share, so a direction common to them is counted
several times ("spectral over-accumulation"). SVC rescales each singular value of the merged
task matrix by how much the merge over-counts the experts along that direction. For every 2-D
entry, with ``D_m = W_mer - W_0`` and ``D_i = W_i - W_0`` (``T`` experts):

    D_m = U diag(S) V^T                          (thin SVD)
    a_r^m = u_r^T D_m,   a_r^i = u_r^T D_i       (responses along direction r)
    s_r^i = <a_r^m, a_r^i> / max(||a_r^i||^2, 1e-12)   (NaN and -inf read as alpha)
    gamma_r = T / sum_i max(alpha, s_r^i)
    W = W_0 + U diag(gamma * S) V^T

computed in float64 and cast back; every other entry is the merged one, unchanged. This is
what FusionBench 0.2.33's ``method/singular_value_calibration`` computes (its vectorised
default). FusionBench walks the model's parameters; a state dict also holds buffers, so here a
floating 2-D buffer is calibrated too (integer entries are copied).

``gamma_r <= 1 / alpha``: at ``alpha`` 1 no direction grows; a smaller ``alpha`` lets a direction
the merge under-counts grow. FusionBench sets ``alpha`` per upstream merger, one recipe each
(``config/method/singular_value_calibration/<merger>.yaml``): :data:`ALPHA_AFTER`, which
:func:`default_alpha` reads; after a merger without a recipe, :data:`ALPHA_FALLBACK`.
"""

from __future__ import annotations

from typing import Mapping

import torch

StateDict = Mapping[str, torch.Tensor]

# FusionBench's alpha per upstream merger (registry names), from its recipes
# config/method/singular_value_calibration/{task_arithmetic, ties_merging, dare_task_arithmetic,
# simple_average, iso_c, iso_cts, task_singular_vector, wudi}.yaml (commit 54c9e8c, 0.2.33).
ALPHA_AFTER: dict[str, float] = {
    "task_arithmetic": 0.1,
    "ties": 0.1,
    "dare": 0.1,
    "average": 0.1,
    "iso_c": 0.1,
    "iso_cts": 0.2,
    "tsv": 1.0,
    "wudi": 1.0,
}
# After any other merger (RegMean, RegMean++, AdaMerging, Fisher merging: no FusionBench recipe)
# or none named: the default of FusionBench's SVC parameter table
# (docs/algorithms/singular_value_calibration.md), the value of 5 of its 8 recipes.
ALPHA_FALLBACK = 0.1


def default_alpha(merger: str | None = None) -> float:
    """SVC's ``alpha`` after ``merger``, the registry name of the method the merge was made with
    (a key of ``featcal.MERGERS`` or ``featcal.MERGERS_WITH_DATA``, any case): FusionBench's
    recipe's (:data:`ALPHA_AFTER`); :data:`ALPHA_FALLBACK` after any other or None."""
    return ALPHA_AFTER.get((merger or "").strip().lower(), ALPHA_FALLBACK)


def svc_matrix(W_0: torch.Tensor, W_i: list[torch.Tensor], W_mer: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """The calibrated ``W`` (``m x n``, the merged weight's dtype) of one 2-D entry (module docstring)."""
    f64 = torch.float64
    base = W_0.to(f64)
    D_m = W_mer.to(f64) - base  # (m, n)
    D = torch.stack([w.to(f64) - base for w in W_i])  # (T, m, n)
    U, S, Vh = torch.linalg.svd(D_m, full_matrices=False)  # (m, k), (k,), (k, n)
    a_m = U.T @ D_m  # (k, n): a_r^m
    a_i = torch.einsum("mr,tmn->rtn", U, D)  # (k, T, n): a_r^i
    s = torch.einsum("rn,rtn->rt", a_m, a_i) / (a_i * a_i).sum(-1).clamp_min(1e-12)  # (k, T)
    s = torch.nan_to_num(s, nan=alpha, neginf=alpha)
    gamma = D.shape[0] / torch.clamp(s, min=alpha).sum(1)  # (k,)
    return (base + (U * (gamma * S)) @ Vh).to(W_mer.dtype)


def svc(
    merged_sd: StateDict,
    base_sd: StateDict,
    expert_sds: Mapping[str, StateDict] | list,
    alpha: float | None = None,
    merger: str | None = None,
) -> dict[str, torch.Tensor]:
    """A new state dict: ``merged_sd`` with every floating 2-D entry calibrated by SVC
    (:func:`svc_matrix`) and every other entry copied; nothing passed in is modified. ``alpha``:
    the floor of the projection coefficients (``gamma <= 1 / alpha``); when None, FusionBench's
    value after ``merger``, the registry name of the method ``merged_sd`` was merged with
    (``"task_arithmetic"``, ``"iso_cts"``, ...: :func:`default_alpha`)."""
    if alpha is None:
        alpha = default_alpha(merger)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
        raise ValueError(f"svc: alpha must be a positive number, got {alpha!r}.")
    experts = list(expert_sds.values()) if isinstance(expert_sds, Mapping) else list(expert_sds)
    if not experts:
        raise ValueError("svc needs at least one expert state dict; got none.")
    for key in merged_sd:
        for sd in (base_sd, *experts):
            if key not in sd or sd[key].shape != merged_sd[key].shape:
                raise ValueError(
                    f"svc: entry {key!r} is missing or has another shape in the base or an expert; "
                    "the merged model, the base and the experts must share one architecture."
                )
    out = {}
    for key, w in merged_sd.items():
        if w.is_floating_point() and w.dim() == 2:
            out[key] = svc_matrix(base_sd[key], [sd[key] for sd in experts], w, float(alpha))
        else:
            out[key] = w.clone()
    return out

"""ACE-Merging (Xu et al., CVPR 2026, arXiv 2603.02945): data-free, closed-form merging with each
task's input covariance estimated from its fine-tuning update, as pure functions over one 2-D
entry's task vectors ``tau_t`` (m x n, T tasks; the entry as stored, its rows the samples).

What the authors run (github unravel-xu/ACE-Merging, ``MergeStrategy.ace_merging`` in
src/merge/strategy.py; defaults ``eps = 1e-2``, ``k_frac = 0.3``, the threshold 0.3 written in the
function; control/config.py merges with ``scaling_coefficient`` 1.0), step by step:

1. heterogeneity (:func:`heterogeneity`): ``gamma = var_t(l_t) / mean_t(l_t)^2`` over the log
   squared norms ``l_t = log ||tau_t||_F^2`` (unbiased variance, so undefined for one task); the
   tasks are *heterogeneous* when ``gamma > 0.3``;
2. the covariance estimate (:func:`centred_covariance`): the rows of ``tau_t`` centred,
   ``C_t = tau_t - 1 mean_rows(tau_t)``, and ``S_t = C_t^T C_t`` (not divided by m);
3. adaptive covariance normalisation (:func:`task_covariances`): heterogeneous tasks each get
   ``Sigma_t = S_t / tr(S_t)`` and the ridge ``eps / tr(S_t)`` (so ``Sigma_t + ridge_t I =
   (S_t + eps I) / tr(S_t)``: every task's covariance weighs the same whatever its update's size);
   homogeneous ones keep ``Sigma_t = S_t`` with the ridge ``eps``;
4. the collective structural prior (:func:`collective_prior`): the row ``c`` of the column means
   of ``sum_t Sigma_t`` (divided by the tasks' mean ``||tau_t||_F^2`` when heterogeneous), added to
   every row of the system's matrix: ``A = sum_t (Sigma_t + ridge_t I) + 1 c^T`` (not symmetric);
5. the closed form (:func:`closed_form`): ``W_0 = (sum_t C_t (Sigma_t + ridge_t I)) A^-1``, the
   *centred* task vectors in the sum (so each column of ``W_0`` has mean zero over the rows);
6. spectral refinement (:func:`spectral_refinement`), heterogeneous tasks only: the residual
   ``R = sum_t tau_t (Sigma_t - M)``, ``M = mean_t (Sigma_t + ridge_t I)``, the *uncentred* task
   vectors this time; the top ``k = int(k_frac * min(m, n))`` singular directions of ``R + W_0``
   added to ``W_0``, each with the mean of their singular values: ``W_0 + s_iso U_k V_k^T``.

Where ours differs from theirs (docs/comparison.md, "ACE-Merging: ours and the authors'"): all in
float64 (theirs float32); one task is never heterogeneous (theirs: a NaN variance, which compares
False, the same); with ``k = 0`` (``min(m, n) < 4`` at 0.3) no refinement is added (theirs: the mean
of no singular values, NaN); a solve instead of an explicit inverse (the same fallback to the
pseudo-inverse when singular). The ``1e-12`` guards are theirs.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-2  # the ridge on each task's covariance (theirs: ``eps``)
K_FRAC = 0.3  # the share of singular directions spectral refinement acts on (theirs: ``k_frac``)
THRESHOLD = 0.3  # gamma above this: heterogeneous tasks (written in their function)
TINY = 1e-12  # their guard against log(0) and division by zero


def heterogeneity(taus: torch.Tensor) -> float:
    """``gamma = var_t(l_t) / (mean_t(l_t)^2 + 1e-12)``, ``l_t = log(||tau_t||_F^2 + 1e-12)`` for
    ``taus`` ``(T, m, n)``: how unequal the tasks' update sizes are, on a log scale. The variance is
    the unbiased one; with one task it is undefined: NaN (never above a threshold)."""
    if taus.shape[0] < 2:
        return math.nan
    logs = torch.log(taus.square().sum(dim=(1, 2)) + TINY)
    return float(logs.var() / (logs.mean().square() + TINY))


def centred_covariance(tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, S)``: the task vector ``tau`` (m x n) with its mean row taken from every row, ``C``,
    and the scatter of those rows, ``S = C^T C`` (n x n): the estimate of the task's input
    covariance, each row of the update one sample of its input directions."""
    C = tau - tau.mean(dim=0, keepdim=True)
    return C, C.T @ C


def task_covariances(
    taus: torch.Tensor, heterogeneous: bool, eps: float = EPS
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[float]]:
    """``(C_t, Sigma_t, ridge_t)`` for each task (:func:`centred_covariance`). Adaptive
    normalisation: when ``heterogeneous``, ``Sigma_t = S_t / tr(S_t)`` and ``ridge_t = eps / tr(S_t)``
    (``tr`` plus 1e-12), so that a task with a larger update does not weigh more; else ``S_t`` and
    ``eps`` as they are."""
    Cs, Sigmas, ridges = [], [], []
    for tau in taus:
        C, S = centred_covariance(tau)
        tr = float(S.diagonal().sum()) + TINY
        Cs.append(C)
        Sigmas.append(S / tr if heterogeneous else S)
        ridges.append(eps / tr if heterogeneous else eps)
    return Cs, Sigmas, ridges


def collective_prior(Sigmas: list[torch.Tensor], heterogeneous: bool, mean_sq_norm: float) -> torch.Tensor:
    """The collective structural prior ``c`` (1 x n): the column means of ``sum_t Sigma_t``,
    divided by ``mean_sq_norm + 1e-12`` (the tasks' mean ``||tau_t||_F^2``) when ``heterogeneous``.
    It is added to every row of the closed form's matrix (:func:`closed_form`)."""
    c = sum(Sigmas).mean(dim=0, keepdim=True)
    return c / (mean_sq_norm + TINY) if heterogeneous else c


def closed_form(
    Cs: list[torch.Tensor], Sigmas: list[torch.Tensor], ridges: list[float], prior: torch.Tensor
) -> torch.Tensor:
    """``W_0 = B A^-1`` (m x n) with ``B = sum_t C_t (Sigma_t + ridge_t I)`` and
    ``A = sum_t (Sigma_t + ridge_t I) + 1 c^T`` (``c`` the ``prior`` row, broadcast to every row):
    the covariance-weighted average of the centred task vectors, ``(sum_t W_t Sigma_t)(sum_t
    Sigma_t)^-1``, with the prior in the denominator. The pseudo-inverse if ``A`` is singular."""
    eye = torch.eye(Sigmas[0].shape[0], dtype=Sigmas[0].dtype, device=Sigmas[0].device)
    regular = [S + r * eye for S, r in zip(Sigmas, ridges)]
    A = sum(regular) + prior  # (n, n) + (1, n): the prior row added to every row
    B = sum(C @ R for C, R in zip(Cs, regular))  # (m, n)
    try:
        return torch.linalg.solve(A, B, left=False)  # B A^-1
    except torch.linalg.LinAlgError:
        return B @ torch.linalg.pinv(A)


def spectral_refinement(
    taus: torch.Tensor, Sigmas: list[torch.Tensor], ridges: list[float], W0: torch.Tensor, k_frac: float = K_FRAC
) -> torch.Tensor:
    """``s_iso U_k V_k^T`` (m x n), what refinement adds to ``W0``: ``U_k, V_k`` the top
    ``k = int(k_frac * min(m, n))`` singular directions of ``R + W0``, ``s_iso`` the mean of their
    singular values, ``R = sum_t tau_t (Sigma_t - M)`` the part of each task's (uncentred) update the
    average covariance ``M = mean_t (Sigma_t + ridge_t I)`` does not explain. Zero when ``k = 0``."""
    k = int(min(W0.shape) * k_frac)
    if k == 0:
        return torch.zeros_like(W0)
    eye = torch.eye(Sigmas[0].shape[0], dtype=W0.dtype, device=W0.device)
    M = sum(S + r * eye for S, r in zip(Sigmas, ridges)) / len(Sigmas)
    R = sum(tau @ (S - M) for tau, S in zip(taus, Sigmas))
    U, s, Vh = torch.linalg.svd(R + W0, full_matrices=False)
    return s[:k].mean() * (U[:, :k] @ Vh[:k])


def ace_task_vector(
    taus: torch.Tensor, eps: float = EPS, k_frac: float = K_FRAC, threshold: float = THRESHOLD
) -> torch.Tensor:
    """ACE-Merging of one 2-D entry, ``taus`` ``(T, m, n)``: :func:`heterogeneity` against
    ``threshold``, :func:`task_covariances`, :func:`collective_prior`, :func:`closed_form`, and when
    heterogeneous :func:`spectral_refinement` added. Computed in float64, returned in their dtype."""
    t64 = taus.double()
    heterogeneous = heterogeneity(t64) > threshold  # NaN (one task): False
    Cs, Sigmas, ridges = task_covariances(t64, heterogeneous, eps)
    mean_sq_norm = float(t64.square().sum(dim=(1, 2)).mean())
    W0 = closed_form(Cs, Sigmas, ridges, collective_prior(Sigmas, heterogeneous, mean_sq_norm))
    if heterogeneous:
        W0 = W0 + spectral_refinement(t64, Sigmas, ridges, W0, k_frac)
    return W0.to(taus.dtype)


def averaged_by_name(key: str) -> bool:
    """Whether a 2-D entry gets the mean task vector instead (theirs: any name containing
    ``text_projection``, CLIP's text projection)."""
    return "text_projection" in key

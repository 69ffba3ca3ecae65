"""ACE-Merging (Xu et al., CVPR 2026, arXiv 2603.02945): data-free merging with each task's input
covariance estimated from its fine-tuning update, as pure functions over one 2-D entry's task vectors.

What the paper's abstract and summaries readable here say (its HTML and code could not be read
here: the authors' repository could not be fetched, the stored pages end after the introduction):

- under a local linear approximation, the input covariance of task t can be estimated from its
  update ``Delta W_t``, its rows taken as samples;
- the merge is the closed form ``W = (sum_t W_t Sigma_t) (sum_t Sigma_t)^-1``, the weight that best
  reproduces every expert's outputs on inputs of covariance ``Sigma_t`` (RegMean's with
  covariances in place of Grams);
- with three components: "adaptive covariance normalization", "a collective structural prior" and
  "spectral refinement".

The equations of the three components and their defaults could not be read; OUR CHOICES, for one
2-D entry with task vectors ``tau_t = W_t - W_0`` (m x n, T tasks):

1. the estimate (:func:`update_covariance`): ``S_t = tau_t^T tau_t / m``, the second moment of the
   rows (uncentered: the merging formula's Sigma_t is the input Gram, which keeps the mean);
2. adaptive covariance normalisation (:func:`normalised`): ``N_t = S_t / (tr(S_t) / n)``, mean
   eigenvalue 1, so that a task whose update is ten times larger does not weigh a hundred times more
   (the update's scale says how long and how fast the expert was trained, not how much its inputs
   matter), and a ridge ``ridge * I`` relative to that mean eigenvalue (1): the ridge adapts to each
   task's own scale, and keeps ``sum_t Sigma_t`` invertible where the updates are low-rank;
3. the collective structural prior (:func:`ace_covariances`): each task's covariance shrunk toward
   the tasks' mean ``P = mean_t N_t`` by ``prior``: ``Sigma_t = (1 - prior) N_t + prior P + ridge I``.
   Without the ridge and for invertible ``sum_t N_t`` this gives ``(1 - prior) tau_ace + prior
   mean_t tau_t`` (``tau_ace`` the merge at ``prior = 0``): the prior moves the merge toward plain
   averaging, the estimate every task agrees on;
4. the closed form (:func:`ace_merge`): ``tau = (sum_t tau_t Sigma_t) (sum_t Sigma_t)^-1`` (equal to
   the paper's on weights, since ``sum_t W_0 Sigma_t (sum_t Sigma_t)^-1 = W_0``);
5. spectral refinement (:func:`spectral_refine`): the merged task vector's singular values moved a
   fraction ``refine`` of the way to their mean, ``s' = (1 - refine) s + refine mean(s)`` (Iso-C's
   flat spectrum at ``refine = 1``; the sum of the singular values is kept), so that the few
   directions the closed form makes dominant do not drown the others.

Defaults (ours, untuned): ``ridge = 0.01``, ``prior = 0.1``, ``refine = 0.5``; the merger's
``scale`` 1.0 (:func:`featcal.baselines.merging.ace`). Everything is in float64.
"""

from __future__ import annotations

import torch

RIDGE = 0.01  # the ridge added to each task's normalised covariance (mean eigenvalue 1)
PRIOR = 0.1  # the weight of the collective prior (the tasks' mean covariance)
REFINE = 0.5  # how far the merged task vector's singular values move toward their mean


def update_covariance(tau: torch.Tensor) -> torch.Tensor:
    """``S = tau^T tau / m`` (n x n): the second moment of the rows of a task vector ``tau`` (m x n),
    each row one sample of the task's input directions."""
    return tau.T @ tau / tau.shape[0]


def normalised(S: torch.Tensor) -> torch.Tensor:
    """``S / (tr(S) / n)``: the covariance with mean eigenvalue 1 (zero for a zero ``S``)."""
    mean = S.diagonal().mean()
    return S / mean if mean > 0 else torch.zeros_like(S)


def ace_covariances(taus: torch.Tensor, prior: float = PRIOR, ridge: float = RIDGE) -> list[torch.Tensor]:
    """``Sigma_t = (1 - prior) N_t + prior P + ridge I`` for each task, ``N_t`` the normalised
    :func:`update_covariance` of ``taus[t]`` (``taus``: ``(T, m, n)``), ``P = mean_t N_t``."""
    N = [normalised(update_covariance(tau)) for tau in taus]  # T x (n, n)
    P = sum(N) / len(N)
    eye = torch.eye(taus.shape[-1], dtype=taus.dtype, device=taus.device)
    return [(1.0 - prior) * Nt + prior * P + ridge * eye for Nt in N]


def ace_merge(taus: torch.Tensor, covariances: list[torch.Tensor]) -> torch.Tensor:
    """``tau = (sum_t tau_t Sigma_t) (sum_t Sigma_t)^-1`` (m x n): the task vector that best
    reproduces every task's on inputs of covariance ``Sigma_t`` (each symmetric, their sum positive
    definite). By Cholesky: ``tau^T = A^-1 (sum_t Sigma_t tau_t^T)``, ``A = sum_t Sigma_t``."""
    A = sum(covariances)  # (n, n)
    B = sum(S @ tau.T for S, tau in zip(covariances, taus))  # (n, m)
    return torch.cholesky_solve(B, torch.linalg.cholesky(A)).T


def spectral_refine(tau: torch.Tensor, refine: float = REFINE) -> torch.Tensor:
    """``U diag((1 - refine) s + refine mean(s)) V^T`` for ``tau = U diag(s) V^T``: the spectrum
    moved toward flat by ``refine`` (0: ``tau`` itself; 1: Iso-C's flat spectrum), its sum kept."""
    if refine == 0:
        return tau
    U, s, Vh = torch.linalg.svd(tau, full_matrices=False)  # (m, k), (k,), (k, n)
    return U @ torch.diag((1.0 - refine) * s + refine * s.mean()) @ Vh


def ace_task_vector(
    taus: torch.Tensor, prior: float = PRIOR, ridge: float = RIDGE, refine: float = REFINE
) -> torch.Tensor:
    """ACE-Merging of one 2-D entry: :func:`ace_covariances`, :func:`ace_merge`, then
    :func:`spectral_refine`; ``taus`` ``(T, m, n)``, computed in float64, returned in their dtype."""
    t64 = taus.double()
    return spectral_refine(ace_merge(t64, ace_covariances(t64, prior, ridge)), refine).to(taus.dtype)

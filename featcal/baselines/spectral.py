"""The matrix rules of the data-free mergers Iso-C, Iso-CTS, TSV and WUDI, as pure functions.

Each function takes the stacked task vectors of one 2-D state-dict entry, ``taus`` of shape
``(T, m, n)`` (``tau_i = theta_i - theta_0``, T tasks), and returns that entry's merged task
vector ``(m, n)``; :mod:`featcal.baselines.merging` applies them to every 2-D entry of a state dict
(and the mean task vector to every other entry). Notation: ``k = min(m, n)``;
``M = sum_i tau_i``; ``svd(A) = U S V^T`` with ``U`` (m, k), ``V`` (n, k); ``polar(U)`` the
orthonormal matrix closest to ``U`` (``P Q^T`` for ``U = P Sigma Q^T``).
"""

from __future__ import annotations

import torch


def polar(A: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor ``P Q^T`` of ``A = P Sigma Q^T`` ``(m, k)``, m >= k: the matrix
    with orthonormal columns nearest to ``A`` (columns that are zero get arbitrary directions
    orthogonal to the others)."""
    P, _, Qh = torch.linalg.svd(A, full_matrices=False)  # (m, k), (k,), (k, k)
    return P @ Qh


def iso_c_task_vector(taus: torch.Tensor) -> torch.Tensor:
    """Iso-C: ``M = U S V^T`` -> ``mean(S) U V^T``, the summed task vector with a flat spectrum
    (the mean over all k singular values)."""
    U, S, Vh = torch.linalg.svd(taus.sum(0), full_matrices=False)  # (m, k), (k,), (k, n)
    return S.mean() * U @ Vh


def iso_cts_split(k: int, n_tasks: int, common_space_fraction: float) -> tuple[int, int]:
    """``(c, r)``: the common space's size c and each task's r, with ``c + n_tasks r = k``.
    ``c = int(k f)`` first, then moved so that the rest splits evenly between the tasks
    (``r = round((k - c) / T)``; never below zero)."""
    c = int(k * common_space_fraction)
    r = round((k - c) / n_tasks)
    while r > 0 and k - r * n_tasks < 0:
        r -= 1
    return k - r * n_tasks, r


def iso_cts_task_vector(taus: torch.Tensor, common_space_fraction: float = 0.8) -> torch.Tensor:
    """Iso-CTS: the top-c singular triplets of ``M`` (the common space) and, per task, the
    top-r triplets of ``tau_i`` with its projection on the common left space removed (its
    own space; :func:`iso_cts_split`), stacked; ``U`` and ``V`` replaced by their polar
    factors and every direction given the mean of the kept singular values."""
    n_tasks, m, n = taus.shape
    c, r = iso_cts_split(min(m, n), n_tasks, common_space_fraction)
    U, S, Vh = torch.linalg.svd(taus.sum(0), full_matrices=False)
    Us, Ss, Vhs = [U[:, :c]], [S[:c]], [Vh[:c]]  # (m, c), (c,), (c, n)
    for tau in taus:
        own = tau - Us[0] @ (Us[0].T @ tau)  # (m, n): tau_i outside the common left space
        Ui, Si, Vhi = torch.linalg.svd(own, full_matrices=False)
        Us.append(Ui[:, :r])
        Ss.append(Si[:r])
        Vhs.append(Vhi[:r])
    U_all, S_all, Vh_all = torch.cat(Us, 1), torch.cat(Ss), torch.cat(Vhs, 0)  # (m, k), (k,), (k, n)
    return S_all.mean() * polar(U_all) @ polar(Vh_all.T).T


def tsv_task_vector(taus: torch.Tensor) -> torch.Tensor:
    """TSV-Merge: each task's top ``r = k // T`` singular triplets in its own block of k slots
    (the last ``k - T r`` slots zero), then ``polar(U) diag(S) polar(V)^T``: the tasks'
    singular vectors made orthogonal to each other, their singular values kept."""
    n_tasks, m, n = taus.shape
    k = min(m, n)
    r = k // n_tasks
    U_all = taus.new_zeros(m, k)
    S_all = taus.new_zeros(k)
    V_all = taus.new_zeros(n, k)
    for i, tau in enumerate(taus):
        U, S, Vh = torch.linalg.svd(tau, full_matrices=False)
        U_all[:, i * r : (i + 1) * r] = U[:, :r]
        S_all[i * r : (i + 1) * r] = S[:r]
        V_all[:, i * r : (i + 1) * r] = Vh[:r].T
    return polar(U_all) @ torch.diag(S_all) @ polar(V_all).T  # (m, n)


def wudi_objective(tau: torch.Tensor, taus: torch.Tensor) -> torch.Tensor:
    """``sum_i ||(tau - tau_i) tau_i^T||_F^2 / ||tau_i||_F^2``: the interference of the merged
    task vector ``tau`` on each task's own input directions (the rows of ``tau_i``). Tasks with
    a zero ``tau_i`` add nothing.

    For ``m > n`` the same value comes from n x n Gram matrices,
    ``||D_i tau_i^T||^2 = <D_i^T D_i, tau_i^T tau_i>``, so that a tall entry (an embedding
    table) never forms an ``m x m`` product."""
    D = tau.unsqueeze(0) - taus  # (T, m, n)
    if taus.shape[1] <= taus.shape[2]:
        per_task = (D @ taus.mT).square().sum((-2, -1))  # (T,): ||D_i tau_i^T||^2 from (T, m, m)
    else:
        per_task = ((D.mT @ D) * (taus.mT @ taus)).sum((-2, -1))  # (T,) from (T, n, n)
    norms = taus.square().sum((-2, -1))  # (T,)
    weight = torch.where(norms > 0, 1.0 / norms.clamp(min=torch.finfo(norms.dtype).tiny), 0.0)
    return (weight * per_task).sum()


def wudi_task_vector(taus: torch.Tensor, iters: int = 400, lr: float = 1e-5) -> torch.Tensor:
    """WUDI: ``tau`` from ``M = sum_i tau_i``, ``iters`` Adam steps (learning rate ``lr``,
    torch's default betas) on :func:`wudi_objective`. Deterministic: nothing is drawn."""
    tau = taus.sum(0).clone().requires_grad_(True)  # a leaf: the optimiser's only parameter
    opt = torch.optim.Adam([tau], lr=lr, foreach=False)  # one tensor: the foreach path brings nothing
    fixed = taus.detach()
    with torch.enable_grad():
        for _ in range(iters):
            opt.zero_grad(set_to_none=True)
            wudi_objective(tau, fixed).backward()
            opt.step()
    return tau.detach()

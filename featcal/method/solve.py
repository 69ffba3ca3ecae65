"""The closed-form FeatCal solves, as pure functions over tensors (docs/maths.md, 'Linear weight',
'Linear bias' and 'LayerNorm affine').

Linear (``W`` is out x in, ``y = W x + b``), with ``s_i = 1/max(||C_i||_F, eps)``
and ``W_anc = rho W_mer + (1 - rho) W_0``::

    W^T = (sum_i s_i C_i + (lam + eps) I)^-1 (sum_i s_i X_i W_i^T + lam W_anc^T)
    b   = [sum_i s_i (b_i + W_i mu_t,i - W mu_s,i) + lam b_anc] / (sum_i s_i + lam)

With ``X_i = alpha P_i + (1 - alpha) C_i`` the task sums split into terms that
do not depend on (lam, rho, alpha): ``S = sum s_i C_i``, ``U = sum s_i C_i W_i^T``,
``V = sum s_i (P_i - C_i) W_i^T``, so that the right-hand side is
``U + alpha V + lam W_anc^T``. A :class:`LinearSystem` holds these terms (and
the few scalars the relative residual needs); it is built task by task and
solved for any setting.

LayerNorm affine, per channel (tasks unweighted), a 2x2 system
``[sum e + lam, sum m; sum m, N + lam] [gamma; beta] = [...]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields, replace

import torch

from featcal.config import Setting
from featcal.method.kernels import Kernels
from featcal.method.linalg import add_gram, add_rows_gram, add_weighted, inner, note, symmetric
from featcal.method.stats import LinearMoments

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Endpoints:
    """One module's parameters at the anchor's two ends: the merged model's ``(W_mer, b_mer)`` and
    the pretrained model's ``(W_0, b_0)`` (a norm's gamma as ``W``, beta as ``b``; None: no bias)."""

    W_mer: torch.Tensor
    b_mer: torch.Tensor | None
    W_0: torch.Tensor
    b_0: torch.Tensor | None


def anchor(mer: torch.Tensor, base: torch.Tensor, rho: float) -> torch.Tensor:
    """``rho * mer + (1 - rho) * base``."""
    return rho * mer + (1.0 - rho) * base


@dataclass
class ResidualTerms:
    """The task sums that only the relative residual reads (:func:`linear_residuals`), beyond
    the solve's: ``K(alpha) = sum s_i E|W_i xt|^2 = a^2 k_ee + 2a(1-a) k_se + (1-a)^2 k_ss``
    and the bias cross terms. Shapes: ``n`` tasks, ``d`` input width, ``o`` output width."""

    k_ee: torch.Tensor  # ()      sum s_i E|W_i xe|^2
    k_se: torch.Tensor  # ()      sum s_i E[(W_i xs).(W_i xe)]
    k_ss: torch.Tensor  # ()      sum s_i E|W_i xs|^2
    sbs: torch.Tensor  # (n, o)  s_i b_i per task     } sum s_i b_i.W mu_s,i = sum(sbs * (mus @ W^T))
    mus: torch.Tensor  # (n, d)  mu_s,i per task     }
    c_s: torch.Tensor  # ()      sum s_i b_i.W_i mu_s,i
    c_v: torch.Tensor  # ()      sum s_i b_i.W_i (mu_e,i - mu_s,i)
    bb: torch.Tensor  # ()      sum s_i |b_i|^2
    k_mm: torch.Tensor | None  # () sum s_i E|W_mer xs|^2 (None once a task did not see it)

    @classmethod
    def zeros(cls, d: int, o: int, dtype: torch.dtype, device) -> "ResidualTerms":
        def z(*shape) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            k_ee=z(()), k_se=z(()), k_ss=z(()), sbs=z(0, o), mus=z(0, d), c_s=z(()), c_v=z(()), bb=z(()), k_mm=z(())
        )


@dataclass
class LinearSystem:
    """Task-summed terms of one Linear target's normal equations (no hyper-parameter in them).

    Shapes: ``d`` input width, ``o`` output width. ``S`` is kept up to date on its upper
    triangle only (:func:`symmetric` gives the whole); ``U`` and ``V`` are in the weight
    layout (their transposes are contiguous).
    """

    S: torch.Tensor  # (d, d)  sum s_i C_i (upper triangle)
    U: torch.Tensor  # (d, o)  sum s_i C_i W_i^T
    V: torch.Tensor | None  # (d, o)  sum s_i (P_i - C_i) W_i^T (None in a one-alpha system)
    s_sum: torch.Tensor  # ()      sum s_i
    m_s: torch.Tensor  # (d,)    sum s_i mu_s,i
    sb: torch.Tensor  # (o,)    sum s_i b_i
    ub: torch.Tensor  # (o,)    sum s_i W_i mu_s,i
    vb: torch.Tensor  # (o,)    sum s_i W_i (mu_e,i - mu_s,i)
    res: ResidualTerms  # what the relative residual reads besides these
    n_tasks: int = 0
    min_rows: int = 0
    owns_S: bool = True  # False: S is another system's (modules reading one input share it)
    alpha: float | None = None  # set: U holds U + alpha V for this alpha alone, V is unused

    @classmethod
    def zeros(
        cls,
        d: int,
        o: int,
        dtype: torch.dtype,
        device,
        S: torch.Tensor | None = None,
        alpha: float | None = None,
        kernels: Kernels | None = None,
    ) -> "LinearSystem":
        """Empty sums; ``S`` given: share that system's ``S`` (same input, so same ``S``),
        which :func:`add_task` then leaves to its owner. ``alpha`` given: a system for that
        alpha only (``U`` holds ``U + alpha V``; :func:`solve_linear` refuses another).
        ``kernels``: where a new ``S`` comes from (default: a new tensor)."""

        def z(*shape) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        owns_S = S is None
        if owns_S:
            S = (kernels or Kernels()).zeros((d, d), dtype, device)
        return cls(
            S=S,
            U=z(o, d).T,
            V=z(o, d).T if alpha is None else None,
            s_sum=z(()),
            m_s=z(d),
            sb=z(o),
            ub=z(o),
            vb=z(o),
            res=ResidualTerms.zeros(d, o, dtype, device),
            owns_S=owns_S,
            alpha=alpha,
        )

    def to(self, device) -> "LinearSystem":
        """The system with every tensor on ``device`` (a new object; tensors already there are shared)."""
        return replace(_tensors_to(self, device), res=_tensors_to(self.res, device))


def _tensors_to(obj, device):
    """A new dataclass like ``obj`` with its tensor fields moved to ``device``."""
    return replace(
        obj, **{f.name: getattr(obj, f.name).to(device) for f in fields(obj) if torch.is_tensor(getattr(obj, f.name))}
    )


def add_task(
    sys: LinearSystem, mom: LinearMoments, W_i: torch.Tensor, b_i: torch.Tensor | None, eps: float
) -> LinearSystem:
    """Add task i's terms (in place; returns ``sys``).

    ``mom``: the task's sums (:func:`featcal.method.stats.linear_moments`); ``W_i`` ``(o, d)``,
    ``b_i`` ``(o,)`` or ``None``: expert i's parameters. With a leading task axis on all of
    them (``mom`` of every task, ``W_i`` ``(T, o, d)``, ``b_i`` ``(T, o)``), every task at once
    (each sum over the tasks one operation); one task is a stack of one.
    """
    if not mom.w.dim():
        mom = replace(
            mom, **{f.name: getattr(mom, f.name)[None] for f in fields(mom) if torch.is_tensor(getattr(mom, f.name))}
        )
        W_i, b_i = W_i[None], None if b_i is None else b_i[None]
    dt = sys.S.dtype
    W = W_i.to(dt)
    w = mom.w.to(dt)  # (T,)
    s = w / torch.maximum(mom.c_norm.to(dt), eps * w)  # s_i = 1 / max(||C_i / w||_F, eps): C holds sums
    f = s / w  # sums -> s_i times means
    U, V = sys.U.T, None if sys.V is None else sys.V.T  # (o, d) contiguous
    CW, PW = (None if x is None else x.mT for x in (mom.CW, mom.PW))  # (T, o, d) contiguous
    if sys.owns_S and mom.C is not None:
        add_gram(sys.S, mom.C, f, mom.edges)
    elif sys.owns_S:  # direct sums: C = Z^T Z, one task at a time
        for Z, f_t in zip(mom.Z, f.tolist()):
            add_rows_gram(sys.S, Z.to(dt), f_t, mom.edges)
    if sys.alpha is None:
        add_weighted(U, CW, f)
        add_weighted(add_weighted(V, PW, f), CW, -f)
    elif mom.T is not None:
        add_weighted(U, mom.T.mT, f)
    else:
        add_weighted(add_weighted(U, CW, f * (1.0 - sys.alpha)), PW, f * sys.alpha)
    sys.s_sum += s.sum()
    mu_s, mu_e = mom.mu_s.to(dt), mom.mu_e.to(dt)  # (T, d)
    sys.m_s.add_(s @ mu_s)
    Wmu_s, Wmu_d = (W @ torch.stack([mu_s, mu_e - mu_s], -1)).unbind(-1)  # (T, o) each: W read once
    sys.ub.add_(s @ Wmu_s)
    sys.vb.add_(s @ Wmu_d)
    res = sys.res
    res.k_ee += f @ mom.k_ee.to(dt)
    res.k_se += f @ mom.k_se.to(dt)
    res.k_ss += f @ mom.k_ss.to(dt)
    if res.k_mm is not None:
        res.k_mm = None if mom.k_mm is None else res.k_mm + f @ mom.k_mm.to(dt)
    if b_i is not None:
        b = b_i.to(dt)
        sys.sb.add_(s @ b)
        res.sbs = torch.cat([res.sbs, s[:, None] * b])
        res.mus = torch.cat([res.mus, mu_s])
        res.c_s += s @ (b * Wmu_s).sum(-1)
        res.c_v += s @ (b * Wmu_d).sum(-1)
        res.bb += s @ (b * b).sum(-1)
    sys.min_rows = mom.rows if sys.n_tasks == 0 else min(sys.min_rows, mom.rows)
    sys.n_tasks += len(w)
    return sys


def linear_rhs(sys: LinearSystem, ends: Endpoints, at: Setting) -> torch.Tensor:
    """``U + alpha V + lam W_anc^T`` ``(d, o)``, a new tensor in the weight layout."""
    lam, rho = at.lam, at.rho
    U = sys.U if sys.alpha is None else _task_rhs(sys, at.alpha)
    Rt = torch.add(U.T, ends.W_mer, alpha=lam * rho).add_(ends.W_0, alpha=lam * (1.0 - rho))  # (o, d)
    if sys.alpha is None:
        Rt.add_(sys.V.T, alpha=at.alpha)
    return Rt.T


def _task_rhs(sys: LinearSystem, alpha: float) -> torch.Tensor:
    """``U + alpha V`` (a system built for one alpha has nothing else)."""
    if sys.alpha is None:
        return sys.U + alpha * sys.V
    if alpha != sys.alpha:
        raise ValueError(
            f"this system was built for alpha={sys.alpha} only, not {alpha}; "
            "calibrate with keep_stats=True to solve other settings."
        )
    return sys.U


def linear_bias(sys: LinearSystem, W: torch.Tensor, ends: Endpoints, at: Setting) -> torch.Tensor:
    """The bias for the new ``W``: ``[sum s_i (b_i + W_i mu_t - W mu_s) + lam b_anc] / (sum s_i + lam)``
    (it reads only the bias sums, which a compacted preview keeps)."""
    dt = sys.m_s.dtype
    b_anc = anchor(ends.b_mer.to(dt), ends.b_0.to(dt), at.rho)
    num = sys.sb + sys.ub + at.alpha * sys.vb - W.to(dt) @ sys.m_s + at.lam * b_anc
    return num / (sys.s_sum + at.lam)


def solve_linear(
    sys: LinearSystem, ends: Endpoints, at: Setting, *, eps: float, bias: bool = True, kernels: Kernels | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The calibrated ``(W, b, S W^T)`` (in the system's dtype). ``b`` is the merged bias when
    ``bias`` is off, ``None`` when the module has none. ``S W^T`` comes free from the normal
    equations (``S W^T = R - (lam + eps) W^T``), for the residual. ``kernels``: where the
    factorisation of ``S + (lam + eps) I`` comes from (and stays, for the other systems sharing
    this ``S``), and what it has to say goes (default: new ones, the default fast paths)."""
    lam = at.lam
    solver = (kernels or Kernels()).solver(sys.S, lam + eps)
    R = linear_rhs(sys, ends, at)  # (d, o)

    def anchor_t() -> torch.Tensor:  # W_anc^T, for a solver that takes R's anchor part apart (EigenSolve)
        return anchor(ends.W_mer.to(R.dtype), ends.W_0.to(R.dtype), at.rho).T

    Wt = solver.ridge(R, lam, anchor_t)  # (d, o)
    W = Wt.T
    if ends.b_mer is None:
        b = None
    elif not bias:
        b = ends.b_mer.to(sys.S.dtype)
    else:
        b = linear_bias(sys, W, ends, at)
    return W, b, R.sub_(Wt, alpha=lam + eps)


def linear_residual(
    sys: LinearSystem,
    W: torch.Tensor,
    b: torch.Tensor | None,
    alpha: float,
    SWt: torch.Tensor | None = None,
    wsw: torch.Tensor | None = None,
) -> float:
    """Relative residual ``sum s_i E|W xs + b - W_i xt - b_i|^2 / sum s_i E|W_i xt + b_i|^2``.
    ``SWt`` (``S W^T``) or ``wsw`` (``tr(W S W^T)``, e.g. ``sys.res.k_mm`` for the merged
    weights) may be given when already known; else ``S W^T`` is computed."""
    return linear_residuals(sys, alpha, (W, b, SWt, wsw))[0]


def linear_residuals(sys: LinearSystem, alpha: float, *models) -> list[float]:
    """:func:`linear_residual` of each ``(W, b, SWt, wsw)`` in ``models`` (e.g. the merged
    weights and the solution): the products with each ``W`` and ``b`` as tensors, all read
    back at once, and the scalar algebra in Python floats (a module's residuals are
    dozens of operations on scalars, which cost more as tensor calls than they compute).
    A NaN or Inf in any ``W`` or ``b`` makes its residual NaN or Inf (``inf * 0`` is NaN)."""
    dt, res = sys.S.dtype, sys.res
    rhs = _task_rhs(sys, alpha)
    rows, with_bias = [], []
    for W, b, SWt, wsw in models:
        Wt = W.to(dt).T  # (d, o), weight layout
        if wsw is None:
            wsw = inner(Wt, symmetric(sys.S) @ Wt if SWt is None else SWt)
        terms = [wsw, inner(Wt, rhs)]
        if b is not None:
            b = b.to(dt)
            terms += [b @ (Wt.T @ sys.m_s), b @ sys.ub, b @ sys.vb, (res.sbs * (res.mus @ Wt)).sum(), b @ b, b @ sys.sb]
        rows.append(torch.stack(terms))
        with_bias.append(b is not None)
    k_ee, k_se, k_ss, c_s, c_v, bb, s_sum, *vals = torch.cat(
        [torch.stack([res.k_ee, res.k_se, res.k_ss, res.c_s, res.c_v, res.bb, sys.s_sum]).to(dt), *rows]
    ).tolist()
    a = alpha
    K = a * a * k_ee + 2 * a * (1 - a) * k_se + (1 - a) ** 2 * k_ss
    den = K + 2 * (c_s + a * c_v) + bb
    den = den if not den < 1e-30 else 1e-30  # (a NaN passes through both clamps)
    out = []
    for has_b in with_bias:
        wsw, w_rhs, *vals = vals
        num = wsw - 2 * w_rhs + K
        if has_b:
            bWm, b_ub, b_vb, sbs_W, b_b, b_sb, *vals = vals
            num += 2 * (bWm - b_ub - a * b_vb - sbs_W + c_s + a * c_v) + s_sum * b_b - 2 * b_sb + bb
        out.append((num if not num < 0 else 0.0) / den)
    return out


@dataclass
class NormSystem:
    """Per-task LayerNorm moments and expert affines, stacked over tasks ``(N, d)``."""

    e: torch.Tensor  # E[z*z] per task and channel
    m: torch.Tensor  # E[z]
    g: torch.Tensor  # gamma_i
    b: torch.Tensor | None  # beta_i (None: the LayerNorm has no bias)

    def to(self, device) -> "NormSystem":
        return NormSystem(
            self.e.to(device), self.m.to(device), self.g.to(device), None if self.b is None else self.b.to(device)
        )


def norm_scale(e: torch.Tensor, g: torch.Tensor, g_anc: torch.Tensor, lam: float, eps: float) -> torch.Tensor:
    """The calibrated per-channel scale of a norm without shift (an RMS norm, or a LayerNorm
    without bias): the minimiser of ``sum_i E|gamma z - gamma_i z|^2 + lam |gamma - gamma_anc|^2``
    per channel, from ``e`` ``(N, d)`` = each task's ``E[z*z]`` and ``g`` ``(N, d)`` = each
    expert's ``gamma_i`` (docs/maths.md, 'LayerNorm affine')::

        gamma = (sum_i e_i gamma_i + lam gamma_anc) / max(sum_i e_i + lam, eps)
    """
    return ((e * g).sum(0) + lam * g_anc) / (e.sum(0) + lam).clamp(min=eps)


# A norm's per-channel system counts as degenerate where its determinant (2x2) or its diagonal
# (1x1) is within this many units of rounding of its size: there the data leave a direction of
# (gamma, beta) undetermined and the clamp at eps would return rounding noise.
NORM_NOISE_ULPS = 64


def norm_degenerate(det: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(d,)`` bool: channels whose ``det`` is within :data:`NORM_NOISE_ULPS` roundings of ``scale``."""
    return det <= NORM_NOISE_ULPS * torch.finfo(det.dtype).eps * scale.abs()


def anchored_rank_one(
    a11: torch.Tensor, a12: torch.Tensor, a22: torch.Tensor, r1, r2, g_anc, b_anc
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel, of all ``(gamma, beta)`` solving a rank-one 2x2 system ``A x = r`` in the
    least-squares sense, the one nearest the anchor: ``x = x_anc + u u^T (r - A x_anc) / s`` with
    ``A ~ s u u^T`` (``s = a11 + a22``, ``u`` along ``A``'s second row, ``a22 = N + lam > 0``),
    which is what exact arithmetic gives as lam tends to zero from above."""
    s = a11 + a22
    norm = (a12 * a12 + a22 * a22).sqrt()
    u1, u2 = a12 / norm, a22 / norm
    q1, q2 = r1 - (a11 * g_anc + a12 * b_anc), r2 - (a12 * g_anc + a22 * b_anc)
    c = (u1 * q1 + u2 * q2) / s
    return g_anc + c * u1, b_anc + c * u2


def solve_norm(
    sys: NormSystem, ends: Endpoints, at: Setting, *, eps: float, kernels: Kernels | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The calibrated ``(gamma, beta)`` per channel (the 2x2 system, determinant clamped below at
    ``eps``; ``ends`` holds the norm's gammas as ``W`` and betas as ``b``); ``gamma`` alone when the
    LayerNorm has no bias. ``alpha`` plays no part: a norm's target is the expert's own output.
    Channels whose system is degenerate (:func:`norm_degenerate`: e.g. lam = 0 and a channel
    constant over the data) take the undetermined direction from the anchor
    (:func:`anchored_rank_one`; the scale alone: the anchor), noted in ``kernels.fallbacks`` (without
    one: logged as a warning), as the Linear solve does."""
    dt = sys.e.dtype
    n = sys.e.shape[0]
    lam, rho = at.lam, at.rho
    g_anc = anchor(ends.W_mer.to(dt), ends.W_0.to(dt), rho)
    E, M = sys.e.sum(0), sys.m.sum(0)
    if sys.b is None:
        gamma = norm_scale(sys.e, sys.g, g_anc, lam, eps)
        bad = norm_degenerate(E + lam, E.abs().max().clamp_min(torch.finfo(dt).tiny) * n)
        if bool(bad.any()):
            gamma = torch.where(bad, g_anc, gamma)
            _note_degenerate(int(bad.sum()), lam, kernels)
        return gamma, None
    b_anc = anchor(ends.b_mer.to(dt), ends.b_0.to(dt), rho)
    r1 = (sys.e * sys.g + sys.m * sys.b).sum(0) + lam * g_anc
    r2 = (sys.m * sys.g + sys.b).sum(0) + lam * b_anc
    a11, a12, a22 = E + lam, M, n + lam
    raw = a11 * a22 - a12 * a12
    det = raw.clamp(min=eps)
    gamma = (a22 * r1 - a12 * r2) / det
    beta = (a11 * r2 - a12 * r1) / det
    bad = norm_degenerate(raw, a11 * a22)
    if bool(bad.any()):
        g1, b1 = anchored_rank_one(a11, a12, a22, r1, r2, g_anc, b_anc)
        gamma, beta = torch.where(bad, g1, gamma), torch.where(bad, b1, beta)
        _note_degenerate(int(bad.sum()), lam, kernels)
    return gamma, beta


def _note_degenerate(count: int, lam: float, kernels: Kernels | None) -> None:
    msg = (
        f"{count} channel(s) have a degenerate system (lam = {lam:.3g}; the channel is constant, or "
        "zero, over the calibration data): the direction the data leave undetermined was taken from the "
        "anchor instead of rounding noise. A larger lam avoids this."
    )
    note(msg, None if kernels is None else kernels.fallbacks)


def norm_residual(sys: NormSystem, g: torch.Tensor, b: torch.Tensor | None) -> float:
    """Relative residual ``sum_i E|(g - g_i) z + b - b_i|^2 / sum_i E|g_i z + b_i|^2``."""
    dt = sys.e.dtype
    dg = g.to(dt) - sys.g
    bi = torch.zeros_like(sys.g) if sys.b is None else sys.b
    db = (torch.zeros_like(g, dtype=dt) if b is None else b.to(dt)) - bi
    num = (dg * dg * sys.e + 2 * dg * db * sys.m + db * db).sum()
    den = (sys.g * sys.g * sys.e + 2 * sys.g * bi * sys.m + bi * bi).sum()
    return float(num.clamp(min=0) / den.clamp(min=1e-30))

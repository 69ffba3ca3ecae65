"""Running statistics of one module's inputs on one task, accumulated batch by batch.

Rows are tokens (every token of every example), each with a weight ``w``
(default 1; 0 for padding). With ``E[.]`` the w-weighted mean over rows:

    C   = E[xs xs^T]     (d, d)   second moment of the calibrating input
    P   = E[xs xe^T]     (d, d)   cross moment with the expert's input
    mu_s = E[xs], mu_e = E[xe]

``X = E[xs xt^T] = alpha P + (1 - alpha) C`` for ``xt = alpha xe + (1 - alpha) xs``,
so one pass serves every alpha. For LayerNorm targets only the normalised
input ``z`` of the calibrating stream matters: ``e = E[z*z]``, ``m = E[z]``.

The functions here are pure over tensors (the ``accumulate_*`` ones add into
the sums they are given, and return them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LinearSums:
    """Weighted sums over rows for a Linear input site (divide by ``w`` for means).

    The cross moment is kept in one of two equivalent forms, whichever is
    cheaper: ``P = sum w xs xe^T`` (d, d), shared by every module reading this
    input, or, per module, ``Q = sum w xs (W_i xe)^T`` (d, o) from the expert
    module's own output (``P W_i^T = Q``; the solve needs nothing else of ``P``).
    """

    w: torch.Tensor          # ()        sum of row weights
    rows: int                # number of rows with positive weight
    s: torch.Tensor          # (d,)      sum w xs
    e: torch.Tensor          # (d,)      sum w xe
    C: torch.Tensor          # (d, d)    sum w xs xs^T
    P: torch.Tensor | None   # (d, d)    sum w xs xe^T (None when the Q form is used)

    @classmethod
    def zeros(cls, d: int, dtype: torch.dtype, device, cross: bool = True) -> "LinearSums":
        z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(z(()), 0, z(d), z(d), z(d, d), z(d, d) if cross else None)


@dataclass
class NormSums:
    """Weighted sums over rows of the normalised input ``z`` of a LayerNorm."""

    w: torch.Tensor          # ()
    rows: int
    z: torch.Tensor          # (d,)  sum w z
    zz: torch.Tensor         # (d,)  sum w z*z

    @classmethod
    def zeros(cls, d: int, dtype: torch.dtype, device) -> "NormSums":
        z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(z(()), 0, z(d), z(d))


def as_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(B, T, d)`` or ``(B, d)`` -> ``(rows, d)`` in ``dtype``."""
    return x.reshape(-1, x.shape[-1]).to(dtype)


def weighted(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Rows scaled by their weights (``x`` itself when ``w`` is None)."""
    return x if w is None else x * w[:, None]


def accumulate_linear(acc: LinearSums, xs: torch.Tensor, xe: torch.Tensor,
                      w: torch.Tensor | None) -> LinearSums:
    """Add one batch: ``xs``, ``xe`` ``(rows, d)``, ``w`` ``(rows,)`` or ``None`` (all 1)."""
    xsw = weighted(xs, w)
    acc.w += xs.shape[0] if w is None else w.sum()
    acc.rows += xs.shape[0] if w is None else int((w > 0).sum())
    acc.s += xsw.sum(0)
    acc.e += weighted(xe, w).sum(0)
    if acc.P is None:
        acc.C.addmm_(xsw.T, xs)
        return acc
    d = xs.shape[1]
    both = xsw.T @ torch.cat([xs, xe], dim=1)  # (d, 2d): [sum w xs xs^T | sum w xs xe^T]
    acc.C += both[:, :d]
    acc.P += both[:, d:]
    return acc


def accumulate_cross(Q: torch.Tensor, xs: torch.Tensor, ye: torch.Tensor,
                     w: torch.Tensor | None) -> torch.Tensor:
    """``Q += sum_r w_r xs_r ye_r^T`` for ``xs`` ``(rows, d)``, ``ye = W_i xe`` ``(rows, o)``."""
    return Q.addmm_(weighted(xs, w).T, ye)


def accumulate_norm(acc: NormSums, xs: torch.Tensor, w: torch.Tensor | None, eps: float) -> NormSums:
    """Add one batch of LayerNorm inputs ``xs`` ``(rows, d)``: ``z = LayerNorm(xs)`` without affine."""
    z = F.layer_norm(xs, (xs.shape[1],), eps=eps)
    zw = z if w is None else z * w[:, None]
    acc.w += xs.shape[0] if w is None else w.sum()
    acc.rows += xs.shape[0] if w is None else int((w > 0).sum())
    acc.z += zw.sum(0)
    acc.zz += (zw * z).sum(0)
    return acc


def weighted_sq_norm(y: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """``sum_r w_r |y_r|^2`` for ``y`` ``(rows, d)``."""
    sq = (y * y).sum(1)
    return sq.sum() if w is None else (w * sq).sum()


@dataclass(frozen=True)
class LinearMoments:
    """Means of one task for one Linear module (the spec's ``C_i``, ``mu``), with the cross
    moment already applied to the expert's weights: ``PW = E[xs xe^T] W_i^T`` ``(d, o)``."""

    C: torch.Tensor
    PW: torch.Tensor
    mu_s: torch.Tensor
    mu_e: torch.Tensor
    rows: int


def linear_moments(acc: LinearSums, W_i: torch.Tensor | None = None,
                   Q: torch.Tensor | None = None) -> LinearMoments:
    """Means of ``acc``; ``PW`` from ``P`` and ``W_i`` or from the per-module sum ``Q``."""
    if not float(acc.w) > 0:
        raise ValueError("no calibration rows with positive weight for this module (empty task?).")
    w = acc.w
    PW = Q / w if Q is not None else (acc.P @ W_i.to(acc.P.dtype).T) / w
    return LinearMoments(acc.C / w, PW, acc.s / w, acc.e / w, acc.rows)


def norm_moments(acc: NormSums) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, m)`` = ``(E[z*z], E[z])`` per channel."""
    if not float(acc.w) > 0:
        raise ValueError("no calibration rows with positive weight for this LayerNorm (empty task?).")
    return acc.zz / acc.w, acc.z / acc.w

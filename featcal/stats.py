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
    """Weighted sums over rows for a Linear input site (divide by ``w`` for means)."""

    w: torch.Tensor          # ()        sum of row weights
    rows: int                # number of rows with positive weight
    s: torch.Tensor          # (d,)      sum w xs
    e: torch.Tensor          # (d,)      sum w xe
    C: torch.Tensor          # (d, d)    sum w xs xs^T
    P: torch.Tensor          # (d, d)    sum w xs xe^T

    @classmethod
    def zeros(cls, d: int, dtype: torch.dtype, device) -> "LinearSums":
        z = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
        return cls(z(()), 0, z(d), z(d), z(d, d), z(d, d))


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


def accumulate_linear(acc: LinearSums, xs: torch.Tensor, xe: torch.Tensor,
                      w: torch.Tensor | None) -> LinearSums:
    """Add one batch: ``xs``, ``xe`` ``(rows, d)``, ``w`` ``(rows,)`` or ``None`` (all 1)."""
    if w is None:
        xsw = xs
        acc.w += xs.shape[0]
        acc.rows += xs.shape[0]
    else:
        xsw = xs * w[:, None]
        acc.w += w.sum()
        acc.rows += int((w > 0).sum())
        xe_w = xe * w[:, None]
    acc.s += xsw.sum(0)
    acc.e += (xe if w is None else xe_w).sum(0)
    d = xs.shape[1]
    both = xsw.T @ torch.cat([xs, xe], dim=1)  # (d, 2d): [sum w xs xs^T | sum w xs xe^T]
    acc.C += both[:, :d]
    acc.P += both[:, d:]
    return acc


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
    """Means of one task at one Linear input site (the spec's ``C_i``, ``P_i``, ``mu``)."""

    C: torch.Tensor
    P: torch.Tensor
    mu_s: torch.Tensor
    mu_e: torch.Tensor
    rows: int


def linear_moments(acc: LinearSums) -> LinearMoments:
    if not float(acc.w) > 0:
        raise ValueError("no calibration rows with positive weight for this module (empty task?).")
    w = acc.w
    return LinearMoments(acc.C / w, acc.P / w, acc.s / w, acc.e / w, acc.rows)


def norm_moments(acc: NormSums) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, m)`` = ``(E[z*z], E[z])`` per channel."""
    if not float(acc.w) > 0:
        raise ValueError("no calibration rows with positive weight for this LayerNorm (empty task?).")
    return acc.zz / acc.w, acc.z / acc.w

"""Cosines and linear CKA between a model and its experts (paper section 3).

Pure maths first (pooling a block output per example, cosines of rows,
streaming linear CKA from Gram sums, cosines from dot-product sums), then
:func:`task_vector_cosine`: ``cos(theta - theta_0, theta_i - theta_0)`` for
the whole model and per block, from parameters only (no data). The per-example
cosine of final features lives in :mod:`diagnostics.output`, the per-block
cosine and CKA of block outputs in :mod:`diagnostics.drift`.

Tables are tidy (one row per measurement). ``block = -1`` (:data:`WHOLE`) means
the whole model: every parameter, the final features, the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import pandas as pd
import torch
from torch import nn

from featcal.model.arch import block_names

WHOLE = -1  # ``block`` value of a whole-model measurement (all parameters, final features)
EPS = 1e-12


# ----------------------------------------------------------------------------- pure maths

TOKENS = ("all", "cls")


def pool_examples(h: torch.Tensor, tokens: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One vector per example from a batch-first block output.

    ``(B, T, d)`` -> ``(B, d)``: the first token (``tokens="cls"``, CLIP's class
    token, taken whatever the mask says) or the mean over tokens with ``mask != 0``
    (``tokens="all"``; every token when ``mask`` is ``None``). ``(B, d)`` is returned
    as it is. Half-precision outputs are pooled in float32.
    """
    if h.dtype in (torch.float16, torch.bfloat16):
        h = h.float()
    if h.dim() == 2:
        return h
    if tokens == "cls":
        return h[:, 0]
    if mask is None:
        return h.mean(1)
    w = mask.to(h.device, h.dtype).unsqueeze(-1)  # (B, T, 1)
    h = h.masked_fill(w == 0, 0.0)  # padding out first: a NaN or Inf there would survive * 0
    return (h * w).sum(1) / w.sum(1).clamp_min(1.0)


def cosine_rows(a: torch.Tensor, b: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Row-wise cosine ``<a_r, b_r> / (|a_r| |b_r|)`` of ``(n, d)`` tensors -> ``(n,)``, in float64.

    A zero row gives cosine 0 (the denominator is clamped at ``eps``)."""
    a, b = a.double(), b.double()
    den = (a.norm(dim=-1) * b.norm(dim=-1)).clamp_min(eps)
    return (a * b).sum(-1) / den


@dataclass
class CKASums:
    """Running sums for linear CKA between paired features ``x_n``, ``y_n`` (rows = examples).

    With ``n`` rows, the centred cross-covariance is ``xy - sx sy^T / n`` (and alike
    for ``xx``, ``yy``), so batches can be added one at a time in any order.
    """

    n: int
    sx: torch.Tensor  # (dx,)      sum x
    sy: torch.Tensor  # (dy,)      sum y
    xx: torch.Tensor  # (dx, dx)   sum x x^T
    yy: torch.Tensor  # (dy, dy)   sum y y^T
    xy: torch.Tensor  # (dx, dy)   sum x y^T

    @classmethod
    def zeros(cls, dx: int, dy: int, device=None) -> "CKASums":
        def z(*s):
            return torch.zeros(*s, dtype=torch.float64, device=device)

        return cls(0, z(dx), z(dy), z(dx, dx), z(dy, dy), z(dx, dy))


def accumulate_cka(acc: CKASums, x: torch.Tensor, y: torch.Tensor) -> CKASums:
    """Add paired rows ``x`` ``(n, dx)`` and ``y`` ``(n, dy)`` into ``acc`` (in place); returns it."""
    x, y = x.double(), y.double()
    acc.n += x.shape[0]
    acc.sx += x.sum(0)
    acc.sy += y.sum(0)
    acc.xx += x.T @ x
    acc.yy += y.T @ y
    acc.xy += x.T @ y
    return acc


def linear_cka(acc: CKASums, eps: float = EPS) -> float:
    """Linear CKA ``||Xc^T Yc||_F^2 / (||Xc^T Xc||_F ||Yc^T Yc||_F)`` with ``Xc``, ``Yc`` the
    column-centred features (Kornblith et al. 2019). 1 for identical features; NaN
    with fewer than two rows."""
    if acc.n < 2:
        return float("nan")
    cxy = acc.xy - torch.outer(acc.sx, acc.sy) / acc.n  # (dx, dy) = Xc^T Yc
    cxx = acc.xx - torch.outer(acc.sx, acc.sx) / acc.n  # (dx, dx)
    cyy = acc.yy - torch.outer(acc.sy, acc.sy) / acc.n  # (dy, dy)
    den = (cxx.norm() * cyy.norm()).clamp_min(eps)
    return float(cxy.pow(2).sum() / den)


@dataclass
class DotSums:
    """``<a, b>``, ``|a|^2``, ``|b|^2`` of two vectors, summed part by part (parameter by parameter)."""

    ab: float = 0.0
    aa: float = 0.0
    bb: float = 0.0

    def add_sums(self, ab: float, aa: float, bb: float) -> None:
        self.ab += ab
        self.aa += aa
        self.bb += bb

    def cosine(self, eps: float = EPS) -> float:
        """``<a, b> / (|a| |b|)``; NaN when either vector is zero."""
        den = (self.aa * self.bb) ** 0.5
        return self.ab / den if den > eps else float("nan")


# ----------------------------------------------------------------------------- task vectors


def block_numbers(model: nn.Module, blocks: str | None = None) -> dict[str, int]:
    """``{block name: its number}`` for every block of every stack, in forward order
    (:func:`featcal.model.arch.block_names`: an encoder-decoder's decoder blocks numbered after
    its encoder's), for :func:`block_of`."""
    return {name: n for n, name in enumerate(block_names(model, blocks))}


def block_of(name: str, numbers: Mapping[str, int]) -> int | None:
    """The number of the block holding parameter ``name`` (``<block name>.``..., ``numbers``:
    :func:`block_numbers`), else ``None`` (a stem's or a head's parameter)."""
    parts = name.split(".")
    for k in range(1, len(parts)):
        block = numbers.get(".".join(parts[:k]))
        if block is not None:
            return block
    return None


@torch.no_grad()
def task_vector_cosine(
    model: nn.Module, base: nn.Module, experts: Mapping[str, nn.Module], blocks: str | None = None
) -> pd.DataFrame:
    """Cosine of the model's task vector with each expert's, whole model and per block.

    With ``tau = theta - theta_0`` (the diagnosed model, merged or calibrated) and
    ``tau_i = theta_i - theta_0`` (expert i), over the floating-point entries of the
    state dict:

    - ``task_vector_cosine`` = ``<tau, tau_i> / (|tau| |tau_i|)``;
    - ``task_vector_norm`` = ``|tau|``, ``expert_task_vector_norm`` = ``|tau_i|``.

    Rows with ``block = -1`` (:data:`WHOLE`) use every floating entry (stem and head
    too); rows with ``block = l`` use block l's (:func:`block_of`; an encoder-decoder's
    decoder blocks are numbered after its encoder's).
    A cosine with a zero task vector is NaN (e.g. the base model itself).

    Returns a tidy DataFrame: ``task``, ``block``, ``metric``, ``value``.
    """
    numbers = block_numbers(model, blocks)
    theta, theta0 = model.state_dict(), base.state_dict()
    thetas = {task: expert.state_dict() for task, expert in experts.items()}
    whole = {task: DotSums() for task in thetas}
    per_block = {task: [DotSums() for _ in numbers] for task in thetas}
    for name, w in theta.items():  # parameters outside, tasks inside: tau once
        if not torch.is_floating_point(w):
            continue
        missing = next((t for t, th in [("", theta0), *thetas.items()] if name not in th), None)
        if missing is not None:
            raise ValueError(
                f"parameter {name!r} of the model is missing from the base or expert {missing!r}; "
                "they must share one architecture."
            )
        w0 = theta0[name].to(w.device, torch.float64)
        tau = (w.double() - w0).reshape(-1)
        aa = float(tau @ tau)
        l = block_of(name, numbers)
        for task, theta_i in thetas.items():
            tau_i = (theta_i[name].to(w.device, torch.float64) - w0).reshape(-1)
            ab, bb = float(tau @ tau_i), float(tau_i @ tau_i)
            whole[task].add_sums(ab, aa, bb)
            if l is not None:
                per_block[task][l].add_sums(ab, aa, bb)
    rows = []
    for task in thetas:
        for l, s in [(WHOLE, whole[task]), *enumerate(per_block[task])]:
            rows += [
                (task, l, "task_vector_cosine", s.cosine()),
                (task, l, "task_vector_norm", s.aa**0.5),
                (task, l, "expert_task_vector_norm", s.bb**0.5),
            ]
    return pd.DataFrame(rows, columns=["task", "block", "metric", "value"])


@torch.no_grad()
def task_vector_matrix(base: nn.Module, models: Mapping[str, nn.Module], blocks: str | None = None) -> pd.DataFrame:
    """Pairwise cosines of the task vectors ``tau_i = theta_i - theta_0`` of ``models`` (the
    experts, usually): ``cos(tau_i, tau_j)`` for every pair, whole model and per block.

    How aligned the experts' weight changes are: near 0 they are nearly orthogonal (merging
    interferes little in weight space), positive they pull the same way. Rows with ``block =
    -1`` (:data:`WHOLE`) use every floating entry, rows with ``block = l`` block l's
    (:func:`block_of`); the diagonal is 1 (NaN for a zero task vector).

    Returns a tidy DataFrame: ``task``, ``other``, ``block``, ``value`` (both orders of a pair).
    """
    names = list(models)
    first = models[names[0]] if names else base
    numbers = block_numbers(first, blocks)
    theta0 = base.state_dict()
    thetas = {name: m.state_dict() for name, m in models.items()}
    n, nb = len(names), len(numbers)
    gram = torch.zeros(nb + 1, n, n, dtype=torch.float64)  # [0]: whole model, [1 + l]: block l
    for key, w0 in theta0.items():
        if not torch.is_floating_point(w0):
            continue
        missing = next((name for name, th in thetas.items() if key not in th), None)
        if missing is not None:
            raise ValueError(
                f"parameter {key!r} of the base is missing from {missing!r}; they must share one architecture."
            )
        w0 = w0.double().reshape(-1)
        taus = torch.stack([thetas[name][key].to(w0.device, torch.float64).reshape(-1) - w0 for name in names])
        g = taus @ taus.T  # (n, n) dot products of this entry's task vectors
        gram[0] += g.cpu()
        l = block_of(key, numbers)
        if l is not None:
            gram[1 + l] += g.cpu()
    norms = gram.diagonal(dim1=1, dim2=2).clamp_min(0).sqrt()  # (nb + 1, n)
    den = norms.unsqueeze(2) * norms.unsqueeze(1)  # (nb + 1, n, n)
    cos = torch.where(den > EPS, gram / den.clamp_min(EPS), torch.full_like(gram, float("nan")))
    rows = [
        (names[i], names[j], WHOLE if k == 0 else k - 1, float(cos[k, i, j]))
        for k in range(nb + 1)
        for i in range(n)
        for j in range(n)
    ]
    return pd.DataFrame(rows, columns=["task", "other", "block", "value"])

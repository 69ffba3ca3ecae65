"""Running statistics of one module's inputs on one task, accumulated batch by batch
(docs/maths.md, 'Statistics').

Rows are tokens (every token of every example), each with a weight ``w``
(default 1; 0 for padding). With ``E[.]`` the w-weighted mean over rows:

    C   = E[xs xs^T]     (d, d)   second moment of the calibrating input
    P   = E[xs xe^T]     (d, d)   cross moment with the expert's input
    mu_s = E[xs], mu_e = E[xe]

``X = E[xs xt^T] = alpha P + (1 - alpha) C`` for ``xt = alpha xe + (1 - alpha) xs``,
so one pass serves every alpha (docs/maths.md, 'How the engine computes it'). The
solve needs ``P`` and ``C`` only through ``C``, ``C W_i^T`` and ``P W_i^T`` (expert
i's weight ``W_i``), which a module gets in one of three forms (:data:`FORMS`, named
by what they keep), each exact, whichever costs fewest flops for its widths and the
task's row count (:func:`cheapest_form`):

- ``"P"``: the shared ``P`` (d, d); ``C W_i^T`` and ``P W_i^T`` at the end;
- ``"PW"``: per module ``PW = P W_i^T = sum w xs (W_i xe)^T`` (d, o), from the
  expert module's own output; ``C W_i^T`` at the end;
- ``"PW+CW"``: per module also ``CW = C W_i^T = sum w xs (W_i xs)^T`` (d, o), so
  nothing of size ``d x d x o`` is left for the end: cheapest when a task has
  fewer rows than the module is wide.

``C`` itself is symmetric: only its upper block triangle is accumulated
(:func:`gram_blocks`); the solve reads no more (:func:`featcal.method.linalg.spd_factor`),
and the rest is mirrored only where a full product needs it (:func:`finish_gram`).
A task that is one batch of few rows for its input width (by default fewer than half,
:attr:`featcal.config.FastPaths.direct_rows`) keeps no ``C`` at all (``direct`` sums): the
batch's weighted rows ``Z`` (``C = Z^T Z``) are added straight into the system once the
task's scale is known, and ``||C||_F`` comes from the ``rows x rows`` Gram matrix
``Z Z^T`` (:func:`rows_gram_norm`): no ``d x d`` buffer to fill, read for its norm and add.
The per-module sums of size ``(d, o)`` are kept in the layout of a weight
(``(o, d)`` contiguous, seen transposed), so that adding them up, solving and the
residual's inner products with ``W^T`` never copy a transpose.
For LayerNorm targets only the normalised input ``z`` of the calibrating stream
matters: ``e = E[z*z]``, ``m = E[z]``.

The functions here are pure over tensors (the ``accumulate_*`` ones add into
the sums they are given, and return them). Every one also takes a leading task axis
(rows ``(T, rows, d)``, sums ``(T, ...)``, expert weights ``(T, o, d)``): small models then
reduce all tasks in one call per operation instead of one per task.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from featcal.config import FORMS
from featcal.method.kernels import Kernels
from featcal.method.linalg import accumulate_gram, add_product, gram_blocks, gram_norm, inner, rows_gram_norm


def cheapest_form(d: int, outs: list[int], rows: int, computed_outputs: int = 0, fixed_alpha: bool = False) -> str:
    """The form (:data:`FORMS`) with the fewest multiply-adds for a group of modules reading
    one input of width ``d``: outputs ``outs``, ``rows`` rows per task; ``computed_outputs``
    of the modules have no captured output, so ``W_i xe`` costs ``rows d o`` more for them;
    ``fixed_alpha``: only one alpha is wanted (``"PW+CW"`` then needs two products, not three)."""
    o = sum(outs)
    extra = rows * d * computed_outputs * (o / max(len(outs), 1))
    cost = {
        "P": rows * d * d + 2 * d * d * o,
        "PW": rows * d * o + d * d * o + extra,
        "PW+CW": (2 if fixed_alpha else 3) * rows * d * o + extra,
    }
    return min(FORMS, key=lambda f: cost[f])


@dataclass
class LinearSums:
    """Weighted sums over rows for a Linear input site (divide by ``w`` for means).

    ``C`` holds only its upper block triangle (``edges``) until :func:`finish_gram`;
    ``direct`` sums (one batch) hold its weighted rows ``Z`` instead (``C = Z^T Z``).
    ``P`` is kept only in the ``"P"`` form.
    """

    w: torch.Tensor  # ()        sum of row weights
    rows: int  # number of rows with positive weight
    s: torch.Tensor  # (d,)      sum w xs
    e: torch.Tensor  # (d,)      sum w xe
    C: torch.Tensor | None  # (d, d)    sum w xs xs^T (None for direct sums)
    P: torch.Tensor | None  # (d, d)    sum w xs xe^T (None unless the "P" form)
    edges: tuple[int, ...] = ()
    finished: bool = False
    Z: torch.Tensor | None = None  # (rows, d)  sqrt(w) xs of the one batch of direct sums

    @classmethod
    def zeros(
        cls,
        d: int,
        dtype: torch.dtype,
        device,
        cross: bool = True,
        lead: tuple[int, ...] = (),
        direct: bool = False,
        kernels: Kernels | None = None,
    ) -> "LinearSums":
        """Empty sums (``lead``: a leading task axis ``(T,)``; ``direct``: for one batch, no
        ``C``), the big ones from ``kernels`` (default: new tensors, the default Gram block)."""
        kernels = kernels or Kernels()

        def z(*shape) -> torch.Tensor:
            return torch.zeros((*lead, *shape), dtype=dtype, device=device)

        def big(*shape) -> torch.Tensor:
            return kernels.zeros((*lead, *shape), dtype, device)

        C = None if direct else big(d, d)
        return cls(z(), 0, z(d), z(d), C, big(d, d) if cross else None, gram_blocks(d, kernels.gram_block))

    def buffers(self) -> list[torch.Tensor]:
        """The big buffers (to hand back to where :meth:`zeros` took them)."""
        return [x for x in (self.C, self.P) if x is not None]


@dataclass
class ModuleSums:
    """Per-module weighted sums of one task (``ys = W_i xs``, ``ye = W_i xe``: expert i's
    module, bias left out, on the calibrating and on the expert's input)."""

    ee: torch.Tensor  # ()      sum w |ye|^2
    PW: torch.Tensor | None = None  # (d, o)  sum w xs ye^T            ("PW", "PW+CW")
    CW: torch.Tensor | None = None  # (d, o)  sum w xs ys^T            ("PW+CW")
    T: torch.Tensor | None = None  # (d, o)  sum w xs ((1-a) ys + a ye)^T  ("PW+CW" at a fixed alpha a)
    ss: torch.Tensor | None = None  # ()      sum w |ys|^2             ("PW+CW")
    se: torch.Tensor | None = None  # ()      sum w ys.ye              ("PW+CW")
    tt: torch.Tensor | None = None  # ()      sum w |(1-a) ys + a ye|^2  ("PW+CW" at a fixed alpha a)
    mm: torch.Tensor | None = None  # ()      sum w |W_mer xs|^2 (when the merged output was seen)


@dataclass
class NormSums:
    """Weighted sums over rows of the normalised input ``z`` of a LayerNorm."""

    w: torch.Tensor  # ()
    rows: int
    z: torch.Tensor  # (d,)  sum w z
    zz: torch.Tensor  # (d,)  sum w z*z

    @classmethod
    def zeros(cls, d: int, dtype: torch.dtype, device, lead: tuple[int, ...] = ()) -> "NormSums":
        def z(*shape) -> torch.Tensor:
            return torch.zeros((*lead, *shape), dtype=dtype, device=device)

        return cls(z(), 0, z(d), z(d))


def as_rows(x: torch.Tensor, dtype: torch.dtype, lead: int = 0) -> torch.Tensor:
    """``(B, T, d)`` or ``(B, d)`` -> ``(rows, d)`` in ``dtype``; with ``lead`` leading axes
    kept (``(tasks, B, T, d)`` -> ``(tasks, rows, d)`` for ``lead=1``)."""
    return x.reshape(*x.shape[:lead], -1, x.shape[-1]).to(dtype)


def weighted(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """Rows scaled by their weights (``x`` itself when ``w`` is None)."""
    return x if w is None else x * w[..., None]


def finish_gram(acc: LinearSums) -> LinearSums:
    """Mirror the upper block triangle of ``C`` into the lower one (once)."""
    if not acc.finished:
        e = acc.edges
        for i in range(len(e) - 1):  # tile by tile: a cache-friendly transpose
            for j in range(i + 1, len(e) - 1):
                acc.C[..., e[j] : e[j + 1], e[i] : e[i + 1]] = acc.C[..., e[i] : e[i + 1], e[j] : e[j + 1]].mT
        acc.finished = True
    return acc


def accumulate_linear(acc: LinearSums, xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor | None) -> LinearSums:
    """Add one batch: ``xs``, ``xe`` ``(rows, d)``, ``w`` ``(rows,)`` or ``None`` (all 1)
    (or each with a leading task axis; ``rows`` then counts the task with fewest)."""
    xsw = weighted(xs, w)
    acc.w += xs.shape[-2] if w is None else w.sum(-1)
    acc.rows += xs.shape[-2] if w is None else int((w > 0).sum(-1).min())
    acc.s += xsw.sum(-2)
    acc.e += weighted(xe, w).sum(-2)
    if acc.C is None:
        if acc.Z is not None:
            raise ValueError("direct sums (no C) take exactly one batch.")
        acc.Z = xs.contiguous() if w is None else xs * w.sqrt().unsqueeze(-1)
    else:
        accumulate_gram(acc.C, xsw, xs, acc.edges or (0, xs.shape[-1]))
    if acc.P is not None:
        add_product(acc.P, xsw.mT, xe)
    return acc


def _add(total: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return x if total is None else total + x


def _addmm(total: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``total + a @ b`` in place (``a @ b`` when ``total`` is None: no zero-filled start), in
    the weight layout: the ``(d, o)`` result is the transpose of an ``(o, d)`` contiguous one."""
    if total is None:
        return (b.mT @ a.mT).mT
    add_product(total.mT, b.mT, a.mT)
    return total


def _wdot(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """``sum_rows w <a_row, b_row>`` for ``(rows, o)`` tensors (``(T,)`` for ``(T, rows, o)``)."""
    if w is None:
        return inner(a, b)
    return w @ (a * b).sum(1) if a.dim() == 2 else (w * (a * b).sum(-1)).sum(-1)


def accumulate_module(
    ms: ModuleSums,
    form: str,
    xs: torch.Tensor,
    ye: torch.Tensor,
    w: torch.Tensor | None,
    W_i: torch.Tensor,
    ym: torch.Tensor | None = None,
    alpha: float | None = None,
) -> ModuleSums:
    """Add one batch to a module's sums in ``form``: ``xs`` ``(rows, d)``, ``ye = W_i xe``
    ``(rows, o)``; ``ym = W_mer xs`` ``(rows, o)`` when the merged module's output was seen.
    ``alpha`` given: the ``"PW+CW"`` form keeps only the sums for that alpha (``T``, ``tt``), one
    ``rows x d x o`` product and four passes over the outputs less, and no preview is
    possible from it."""
    if ym is not None:
        ms.mm = _add(ms.mm, _wdot(ym, ym, w))
    if form == "PW+CW" and alpha is not None:
        W = W_i.to(xs.dtype).mT
        mm = torch.addmm if xs.dim() == 2 else torch.baddbmm
        yt = mm(ye, xs, W, beta=alpha, alpha=1.0 - alpha)  # W_i xt = (1-a) W_i xs + a ye
        ms.tt = _add(ms.tt, _wdot(yt, yt, w))
        ms.T = _addmm(ms.T, weighted(xs, w).mT, yt)
        return ms
    ms.ee = ms.ee + _wdot(ye, ye, w)
    if form == "P":
        return ms
    xswT = weighted(xs, w).mT
    if form == "PW":
        ms.PW = _addmm(ms.PW, xswT, ye)
        return ms
    ys = xs @ W_i.to(xs.dtype).mT  # (rows, o)
    ms.ss = _add(ms.ss, _wdot(ys, ys, w))
    ms.se = _add(ms.se, _wdot(ys, ye, w))
    ms.PW = _addmm(ms.PW, xswT, ye)
    ms.CW = _addmm(ms.CW, xswT, ys)
    return ms


def rms_normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last axis: an RMS norm without its scale."""
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def accumulate_norm(
    acc: NormSums, xs: torch.Tensor, w: torch.Tensor | None, eps: float, centred: bool = True
) -> NormSums:
    """Add one batch of norm inputs ``xs`` ``(rows, d)``: ``z = LayerNorm(xs)`` without affine
    (``centred``), or the RMS-normalised ``xs`` (an RMS norm)."""
    z = F.layer_norm(xs, (xs.shape[-1],), eps=eps) if centred else rms_normalise(xs, eps)
    zw = weighted(z, w)
    acc.w += xs.shape[-2] if w is None else w.sum(-1)
    acc.rows += xs.shape[-2] if w is None else int((w > 0).sum(-1).min())
    acc.z += zw.sum(-2)
    acc.zz += (zw * z).sum(-2)
    return acc


@dataclass(frozen=True, kw_only=True)
class LinearMoments:
    """One task's terms for one Linear module (of every task, with a leading task axis), as
    weighted *sums* (divide by ``w`` for the spec's means). In three shapes: any alpha (``CW``
    and ``PW``), one fixed alpha (``T`` alone), and a task of one batch of direct sums (its rows
    ``Z`` instead of ``C``). The ``(d, o)`` terms are in the weight layout (their transposes are
    contiguous)."""

    # the task's input Gram sums
    C: torch.Tensor | None  # (d, d)  sum w xs xs^T, trustworthy on its upper block triangle (edges) only
    Z: torch.Tensor | None = None  # (rows, d)  direct sums: C = Z^T Z (C is None)
    edges: tuple[int, ...]
    c_norm: torch.Tensor  # ()  ||C||_F
    # the module's products with expert i's weight W_i
    CW: torch.Tensor | None  # (d, o)  C W_i^T (None at a fixed alpha)
    PW: torch.Tensor | None  # (d, o)  P W_i^T = sum w xs (W_i xe)^T (None at a fixed alpha)
    T: torch.Tensor | None = None  # (d, o)  (1 - alpha) CW + alpha PW, at a fixed alpha only
    # what the relative residual reads
    k_ss: torch.Tensor  # ()  sum w |W_i xs|^2 (at a fixed alpha: sum w |W_i xt|^2, as are the next two)
    k_se: torch.Tensor  # ()  sum w (W_i xs).(W_i xe)
    k_ee: torch.Tensor  # ()  sum w |W_i xe|^2
    k_mm: torch.Tensor | None  # ()  sum w |W_mer xs|^2 (None: the merged output was not seen)
    # the means' sums
    s: torch.Tensor  # (d,)  sum w xs
    e: torch.Tensor  # (d,)  sum w xe
    w: torch.Tensor  # ()  sum w
    rows: int  # rows with positive weight

    @property
    def mu_s(self) -> torch.Tensor:
        return self.s / self.w.unsqueeze(-1)

    @property
    def mu_e(self) -> torch.Tensor:
        return self.e / self.w.unsqueeze(-1)


def linear_moments(acc: LinearSums, W_i: torch.Tensor, ms: ModuleSums) -> LinearMoments:
    """The terms of one task for one module, from its group's sums ``acc`` and its own ``ms``
    (of every task, with a leading task axis)."""
    if not bool((acc.w > 0).all()):
        raise ValueError("no calibration rows with positive weight for this module (empty task?).")
    edges = acc.edges or (0, acc.s.shape[-1])
    c_norm = rows_gram_norm(acc.Z) if acc.C is None else gram_norm(acc.C, edges, acc.finished)
    gram = dict(C=acc.C, Z=acc.Z, edges=edges, c_norm=c_norm)
    means = dict(k_mm=ms.mm, s=acc.s, e=acc.e, w=acc.w, rows=acc.rows)
    if ms.T is not None:  # K(a) = a^2 k_ee + 2a(1-a) k_se + (1-a)^2 k_ss is tt when all three are tt
        return LinearMoments(**gram, CW=None, PW=None, T=ms.T, k_ss=ms.tt, k_se=ms.tt, k_ee=ms.tt, **means)
    W = W_i.to(acc.s.dtype)  # (o, d)
    if ms.CW is not None:
        CW = ms.CW
    elif acc.C is None:
        CW = ((W @ acc.Z.mT) @ acc.Z).mT  # C W^T = (W Z^T Z)^T
    else:
        CW = (W @ finish_gram(acc).C).mT  # C W^T = (W C)^T: C symmetric
    PW = ms.PW if ms.PW is not None else (W @ acc.P.mT).mT
    k_ss = ms.ss if ms.ss is not None else inner(W.mT, CW)
    k_se = ms.se if ms.se is not None else inner(W.mT, PW)
    return LinearMoments(**gram, CW=CW, PW=PW, k_ss=k_ss, k_se=k_se, k_ee=ms.ee, **means)


def norm_moments(acc: NormSums) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, m)`` = ``(E[z*z], E[z])`` per channel (per task and channel with a task axis)."""
    if not bool((acc.w > 0).all()):
        raise ValueError("no calibration rows with positive weight for this LayerNorm (empty task?).")
    w = acc.w.unsqueeze(-1)
    return acc.zz / w, acc.z / w

"""The CPU kernels under the maths: how the Gram sums and the symmetric solves are computed, not what
they are (that is :mod:`featcal.method.stats` and :mod:`featcal.method.solve`).

- Gram matrices: accumulated on their upper block triangle only (:func:`gram_blocks`,
  :func:`accumulate_gram`), by BLAS ``syrk`` on one thread where it applies (:func:`add_rows_gram`),
  their Frobenius norms reduced in float64 (:func:`gram_norm`, :func:`rows_gram_norm`);
- symmetric positive-definite solves: Cholesky (LAPACK ``potrf`` in place for wide CPU systems, else
  torch's), with a float64 eigendecomposition fallback (:class:`EigenSolve`) when the factorisation
  fails or rests on rounding noise (:func:`spd_factor`).

Which of these run is chosen by the run's :class:`featcal.method.kernels.Kernels` (from
:class:`featcal.config.FastPaths`); benchmarks/engine_notes.md has the timings behind each choice.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch

log = logging.getLogger(__name__)


def gram_blocks(d: int, block: int | None) -> tuple[int, ...]:
    """Block edges ``(0, ..., d)`` of the triangular accumulation of a ``d x d`` Gram matrix,
    about ``block`` columns each (at most 8; ``None``: one block, the full product): ``k``
    blocks cost ``(k + 1) / 2k`` of the full product."""
    k = 1 if block is None else max(1, min(8, d // block))
    return tuple(round(i * d / k) for i in range(k + 1))


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out += alpha a @ b`` in place, for matrices or stacks of them."""
    return out.addmm_(a, b, alpha=alpha) if out.dim() == 2 else out.baddbmm_(a, b, alpha=alpha)


def inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum(a * b)`` for two tensors of one shape, without the elementwise product; for
    stacks of matrices ``(T, m, n)``, one sum per matrix ``(T,)``."""
    if a.dim() > 2:
        return (a * b).sum((-2, -1))  # (a bmm of 1 x n by n x 1 stacks is much slower)
    if not (a.is_contiguous() and b.is_contiguous()):
        if a.mT.is_contiguous() and b.mT.is_contiguous():
            a, b = a.mT, b.mT
        else:
            a, b = a.contiguous(), b.contiguous()
    return torch.dot(a.reshape(-1), b.reshape(-1))


def accumulate_gram(
    C: torch.Tensor, xw: torch.Tensor, x: torch.Tensor, edges: tuple[int, ...], alpha: float = 1.0
) -> torch.Tensor:
    """``C += alpha xw^T x`` on the upper block triangle only (``C`` symmetric once finished)."""
    if len(edges) <= 2:
        return add_product(C, xw.mT, x, alpha)
    for lo, hi in zip(edges[:-1], edges[1:]):
        add_product(C[..., lo:hi, lo:], xw[..., lo:hi].mT, x[..., lo:], alpha)
    return C


def _blas(name: str, x: torch.Tensor):
    """scipy's BLAS routine ``name`` (``"syrk"``) for CPU float32/float64 tensors on one torch
    thread, else None (torch's products, threaded, are used then)."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or torch.get_num_threads() != 1:
        return None
    from scipy.linalg import blas

    return getattr(blas, ("s" if x.dtype == torch.float32 else "d") + name)


def one_blas_thread():
    """A context in which scipy's BLAS runs on one thread: OpenBLAS's worker threads spin on
    after a call and slow torch's next operation."""
    return _blas_threads().limit(limits=1, user_api="blas")


@functools.cache
def _blas_threads():
    """One threadpoolctl controller for scipy's BLAS, made once scipy's BLAS is loaded and
    kept (finding the libraries costs far more than setting a limit on a kept controller)."""
    from scipy.linalg import blas  # noqa: F401  (loads the BLAS the controller must see)
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def _syrk(C: torch.Tensor, Z: torch.Tensor, alpha: float, rows: bool) -> bool:
    """``C += alpha Z^T Z`` (``rows``: ``alpha Z Z^T``) on the upper triangle of ``C`` by BLAS
    ``syrk`` (half a product's flops) on one CPU thread; False, with nothing done, where it
    does not apply (:func:`_blas`, non-contiguous or mixed dtypes)."""
    syrk = _blas("syrk", C) if C.is_contiguous() and Z.is_contiguous() and C.dtype == Z.dtype else None
    if syrk is None:
        return False
    with one_blas_thread():  # row-major C and Z are column-major C^T (= C) and Z^T
        out = syrk(alpha, Z.numpy().T, beta=1.0, c=C.numpy().T, trans=int(rows), lower=1, overwrite_c=1)
    if out.ctypes.data != C.data_ptr():  # pragma: no cover  (scipy copied: keep the result)
        C.copy_(torch.from_numpy(out.T))
    return True


def add_rows_gram(S: torch.Tensor, Z: torch.Tensor, alpha: float, edges: tuple[int, ...]) -> torch.Tensor:
    """``S += alpha Z^T Z`` on the upper triangle of ``S`` ``(d, d)`` for rows ``Z`` ``(rows, d)``:
    :func:`_syrk` (cheaper than the block triangle's products), else on the upper block
    triangle (``edges``)."""
    if not _syrk(S, Z, alpha, rows=False):
        accumulate_gram(S, Z, Z, edges, alpha)
    return S


def rows_gram_norm(Z: torch.Tensor) -> torch.Tensor:
    """``||Z^T Z||_F`` from the ``rows x rows`` Gram matrix ``Z Z^T`` (the same norm; fewer
    flops when ``rows < d``), in ``Z``'s dtype, reduced in float64 (:func:`_sum_sq`)."""
    K = torch.zeros(Z.shape[0], Z.shape[0], dtype=Z.dtype, device=Z.device)
    if not _syrk(K, Z, 1.0, rows=True):
        return _sum_sq(Z @ Z.mT).sqrt().to(Z.dtype)
    diag = K.diagonal().double()  # K: its upper triangle, zeros below
    return (2 * _sum_sq(K) - diag @ diag).clamp(min=0).sqrt().to(Z.dtype)


def _sum_sq(x: torch.Tensor) -> torch.Tensor:
    """Sum of squares of the entries of a matrix (one per matrix of a stack), in float64: each
    row's in ``x``'s dtype (a short sum, at most ``d`` terms), the rows' in float64. One
    float32 accumulation of all ``d^2`` terms (a BLAS dot product, ``vector_norm`` of the
    whole matrix) loses up to 1e-4 of the sum, how much depending on the CPU's kernel: with
    millions of positive terms, each new one is tiny next to the running sum and partly
    rounded away."""
    rows = torch.linalg.vector_norm(x, dim=-1).double()  # (..., m): each row's norm
    return torch.linalg.vecdot(rows, rows)


def gram_norm(C: torch.Tensor, edges: tuple[int, ...], finished: bool = False) -> torch.Tensor:
    """``||C||_F`` of a symmetric ``C`` from its upper block triangle (:func:`accumulate_gram`),
    whose tiles below are still zero (``finished``: mirrored, :func:`finish_gram`): the
    diagonal tiles count once, the others twice (one norm per matrix of a stack). In ``C``'s
    dtype, reduced in float64 (:func:`_sum_sq`)."""
    if len(edges) <= 2 or finished:
        return _sum_sq(C).sqrt().to(C.dtype)
    diag = sum(_sum_sq(C[..., lo:hi, lo:hi]) for lo, hi in zip(edges[:-1], edges[1:]))
    return (2 * _sum_sq(C) - diag).clamp(min=0).sqrt().to(C.dtype)


def add_weighted(out: torch.Tensor, x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``out += sum_t f_t x_t`` for a stack ``x`` ``(T, ...)`` and weights ``f`` ``(T,)``, in
    place; one task is one scaled add (no temporary: wide systems are tens of MB), and so
    is each task of a strided ``x`` (a tile of a stack of Gram matrices, which a product
    with ``f`` would first copy whole)."""
    if len(f) == 1 or not x.is_contiguous():
        for x_t, f_t in zip(x, f.tolist()):
            out.add_(x_t, alpha=f_t)
        return out
    return out.add_(torch.tensordot(f, x, 1))


def add_gram(S: torch.Tensor, C: torch.Tensor, f: torch.Tensor, edges: tuple[int, ...]) -> torch.Tensor:
    """``S += sum_t f_t C_t`` for a stack ``C`` ``(T, d, d)``, on the upper block triangle (all
    that :func:`accumulate_gram` fills)."""
    if len(edges) <= 2:
        return add_weighted(S, C, f)
    for lo, hi in zip(edges[:-1], edges[1:]):
        add_weighted(S[lo:hi, lo:], C[:, lo:hi, lo:], f)
    return S


def symmetric(S: torch.Tensor) -> torch.Tensor:
    """The full symmetric matrix whose upper triangle is ``S``'s (a new tensor; the systems
    keep only their upper triangle up to date, :func:`featcal.method.linalg.accumulate_gram`)."""
    return S.triu() + S.triu(1).T


def _lapack_cholesky(A: torch.Tensor) -> torch.Tensor | None:
    """The lower Cholesky factor of ``A`` (CPU float32/float64), computed in place by LAPACK's
    ``potrf`` on the upper triangle of the row-major ``A`` (the lower one of its column-major
    view): no copy of ``A`` and no zeroing of its other triangle, which
    ``torch.linalg.cholesky_ex`` does; on one thread, since OpenBLAS's worker threads spin on
    after a call and slow torch's next operation. The factor's other triangle keeps
    leftovers that the triangular solves never read. None when ``A`` is not numerically
    positive definite (``A`` is then partly overwritten)."""
    from scipy.linalg import lapack

    potrf = lapack.spotrf if A.dtype == torch.float32 else lapack.dpotrf
    with one_blas_thread():
        c, info = potrf(A.numpy().T, lower=1, clean=0, overwrite_a=1)
    return torch.from_numpy(c) if info == 0 else None


class Cholesky:
    """``B -> (L L^T)^-1 B`` for the lower Cholesky factor ``L`` of ``S + shift I``: from LAPACK as
    it is (``lapack``: column-major, two triangular solves; ``torch.cholesky_solve`` would first
    copy it), else torch's."""

    def __init__(self, L: torch.Tensor, lapack: bool):
        self.L, self.lapack = L, lapack

    def __call__(self, B: torch.Tensor) -> torch.Tensor:
        if self.lapack:
            y = torch.linalg.solve_triangular(self.L, B.to(self.L.dtype), upper=False)
            return torch.linalg.solve_triangular(self.L.mT, y, upper=True)
        return torch.cholesky_solve(B, self.L)

    def ridge(self, R: torch.Tensor, lam: float, anchor_t: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``(S + shift I)^-1 R`` for ``R = data + lam anchor_t()`` (read whole: see :meth:`EigenSolve.ridge`)."""
        return self(R)


def noise_floor(S: torch.Tensor) -> float:
    """The size below which an eigenvalue of the Gram-like ``S`` (its upper triangle) is rounding
    noise of its own dtype: ``d * eps_dtype * max(diag S)`` (the rounding of ``d``-term sums of
    entries up to ``max(diag S)``)."""
    d = S.shape[0]
    return d * torch.finfo(S.dtype).eps * float(S.diagonal().abs().max())


class EigenSolve:
    """``(S + shift I)^-1`` in float64 from the eigendecomposition of ``S`` (upper triangle), the
    fallback when its factorisation in ``S``'s dtype fails or is dominated by rounding noise.
    Eigenvalues within the noise floor of ``S``'s dtype (:func:`noise_floor`) are taken as exact
    zeros: on that subspace the data say nothing, and :meth:`ridge` takes the solution from the
    anchor term alone, as exact arithmetic would (``U`` and ``V`` lie in the span of the
    calibrating rows, i.e. in the range of ``S``)."""

    def __init__(self, S: torch.Tensor, shift: float, what: str | None = "system"):
        A = symmetric(S.double())
        self.dtype, self.shift, self.what = S.dtype, shift, what
        self.evals, self.Q = torch.linalg.eigh(A)  # (d,), (d, d)
        self.noise = self.evals.abs() <= (noise_floor(S) if S.dtype != torch.float64 else 0.0)
        self.evals = self.evals.masked_fill(self.noise, 0.0)
        self.den = (self.evals + shift)[:, None]  # (d, 1)
        if not bool((self.den != 0).all()):
            raise FloatingPointError(labelled(what, "the FeatCal system is singular; raise lam or eps."))

    def __call__(self, B: torch.Tensor) -> torch.Tensor:
        """``(S + shift I)^-1 B`` (noise eigenvalues as zeros), in ``B``'s dtype."""
        QtB = self.Q.T @ B.double()
        return (self.Q @ (QtB / self.den)).to(B.dtype)

    def ridge(self, R: torch.Tensor, lam: float, anchor_t: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``(S + shift I)^-1 R`` for ``R = data + lam anchor_t()``, the data's part and the anchor's
        apart: ``data``'s components on the noise subspace dropped (they are rounding noise of
        ``S``'s dtype, which ``1 / shift`` would blow up). In ``S``'s dtype."""
        A_t = anchor_t()
        data = R - lam * A_t
        Qd, Qa = self.Q.T @ data.double(), self.Q.T @ A_t.double()  # (d, o)
        Qd[self.noise] = 0.0
        return (self.Q @ ((Qd + lam * Qa) / self.den)).to(self.dtype)


def spd_factor(
    S: torch.Tensor,
    shift: float = 0.0,
    what: str | None = "system",
    take: Callable | None = None,
    lapack_min_d: int | None = None,
    notes: list | None = None,
    precision: list | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A solver ``B -> (S + shift I)^-1 B`` for the symmetric matrix whose upper triangle is
    ``S``'s (``S + shift I`` positive definite): Cholesky (in place by LAPACK on a copy for
    CPU systems ``lapack_min_d`` wide or wider, else torch's). When the factorisation fails,
    or succeeds only on a pivot within the rounding noise of ``S``'s dtype (:func:`noise_floor`:
    ``shift`` too small for the statistics' precision, e.g. ``lam = 0`` with fewer rows than
    width), an :class:`EigenSolve` in float64 instead, logged and noted in ``notes``. ``S`` is
    left as it is; ``take(shape, dtype, device, zero)``: where that copy's buffer comes from (a
    fresh big tensor costs its page faults; the solver keeps it). A float32 factorisation that
    holds but whose estimated error (:func:`float32_error`) exceeds :data:`F32_WARN` is noted
    in ``precision`` (default ``notes``)."""
    lapack = (
        lapack_min_d is not None
        and S.shape[0] >= lapack_min_d
        and S.device.type == "cpu"
        and S.dtype in (torch.float32, torch.float64)
    )
    floor = noise_floor(S) if S.dtype != torch.float64 else 0.0
    L = None
    if lapack:
        A = S.clone() if take is None else take(S.shape, S.dtype, S.device, zero=False).copy_(S)
        A.diagonal().add_(shift)
        L = _lapack_cholesky(A)
    else:
        A = symmetric(S)
        A.diagonal().add_(shift)
        L, info = torch.linalg.cholesky_ex(A)
        L = L if int(info) == 0 else None
    if L is not None and (pivot2 := float(L.diagonal().min()) ** 2) > floor:
        if S.dtype == torch.float32 and (est := float32_error(floor, pivot2)) > F32_WARN:
            _note_float32(what, est, shift, precision if precision is not None else notes)
        return Cholesky(L, lapack)
    reason = "fails" if L is None else "rests on pivots within its rounding noise"
    msg = labelled(
        what,
        f"the {str(S.dtype).removeprefix('torch.')} Cholesky factorisation of S + (lam + eps) I {reason} "
        f"(lam + eps = {shift:.3g}; fewer rows than width, or lam too small for these statistics); "
        "re-solved in float64 by eigendecomposition, the directions the data leave undetermined taken from "
        "the anchor. stats_dtype=torch.float64 or a larger lam avoids this.",
    )
    note(msg, notes)
    return EigenSolve(S, shift, what)


# The weight error of float32 statistics above which the solve says so (report.warnings);
# docs/architectures.md 'Dtypes and precision' states it, benchmarks/precision.py measures it.
F32_WARN = 3e-3


def float32_error(floor: float, pivot2: float) -> float:
    """The estimated relative error of weights solved from float32 statistics: the statistics'
    rounding floor (:func:`noise_floor`) over the smallest squared Cholesky pivot of
    ``S + shift I`` (about its smallest eigenvalue). Free once factored; an overestimate in every
    case measured (benchmarks/README.md, 'Low-rank inputs')."""
    return floor / pivot2


def labelled(what: str | None, msg: str) -> str:
    """``msg`` about the system ``what`` (None: the caller names it)."""
    return msg if what is None else f"{what}: {msg}"


def note(msg: str, notes: list | None) -> None:
    """Keep ``msg`` in ``notes`` (the engine says them once per run, in ``report.warnings``), logged
    at INFO (at WARNING, Python's last-resort handler would print every module's to the terminal);
    without ``notes``, logged at WARNING: nobody else says it."""
    if notes is None:
        log.warning(msg)
    else:
        log.info(msg)
        notes.append(msg)


def _note_float32(what: str | None, est: float, shift: float, notes: list | None) -> None:
    msg = labelled(
        what,
        f"float32 statistics at lam + eps = {shift:.3g} may move these weights by up to ~{est:.1e} of "
        "their size (estimated from the factorisation's smallest pivot); stats_dtype=torch.float64 or a larger "
        "lam avoids it.",
    )
    note(msg, notes)


def spd_solve(A: torch.Tensor, B: torch.Tensor, what: str = "system") -> torch.Tensor:
    """Solve ``A X = B`` for symmetric positive-definite ``A`` (:func:`spd_factor`)."""
    return spd_factor(A, 0.0, what)(B)

"""How one run computes its sums and solves (:class:`Kernels`), handed to the statistics and the
solves as one argument: where big buffers come from (:class:`Scratch`), from which width LAPACK
factors a system, the Gram accumulations' column block, and the factorisations of the block
being solved (one per shared ``S``: q/k/v share theirs). None of it changes a result beyond
float rounding; :class:`featcal.config.FastPaths` chooses it (:meth:`Kernels.of`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from featcal.config import FastPaths
from featcal.method.linalg import spd_factor


class Scratch:
    """Big buffers handed from one use to the next instead of freed: a fresh CPU tensor of
    tens of MB costs its page faults on first touch, a kept one does not, so the engine
    keeps the Gram matrices, systems and factors of one block for the next one of the same
    widths. :meth:`take` a buffer, :meth:`give` it back when done; what was given is held
    until the scratch is dropped or :meth:`trim` lets go of it."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, shape, dtype: torch.dtype, device, zero: bool = True) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        free = self._free.get(key)
        if not free:
            return (torch.zeros if zero else torch.empty)(tuple(shape), dtype=dtype, device=device)
        x = free.pop()
        return x.zero_() if zero else x

    def give(self, tensors) -> None:
        for x in tensors:
            self._free.setdefault((tuple(x.shape), x.dtype, x.device), []).append(x)

    def trim(self, max_numel: int) -> None:
        """Let go of the free buffers of more than ``max_numel`` elements (kept from one block
        to the next they would add to the peak memory, while their page faults are small next
        to a factorisation of their size)."""
        self._free = {k: v for k, v in self._free.items() if math.prod(k[0]) <= max_numel}


class Kernels:
    """The run's kernels: ``lapack_min_d`` (LAPACK's in-place Cholesky for CPU systems this wide
    or wider; None: torch's), ``gram_block`` (:func:`featcal.method.linalg.gram_blocks`), and a
    ``scratch`` to take big buffers from and give them back to, trimmed to ``scratch_keep``
    elements between uses (None: new tensors every time, as ``Kernels()``).

    :meth:`solver` factors each ``S`` once until :meth:`end_block`; what the factorisations say
    (a float64 fallback, a float32 precision estimate, a degenerate norm) waits in
    :attr:`fallbacks` and :attr:`precision` until :meth:`said` collects it, without the module's
    name, which the caller knows."""

    def __init__(
        self,
        lapack_min_d: int | None = FastPaths.lapack_min_d,
        gram_block: int | None = FastPaths.gram_block,
        scratch: Scratch | None = None,
        scratch_keep: int = 0,
    ):
        self.lapack_min_d, self.gram_block = lapack_min_d, gram_block
        self.scratch, self.scratch_keep = scratch, scratch_keep
        self.fallbacks: list[str] = []  # solves re-done in float64, degenerate norm channels
        self.precision: list[str] = []  # float32 factorisations with a large estimated error
        self._solvers: dict[tuple, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._noted: dict[tuple, str | None] = {}  # the precision note of each factorisation
        self._taken: list[torch.Tensor] = []

    @classmethod
    def of(cls, fast: FastPaths) -> "Kernels":
        """The kernels ``fast`` chooses, with a scratch of their own."""
        return cls(fast.lapack_min_d, fast.gram_block, Scratch(), fast.scratch_keep)

    def zeros(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A zeroed big buffer (from the scratch when there is one)."""
        if self.scratch is None:
            return torch.zeros(tuple(shape), dtype=dtype, device=device)
        return self.scratch.take(shape, dtype, device)

    def give(self, tensors) -> None:
        """Big buffers done with, for the next :meth:`zeros` of their shape (dropped without a scratch)."""
        if self.scratch is not None:
            self.scratch.give(tensors)

    def trim(self) -> None:
        """Let go of the kept buffers over ``scratch_keep`` elements (:meth:`Scratch.trim`)."""
        if self.scratch is not None:
            self.scratch.trim(self.scratch_keep)

    def _kept_buffer(self, shape, dtype, device, zero: bool = True) -> torch.Tensor:
        self._taken.append(self.scratch.take(shape, dtype, device, zero))
        return self._taken[-1]

    def solver(self, S: torch.Tensor, shift: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """``B -> (S + shift I)^-1 B`` (:func:`featcal.method.linalg.spd_factor`), factored on first use."""
        key = (id(S), shift)
        if key not in self._solvers:
            take = None if self.scratch is None else self._kept_buffer
            n = len(self.precision)
            self._solvers[key] = spd_factor(
                S, shift, None, take, self.lapack_min_d, notes=self.fallbacks, precision=self.precision
            )
            self._noted[key] = self.precision[n] if len(self.precision) > n else None
        elif self._noted[key] is not None:  # a module sharing the input (q/k/v): the same estimate
            self.precision.append(self._noted[key])
        return self._solvers[key]

    def said(self) -> tuple[list[str], list[str]]:
        """``(fallbacks, precision)`` noted since the last call (then forgotten here)."""
        out = (self.fallbacks, self.precision)
        self.fallbacks, self.precision = [], []
        return out

    def end_block(self) -> None:
        """Drop the block's factorisations; their buffers go back to the scratch."""
        self.give(self._taken)
        self._taken, self._solvers, self._noted = [], {}, {}

"""Instant preview: re-solve every module for another (lam, rho, alpha) from the
statistics of one exact run.

With ``S = Q diag(ev) Q^T`` (one symmetric eigendecomposition per module, done
once), any setting is a few matrix products::

    W^T = Q diag(1 / (ev + lam + eps)) (Q^T U + alpha Q^T V
                                         + lam (rho Q^T W_mer^T + (1 - rho) Q^T W_0^T))

This ignores how earlier blocks' changes move later features (the exact run
does not): it is a *preview*, exact only when the features do not depend on
the hyper-parameters (a single calibrated block).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from featcal.method import solve
from featcal.model import arch


@dataclass
class _EigLinear:
    Q: torch.Tensor  # (d, d)
    ev: torch.Tensor  # (d,)
    QU: torch.Tensor  # (d, o)
    QV: torch.Tensor  # (d, o)
    QWm: torch.Tensor  # (d, o)  Q^T W_mer^T
    QW0: torch.Tensor  # (d, o)  Q^T W_0^T

    def solve(self, lam: float, rho: float, alpha: float, eps: float) -> torch.Tensor:
        rhs = self.QU + alpha * self.QV + lam * (rho * self.QWm + (1.0 - rho) * self.QW0)
        return (self.Q @ (rhs / (self.ev + lam + eps)[:, None])).T  # W (o, d)


def _eig_linear(
    sysm: solve.LinearSystem,
    W_mer: torch.Tensor,
    W_0: torch.Tensor,
    eigh: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> _EigLinear:
    ev, Q = torch.linalg.eigh(sysm.S, UPLO="U") if eigh is None else eigh  # S: upper triangle
    dt = sysm.S.dtype
    Qt = Q.T
    QU, QV = Qt @ sysm.U, Qt @ sysm.V
    if dt != torch.float64:  # eigenvalues within rounding noise are zeros, as in the exact solve
        noise = ev.abs() <= solve.noise_floor(sysm.S)  # (solve.EigenSolve): data terms dropped there
        ev, QU[noise], QV[noise] = ev.masked_fill(noise, 0.0), 0.0, 0.0
    return _EigLinear(Q, ev, QU, QV, Qt @ W_mer.to(dt).T, Qt @ W_0.to(dt).T)


class Preview:
    """Kept statistics of one run; :meth:`params` and :meth:`model` solve any setting."""

    def __init__(self, template: nn.Module, blocks_path: str, entries: list, eps: float, bias: bool):
        self.template = template
        self.blocks_path = blocks_path
        self.entries = entries  # (block, target, system, W_mer, b_mer, W_0, b_0)
        self.eps = eps
        self.bias = bias
        self._eig: dict[int, _EigLinear] = {}

    def _eig_of(self, i: int) -> _EigLinear:
        if i not in self._eig:
            _, _, sysm, W_mer, _, W_0, _ = self.entries[i]
            shared = next((e for j, e in self._eig.items() if self.entries[j][2].S is sysm.S), None)
            eigh = None if shared is None else (shared.ev, shared.Q)  # q/k/v share one S
            self._eig[i] = _eig_linear(sysm, W_mer, W_0, eigh)
        return self._eig[i]

    def prepare(self) -> None:
        """Do the one-off eigendecompositions now (else on the first preview)."""
        for i, e in enumerate(self.entries):
            if e[1].kind == arch.LINEAR:
                self._eig_of(i)

    @torch.no_grad()
    def params(
        self, lam: float, rho: float, alpha: float
    ) -> list[tuple[int, arch.Target, torch.Tensor, torch.Tensor | None]]:
        """``[(block, target, W, b), ...]`` previewed for (lam, rho, alpha)."""
        out = []
        for i, (blk, t, sysm, W_mer, b_mer, W_0, b_0) in enumerate(self.entries):
            if t.kind == arch.LINEAR:
                W = self._eig_of(i).solve(lam, rho, alpha, self.eps)
                if b_mer is None:
                    b = None
                elif not self.bias:
                    b = b_mer
                else:
                    b = solve.linear_bias(sysm, W, b_mer, b_0, lam, rho, alpha)
            else:
                W, b = solve.solve_norm(sysm, W_mer, b_mer, W_0, b_0, lam=lam, rho=rho, eps=self.eps)
            out.append((blk, t, W, b))
        return out

    @torch.no_grad()
    def model(self, lam: float, rho: float, alpha: float) -> nn.Module:
        """A new model (a copy of the calibrated one) holding the previewed parameters."""
        model = copy.deepcopy(self.template)
        self.load_into(model, lam, rho, alpha)
        return model

    @torch.no_grad()
    def load_into(self, model: nn.Module, lam: float, rho: float, alpha: float) -> nn.Module:
        """Write the previewed parameters into ``model`` (same architecture) in place."""
        blks = arch.all_blocks(model, self.blocks_path)
        for blk, t, W, b in self.params(lam, rho, alpha):
            arch.set_params(blks[blk], t, W, b)
        return model

"""Instant preview: re-solve every module for another (lam, rho, alpha), or another per-block
schedule of them (``FeatCalConfig.schedule``), from the statistics of one exact run.

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
import threading
from dataclasses import dataclass, replace

import torch
from torch import nn

from featcal.config import FeatCalConfig, Setting
from featcal.engine.trace import storage_bytes
from featcal.method import linalg, solve
from featcal.model import arch


@dataclass(frozen=True)
class Kept:
    """One solved module as a preview keeps it: where it is, its system, its anchor's ends."""

    block: int  # its block's number in the report (an encoder-decoder's decoder after the encoder)
    target: arch.Target
    system: solve.LinearSystem | solve.NormSystem
    ends: solve.Endpoints


@dataclass
class _EigLinear:
    Q: torch.Tensor  # (d, d)
    ev: torch.Tensor  # (d,)
    QU: torch.Tensor  # (d, o)
    QV: torch.Tensor  # (d, o)
    QWm: torch.Tensor  # (d, o)  Q^T W_mer^T
    QW0: torch.Tensor  # (d, o)  Q^T W_0^T

    def solve(self, at: Setting, eps: float) -> torch.Tensor:
        lam, rho = at.lam, at.rho
        rhs = self.QU + at.alpha * self.QV + lam * (rho * self.QWm + (1.0 - rho) * self.QW0)
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
        noise = ev.abs() <= linalg.noise_floor(sysm.S)  # (linalg.EigenSolve): data terms dropped there
        ev, QU[noise], QV[noise] = ev.masked_fill(noise, 0.0), 0.0, 0.0
    return _EigLinear(Q, ev, QU, QV, Qt @ W_mer.to(dt).T, Qt @ W_0.to(dt).T)


class Preview:
    """Kept statistics of one run; :meth:`params` and :meth:`model` solve any setting."""

    def __init__(self, template: nn.Module, blocks_path: str, entries: list[Kept], config: FeatCalConfig):
        self.template = template
        self.blocks_path = blocks_path
        self.entries = entries
        self.config = config  # the run's: its eps and bias switch hold for every previewed setting
        self._eig: dict[int, _EigLinear] = {}
        self._lock = threading.Lock()  # one decomposition at a time: prepare() may run beside a preview
        # Linears that read one input (q/k/v) share one S, so one decomposition: each Linear's
        # first sharer, found now, before prepare(compact=True) lets go of S.
        first: dict[int, int] = {}
        self._same_S = {
            i: first.setdefault(id(e.system.S), i) for i, e in enumerate(entries) if e.target.kind == arch.LINEAR
        }

    def __getstate__(self) -> dict:  # pickled to other processes (featcal tune on Ray): no lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _eig_of(self, i: int) -> _EigLinear:
        with self._lock:
            if i not in self._eig:
                kept, shared = self.entries[i], self._eig.get(self._same_S[i])
                eigh = None if shared is None else (shared.ev, shared.Q)
                self._eig[i] = _eig_linear(kept.system, kept.ends.W_mer, kept.ends.W_0, eigh)
            return self._eig[i]

    def _compact(self, i: int) -> None:
        """Let go of what Linear ``i``'s decomposition replaces: its ``S``, ``U``, ``V`` (``S``
        freed with its last sharer), residual terms and merged-weight copy. What the bias
        reads stays (:func:`featcal.method.solve.linear_bias`)."""
        with self._lock:
            kept = self.entries[i]
            light = replace(kept.system, S=None, U=None, V=None, res=None)
            self.entries[i] = replace(kept, system=light, ends=replace(kept.ends, W_mer=None, W_0=None))

    def prepare(self, compact: bool = False) -> None:
        """Do the one-off eigendecompositions now (else on the first preview); safe to run on
        another thread beside a preview. ``compact``: free each Linear's statistics as soon as
        it is decomposed (the previews are the same; the statistics can no longer be read)."""
        for i in self._same_S:
            self._eig_of(i)
            if compact:
                self._compact(i)

    def nbytes(self) -> int:
        """Bytes of the tensors this preview holds, each storage once (its template model and
        the pretrained weights it points at excluded)."""
        own = [(e.system, e.ends.W_mer, e.ends.b_mer) for e in self.entries]
        return storage_bytes([own, list(self._eig.values())])

    def config_at(self, at: Setting | FeatCalConfig) -> FeatCalConfig:
        """The run's config (its eps and bias switch) at ``at``: a :class:`Setting` in every
        block, or a config's setting and schedule."""
        schedule = at.schedule if isinstance(at, FeatCalConfig) else ()
        return self.config.with_(lam=at.lam, rho=at.rho, alpha=at.alpha, schedule=schedule)

    @torch.no_grad()
    def params(self, at: Setting | FeatCalConfig) -> list[tuple[int, arch.Target, torch.Tensor, torch.Tensor | None]]:
        """``[(block, target, W, b), ...]`` previewed for ``at``: a setting in every block, or a
        config's setting and schedule (each block's from ``setting_at``, as in the exact run)."""
        cfg, out = self.config_at(at), []
        for i, kept in enumerate(self.entries):
            ends, setting = kept.ends, cfg.setting_at(kept.block)
            if kept.target.kind == arch.LINEAR:
                W = self._eig_of(i).solve(setting, self.config.eps)
                if ends.b_mer is None:
                    b = None
                elif not self.config.bias:
                    b = ends.b_mer
                else:
                    b = solve.linear_bias(kept.system, W, ends, setting)
            else:
                W, b = solve.solve_norm(kept.system, ends, setting, eps=self.config.eps)
            out.append((kept.block, kept.target, W, b))
        return out

    @torch.no_grad()
    def model(self, at: Setting | FeatCalConfig) -> nn.Module:
        """A new model (a copy of the calibrated one) holding the previewed parameters."""
        model = copy.deepcopy(self.template)
        self.load_into(model, at)
        return model

    @torch.no_grad()
    def load_into(self, model: nn.Module, at: Setting | FeatCalConfig) -> nn.Module:
        """Write the previewed parameters into ``model`` (same architecture) in place."""
        blks = arch.all_blocks(model, self.blocks_path)
        for blk, t, W, b in self.params(at):
            arch.set_params(blks[blk], t, W, b)
        return model

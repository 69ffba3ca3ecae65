"""What one :func:`featcal.calibrate` call carries from block to block, frozen: the run's
(:class:`Run`: config, fast paths, device, process group, kernels, the report and notes it fills,
the experts' cache) and the stack's being visited (:class:`Stack`: an encoder-decoder has two,
calibrated one after the other). What moves, each task's streams at the input of the current
block (:class:`Stream`), is the visiting loop's own (:func:`featcal.engine.run._visit_blocks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn

from featcal.config import FastPaths, FeatCalConfig
from featcal.engine.distributed import Dist
from featcal.engine.report import CalibrationReport, Notes
from featcal.engine.trace import ExpertCache
from featcal.method.kernels import Kernels
from featcal.model.streams import BlockCall


@dataclass(frozen=True)
class Run:
    """What the steps of every block of one :func:`calibrate` call share."""

    cfg: FeatCalConfig  # the method: lam, rho, alpha, eps and the switches
    fast: FastPaths  # which exact fast paths the engine may take
    device: torch.device  # where the blocks run
    dist: Dist | None  # the process group sharing the batches (featcal.engine.distributed)
    kernels: Kernels  # scratch buffers, LAPACK choice, the block's factorisations (featcal.method.kernels)
    experts: ExpertCache  # the experts' side, through the expert trace (featcal.engine.trace)
    report: CalibrationReport  # filled block by block
    notes: Notes  # what the run will say when it ends
    keep: list | None  # each solved module's system and parameters, for a preview (keep_stats)
    on_block: Callable[[int, dict], None] | None  # after each block (calibrate's docstring)
    blocks_total: int  # over every stack

    def alpha_only(self, block: int) -> float | None:
        """Block ``block``'s alpha (its number in the report: ``cfg.setting_at``) when its sums and
        systems are built for it alone (cheaper, no preview: nothing is kept), else None (built
        for any alpha)."""
        return None if self.keep is not None else self.cfg.setting_at(block).alpha


@dataclass(frozen=True)
class Stack:
    """One stack of blocks of the models, at ``path`` (e.g. ``"encoder.block"``)."""

    path: str
    offset: int  # its first block's number in the report (the blocks of earlier stacks before it)
    blocks: nn.ModuleList  # the model being calibrated's
    base_blocks: nn.ModuleList
    expert_blocks: Mapping[str, nn.ModuleList]  # task -> expert i's

    @property
    def n_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class Stream:
    """One task's batches at the input of the current block."""

    cal: list[BlockCall]
    exp: list[BlockCall]

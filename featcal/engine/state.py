"""What one :func:`featcal.calibrate` call carries from block to block: the run's shared state
(:class:`RunState`: config and scratch, the report, the kept systems, the expert trace, and the
stack being visited) and each task's streams at the input of the current block (:class:`Stream`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from torch import nn

from featcal.engine.blockstats import Context
from featcal.engine.distributed import Dist
from featcal.engine.notes import Notes
from featcal.engine.report import CalibrationReport
from featcal.engine.trace import ExpertTrace
from featcal.model.streams import BlockCall


@dataclass
class Stream:
    """One task's batches at the input of the current block."""

    cal: list[BlockCall]
    exp: list[BlockCall]


@dataclass
class RunState:
    """What the steps of every block of one :func:`calibrate` call share."""

    ctx: Context  # config, fast paths, scratch (featcal.engine.blockstats)
    notes: Notes  # what the run will say when it ends
    report: CalibrationReport
    keep: list | None  # each solved module's system and parameters, for a preview
    trace: ExpertTrace | None
    # the stack being calibrated (an encoder-decoder has two, calibrated one after the other)
    path: str = ""
    offset: int = 0  # its first block's number in the report (blocks of earlier stacks before it)
    base_blocks: nn.ModuleList | None = None
    expert_blocks: Mapping[str, nn.ModuleList] | None = None
    streams: dict[str, Stream] | None = None
    offload: bool = False  # the streams go to the host between blocks
    dist: Dist | None = None  # the process group sharing the batches (featcal.engine.distributed)
    on_block: Callable[[int, dict], None] | None = None  # after each block (calibrate's docstring)
    blocks_done: int = 0  # over every stack
    blocks_total: int = 0

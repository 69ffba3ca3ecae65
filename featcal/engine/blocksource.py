"""Where the blocks' weights are while :func:`featcal.calibrate` visits them.

The engine's forward order needs block l of every model only while it visits block l. A
:class:`BlockSource` is the engine's hook for that: it makes the streams at the input of the
first block to visit, brings block l of every model where the run computes before the block
is visited (:meth:`~BlockSource.enter`) and lets it go after (:meth:`~BlockSource.leave`).
The default keeps everything where it is (the in-memory run); :class:`DeviceBlocks` moves one
block of every model at a time onto an accelerator; :mod:`featcal.streaming.run` reads the
blocks from checkpoint shards and writes the calibrated ones out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn

from featcal.model.streams import BlockCall, device_of, to_device


class BlockSource:
    """The in-memory run: every block already where it runs; the streams made by the engine."""

    #: First block to visit (a resumed run starts past the blocks it finished).
    first: int = 0
    #: Whether the models' parameters are all present (the engine then checks them up front;
    #: a lazy source holds skeletons and checks each block as it loads it).
    loaded: bool = True

    def streams(self, make: Callable[[], dict]) -> dict:
        """The streams at the input of block :attr:`first` (``make()`` runs every stem)."""
        return make()

    def offload(self, streams: dict) -> bool:
        """Whether the streams go to the host between blocks (beyond ``FeatCalConfig.offload_streams``)."""
        return False

    def enter(self, block: int) -> None:
        """Before block ``block`` is visited."""

    def leave(self, block: int, streams: dict, report) -> None:
        """After block ``block`` is calibrated and the streams have moved past it (``report``:
        the run's :class:`~featcal.engine.report.CalibrationReport` so far)."""

    def close(self) -> None:
        """When the run ends, finished or not (a block entered and not left goes home)."""


def to_host(h: torch.Tensor) -> torch.Tensor:
    """``h`` on the CPU; pinned when it comes from an accelerator (the next copy back is async-able)."""
    if h.device.type == "cpu":
        return h
    out = torch.empty(h.shape, dtype=h.dtype, pin_memory=torch.cuda.is_available())
    return out.copy_(h)


def call_bytes(calls: list[BlockCall]) -> int:
    return sum(c.hidden.numel() * c.hidden.element_size() for c in calls)


def streams_fit(streams: dict, device: torch.device, share: float = 0.25) -> bool:
    """Whether every stream (calibrating and expert) fits in ``share`` of the accelerator's
    free memory (the rest is for the block, its statistics and the solve)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    need = sum(call_bytes(st.cal) + call_bytes(st.exp) for st in streams.values())
    return need <= share * free


def check_device(device) -> torch.device:
    """``device`` as a torch device; a clear error when it names CUDA and there is none."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' was asked but torch.cuda.is_available() is False on this machine "
            "(no GPU, or a CPU-only torch build); use device='cpu'."
        )
    return device


def move_streams(streams: dict, device: torch.device) -> None:
    """Every stream's hidden states, block arguments and padding masks onto ``device``, in place
    (the calls' other fields, e.g. a decoder's cross-attention sites and carried outputs, kept)."""

    def moved(c: BlockCall) -> BlockCall:
        return replace(
            c,
            hidden=c.hidden.to(device),
            args=to_device(c.args, device),
            kwargs=to_device(c.kwargs, device),
            mask=to_device(c.mask, device),
            memory_mask=to_device(c.memory_mask, device),
        )

    for st in streams.values():
        st.cal = [moved(c) for c in st.cal]
        st.exp = [moved(c) for c in st.exp]


class DeviceBlocks(BlockSource):
    """In-memory models on the host, one block of each on ``device`` at a time: block l of
    the calibrated model, the base and every expert goes to ``device`` before it is visited
    and back to where it was after (values unchanged). The streams stay on ``device`` when they
    fit in a quarter of its free memory, else on the host (pinned) between blocks."""

    def __init__(self, device: torch.device, calibrated: nn.ModuleList, others: list[nn.ModuleList]):
        self.device = device
        self.lists = [calibrated, *others]
        self._fit = True

    def streams(self, make: Callable[[], dict]) -> dict:
        streams = make()
        self._fit = streams_fit(streams, self.device)
        if self._fit:
            move_streams(streams, self.device)
        return streams

    def offload(self, streams: dict) -> bool:
        return not self._fit

    def enter(self, block: int) -> None:
        self._away = (block, [device_of(blocks[block]) for blocks in self.lists])
        for blocks in self.lists:
            blocks[block].to(self.device)

    def leave(self, block: int, streams: dict, report) -> None:
        self.close()

    def close(self) -> None:
        if getattr(self, "_away", None) is not None:
            block, homes = self._away
            for blocks, home in zip(self.lists, homes):
                blocks[block].to(home)
            self._away = None

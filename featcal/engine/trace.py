"""What :func:`featcal.calibrate` keeps of the experts between calls (:class:`ExpertTrace`),
bound to the very expert modules and batches it was made with. A run reads and fills it through
:class:`featcal.engine.experts.ExpertCache` alone."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Mapping

import torch
from torch import nn

from featcal.model.capture import Captured
from featcal.model.streams import ExpertStreams


class ExpertTrace:
    """What :func:`calibrate` computes of the experts, kept for the next call on the same
    experts and calibration data: their streams at every block (:attr:`streams`, one
    :class:`featcal.model.streams.ExpertStreams` per stack, the same type the diagnostics keep of
    the experts) and per block their captured inputs (and, when all tasks are reduced as one
    stack, the stacked captures and parameters). None of it depends on the merged model or the
    hyper-parameters, so an app that re-runs the exact calibration for every slider move
    (the merged model, lam, rho or alpha changed) runs no expert block again.

    Bound to the very expert modules, batches, blocks and modules of its first use (held by
    weak references; a dict batch by its keys and its tensors): any other ones clear it. The
    experts and the batches must not be changed in place while it is used. It holds every
    block's expert captures (about one forward pass of activations per task), so keep it for
    small models, or give it ``max_bytes``: it then keeps the first blocks' work that fits
    (:meth:`room_for`), and later calls run the experts from the first block it lacks on, the
    experts' stream at that block being kept with the block before it.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        self.max_bytes = max_bytes  # None: no limit
        self.nbytes = 0  # what the kept captures and streams hold (tensor storage, each counted once)
        self._key: tuple | None = None
        self._refs: list = []
        self.streams: dict[str, ExpertStreams] = {}  # stack path -> every expert's stream at every block
        self.captures: dict[tuple, Captured] = {}  # (path, block, task, batch) -> expert i's captures
        # (path, block) -> (stacked captures, stacked params): all tasks reduced as one stack
        self.stacked: dict[tuple, tuple[Captured, dict]] = {}

    def room_for(self, *kept) -> bool:
        """Whether keeping ``kept`` (captures, block calls, tensors) stays within ``max_bytes``;
        when it does, its bytes are counted as kept (the caller then keeps all of it)."""
        size = storage_bytes(kept)
        if self.max_bytes is not None and self.nbytes + size > self.max_bytes:
            return False
        self.nbytes += size
        return True

    def stream(self, path: str) -> ExpertStreams:
        """The experts' streams through the stack at ``path`` (empty until a calibration fills it)."""
        return self.streams.setdefault(path, ExpertStreams(path, {}))

    def bind(
        self, experts: Mapping[str, nn.Module], calib_data: Mapping[str, list], tasks: list[str], key: tuple
    ) -> "ExpertTrace":
        """Clear the trace unless it was made with these experts, batches and ``key`` (the
        blocks' path and what decides the captured modules)."""
        objs = [x for o in [experts[t] for t in tasks] + [b for t in tasks for b in calib_data[t]] for x in _leaves(o)]
        key = (key, tuple(tasks), tuple(len(calib_data[t]) for t in tasks))
        alive = [r() for r in self._refs]
        if self._key != key or len(alive) != len(objs) or not all(_same(a, o) for a, o in zip(alive, objs)):
            self.__init__(self.max_bytes)
            self._key = key
            self._refs = [_ref(o) for o in objs]
        return self


def storage_bytes(obj) -> int:
    """Bytes of the tensor storages in ``obj`` (a tensor, a :class:`Captured`, a block call, a
    dataclass, or lists, tuples and dicts of them), each storage counted once: captures that share one input
    tensor (q/k/v) or views of one output hold it once."""
    seen: dict[int, int] = {}

    def visit(x) -> None:
        if torch.is_tensor(x):
            st = x.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
        elif isinstance(x, Captured):
            visit(x.inputs), visit(x.outputs)
        elif isinstance(x, Mapping):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        elif hasattr(x, "hidden"):  # a BlockCall: its hidden state (its other arguments are shared)
            visit(x.hidden)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):  # a solver's systems, a preview's parts
            for f in dataclasses.fields(x):
                visit(getattr(x, f.name))

    visit(obj)
    return sum(seen.values())


def _leaves(obj) -> list:
    """What identifies a model or batch for :meth:`ExpertTrace.bind`: the object itself, or for a
    dict batch (which takes no weak reference) its keys and values, nested dicts flattened."""
    if isinstance(obj, Mapping):
        return [x for k, v in obj.items() for x in (k, *_leaves(v))]
    return [obj]


def _ref(obj):
    """A weak reference to ``obj`` where it takes one (modules, tensors), else a strong one (a
    dict batch's keys and plain values: small)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _same(a, b) -> bool:
    """``a`` is ``b``, or two equal plain values (not arrays: those must be the very object)."""
    if a is b:
        return True
    if torch.is_tensor(a) or torch.is_tensor(b) or isinstance(a, nn.Module):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # arrays and odd objects: not the same unless identical
        return False

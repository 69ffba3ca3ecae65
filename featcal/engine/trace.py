"""The experts' side of a :func:`featcal.calibrate` run: what it keeps of the experts between calls
(:class:`ExpertTrace`, bound to the very expert modules and batches it was made with), and
:class:`ExpertCache`, which runs each expert's stem and blocks on its own stream, reading them from
the trace when it has them and keeping them in it when they fit: the only place the trace is read
or filled."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Iterator, Mapping

import torch
from torch import nn

from featcal.engine.blocksource import to_host
from featcal.model import arch
from featcal.model.capture import Captured, capture, stacked
from featcal.model.streams import BlockCall, ExpertStreams, block_output


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


# ------------------------------------------------------------------ the run's side


class ExpertCache:
    """What is computed of the experts in one run, through ``trace`` (None: nothing kept).

    Three kinds of entries, each fetched whole or not at all (:meth:`fetch`) and kept whole or
    not at all (:meth:`update`, within :attr:`ExpertTrace.max_bytes`): ``("stem", path, task)``,
    a task's streams at the stack's first block; ``("batch", path, block, task, b)``, expert
    ``task``'s captures on its batch ``b`` and its stream past the block; ``("stack", path,
    block, tasks)``, every task's captures and parameters stacked on a leading task axis and
    their streams past the block."""

    def __init__(self, trace: ExpertTrace | None, device: torch.device):
        self.trace, self.device = trace, device

    def fetch(self, key: tuple):
        """The entry at ``key`` when the trace holds all of it, else None."""
        if self.trace is None:
            return None
        kind, path, *rest = key
        kept = self.trace.stream(path)
        if kind == "stem":
            task, n = rest
            calls = [kept.get(task, 0, b) for b in range(n)]
            return None if any(c is None for c in calls) else calls
        if kind == "batch":
            block, task, b = rest
            ce, nxt = self.trace.captures.get((path, block, task, b)), kept.get(task, block + 1, b)
            return None if ce is None or nxt is None else (ce, nxt)
        block, tasks = rest
        hit = self.trace.stacked.get((path, block))
        outs = [kept.get(task, block + 1, 0) for task in tasks]
        return None if hit is None or any(o is None for o in outs) else (*hit, outs)

    def update(self, key: tuple, entry) -> None:
        """Keep ``entry`` at ``key`` when it fits (a stem's calls one by one; the others whole)."""
        if self.trace is None:
            return
        kind, path, *rest = key
        kept = self.trace.stream(path)
        if kind == "stem":
            task, _ = rest
            for b, call in enumerate(entry):
                if self.trace.room_for(call):
                    kept.put(task, 0, b, call)
        elif kind == "batch":
            block, task, b = rest
            if self.trace.room_for(*entry):  # both or neither (ExpertTrace.max_bytes)
                self.trace.captures[path, block, task, b] = entry[0]
                kept.put(task, block + 1, b, entry[1])
        else:
            block, tasks = rest
            ce, params, outs = entry
            if self.trace.room_for((ce, params), outs):
                self.trace.stacked[path, block] = (ce, params)
                for task, out in zip(tasks, outs):
                    kept.put(task, block + 1, 0, out)

    def stem(self, path: str, task: str, n: int, run_stem: Callable[[], list[BlockCall]]) -> list[BlockCall]:
        """Expert ``task``'s streams at the first block of the stack at ``path`` on its ``n``
        batches (``run_stem()`` when not kept)."""
        calls = self.fetch(("stem", path, task, n))
        if calls is None:
            calls = run_stem()
            self.update(("stem", path, task, n), calls)
        return list(calls)

    def _run(self, eblk: nn.Module, targets, call: BlockCall, offload: bool) -> tuple[Captured, BlockCall]:
        """Expert block ``eblk`` on ``call``: the targets' captures and the call of the next block."""
        with capture(eblk, targets, outputs=True) as ce:
            nxt = call.after(block_output(eblk, call, self.device))
        return ce, nxt.with_hidden(to_host(nxt.hidden)) if offload else nxt

    def block(self, path: str, block: int, eblks: dict, targets, streams: dict, offload: bool, lead: int):
        """``(params, captures)`` of the experts at ``block`` for the tasks of ``eblks``
        (``{task: its expert's block}``): their targets' parameters, and an iterator over their
        batches' captures, each batch's stream moved past the block as it is captured. With
        ``lead``, every task's at once on a leading task axis (one batch each)."""
        tasks = list(eblks)
        if not lead:
            (task,) = tasks
            params = {t.name: arch.get_params(eblks[task], t) for t in targets}
            return params, self._batches(path, block, task, eblks[task], targets, streams[task].exp, offload)
        key = ("stack", path, block, tasks)
        entry = self.fetch(key)
        if entry is None:
            runs = [self._run(eblks[task], targets, streams[task].exp[0], offload) for task in tasks]
            params = {t.name: _stack_params([arch.get_params(eblks[task], t) for task in tasks]) for t in targets}
            entry = (stacked([ce for ce, _ in runs]), params, [nxt for _, nxt in runs])
            self.update(key, entry)
        ce, params, outs = entry
        for task, out in zip(tasks, outs):
            streams[task].exp[0] = out
        return params, iter([ce])

    def _batches(self, path, block, task, eblk, targets, exp: list[BlockCall], offload) -> Iterator[Captured]:
        """Expert ``task``'s captures batch by batch, its stream ``exp`` moved on in place."""
        for b in range(len(exp)):
            key = ("batch", path, block, task, b)
            entry = self.fetch(key)
            if entry is None:
                entry = self._run(eblk, targets, exp[b], offload)
                self.update(key, entry)
            exp[b] = entry[1]
            yield entry[0]


def _stack_params(params: list[tuple[torch.Tensor, torch.Tensor | None]]):
    """Every task's ``(W_i, b_i)`` of one target, stacked: ``((T, o, d), (T, o) or None)``."""
    W, b = zip(*params)
    return torch.stack(W), None if b[0] is None else torch.stack(b)

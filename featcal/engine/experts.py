"""The experts' side of a :func:`featcal.calibrate` run (:class:`ExpertCache`): each expert's stem
and blocks run on its own stream, read from the run's :class:`~featcal.engine.trace.ExpertTrace`
when it has them and kept in it when they fit. The only place the trace is read or filled.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
from torch import nn

from featcal.engine.blocksource import to_host
from featcal.engine.trace import ExpertTrace
from featcal.model import arch
from featcal.model.capture import Captured, capture, stacked
from featcal.model.streams import BlockCall, block_output


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

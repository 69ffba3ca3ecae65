"""A task's calibration batches as one pool of examples, drawn again in seeded minibatches.

The data-using baselines (AdaMerging, Fisher merging, the trained calibrators' final module)
follow their authors' loaders: minibatches of a fixed size drawn from the task's examples,
reshuffled every pass. ``calib_data[task]`` comes as a list of batches (a tensor, or a dict of
tensors such as ``input_ids`` and ``attention_mask``); when they can be joined (same trailing
shapes, same keys) they are, and any number of examples can be drawn; when not, each draw is
one of the given batches, in a seeded order.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch

from featcal.model.validate import batch_len


def _join(batches: list) -> Any | None:
    """The batches concatenated along the first axis, or None when they do not fit together."""
    first = batches[0]
    if torch.is_tensor(first):
        ok = all(torch.is_tensor(b) and b.shape[1:] == first.shape[1:] for b in batches)
        return torch.cat(batches) if ok else None
    if isinstance(first, Mapping):
        keys = set(first)
        if not all(isinstance(b, Mapping) and set(b) == keys for b in batches):
            return None
        out = {}
        for k in first:
            vals = [b[k] for b in batches]
            if not all(torch.is_tensor(v) and v.shape[1:] == vals[0].shape[1:] for v in vals):
                return None
            out[k] = torch.cat(vals)
        return out
    return None


def take(batch: Any, idx: torch.Tensor) -> Any:
    """The examples ``idx`` of a tensor or dict batch."""
    if torch.is_tensor(batch):
        return batch[idx]
    return {k: v[idx] if torch.is_tensor(v) else v for k, v in batch.items()}


class ExamplePool:
    """One task's calibration examples (see the module docstring)."""

    def __init__(self, batches: list):
        if not batches:
            raise ValueError("no calibration batches for this task; give at least one.")
        self.batches = list(batches)
        self.joined = _join(self.batches)
        self.n = sum(batch_len(b) for b in self.batches)

    def __len__(self) -> int:
        return self.n

    @property
    def units(self) -> list:
        """What :meth:`draws` indexes: ``[the joined examples]``, or the given batches."""
        return [self.joined] if self.joined is not None else self.batches

    def draws(self, size: int, generator: torch.Generator) -> Iterator[tuple[int, torch.Tensor | None]]:
        """Endless ``(unit, rows)``: the rows of ``units[unit]`` that :meth:`minibatches` yields
        (``None``: the whole unit, a given batch), in the same seeded order."""
        if size < 1:
            raise ValueError(f"batch size must be at least 1, got {size}.")
        while True:
            if self.joined is None:
                for j in torch.randperm(len(self.batches), generator=generator).tolist():
                    yield j, None
            else:
                for idx in torch.randperm(self.n, generator=generator).split(size):
                    yield 0, idx

    def minibatches(self, size: int, generator: torch.Generator) -> Iterator[Any]:
        """Endless minibatches of ``size`` examples (the last of a pass may be smaller), each
        pass a new seeded permutation; the given batches in a seeded order when they cannot be
        joined."""
        units = self.units
        for j, idx in self.draws(size, generator):
            yield units[j] if idx is None else take(units[j], idx)

    def in_order(self, size: int) -> Iterator[Any]:
        """One pass over the examples in their order, in batches of ``size`` (the given batches
        when they cannot be joined)."""
        if self.joined is None:
            yield from self.batches
            return
        for idx in torch.arange(self.n).split(size):
            yield take(self.joined, idx)

"""Moving hidden states one block at a time.

:func:`catch_block_inputs` runs a model's stem once and stops at the first
block, keeping everything the first block was called with (the hidden state
and every other positional and keyword argument: attention masks, position
embeddings, ...). :func:`run_block` then calls any block of the same model on a
hidden state with those same extra arguments, and :func:`advance` also hands on
what a block returns for the next one (:attr:`featcal.model.arch.BlockKind.carries`,
e.g. T5's position biases), so a stream advances block by block without
re-running its prefix, exactly as the model's own forward pass moves it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import nn

from featcal.config import FastPaths
from featcal.model.arch import BlockKind, block_kind


class _Stop(Exception):
    """Raised inside the first block's pre-hook to end the stem's forward pass."""


@dataclass
class BlockCall:
    """One batch's call of a block: the hidden state plus the other arguments.

    ``hidden`` is ``(B, T, d)`` (or whatever the blocks take first); ``args`` and
    ``kwargs`` are the remaining arguments exactly as the model passed them to
    block 0; ``hidden_key`` is set when the hidden state came as a keyword.
    ``mask`` is the padding mask (``(B, T)``) of the stack's tokens, used to give padding
    tokens weight 0 in the statistics; ``memory_mask`` that of the tokens read by the
    input sites ``memory_sites`` (a decoder's cross-attention keys and values read the
    encoder's tokens). ``carries`` are ``(output index, slot)`` pairs: the block's output
    at that index becomes the next block's argument ``args[slot]`` (an int) or
    ``kwargs[slot]`` (a name) (:attr:`featcal.model.arch.BlockKind.carries`, see :meth:`after`).
    """

    hidden: torch.Tensor
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    hidden_key: str | None = None
    mask: torch.Tensor | None = None
    memory_mask: torch.Tensor | None = None
    memory_sites: tuple[str, ...] = ()
    carries: tuple[tuple[int, int | str], ...] = ()

    def with_hidden(self, h: torch.Tensor) -> "BlockCall":
        return replace(self, hidden=h)

    def after(self, out: Any) -> "BlockCall":
        """The next block's call, given this block's output ``out``: its first output as the
        hidden state, and each carried output in its argument's slot."""
        if not isinstance(out, (tuple, list)):
            return self.with_hidden(out)
        args, kwargs = list(self.args), dict(self.kwargs)
        for index, slot in self.carries:
            if isinstance(slot, int):
                args[slot] = out[index]
            else:
                kwargs[slot] = out[index]
        return replace(self, hidden=out[0], args=tuple(args), kwargs=kwargs)

    def mask_for(self, site: str) -> torch.Tensor | None:
        """The padding mask of the tokens that input ``site`` reads (None: no padding)."""
        return self.memory_mask if site in self.memory_sites else self.mask


def _has_array(obj: Any) -> bool:
    """Whether ``obj`` holds a tensor or any other array (something with a ``shape``)."""
    if torch.is_tensor(obj) or getattr(obj, "shape", None) is not None:
        return True
    if isinstance(obj, Mapping):
        return any(_has_array(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_array(v) for v in obj)
    return False


def _equal(a: Any, b: Any) -> bool:
    """``a == b`` as a plain bool; False when the comparison is not one (arrays, odd objects)."""
    try:
        return bool(a == b)
    except Exception:  # e.g. numpy arrays: "truth value ... is ambiguous"
        return False


def pool_spans(calls: list[BlockCall], max_rows: int = FastPaths.pool_rows) -> list[tuple[int, int]] | None:
    """The example ranges ``[(lo, hi), ...]`` of ``calls`` inside one pooled call, or None when
    they cannot run as one: more than ``max_rows`` rows (tokens) in all (default:
    :attr:`FastPaths.pool_rows`), a padding mask, carried outputs, a tensor or other array among the other
    arguments (it may have a batch dimension), or calls that differ in anything but the
    hidden state (or a single call: nothing to pool)."""
    first = calls[0]
    if len(calls) < 2 or sum(c.hidden.shape[:-1].numel() for c in calls) > max_rows:
        return None
    for c in calls:
        if (
            c.mask is not None
            or c.memory_mask is not None
            or c.carries
            or c.hidden.dim() < 2
            or c.hidden.shape[1:] != first.hidden.shape[1:]
            or c.hidden.dtype != first.hidden.dtype
            or c.hidden_key != first.hidden_key
            or _has_array(c.args)
            or _has_array(c.kwargs)
            or not _equal(c.args, first.args)
            or not _equal(c.kwargs, first.kwargs)
        ):
            return None
    edges = [0]
    for c in calls:
        edges.append(edges[-1] + c.hidden.shape[0])
    return list(zip(edges[:-1], edges[1:]))


def pooled(calls: list[BlockCall]) -> BlockCall:
    """One call over the concatenated hidden states (see :func:`pool_spans`)."""
    return calls[0].with_hidden(torch.cat([c.hidden for c in calls]))


def device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def dtype_of(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def to_device(obj: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """Move every tensor inside nested tuples/lists/dicts to ``device``; with ``dtype``, also
    cast the floating-point ones (a bf16 model gets bf16 inputs)."""
    if torch.is_tensor(obj):
        if dtype is not None and obj.is_floating_point():
            return obj.to(device=device, dtype=dtype)
        return obj.to(device)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device, dtype) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device, dtype) for v in obj)
    return obj


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model(batch)`` for a tensor batch, ``model(**batch)`` for a dict batch."""
    if isinstance(batch, Mapping):
        return model(**batch)
    return model(batch)


@dataclass
class ExpertStreams:
    """Every task's stream of one model at every block of a stack: ``calls[task][l][b]`` is the
    call that block ``l`` gets on batch ``b`` (``l = L``: the last block's output); of several
    stacks (an encoder-decoder's, ``blocks`` their paths joined by
    :data:`~featcal.model.arch.STACK_SEP`), each stack's ``L + 1`` calls after the previous
    stack's. What the
    diagnostics need of the experts (:func:`diagnostics.expert_streams`), of a diagnosed model
    (:func:`diagnostics.streams_while`), and what :class:`featcal.ExpertTrace` keeps of the
    experts between calibrations. Holds ``tasks x batches x (blocks + 1)`` hidden states."""

    blocks: str
    calls: dict[str, list[list[BlockCall]]]  # task -> [l = 0..L] -> batch -> the block-l call

    @property
    def nbytes(self) -> int:
        return sum(
            c.hidden.numel() * c.hidden.element_size()
            for per_task in self.calls.values()
            for per_block in per_task
            for c in per_block
            if c is not None
        )

    def get(self, task: str, block: int, batch: int) -> BlockCall | None:
        """The call of ``block`` on ``batch`` of ``task``, or None when not kept."""
        per_block = self.calls.get(task, [])
        if block >= len(per_block) or batch >= len(per_block[block]):
            return None
        return per_block[block][batch]

    def put(self, task: str, block: int, batch: int, call: BlockCall) -> None:
        """Keep the call of ``block`` on ``batch`` of ``task`` (filled in any order)."""
        per_block = self.calls.setdefault(task, [])
        per_block.extend([] for _ in range(block + 1 - len(per_block)))
        row = per_block[block]
        row.extend([None] * (batch + 1 - len(row)))
        row[batch] = call


@torch.no_grad()
def catch_block_inputs(model: nn.Module, first_block: nn.Module, batch: Any) -> BlockCall:
    """Run ``model`` on ``batch`` up to ``first_block`` and return its call."""
    caught: dict[str, Any] = {}

    def hook(_mod, args, kwargs):
        caught["args"], caught["kwargs"] = args, dict(kwargs)
        raise _Stop

    handle = first_block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        call_model(model, to_device(batch, device_of(model), dtype_of(model)))
    except _Stop:
        pass
    finally:
        handle.remove()
    if "args" not in caught:
        raise RuntimeError(
            f"{type(model).__name__}'s forward never called its first block; check blocks=... "
            "names the blocks that the forward pass runs."
        )
    return block_call(caught["args"], caught["kwargs"], batch, first_block)


def block_call(args: tuple, kwargs: dict, batch: Any, block: nn.Module | None = None) -> BlockCall:
    """The :class:`BlockCall` of ``block`` called as ``block(*args, **kwargs)`` on ``batch``:
    the hidden state is the first argument (or the first keyword when there is none); the
    masks and carried outputs as the block's :func:`featcal.model.arch.block_kind` says (plain
    blocks when ``block`` is None)."""
    kwargs = dict(kwargs)
    key = None
    if args:
        hidden, args = args[0], tuple(args[1:])
    else:  # hidden state passed by keyword
        key = next(iter(kwargs))
        hidden = kwargs.pop(key)
    _drop_caches(kwargs)
    kind = BlockKind() if block is None else block_kind(block)
    get = batch.get if isinstance(batch, Mapping) else (lambda _k: None)
    return BlockCall(
        hidden,
        args,
        kwargs,
        key,
        get(kind.mask),
        None if kind.memory_mask is None else get(kind.memory_mask),
        kind.memory_sites,
        _carry_slots(block, kind, args, kwargs, key),
    )


def _carry_slots(block, kind: BlockKind, args: tuple, kwargs: dict, hidden_key) -> tuple:
    """``(output index, slot)`` of each carried output: where the block's call holds the
    argument it feeds (a position in ``args`` when passed positionally, else its name)."""
    if not kind.carries:
        return ()
    names = list(inspect.signature(block.forward).parameters)
    if hidden_key is None:
        names = names[1:]  # args holds what follows the hidden state
    slots = []
    for index, name in kind.carries:
        pos = names.index(name) if name in names and name not in kwargs else None
        slots.append((index, pos if pos is not None and pos < len(args) else name))
    return tuple(slots)


CACHE_KWARGS = ("past_key_value", "past_key_values", "cache", "layer_past", "cache_params")


def _drop_caches(kwargs: dict) -> None:
    """Blocks re-run on the same call must not grow a key/value cache (HF decoder LMs pass a
    ``DynamicCache`` to every layer, which each call would append to)."""
    for k, v in kwargs.items():
        if v is not None and (k in CACHE_KWARGS or type(v).__name__.endswith("Cache")):
            kwargs[k] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False


def run_block(block: nn.Module, call: BlockCall, device: torch.device | None = None) -> torch.Tensor:
    """``block(hidden, *args, **kwargs)``; returns the new hidden state (the first output)."""
    out = block_output(block, call, device)
    return out[0] if isinstance(out, (tuple, list)) else out


def advance(block: nn.Module, call: BlockCall, device: torch.device | None = None) -> BlockCall:
    """The next block's call: ``block`` run on ``call``, its outputs handed on (:meth:`BlockCall.after`)."""
    return call.after(block_output(block, call, device))


def block_output(block: nn.Module, call: BlockCall, device: torch.device | None = None) -> Any:
    """``block(hidden, *args, **kwargs)``, everything it returns."""
    h, args, kwargs = call.hidden, call.args, call.kwargs
    if device is not None:
        h, args, kwargs = h.to(device), to_device(args, device), to_device(kwargs, device)
    if call.hidden_key is not None:
        out = block(*args, **{call.hidden_key: h}, **kwargs)
    else:
        out = block(h, *args, **kwargs)
    return out

"""Moving hidden states one block at a time.

:func:`catch_block_inputs` runs a model's stem once and stops at the first
block, keeping everything the first block was called with (the hidden state
and every other positional and keyword argument: attention masks, position
embeddings, ...). :func:`run_block` then calls any block of the same model on a
hidden state with those same extra arguments, so a stream advances block by
block without re-running its prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from featcal.config import FastPaths


class _Stop(Exception):
    """Raised inside the first block's pre-hook to end the stem's forward pass."""


@dataclass
class BlockCall:
    """One batch's call of a block: the hidden state plus the other arguments.

    ``hidden`` is ``(B, T, d)`` (or whatever the blocks take first); ``args`` and
    ``kwargs`` are the remaining arguments exactly as the model passed them to
    block 0; ``hidden_key`` is set when the hidden state came as a keyword.
    ``mask`` is the batch's ``attention_mask`` (``(B, T)``), used to give padding
    tokens weight 0 in the statistics.
    """

    hidden: torch.Tensor
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    hidden_key: str | None = None
    mask: torch.Tensor | None = None

    def with_hidden(self, h: torch.Tensor) -> "BlockCall":
        return BlockCall(h, self.args, self.kwargs, self.hidden_key, self.mask)


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
    :attr:`FastPaths.pool_rows`), a padding mask, a tensor or other array among the other
    arguments (it may have a batch dimension), or calls that differ in anything but the
    hidden state (or a single call: nothing to pool)."""
    first = calls[0]
    if len(calls) < 2 or sum(c.hidden.shape[:-1].numel() for c in calls) > max_rows:
        return None
    for c in calls:
        if (
            c.mask is not None
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
    return block_call(caught["args"], caught["kwargs"], batch)


def block_call(args: tuple, kwargs: dict, batch: Any) -> BlockCall:
    """The :class:`BlockCall` of a block called as ``block(*args, **kwargs)`` on ``batch``:
    the hidden state is the first argument (or the first keyword when there is none)."""
    kwargs = dict(kwargs)
    key = None
    if args:
        hidden, args = args[0], tuple(args[1:])
    else:  # hidden state passed by keyword
        key = next(iter(kwargs))
        hidden = kwargs.pop(key)
    _drop_caches(kwargs)
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return BlockCall(hidden, args, kwargs, key, mask)


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
    h, args, kwargs = call.hidden, call.args, call.kwargs
    if device is not None:
        h, args, kwargs = h.to(device), to_device(args, device), to_device(kwargs, device)
    if call.hidden_key is not None:
        out = block(*args, **{call.hidden_key: h}, **kwargs)
    else:
        out = block(h, *args, **kwargs)
    return out[0] if isinstance(out, (tuple, list)) else out

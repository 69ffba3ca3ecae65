"""Hooks that capture, for one forward call of one block, the input of every
calibrated target (and the output where it comes for free).

The hooks live only inside :func:`capture`, which removes them in ``finally``,
so an exception never leaves a hook behind. Nothing is stored on the modules.
Captured tensors are batch-first: ``(B, T, d)`` for token sequences, ``(B, d)``
otherwise, also in a sequence-first block (:func:`sequence_first`), whose captures
are transposed views.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from featcal.model.arch import Target, get_submodule


@dataclass
class Captured:
    """What one forward call of a block showed: ``inputs[site]`` and ``outputs[owner]``."""

    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)


def _mapped(caps: list[Captured], fn) -> Captured:
    """``fn`` of the tensors under each key of ``caps``; tensors that were one (in every
    capture) stay one, since modules sharing an input are recognised by identity."""
    done: dict[tuple[int, ...], torch.Tensor] = {}

    def one(xs: list[torch.Tensor]) -> torch.Tensor:
        key = tuple(id(x) for x in xs)
        if key not in done:
            done[key] = fn(xs)
        return done[key]

    return Captured(
        {k: one([c.inputs[k] for c in caps]) for k in caps[0].inputs},
        {k: one([c.outputs[k] for c in caps]) for k in caps[0].outputs},
    )


def sliced(cap: Captured, lo: int, hi: int) -> Captured:
    """Examples ``lo:hi`` (the batch dimension) of every captured tensor, as views."""
    return _mapped([cap], lambda xs: xs[0][lo:hi])


def per_task(cap: Captured, tasks: int) -> Captured:
    """A pooled call's captures (the tasks' equal batches one after another) with a leading
    task axis: ``(tasks * B, ...)`` -> ``(tasks, B, ...)``, as views."""
    return _mapped([cap], lambda xs: xs[0].unflatten(0, (tasks, -1)))


def stacked(caps: list[Captured]) -> Captured:
    """One capture per task (same keys and shapes), stacked along a new leading task axis."""
    return _mapped(caps, torch.stack)


def _mha_args(args, kwargs):
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def _mha_context(mod: nn.MultiheadAttention, q, k, v, call: dict) -> torch.Tensor:
    """The attention output before ``out_proj`` (the input of the output projection),
    recomputed with an identity output projection. Inputs are sequence-first ``(T, B, d)``."""
    d = mod.embed_dim
    eye = torch.eye(d, dtype=q.dtype, device=q.device)
    ctx, _ = F.multi_head_attention_forward(
        q,
        k,
        v,
        d,
        mod.num_heads,
        mod.in_proj_weight,
        mod.in_proj_bias,
        mod.bias_k,
        mod.bias_v,
        mod.add_zero_attn,
        0.0,
        eye,
        None,
        training=False,
        key_padding_mask=call.get("key_padding_mask"),
        need_weights=False,
        attn_mask=call.get("attn_mask"),
        is_causal=call.get("is_causal", False),
    )
    return ctx


def _mha_hook(site: str, store: Captured, want_context: bool, want_output: bool):
    def hook(mod: nn.MultiheadAttention, args, kwargs, output):
        call = _mha_args(args, kwargs)
        q, k, v = call["query"], call["key"], call["value"]
        bf = mod.batch_first and q.dim() == 3
        seq_first = (lambda t: t.transpose(0, 1)) if bf else (lambda t: t)
        batch_first = (lambda t: t.transpose(0, 1)) if q.dim() == 3 else (lambda t: t)
        qs, ks, vs = seq_first(q), seq_first(k), seq_first(v)  # (T, B, d)
        store.inputs[site] = batch_first(qs)
        store.inputs[f"{site}#key"] = store.inputs[site] if k is q else batch_first(ks)
        store.inputs[f"{site}#value"] = store.inputs[site] if v is q else batch_first(vs)
        if want_context:
            store.inputs[f"{site}#context"] = batch_first(_mha_context(mod, qs, ks, vs, call))
        if want_output:
            out = output[0] if isinstance(output, tuple) else output
            store.outputs[f"{site}.out_proj"] = out if bf or out.dim() != 3 else out.transpose(0, 1)

    return hook


def sequence_first(block: nn.Module) -> bool:
    """Whether ``block`` runs on sequence-first hidden states ``(T, B, d)``: it holds an
    ``nn.MultiheadAttention`` with ``batch_first=False`` (open_clip's Transformer with
    ``batch_first=False``, as older open_clip builds run it)."""
    return any(isinstance(m, nn.MultiheadAttention) and not m.batch_first for m in block.modules())


def _batch_first_views():
    """``x -> x.transpose(0, 1)`` for the ``(T, B, d)`` tensors of a sequence-first block, one
    view per tensor (modules reading one input keep sharing one captured tensor)."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def view(x: torch.Tensor) -> torch.Tensor:
        if not torch.is_tensor(x) or x.dim() != 3:
            return x
        if id(x) not in seen:
            seen[id(x)] = (x, x.transpose(0, 1))  # x kept: its id stays its own
        return seen[id(x)][1]

    return view


def _plain_hook(site: str, store: Captured, want_output: bool, layout=lambda x: x):
    def hook(_mod, args, output):
        store.inputs[site] = layout(args[0])
        if want_output:
            store.outputs[site] = layout(output)

    return hook


def target_site(t: Target) -> str:
    """The capture key of a target's input (distinct for the packed k/v rows)."""
    if t.rows is not None and t.name.endswith("[k]"):
        return f"{t.site}#key"
    if t.rows is not None and t.name.endswith("[v]"):
        return f"{t.site}#value"
    return t.site


@contextmanager
def capture(block: nn.Module, targets: list[Target], outputs: bool = True) -> Iterator[Captured]:
    """Register the hooks for ``targets`` on ``block``; yield the :class:`Captured` record
    that the next forward call of the block fills; always remove the hooks."""
    store = Captured()
    handles = []
    try:
        mha_sites: dict[str, bool] = {}
        for t in targets:
            if t.rows is not None or t.site.endswith("#context"):
                owner = t.site.split("#")[0]
                mha_sites[owner] = mha_sites.get(owner, False) or t.site.endswith("#context")
        for owner, want_ctx in mha_sites.items():
            mod = get_submodule(block, owner)
            handles.append(mod.register_forward_hook(_mha_hook(owner, store, want_ctx, outputs), with_kwargs=True))
        layout = _batch_first_views() if sequence_first(block) else (lambda x: x)
        for t in targets:
            if t.rows is None and not t.site.endswith("#context"):
                mod = get_submodule(block, t.site)
                hook = _plain_hook(t.site, store, outputs and t.kind == "linear", layout)
                handles.append(mod.register_forward_hook(hook))
        yield store
    finally:
        for h in handles:
            h.remove()

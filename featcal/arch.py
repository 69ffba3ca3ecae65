"""Architecture knowledge: where a model's blocks are, which parameters inside a
block FeatCal calibrates, and how to read and write them.

This is the only module that knows about concrete architectures. A calibrated
parameter set is a :class:`Target`: a Linear (``W``, ``b``), a row slice of a
packed attention input projection (``nn.MultiheadAttention.in_proj_weight``,
treated as a Linear over the attention input), or a LayerNorm affine
(``gamma``, ``beta``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

# Tried in order when ``blocks`` is not given.
KNOWN_BLOCK_PATHS = (
    "vision_model.encoder.layers",  # HF CLIPVisionModel (transformers 4.x), CLIPVisionModelWithProjection
    "encoder.layers",  # HF CLIPVisionModel (transformers 5.x, flat)
    "visual.transformer.resblocks",  # open_clip CLIP
    "transformer.resblocks",  # open_clip VisionTransformer
    "model.layers",  # Llama-family causal LMs
    "encoder.layer",  # HF BERT-style encoders (BertModel, RobertaModel, ...)
    "layers",
    "blocks",
)

LINEAR = "linear"
LAYERNORM = "layernorm"
PACKED_ROWS = ("q", "k", "v")


@dataclass(frozen=True)
class Target:
    """One calibrated parameter set inside a block.

    Attributes:
        name: its name inside the block (``self_attn.q_proj``, ``attn.in_proj[k]``, ``ln_1``).
        kind: ``linear`` or ``layernorm``.
        owner: path (inside the block) of the module holding the parameters.
        site: path of the module whose input is the target's input ``x``
            (``attn`` for the packed projection; ``attn#context`` for the output
            projection of an ``nn.MultiheadAttention``, whose input is the attention
            context before ``out_proj``).
        rows: ``(start, stop)`` rows of a packed weight, else ``None``.
        ln_eps: the LayerNorm epsilon (LayerNorm targets only).
    """

    name: str
    kind: str
    owner: str
    site: str
    rows: tuple[int, int] | None = None
    ln_eps: float = 0.0


def get_submodule(root: nn.Module, path: str) -> nn.Module:
    return root.get_submodule(path) if path else root


def resolve_blocks(model: nn.Module, blocks: str | None = None) -> tuple[str, nn.ModuleList]:
    """Return ``(dotted_path, ModuleList)`` of the model's blocks.

    ``blocks`` names the path explicitly; otherwise the known paths are tried.
    """
    if blocks is not None:
        try:
            found = model.get_submodule(blocks)
        except AttributeError as err:
            raise ValueError(f"blocks={blocks!r}: no such submodule in {type(model).__name__} ({err}).") from None
        if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) == 0:
            raise ValueError(f"blocks={blocks!r} is a {type(found).__name__}, not a non-empty nn.ModuleList.")
        return blocks, found
    for path in KNOWN_BLOCK_PATHS:
        try:
            found = model.get_submodule(path)
        except AttributeError:
            continue
        if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0:
            return path, found
    candidates = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    raise ValueError(
        f"featcal does not know where the blocks of {type(model).__name__} are; pass "
        f"blocks='dotted.path' naming the nn.ModuleList of blocks. Candidates: {candidates[:8]}"
    )


def _selected(name: str, only: tuple[str, ...] | None) -> bool:
    return only is None or name.endswith(only) or name in only


def block_targets(
    block: nn.Module, *, linear: bool = True, layernorm: bool = True, only: tuple[str, ...] | None = None
) -> list[Target]:
    """Every calibrated parameter set of one block, in module order."""
    out: list[Target] = []
    packed_outs: set[str] = set()
    for name, mod in block.named_modules():
        if name in packed_outs:
            continue
        if isinstance(mod, nn.MultiheadAttention):
            if mod.in_proj_weight is None:
                raise NotImplementedError(
                    f"{name}: nn.MultiheadAttention with separate q/k/v weights (kdim/vdim != embed_dim) "
                    "is not supported; featcal calibrates the packed in_proj_weight."
                )
            packed_outs.add(f"{name}.out_proj")
            if linear:
                d = mod.embed_dim
                for j, r in enumerate(PACKED_ROWS):
                    t = f"{name}.in_proj[{r}]"
                    if _selected(t, only):
                        out.append(Target(t, LINEAR, name, name, (j * d, (j + 1) * d)))
                if _selected(f"{name}.out_proj", only):
                    out.append(Target(f"{name}.out_proj", LINEAR, f"{name}.out_proj", f"{name}#context"))
        elif isinstance(mod, nn.Linear):
            if linear and _selected(name, only):
                out.append(Target(name, LINEAR, name, name))
        elif isinstance(mod, nn.LayerNorm):
            if layernorm and mod.elementwise_affine and _selected(name, only):
                if len(mod.normalized_shape) != 1:
                    raise NotImplementedError(f"{name}: LayerNorm over {mod.normalized_shape} (only 1-D is supported).")
                out.append(Target(name, LAYERNORM, name, name, ln_eps=float(mod.eps)))
    return out


def _weight_bias(block: nn.Module, t: Target) -> tuple[torch.Tensor, torch.Tensor | None]:
    mod = get_submodule(block, t.owner)
    if t.rows is not None:
        w, b = mod.in_proj_weight, mod.in_proj_bias
        lo, hi = t.rows
        return w[lo:hi], (None if b is None else b[lo:hi])
    return mod.weight, mod.bias


def get_params(block: nn.Module, t: Target) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(W, b)`` of a Linear target (``W`` is out x in) or ``(gamma, beta)`` of a LayerNorm;
    detached views of the live parameters."""
    w, b = _weight_bias(block, t)
    return w.detach(), (None if b is None else b.detach())


@torch.no_grad()
def set_params(block: nn.Module, t: Target, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Copy new values into the target's parameters (cast to their dtype and device)."""
    pw, pb = _weight_bias(block, t)
    pw.copy_(w.to(pw.dtype))
    if b is not None and pb is not None:
        pb.copy_(b.to(pb.dtype))


def block_parameter_names(blocks_path: str, index: int, targets: Iterable[Target]) -> list[str]:
    """Full parameter names touched by ``targets`` in block ``index`` (for reports)."""
    names = []
    for t in targets:
        stem = f"{blocks_path}.{index}.{t.owner}"
        names += [f"{stem}.in_proj_weight"] if t.rows else [f"{stem}.weight", f"{stem}.bias"]
    return names

"""Architecture knowledge: where a model's blocks are, which parameters inside a
block FeatCal calibrates, and how to read and write them.

This is the only module that knows about concrete architectures. A calibrated
parameter set is a :class:`Target`: a Linear (``W``, ``b``), a row slice of a
packed attention input projection (``nn.MultiheadAttention.in_proj_weight``,
treated as a Linear over the attention input), or a norm's affine: a LayerNorm's
(``gamma``, ``beta``) or an RMS norm's scale ``gamma`` (Llama's RMSNorm, T5's
LayerNorm: no mean, no bias).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

# Models of two stacks run in this order (encoder, then decoder); tried first when ``blocks``
# is not given. :func:`resolve_stacks` finds them; :func:`resolve_blocks` wants one named.
KNOWN_STACK_PATHS = (
    ("encoder.block", "decoder.block"),
)  # HF T5 / FLAN-T5 / mT5 (T5Model, ...ForConditionalGeneration)

# Tried in order when ``blocks`` is not given.
KNOWN_BLOCK_PATHS = (
    "vision_model.encoder.layers",  # HF CLIPVisionModel (transformers 4.x), CLIPVisionModelWithProjection
    "encoder.layers",  # HF CLIPVisionModel (transformers 5.x, flat)
    "visual.transformer.resblocks",  # open_clip CLIP
    "transformer.resblocks",  # open_clip VisionTransformer
    "model.layers",  # Llama-family causal LMs
    "encoder.block",  # HF T5EncoderModel
    "encoder.layer",  # HF BertModel, RobertaModel
    "bert.encoder.layer",  # HF Bert heads (BertForSequenceClassification, ...)
    "roberta.encoder.layer",  # HF RoBERTa heads
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
        ln_eps: the norm's epsilon (``layernorm`` targets only).
        centred: the norm subtracts the mean (a LayerNorm); False for an RMS norm
            (``z = x / sqrt(mean(x^2) + eps)``, a scale and no shift).
    """

    name: str
    kind: str
    owner: str
    site: str
    rows: tuple[int, int] | None = None
    ln_eps: float = 0.0
    centred: bool = True


@dataclass(frozen=True)
class BlockKind:
    """How a model's forward threads one stack of blocks, beyond the hidden state.

    Attributes:
        carries: ``(output index, argument name)`` pairs: output ``index`` of block l is
            passed to block l + 1 as the argument so named (T5's block 0 computes the
            relative position biases and every later block receives them).
        mask: the batch key of the padding mask of this stack's tokens (``(B, T)``).
        memory_mask: the batch key of the padding mask of the tokens that the blocks'
            cross-attention reads (an encoder's tokens, in a decoder), or None.
        memory_sites: the input sites (paths inside a block, see :class:`Target`) that read
            those tokens: the cross-attention's key and value projections.
    """

    carries: tuple[tuple[int, str], ...] = ()
    mask: str = "attention_mask"
    memory_mask: str | None = None
    memory_sites: tuple[str, ...] = ()


_T5_CARRIES = ((1, "position_bias"), (2, "encoder_decoder_position_bias"))


def _t5_kind(block: nn.Module) -> BlockKind:
    if getattr(block, "is_decoder", False):
        sites = tuple(f"layer.1.EncDecAttention.{p}" for p in ("k", "v"))
        return BlockKind(_T5_CARRIES, "decoder_attention_mask", "attention_mask", sites)
    return BlockKind(_T5_CARRIES)


# Block class name -> its BlockKind; a block class not named here gets the plain BlockKind()
# (hidden state in, hidden state first out, padding in ``attention_mask``). Add an entry for a
# model whose blocks pass extra outputs on or read another stack's tokens.
BLOCK_KINDS: dict[str, Callable[[nn.Module], BlockKind]] = {"T5Block": _t5_kind, "MT5Block": _t5_kind}


def block_kind(block: nn.Module) -> BlockKind:
    """The :class:`BlockKind` of a stack whose blocks are like ``block``."""
    make = BLOCK_KINDS.get(type(block).__name__)
    return BlockKind() if make is None else make(block)


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
    stacks = _known_stacks(model)
    if stacks is not None:
        raise ValueError(
            f"{type(model).__name__} has two stacks of blocks, {stacks[0]!r} and {stacks[1]!r}; "
            "pass blocks= naming one of them (calibrate() without blocks= does both, in forward order)."
        )
    for path in KNOWN_BLOCK_PATHS:
        found = _module_list(model, path)
        if found is not None:
            return path, found
    candidates = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    raise ValueError(
        f"featcal does not know where the blocks of {type(model).__name__} are; pass "
        f"blocks='dotted.path' naming the nn.ModuleList of blocks. Candidates: {candidates[:8]}"
    )


def _module_list(model: nn.Module, path: str) -> nn.ModuleList | None:
    try:
        found = model.get_submodule(path)
    except AttributeError:
        return None
    ok = isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found) > 0
    return found if ok else None


def _known_stacks(model: nn.Module) -> tuple[str, ...] | None:
    for paths in KNOWN_STACK_PATHS:
        if all(_module_list(model, p) is not None for p in paths):
            return paths
    return None


def resolve_stacks(model: nn.Module, blocks: str | None = None) -> list[tuple[str, nn.ModuleList]]:
    """Every stack of blocks to calibrate, in forward order: ``[(dotted_path, ModuleList)]``.

    An encoder-decoder (:data:`KNOWN_STACK_PATHS`) without ``blocks`` gives its encoder's
    and its decoder's; otherwise the one stack of :func:`resolve_blocks`.
    """
    stacks = None if blocks is not None else _known_stacks(model)
    if stacks is not None:
        return [(p, _module_list(model, p)) for p in stacks]
    return [resolve_blocks(model, blocks)]


STACK_SEP = "+"  # joins the paths of several stacks into one ``blocks_path`` (reports, previews)


def block_names(model: nn.Module, blocks: str | None = None) -> list[str]:
    """Every block's name, in forward order over every stack of :func:`resolve_stacks`: the
    module path of block ``i`` of stack ``path`` is ``f"{path}.{i}"`` (``encoder.block.3``, then
    ``decoder.block.0``). Position ``n`` in the list is block ``n`` as a report, a schedule and
    the diagnostics' tables number the blocks (a decoder's after the encoder's)."""
    return [f"{path}.{i}" for path, blks in resolve_stacks(model, blocks) for i in range(len(blks))]


def block_axis_names(model: nn.Module) -> list[str] | None:
    """The names a figure's block axis gives ``model``'s blocks: None where it has one stack (the
    blocks are numbered, 0 to L - 1), else :func:`block_names`, so that an encoder's blocks are told
    from a decoder's (``encoder.block.3``, ``decoder.block.0``)."""
    return block_names(model) if len(resolve_stacks(model)) > 1 else None


def all_blocks(model: nn.Module, blocks_path: str) -> list[nn.Module]:
    """The blocks of every stack named in ``blocks_path`` (paths joined by :data:`STACK_SEP`),
    one list in forward order: the block numbers of a report over several stacks."""
    return [blk for p in blocks_path.split(STACK_SEP) for blk in resolve_blocks(model, p)[1]]


# RMS norms ``gamma * x / sqrt(mean(x^2) + eps)`` by class name (besides torch's nn.RMSNorm);
# their scale is calibrated as a LayerNorm's gamma without the shift. Not every "RMSNorm" is
# one: Gemma's scales by (1 + weight), so it is not listed.
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "T5LayerNorm", "MT5LayerNorm")


def rms_norm_eps(mod: nn.Module) -> float | None:
    """The epsilon of an RMS norm with a scale (:data:`RMS_NORMS`, ``nn.RMSNorm``), else None."""
    if isinstance(mod, nn.RMSNorm):
        if mod.weight is None or len(mod.normalized_shape) != 1:
            return None
        return float(mod.eps) if mod.eps is not None else torch.finfo(mod.weight.dtype).eps
    if type(mod).__name__ not in RMS_NORMS or getattr(mod, "weight", None) is None:
        return None
    return float(getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6)))


def untouched_norms(block: nn.Module) -> list[str]:
    """Norm-like modules of ``block`` (a class name holding "Norm", with parameters) that
    featcal does not calibrate: reported, since their affine stays the merged one."""
    return [
        f"{name} ({type(mod).__name__})"
        for name, mod in block.named_modules()
        if "Norm" in type(mod).__name__
        and not isinstance(mod, nn.LayerNorm)
        and rms_norm_eps(mod) is None
        and any(True for _ in mod.parameters(recurse=False))
    ]


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
        elif layernorm and rms_norm_eps(mod) is not None and _selected(name, only):
            out.append(Target(name, LAYERNORM, name, name, ln_eps=rms_norm_eps(mod), centred=False))
    return out


def _weight_bias(block: nn.Module, t: Target) -> tuple[torch.Tensor, torch.Tensor | None]:
    mod = get_submodule(block, t.owner)
    if t.rows is not None:
        w, b = mod.in_proj_weight, mod.in_proj_bias
        lo, hi = t.rows
        return w[lo:hi], (None if b is None else b[lo:hi])
    return mod.weight, getattr(mod, "bias", None)  # RMS norms have no bias


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

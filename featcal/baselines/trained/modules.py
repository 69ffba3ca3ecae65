"""The task-specific modules that trained post-merging calibrators add, the maths of their
fixed bases, and how they sit inside a model's blocks.

- :class:`Bridge` (ESCal): ``h <- h + U_w A U_r^T h`` with fixed orthonormal bases
  ``U_r``, ``U_w`` (``d x r``) and a trained ``A`` (``r x r``, zero at the start).
- :class:`SurgeryAdapter` (Representation Surgery, SurgeryV2):
  ``z <- z - W_up ReLU(W_down z)``, ``W_down`` (``r x d``), ``W_up`` (``d x r``, zero at the start).
- :func:`error_bases`: ESCal's bases, the top singular vectors of merging errors (pure maths).
- :func:`escal_weights`: where the q/k/v and MLP output projections of a block are, per
  architecture (a small table over :mod:`featcal.model.arch`'s target names).
- :func:`insert`: a block that adds a module to its output, keeping the block's class, its
  parameter names and the blocks' path (so ``resolve_blocks``, the diagnostics and
  ``featcal.evaluate`` work on the result unchanged).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from featcal.model.arch import block_targets, get_params

ATTR = "featcal_calibrator"  # the attribute of a block that holds its added module

# Per architecture, the target names (featcal.model.arch) of a block's q/k/v input projections and its
# MLP output projection. The first row whose names all exist in the block is used.
ESCAL_TABLE = (
    # HF CLIP (CLIPEncoderLayer)
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "mlp.fc2"),
    # open_clip (ResidualAttentionBlock: packed nn.MultiheadAttention.in_proj_weight)
    (("attn.in_proj[q]", "attn.in_proj[k]", "attn.in_proj[v]"), "mlp.c_proj"),
    # Llama family (LlamaDecoderLayer, Mistral, Qwen2, ...)
    (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "mlp.down_proj"),
    # BERT / RoBERTa (BertLayer); "output.dense" is the MLP's, "attention.output.dense" the attention's
    (("attention.self.query", "attention.self.key", "attention.self.value"), "output.dense"),
)


# ----------------------------------------------------------------------------- maths


def top_right_singular(E: torch.Tensor, r: int) -> torch.Tensor:
    """The top-``r`` right singular vectors of ``E`` (``m x d``) as columns: ``(d, r)``."""
    _, _, Vh = torch.linalg.svd(E.double(), full_matrices=False)
    return Vh[:r].T.to(E.dtype)


def top_left_singular(E: torch.Tensor, r: int) -> torch.Tensor:
    """The top-``r`` left singular vectors of ``E`` (``d x n``) as columns: ``(d, r)``."""
    U, _, _ = torch.linalg.svd(E.double(), full_matrices=False)
    return U[:, :r].to(E.dtype)


def error_bases(
    qkv_expert: torch.Tensor, qkv_merged: torch.Tensor, out_expert: torch.Tensor, out_merged: torch.Tensor, r: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """ESCal's fixed bases at one block boundary: ``(U_r, U_w)``, each ``(d, r)``.

    ``U_r``: top-``r`` right singular vectors of the next block's stacked q/k/v merging error
    ``[W_q; W_k; W_v]_i - [W_q; W_k; W_v]_mer`` (``3d x d``): the input directions the next
    block reads most wrongly. ``U_w``: top-``r`` left singular vectors of this block's MLP output
    projection error ``W_out,i - W_out,mer`` (``d x hidden``): the output directions this block
    writes most wrongly."""
    return top_right_singular(qkv_expert - qkv_merged, r), top_left_singular(out_expert - out_merged, r)


def bridge_correction(h: torch.Tensor, U_r: torch.Tensor, A: torch.Tensor, U_w: torch.Tensor) -> torch.Tensor:
    """``U_w A U_r^T h`` for every row ``h`` of ``h`` (``(..., d)``)."""
    return (h @ U_r) @ A.T @ U_w.T  # (..., r) -> (..., r) -> (..., d)


def surgery_correction(z: torch.Tensor, W_down: torch.Tensor, W_up: torch.Tensor) -> torch.Tensor:
    """``W_up ReLU(W_down z)`` for every row ``z`` of ``z`` (``(..., d)``)."""
    return F.relu(z @ W_down.T) @ W_up.T  # (..., r) -> (..., d)


# ----------------------------------------------------------------------------- modules


class Bridge(nn.Module):
    """ESCal's bridge at a block boundary: ``h + U_w A U_r^T h``; ``A`` is the only trained tensor."""

    def __init__(self, U_r: torch.Tensor, U_w: torch.Tensor):
        super().__init__()
        self.register_buffer("U_r", U_r.detach().clone())  # (d, r)
        self.register_buffer("U_w", U_w.detach().clone())  # (d, r)
        self.A = nn.Parameter(torch.zeros(U_w.shape[1], U_r.shape[1], dtype=U_r.dtype, device=U_r.device))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + bridge_correction(h, self.U_r.to(h.dtype), self.A.to(h.dtype), self.U_w.to(h.dtype))


def linear_init(rows: int, d: int, generator: torch.Generator, dtype=torch.float32, device=None) -> nn.Parameter:
    """A ``(rows, d)`` weight drawn as ``nn.Linear`` draws its own (uniform in +-1/sqrt(d)), from a
    seeded ``generator`` in float64 then cast, so a seed gives the same module on any device."""
    bound = 1.0 / math.sqrt(d)
    w = (torch.rand(rows, d, generator=generator, dtype=torch.float64) * 2 - 1) * bound
    return nn.Parameter(w.to(dtype=dtype, device=device))


class SurgeryAdapter(nn.Module):
    """Surgery's module: ``z - W_up ReLU(W_down z)``; ``W_up`` starts at zero, ``W_down`` as an
    ``nn.Linear`` weight (uniform in +-1/sqrt(d)) from a seeded generator."""

    def __init__(self, d: int, r: int, generator: torch.Generator, dtype=torch.float32, device=None):
        super().__init__()
        self.W_down = linear_init(r, d, generator, dtype, device)  # (r, d)
        self.W_up = nn.Parameter(torch.zeros(d, r, dtype=dtype, device=device))  # (d, r)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z - surgery_correction(z, self.W_down.to(z.dtype), self.W_up.to(z.dtype))


def frozen(module: nn.Module) -> nn.Module:
    """The module with every parameter turned into a buffer of the same name (a trained module
    inside a model for inference adds no parameters, so the model keeps its parameter names)."""
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            delattr(mod, name)
            mod.register_buffer(name, p.detach().clone())
    return module


# ----------------------------------------------------------------------------- architectures


def escal_weights(
    block: nn.Module, qkv: tuple[str, ...] | None = None, mlp_out: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_qkv, W_out)`` of one block: the stacked q/k/v input projections (``(rows, d)``, rows
    ``3d`` without grouped-query attention) and the MLP output projection (``(d, hidden)``).
    ``qkv`` and ``mlp_out`` name the targets (see :func:`featcal.model.arch.block_targets`); by default
    they are looked up in :data:`ESCAL_TABLE`."""
    targets = {t.name: t for t in block_targets(block, layernorm=False)}
    if qkv is None or mlp_out is None:
        row = next((row for row in ESCAL_TABLE if all(n in targets for n in (*row[0], row[1]))), None)
        if row is None:
            raise ValueError(
                f"ESCal does not know the q/k/v and MLP output projections of {type(block).__name__}; "
                f"pass qkv=(names...) and mlp_out=name from the block's Linears: {sorted(targets)[:12]}"
            )
        qkv, mlp_out = qkv or row[0], mlp_out or row[1]
    missing = [n for n in (*qkv, mlp_out) if n not in targets]
    if missing:
        raise ValueError(f"{type(block).__name__} has no Linear {missing}; its Linears: {sorted(targets)[:12]}")
    W_qkv = torch.cat([get_params(block, targets[n])[0] for n in qkv])  # (rows, d)
    return W_qkv, get_params(block, targets[mlp_out])[0]


# ----------------------------------------------------------------------------- insertion


class _Calibrated:
    """Mixed into a block's own class: the block's output (its first output when it returns a
    tuple) goes through the block's added module."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        add = getattr(self, ATTR)
        if isinstance(out, (tuple, list)):
            return type(out)([add(out[0]), *out[1:]])
        return add(out)


_CLASSES: dict[type, type] = {}


def insert(block: nn.Module, module: nn.Module) -> None:
    """Make ``block`` (in place; call it on a copy) add ``module`` to its output. The block keeps
    its class (a subclass of it), its parameters and their names; ``module`` becomes its
    ``featcal_calibrator`` child."""
    cls = type(block)
    if not issubclass(cls, _Calibrated):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Calibrated{cls.__name__}", (_Calibrated, cls), {"__module__": __name__})
        block.__class__ = _CLASSES[cls]
    block.add_module(ATTR, module)

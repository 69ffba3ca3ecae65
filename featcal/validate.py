"""Checks of ``calibrate``'s inputs; each error names the problem and the fix."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

SMALL = 1 << 16  # parameters with fewer elements are checked for NaN/Inf together


def _params(model: nn.Module, role: str) -> dict[str, torch.Tensor]:
    """``{name: parameter}`` (detached), after checking there are some and all are float."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    if not params:
        raise ValueError(f"{role} has no parameters.")
    bad = next((n for n, p in params.items() if not torch.is_floating_point(p)), None)
    if bad is not None:
        raise TypeError(
            f"{role}: parameter {bad!r} is not floating point ({params[bad].dtype}); "
            "FeatCal calibrates float models (quantised models must be dequantised first)."
        )
    return params


def _same_params(ref: dict, oth: dict, role: str) -> None:
    for name, p in ref.items():
        if name not in oth:
            raise ValueError(
                f"{role} has no parameter {name!r} that the merged model has; base and experts "
                "must share the merged model's architecture."
            )
        if oth[name].shape != p.shape:
            raise ValueError(
                f"{role}: parameter {name!r} has shape {tuple(oth[name].shape)}, the merged model "
                f"{tuple(p.shape)}; base and experts must share the merged model's architecture."
            )
    extra = next((n for n in oth if n not in ref), None)
    if extra is not None:
        raise ValueError(f"{role} has a parameter {extra!r} that the merged model lacks.")


def check_same_params(reference: nn.Module, other: nn.Module, role: str) -> None:
    """``other`` must have the merged model's parameter names and shapes."""
    _same_params(dict(reference.named_parameters()), dict(other.named_parameters()), role)


def _nonfinite(name: str, role: str, blocks_path: str) -> FloatingPointError:
    where = ""
    if name.startswith(blocks_path + "."):
        idx, _, rest = name[len(blocks_path) + 1 :].partition(".")
        where = f" (block {idx}, module {rest.rsplit('.', 1)[0]})"
    return FloatingPointError(f"{role}: parameter {name!r}{where} holds NaN or Inf values.")


def _finite_params(params: dict[str, torch.Tensor], role: str, blocks_path: str) -> None:
    """Small parameters in one fused check per device and dtype (one check each costs more
    than its arithmetic), large ones one by one (no copy)."""
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, p in params.items():
        if p.numel() == 0:
            continue
        if p.numel() < SMALL:
            groups.setdefault((p.device, p.dtype), []).append((name, p))
            continue
        # A NaN or Inf makes the sum NaN or Inf: one streaming pass (cheaper than aminmax, and
        # much cheaper than isfinite().all()); a non-finite sum of finite values (overflow) is
        # told apart by the exact check.
        total = p.sum(dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
        if not bool(torch.isfinite(total)) and not bool(torch.isfinite(p).all()):
            raise _nonfinite(name, role, blocks_path)
    for group in groups.values():
        if not bool(torch.isfinite(torch.cat([p.reshape(-1) for _, p in group])).all()):
            bad = next(n for n, p in group if not bool(torch.isfinite(p).all()))
            raise _nonfinite(bad, role, blocks_path)


def check_models(merged: nn.Module, others: list[tuple[str, nn.Module]], blocks_path_of) -> str:
    """Every check of the models in one pass over each one's parameters: float, the merged
    model's names and shapes, no NaN/Inf. ``blocks_path_of(merged)`` resolves the blocks
    (after the float checks, before the finiteness ones, which name the block); returned."""
    ref = _params(merged, "the merged model")
    named = [(role, _params(m, role)) for role, m in others]
    for role, params in named:
        _same_params(ref, params, role)
    path = blocks_path_of(merged)
    for role, params in [("the merged model", ref), *named]:
        _finite_params(params, role, path)
    return path


def check_tasks(experts: Mapping, data: Mapping, name: str = "calib_data") -> list[str]:
    """The tasks, once ``experts`` and ``data`` (``{task: [batch, ...]}``, called ``name`` in
    the messages) are checked to pair up: the same tasks, each with a non-empty list of batches."""
    if not experts:
        raise ValueError("experts is empty; give at least one {task: expert model}.")
    te, td = list(experts), list(data)
    if set(te) != set(td):
        only_e = sorted(set(te) - set(td))
        only_d = sorted(set(td) - set(te))
        raise ValueError(
            f"the tasks of experts and {name} differ: "
            f"only in experts {only_e}, only in {name} {only_d}; give one list of batches per expert."
        )
    for t in te:
        batches = data[t]
        if isinstance(batches, (torch.Tensor, Mapping)):
            raise TypeError(
                f"{name}[{t!r}] must be a list of batches, got a single {type(batches).__name__}; "
                "wrap it in a list or split it into batches."
            )
        if len(batches) == 0 or all(batch_len(b) == 0 for b in batches):
            raise ValueError(f"task {t!r} has no examples in {name}; give at least one non-empty batch.")
    return te


def batch_len(batch) -> int:
    """Examples in a batch: a tensor's first axis (1 for a scalar), or a dict batch's first tensor's."""
    if torch.is_tensor(batch):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        for v in batch.values():
            if torch.is_tensor(v):
                return v.shape[0] if v.dim() else 1
        raise ValueError(f"a dict batch must hold at least one tensor; got keys {sorted(map(str, batch))}.")
    raise TypeError(
        f"a batch is a tensor (model(batch)) or a dict of tensors (model(**batch)), got {type(batch).__name__}."
    )

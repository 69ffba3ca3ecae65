"""Checks of ``calibrate``'s inputs; each error names the problem and the fix."""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn


def check_model_float(model: nn.Module, role: str) -> None:
    params = list(model.parameters())
    if not params:
        raise ValueError(f"{role} has no parameters.")
    bad = next((n for n, p in model.named_parameters() if not torch.is_floating_point(p)), None)
    if bad is not None:
        raise TypeError(
            f"{role}: parameter {bad!r} is not floating point ({dict(model.named_parameters())[bad].dtype}); "
            "FeatCal calibrates float models (quantised models must be dequantised first)."
        )


def check_same_params(reference: nn.Module, other: nn.Module, role: str) -> None:
    """``other`` must have the merged model's parameter names and shapes."""
    ref = dict(reference.named_parameters())
    oth = dict(other.named_parameters())
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


def check_finite_params(model: nn.Module, role: str, blocks_path: str) -> None:
    for name, p in model.named_parameters():
        if p.numel() == 0:
            continue
        lo, hi = torch.aminmax(p.detach().reshape(-1))  # NaN propagates; faster than isfinite().all()
        if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
            where = ""
            if name.startswith(blocks_path + "."):
                idx, _, rest = name[len(blocks_path) + 1:].partition(".")
                where = f" (block {idx}, module {rest.rsplit('.', 1)[0]})"
            raise FloatingPointError(f"{role}: parameter {name!r}{where} holds NaN or Inf values.")


def check_tasks(experts: Mapping, calib_data: Mapping) -> list[str]:
    if not experts:
        raise ValueError("experts is empty; give at least one {task: expert model}.")
    te, td = list(experts), list(calib_data)
    if set(te) != set(td):
        only_e = sorted(set(te) - set(td))
        only_d = sorted(set(td) - set(te))
        raise ValueError(
            "the tasks of experts and calib_data differ: "
            f"only in experts {only_e}, only in calib_data {only_d}; give one calibration set per expert."
        )
    for t in te:
        batches = calib_data[t]
        if isinstance(batches, (torch.Tensor, Mapping)):
            raise TypeError(f"calib_data[{t!r}] must be a list of batches, got a single {type(batches).__name__}; "
                            "wrap it in a list or split it into batches.")
        if len(batches) == 0 or all(_batch_len(b) == 0 for b in batches):
            raise ValueError(f"task {t!r} has no calibration examples; give at least one batch.")
    return te


def _batch_len(batch) -> int:
    if torch.is_tensor(batch):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        for v in batch.values():
            if torch.is_tensor(v):
                return v.shape[0] if v.dim() else 1
    return 1

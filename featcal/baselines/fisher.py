"""Fisher merging (Matena & Raffel, NeurIPS 2022) with FusionBench's conventions.

Each expert's diagonal Fisher information on its own task's unlabeled calibration inputs,
in batches of ``batch`` (32) up to ``n_examples`` (256) examples:

    F_i = (1 / n) sum_batches ( d/dtheta sum_b sum_c sqrt(p_bc) log p_bc )^2

with ``p`` the expert's own softmax (the square root detached: squared, it weights each class
by its probability, the expected Fisher under the model's predictive distribution). With
``normalize`` (the default), expert i's coefficient is
``c_i = s_i / (||F_i|| + 1e-6) / sum_j 1 / (||F_j|| + 1e-6)`` (``||F_i||``: the L2 norm over all
its merged parameters; ``s_i`` = 1/T unless ``scaling`` is given), and per parameter

    theta = sum_i c_i (F_i + 1e-6) theta_i / sum_i c_i (F_i + 1e-6)

(``minimal`` = 1e-6 keeps a zero Fisher entry defined). Parameters are merged this way;
buffers are the experts' mean (integer ones the base's). The log-likelihood needs a
classification head per task, ``logits(model, task, batch)``; a model without one (an LLM) is
refused (FusionBench's GPT-2 variant reads a sequence-classification head too).
"""

from __future__ import annotations

import copy
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from featcal.baselines.examples import ExamplePool
from featcal.model.modes import eval_mode
from featcal.util.progress import bar

MINIMAL = 1e-6
Logits = Callable[[nn.Module, str, object], torch.Tensor]


def fisher_weighted_average(
    params: Mapping[str, Sequence[torch.Tensor]],
    fishers: Sequence[Mapping[str, torch.Tensor]],
    scaling: Sequence[float] | None = None,
    normalize: bool = True,
    minimal: float = MINIMAL,
) -> dict[str, torch.Tensor]:
    """``{name: merged}`` from ``params[name]`` (one tensor per expert) and each expert's
    diagonal Fisher ``fishers[i][name]`` (module docstring)."""
    T = len(fishers)
    device = next(iter(params.values()))[0].device  # the experts' weights' device (a GPU's too)
    s = (
        torch.full((T,), 1.0 / T, dtype=torch.float64, device=device)
        if scaling is None
        else torch.tensor(scaling, dtype=torch.float64, device=device)
    )
    if s.shape != (T,):
        raise ValueError(f"scaling must give one number per expert ({T}), got {list(scaling)}.")
    if normalize:
        norms = torch.stack(
            [torch.linalg.vector_norm(torch.stack([f[n].double().norm() for n in params])) for f in fishers]
        )  # (T,): the L2 norm over all merged parameters
        inv = 1.0 / (norms + minimal)
        s = s * inv / inv.sum()
    out = {}
    for name, values in params.items():
        theta = torch.stack([v.double() for v in values])  # (T, *shape)
        F = torch.stack([f[name].double() for f in fishers]) + minimal
        c = s.reshape(-1, *[1] * (theta.dim() - 1))
        out[name] = ((c * F * theta).sum(0) / (c * F).sum(0)).to(values[0].dtype)
    return out


def diagonal_fisher(
    model: nn.Module, task: str, batches: list, logits: Logits, batch: int = 32, n_examples: int = 256
) -> dict[str, torch.Tensor]:
    """``{name: F}`` for every parameter of ``model`` on up to ``n_examples`` of ``batches``."""
    model = copy.deepcopy(model).requires_grad_(True)
    params = dict(model.named_parameters())
    acc = {n: torch.zeros_like(p) for n, p in params.items()}
    seen = 0
    with eval_mode(model), torch.enable_grad():
        for xb in ExamplePool(batches).in_order(batch):
            if seen >= n_examples:
                break
            out = logits(model, task, xb)  # (B, C)
            p = torch.softmax(out, dim=-1).detach()
            expectation = (p.sqrt() * torch.log_softmax(out, dim=-1)).sum()
            model.zero_grad(set_to_none=True)
            expectation.backward()
            for n, q in params.items():
                if q.grad is not None:
                    acc[n] += q.grad.detach() ** 2
            seen += out.shape[0]
    return {n: a / max(seen, 1) for n, a in acc.items()}


def fisher_merging(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    logits: Logits | None = None,
    batch: int = 32,
    n_examples: int = 256,
    normalize: bool = True,
    minimal: float = MINIMAL,
    scaling: Sequence[float] | None = None,
    progress: bool = True,
) -> nn.Module:
    """A new model: the experts' parameters merged by their Fisher weights (module docstring)."""
    if logits is None:
        raise ValueError(
            "fisher_merging needs each task's class logits: logits=fn(model, task, batch) -> (batch, classes) "
            "(a zoo's heads give them; featcal compare passes them). A model without a classification head "
            "(an LLM) is not supported."
        )
    missing = [t for t in experts if not calib_data.get(t)]
    if not experts or missing:
        raise ValueError(f"fisher_merging needs one expert and calibration batches per task; missing {missing}.")
    tasks = list(experts)
    fishers = [
        diagonal_fisher(experts[t], t, calib_data[t], logits, batch, n_examples)
        for t in bar(tasks, desc="fisher", unit="task", show=progress)
    ]
    names = [n for n, _ in base.named_parameters()]
    params = {n: [dict(experts[t].named_parameters())[n].detach() for t in tasks] for n in names}
    merged = fisher_weighted_average(params, fishers, scaling, normalize, minimal)
    model = copy.deepcopy(base)
    with torch.no_grad():
        sd = model.state_dict()
        for key, v in sd.items():  # buffers: the experts' mean (integers: the base's)
            if key not in merged and v.is_floating_point():
                sd[key] = torch.stack([e.state_dict()[key].to(v.dtype) for e in experts.values()]).mean(0)
        sd.update(merged)
        model.load_state_dict(sd)
    return model.eval()

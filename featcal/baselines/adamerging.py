"""AdaMerging (Yang et al., ICLR 2024): merging coefficients learned at test time by entropy
minimisation on unlabeled inputs, task-wise or layer-wise, with FusionBench's conventions.

With ``theta_0`` the base's parameters and ``tau_i = theta_i - theta_0`` each expert's task
vector, the merged parameters are

    task-wise:  theta = theta_0 + sum_i lambda_i tau_i          (one lambda per task)
    layer-wise: theta^p = theta_0^p + sum_i lambda_i^p tau_i^p   (one per task and parameter tensor)

``lambda`` starts at 0.3 everywhere (Task Arithmetic at 0.3) and is trained with Adam (lr 1e-3)
for 1000 steps; each step adds, for every task, the gradient of the mean Shannon entropy of the
merged model's predictions on a minibatch of 16 of that task's unlabeled inputs
(``H = -sum_c p_c log(p_c + 1e-8)``), then takes one step. No clamping by default
(``clamp_weights``: lambda clamped to [0, 1] where used). FusionBench's "layer" is one parameter
tensor of the model (every entry of ``named_parameters``); buffers stay the base's.

Predictions need a classification head per task: ``logits(model, task, batch)`` returns the
``(B, classes)`` logits of ``model`` on ``batch`` (a zoo gives it: the task's frozen head on its
features). A model without one (an LLM's next-token distribution) is refused: FusionBench's
Llama variant is another method: it learns layer-wise coefficients on the next-token
cross-entropy of labelled instruction data, not on an entropy; featcal does not implement it.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn
from torch.func import functional_call

from featcal.baselines.examples import ExamplePool
from featcal.model.modes import eval_mode
from featcal.util.progress import bar

GRANULARITY = ("task", "layer")
Logits = Callable[[nn.Module, str, object], torch.Tensor]


def entropy(logits: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """The mean over rows of the Shannon entropy of ``softmax(logits)`` (``(B, C)``)."""
    if logits.dim() != 2:
        raise ValueError(f"entropy expects (batch, classes) logits, got shape {tuple(logits.shape)}.")
    p = torch.softmax(logits, dim=-1)
    return -(p * torch.log(p + eps)).sum(-1).mean()


def merged_parameters(
    theta_0: Mapping[str, torch.Tensor], taus: Mapping[str, torch.Tensor], lam: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``theta_0 + sum_i lambda_i tau_i`` per parameter; ``taus[name]`` is ``(T, *shape)``,
    ``lam`` is ``(T,)`` (task-wise) or ``(T, P)`` (layer-wise, one column per parameter in order)."""
    out = {}
    for p, (name, t0) in enumerate(theta_0.items()):
        w = lam if lam.dim() == 1 else lam[:, p]  # (T,)
        out[name] = t0 + torch.tensordot(w.to(t0.dtype), taus[name], dims=1)
    return out


@dataclass
class AdaMergingRun:
    """The learned coefficients (``(T,)`` or ``(T, P)``), the parameter names (P), the tasks (T)
    and the summed entropy over tasks before each step."""

    weights: torch.Tensor
    names: list[str]
    tasks: list[str]
    losses: list[float]


class _Head(nn.Module):
    """``forward(task, batch)`` = ``logits(inner, task, batch)``: so that ``functional_call``
    can swap the inner model's parameters."""

    def __init__(self, inner: nn.Module, logits: Logits):
        super().__init__()
        self.inner, self.logits = inner, logits

    def forward(self, task, batch):
        return self.logits(self.inner, task, batch)


def learn_coefficients(
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    logits: Logits,
    *,
    granularity: str = "layer",
    init: float = 0.3,
    lr: float = 1e-3,
    steps: int = 1000,
    batch: int = 16,
    clamp_weights: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> AdaMergingRun:
    """Learn AdaMerging's coefficients (module docstring); nothing passed in is changed."""
    _check(experts, calib_data, logits, granularity, steps, lr, batch)
    tasks = list(experts)
    theta_0 = {n: p.detach() for n, p in base.named_parameters()}
    expert_params = {t: dict(m.named_parameters()) for t, m in experts.items()}
    taus = {n: torch.stack([expert_params[t][n].detach() - t0 for t in tasks]) for n, t0 in theta_0.items()}
    shape = (len(tasks),) if granularity == "task" else (len(tasks), len(theta_0))
    device = next(iter(theta_0.values())).device  # the coefficients live beside the weights they mix
    lam = torch.full(shape, float(init), dtype=torch.float32, device=device, requires_grad=True)
    opt = torch.optim.Adam([lam], lr=lr)
    head = _Head(copy.deepcopy(base).requires_grad_(False), logits)
    gen = torch.Generator().manual_seed(seed)
    draws = {t: ExamplePool(calib_data[t]).minibatches(batch, gen) for t in tasks}
    losses = []
    with eval_mode(head), torch.enable_grad():
        for _ in bar(range(steps), desc=f"adamerging ({granularity}-wise)", unit="step", show=progress):
            w = lam.clamp(0, 1) if clamp_weights else lam
            params = {f"inner.{n}": v for n, v in merged_parameters(theta_0, taus, w).items()}
            total = 0.0
            for t in tasks:  # the gradients of every task's entropy add up before one step
                loss = entropy(functional_call(head, params, (t, next(draws[t])), strict=False))
                loss.backward(retain_graph=True)
                total += float(loss.detach())
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
            if not math.isfinite(total):
                raise FloatingPointError(f"adamerging: the entropy became {total}; lower lr (now {lr:g}).")
    weights = (lam.clamp(0, 1) if clamp_weights else lam).detach()
    return AdaMergingRun(weights, list(theta_0), tasks, losses)


def adamerging(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    logits: Logits | None = None,
    granularity: str = "layer",
    init: float = 0.3,
    lr: float = 1e-3,
    steps: int = 1000,
    batch: int = 16,
    clamp_weights: bool = False,
    seed: int = 0,
    progress: bool = True,
) -> nn.Module:
    """A new model merged with AdaMerging's learned coefficients (module docstring).
    ``granularity``: ``layer`` (FusionBench's CLIP default) or ``task``."""
    run = learn_coefficients(
        base,
        experts,
        calib_data,
        logits,
        granularity=granularity,
        init=init,
        lr=lr,
        steps=steps,
        batch=batch,
        clamp_weights=clamp_weights,
        seed=seed,
        progress=progress,
    )
    return model_from_coefficients(base, experts, run.weights)


@torch.no_grad()
def model_from_coefficients(base: nn.Module, experts: Mapping[str, nn.Module], weights: torch.Tensor) -> nn.Module:
    """A copy of ``base`` with ``theta_0 + sum_i lambda_i tau_i`` in its parameters."""
    model = copy.deepcopy(base)
    theta_0 = {n: p.detach() for n, p in base.named_parameters()}
    taus = {
        n: torch.stack([dict(m.named_parameters())[n].detach() - t0 for m in experts.values()])
        for n, t0 in theta_0.items()
    }
    new = merged_parameters(theta_0, taus, weights)
    for n, p in model.named_parameters():
        p.copy_(new[n])
    return model.eval()


def _check(experts, calib_data, logits, granularity, steps, lr, batch) -> None:
    if logits is None:
        raise ValueError(
            "adamerging needs each task's class logits: logits=fn(model, task, batch) -> (batch, classes) "
            "(a zoo's heads give them; featcal compare passes them). A model without a classification head "
            "(an LLM) is not supported: FusionBench's Llama variant trains on labelled next-token cross-entropy "
            "instead, which featcal does not implement."
        )
    if granularity not in GRANULARITY:
        raise ValueError(f"adamerging: granularity={granularity!r}; choose one of {GRANULARITY}.")
    if not experts:
        raise ValueError("adamerging needs at least one expert; got none.")
    missing = [t for t in experts if not calib_data.get(t)]
    if missing:
        raise ValueError(f"calib_data has no batches for task(s) {missing}; give one entry per expert.")
    if steps < 1 or batch < 1 or not lr > 0:
        raise ValueError(f"adamerging: steps and batch must be >= 1 and lr > 0; got {steps}, {batch}, {lr}.")

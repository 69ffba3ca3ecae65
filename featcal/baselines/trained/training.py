"""Training the task-specific modules of a post-merging calibrator (see :mod:`featcal.baselines.trained.calibrators`).

ESCal's; Surgery and SurgeryV2 train in :mod:`featcal.baselines.trained.surgery`. For one
task, :func:`train_task`:

1. catches the merged model's block-0 inputs on the task's calibration batches, and runs expert
   i once over the same batches to keep its block outputs at every boundary that gets a module
   (the targets; no gradient);
2. runs the merged model, without gradient, through the first block with a module (nothing up
   to its output changes during training; Surgery's whole model);
3. trains the modules with Adam: each step passes that output through its module and runs the
   blocks after it up to the last module, each block's output through its module; the loss is
   the weighted sum over those boundaries of the distance (MSE or L1) to expert i's block
   outputs. The merged model's weights stay frozen. A loss that stops being finite is an error.

Minibatches of ``batch`` examples are drawn (seeded, without replacement within an epoch) from
all the task's examples when its batches can run as one call (tensor batches of one shape, no
padding mask, no tensors among the blocks' other arguments); otherwise each step takes one of the
given batches, in a seeded order.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from featcal.model.arch import resolve_blocks
from featcal.model.modes import eval_mode
from featcal.model.streams import BlockCall, catch_block_inputs, device_of, pool_spans, pooled, run_block
from featcal.util.options import option
from featcal.util.progress import bar

TOKENS = ("all", "cls")
LOSSES = {"mse": F.mse_loss, "l1": F.l1_loss}


@dataclass(frozen=True)
class TrainOptions:
    """What every trained calibrator (ESCal, Surgery, SurgeryV2) trains with, declared once:
    modules of ``rank``, Adam at ``lr``, minibatches of ``batch`` examples drawn with ``seed``, on
    ``device``, with a ``progress`` bar. Each method's options (:class:`~featcal.baselines.trained.
    calibrators.ESCalOptions`, :class:`~featcal.baselines.trained.surgery.SurgeryOptions`) add its
    own fields, its training length among them (:attr:`length`), and set its authors' defaults.
    The registry reads these fields (help, default, range, choices) for ``--param``, help and the app."""

    LENGTH = "steps"  # the name of the method's field holding the training length (a subclass's)

    rank: int = option(16, "rank r of each module")
    lr: float = option(1e-3, "Adam's learning rate")
    batch: int = option(16, "examples per minibatch")
    seed: int = option(0, "seed of the modules' start and of the minibatch order")
    blocks: str | None = option(None, "dotted path of the blocks, for architectures featcal does not know")
    device: str | torch.device | None = option(None, "where the modules train (default: the merged model's device)")
    progress: bool = option(True, "a progress bar per task")

    @property
    def length(self) -> int:
        """How long each task trains (ESCal: epochs over its examples; Surgery, SurgeryV2: steps)."""
        return getattr(self, self.LENGTH)

    def __post_init__(self):
        self.check(type(self).__name__)

    def check(self, owner: str) -> None:
        """``ValueError`` (naming ``owner``) unless every field declared with ``choices`` holds one of
        them, and rank, the length and batch are >= 1 and lr > 0: what each method's options check
        when made."""
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices is not None and getattr(self, f.name) not in choices:
                raise ValueError(f"{owner}: {f.name}={getattr(self, f.name)!r}; choose one of {choices}.")
        if self.rank < 1 or self.length < 1 or self.batch < 1 or not self.lr > 0:
            raise ValueError(
                f"{owner}: rank, {self.LENGTH} and batch must be >= 1 and lr > 0; "
                f"got {self.rank}, {self.length}, {self.batch}, {self.lr}."
            )

    def settings(self) -> dict:
        """The training's part of a :class:`~featcal.baselines.trained.calibrators.TaskCalibrated`'s
        ``settings``, the length under its method's name for it (``epochs`` or ``steps``)."""
        return {"rank": self.rank, self.LENGTH: self.length, "lr": self.lr, "batch": self.batch, "seed": self.seed}

    def training_copy(self, merged: nn.Module) -> nn.Module:
        """The model the modules train in: a copy of ``merged`` on :attr:`device`, frozen, in eval
        mode (the merged model given is never changed)."""
        model = copy.deepcopy(merged).to(self.device if self.device is not None else device_of(merged)).eval()
        return model.requires_grad_(False)


@dataclass
class Schedule:
    """How the modules are trained: ``epochs`` passes over the task's examples with Adam at
    ``lr``, minibatches of ``batch`` examples (when the batches cannot be pooled, each step is one
    given batch, so a pass is one step per given batch), ``seed`` for the minibatch order,
    ``loss`` (``mse`` or ``l1``) on the ``tokens`` (``all``: every non-padding token; ``cls``: the
    first one), boundaries weighted by
    ``weights`` (``{block: w}``; every module's boundary, normalised to sum 1)."""

    epochs: int
    lr: float
    batch: int
    seed: int
    loss: str
    tokens: str
    weights: dict[int, float]


@dataclass
class TaskRun:
    """One task's training: the loss at every step and the seconds it took (targets included)."""

    losses: list[float]
    seconds: float

    @property
    def steps(self) -> int:
        return len(self.losses)


def block_weights(weights, blocks: list[int]) -> dict[int, float]:
    """``{block: w}`` normalised to sum 1: uniform when ``weights`` is None, else one
    non-negative weight per boundary that gets a module (in block order)."""
    if weights is None:
        weights = [1.0] * len(blocks)
    weights = [float(w) for w in weights]
    if len(weights) != len(blocks) or any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"block_weights must be {len(blocks)} non-negative numbers (one per block with a module, "
            f"blocks {blocks}) with a positive sum; got {weights}."
        )
    total = sum(weights)
    return {l: w / total for l, w in zip(blocks, weights)}


def distance(h: torch.Tensor, target: torch.Tensor, kind: str, tokens: str, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean ``kind`` distance between ``h`` and ``target`` (``(B, T, d)`` or ``(B, d)``) over the
    chosen tokens' entries; padding tokens (``mask == 0``) are left out."""
    if tokens == "cls" and h.dim() == 3:
        h, target, mask = h[:, 0], target[:, 0], None
    if mask is not None and h.dim() == 3:
        keep = mask.to(h.device).bool()  # (B, T)
        h, target = h[keep], target[keep]  # (rows, d)
    return LOSSES[kind](h.float(), target.float())


@torch.no_grad()
def expert_targets(expert: nn.Module, path: str, batches: list, at: set[int], device) -> dict[int, list]:
    """``{block: [expert i's output of that block, per batch]}`` for the blocks in ``at``
    (``path``: the blocks' path); an expert on another device runs as a copy on ``device``."""
    if device_of(expert) != torch.device(device):
        expert = copy.deepcopy(expert).to(device)
    _, eblks = resolve_blocks(expert, path)
    out: dict[int, list] = {l: [] for l in at}
    with eval_mode(expert):
        for b in batches:
            call = catch_block_inputs(expert, eblks[0], b)
            h = call.hidden
            for l, blk in enumerate(eblks[: max(at) + 1]):
                h = run_block(blk, call.with_hidden(h))
                if l in at:
                    out[l].append(h)
    return out


def _minibatches(n_rows: int, n_calls: int, pooled_call: bool, batch: int, gen: torch.Generator):
    """Endless seeded minibatches: ``(call index, rows or None)``."""
    while True:
        if pooled_call:
            for idx in torch.randperm(n_rows, generator=gen).split(batch):
                yield 0, idx
        else:
            for j in torch.randperm(n_calls, generator=gen).tolist():
                yield j, None


def train_task(
    model: nn.Module,
    path: str,
    expert: nn.Module,
    batches: list,
    modules: dict[int, nn.Module],
    sched: Schedule,
    desc: str,
    progress: bool,
) -> TaskRun:
    """Train ``modules`` (``{block: module}``, on the model's device) in place (steps 1-3 above)."""
    start = time.perf_counter()
    device = device_of(model)
    _, blks = resolve_blocks(model, path)
    first, last = min(modules), max(modules)
    # 1. The merged model's block-0 calls and expert i's targets.
    with torch.no_grad():
        calls = [catch_block_inputs(model, blks[0], b) for b in batches]
    targets = expert_targets(expert, path, batches, set(modules), device)
    # One call can be drawn from by rows when it could be pooled with a copy of itself (no padding
    # mask, no tensors among its other arguments): then minibatches of ``batch`` rows, as for many.
    spans = pool_spans(calls if len(calls) > 1 else calls * 2, max_rows=1 << 62)
    if spans is not None and len(calls) > 1:
        calls = [pooled(calls)]
        targets = {l: [torch.cat(ts)] for l, ts in targets.items()}
    # 2. The frozen prefix: the merged stream through the first block with a module.
    with torch.no_grad():
        for blk in blks[: first + 1]:
            calls = [c.with_hidden(run_block(blk, c)) for c in calls]
    # 3. Adam on the modules' parameters, for ``epochs`` passes over the examples however they are batched.
    per_pass = -(-calls[0].hidden.shape[0] // sched.batch) if spans is not None else len(calls)
    steps = sched.epochs * per_pass
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=sched.lr)
    gen = torch.Generator().manual_seed(sched.seed)
    draws = _minibatches(calls[0].hidden.shape[0], len(calls), spans is not None, sched.batch, gen)
    losses = []
    for step in bar(range(steps), desc=desc, unit="step", show=progress):
        j, rows = next(draws)
        rows = None if rows is None else rows.to(device)
        call = calls[j] if rows is None else call_rows(calls[j], rows)
        loss = _loss(blks, modules, call, {l: ts[j] for l, ts in targets.items()}, rows, first, last, sched)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(
                f"{desc}: the loss became {losses[-1]} at step {step}; lower lr (now {sched.lr:g})."
            )
    return TaskRun(losses, time.perf_counter() - start)


def call_rows(call: BlockCall, rows: torch.Tensor) -> BlockCall:
    """The examples ``rows`` of a pooled call (whose other arguments hold no tensors)."""
    return call.with_hidden(call.hidden[rows])


def _loss(blks, modules, call: BlockCall, targets: dict, rows, first: int, last: int, sched: Schedule) -> torch.Tensor:
    """The weighted distance to the expert over the boundaries with a module, for one minibatch;
    ``call.hidden`` is the merged model's output of block ``first``."""
    h = call.hidden
    loss = h.new_zeros((), dtype=torch.float32)
    for l in range(first, last + 1):
        if l > first:
            h = run_block(blks[l], call.with_hidden(h))
        if l in modules:
            h = modules[l](h)
            target = targets[l] if rows is None else targets[l][rows]
            loss = loss + sched.weights[l] * distance(h, target, sched.loss, sched.tokens, call.mask)
    return loss

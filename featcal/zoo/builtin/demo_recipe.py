"""The demo zoo's recipe: synthetic data, a pretrained base, heads and fine-tuned experts.

Everything is seeded and runs offline (:mod:`featcal.zoo.builtin.demo` builds, caches and
loads the result). The steps of :func:`build_parts`:

1. data: each task of :mod:`featcal.zoo.builtin.demo_data` gets a train set, a
   disjoint test set and a separate pretraining pool; ``calib`` and ``val``
   are carved from train (disjoint from each other);
2. pretrain the base on the mixture of the pretraining pools with *coarse*
   labels (pairs of classes merged), so the base knows the domain but not the
   tasks;
3. make one head per task from the base's features of one example per class
   (class prototypes, :func:`prototype_head`) and freeze it: a zero-shot-like
   head, weak on the base as CLIP's class-name heads are, that every model of
   the task is scored with;
4. fine-tune the whole encoder per task with its head frozen (train minus val),
   the stem at a tenth of the learning rate (see :func:`finetune`).

Why these choices (the paper's regime: the base far below the experts, Task
Arithmetic in between): with heads fit on 16 examples per class the base scored
78% and Task Arithmetic fell *below* it; one-example prototype heads make the
base weak (about 52%) while the experts still learn their tasks.

The models are HF ``CLIPVisionModel``s, so the demo runs the same code path as
real CLIP; heads read ``pooler_output``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from featcal.util.progress import Progress, Tracker
from featcal.zoo.builtin.demo_data import TASKS, drop_duplicates, make_task
from featcal.zoo.core import SPLITS
from featcal.zoo.store import pooler_output, to_pixels

DEMO_VERSION = "2"  # bump when demo_data or the training code changes (the Recipe is hashed too)

Arrays = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the demo zoo (its hash is part of the cache meta)."""

    tasks: tuple[str, ...] = ("digits", "letters", "shapes", "colour", "count", "position", "orientation")
    n_train: int = 4000  # per task; calib and val are carved from it
    n_calib: int = 512
    n_val: int = 200
    n_test: int = 300
    n_pretrain: int = 2500  # per task, a separate pool, never saved
    coarse: int = 2  # pretraining label = class // coarse
    pretrain_steps: int = 800
    pretrain_lr: float = 1e-3
    finetune_steps: int = 150
    finetune_lr: float = 1e-3
    stem_lr_scale: float = 0.1  # fine-tuning lr of the stem and the final LayerNorm, relative
    head: str = "prototype"  # "prototype" (zero-shot-like, see prototype_head) or "logistic" (fit_head)
    head_shots: int = 1  # examples per class the heads are made from (0: up to 3000 in all)
    logit_scale: float = 10.0  # the prototype heads' logit scale
    batch_size: int = 64
    noise: float = 0.0  # pixel noise of the images (0 keeps data.npz small)
    seed: int = 0
    vision: dict = field(
        default_factory=lambda: dict(
            image_size=32,
            patch_size=8,
            hidden_size=128,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
        )
    )


def micro_recipe(**changes) -> Recipe:
    """The tests' micro demo zoo: two tasks, a one-block model of width 16, a few steps (seconds)."""
    base = dict(
        tasks=("colour", "position"),
        n_train=96,
        n_calib=32,
        n_val=16,
        n_test=24,
        n_pretrain=32,
        pretrain_steps=2,
        finetune_steps=2,
        batch_size=8,
        vision=dict(
            image_size=32,
            patch_size=16,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
    )
    return Recipe(**{**base, **changes})


def recipe_sha256(recipe: Recipe) -> str:
    """A digest of the recipe and the demo version: a cached zoo built from another is stale."""
    text = json.dumps({"version": DEMO_VERSION, **asdict(recipe)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


# The cost of the build's parts in training steps (measured on a 2-core CPU, roughly):
# drawing one task's images, and fitting one head.
DATA_WORK, HEAD_WORK = 15.0, 3.0


def build_work(recipe: Recipe, n_tasks: int | None = None) -> float:
    """The build's cost in training steps, for :class:`featcal.util.progress.Tracker`'s estimate."""
    n = len(recipe.tasks) if n_tasks is None else n_tasks
    return n * DATA_WORK + recipe.pretrain_steps + n * (HEAD_WORK + recipe.finetune_steps)


def build_parts(
    recipe: Recipe,
    progress: bool = True,
    device: str | torch.device = "cpu",
    on_step: Callable[[Progress], None] | None = None,
) -> dict:
    """Run the recipe on ``device``; returns the keyword arguments of :func:`featcal.zoo.store.write_zoo_dir`
    (models and heads on the CPU). ``progress`` shows a bar per stage; ``on_step`` receives
    the stage, the step and the estimated time left (see :class:`featcal.util.progress.Tracker`)."""
    track = Tracker(build_work(recipe), on_step=on_step, show=progress)
    torch.manual_seed(recipe.seed)
    arrays, pretrain = make_data(recipe, track=track)
    classes = {t: list(TASKS[t].classes) for t in recipe.tasks}
    base = pretrain_base(recipe, pretrain, classes, device=device, track=track)
    heads, experts = {}, {}
    for i, task in enumerate(recipe.tasks):
        x, y = train_minus_val(arrays[task], device)
        head = make_head(recipe, base, x, y, len(classes[task]))
        track.advance(HEAD_WORK)
        experts[task] = finetune(base, head, x, y, recipe, seed=recipe.seed + 100 + i, track=track, task=task).cpu()
        heads[task] = head.cpu()
    base = base.cpu()
    saved = {t: {s: a[s] for s in SPLITS} for t, a in arrays.items()}  # train is not kept
    return dict(
        name="demo",
        base=base,
        experts=experts,
        heads=heads,
        arrays=saved,
        classes=classes,
        features="pooler_output",
        extra_meta={
            "variant": "default",
            "demo_version": DEMO_VERSION,
            "recipe": asdict(recipe),
            "recipe_sha256": recipe_sha256(recipe),
            "torch": torch.__version__,
        },
    )


def make_data(recipe: Recipe, progress: bool = True, track: Tracker | None = None) -> tuple[dict[str, Arrays], Arrays]:
    """``({task: {calib, val, test, train}}, {task: pretrain pool})`` as uint8 arrays.

    ``train`` (all ``n_train`` rows, not saved) contains ``calib`` (its first
    ``n_calib`` rows) and ``val`` (the next ``n_val``). Test rows equal to any
    train or pretraining image are dropped before ``n_test`` are kept.
    """
    arrays, pretrain = {}, {}
    track = track or Tracker(len(recipe.tasks) * DATA_WORK, show=progress)
    for k, task in enumerate(track.steps(recipe.tasks, "draw the tasks' images", work=DATA_WORK)):
        seed = recipe.seed * 1000 + 10 * k
        x, y = make_task(task, recipe.n_train, seed + 1, "train", recipe.noise)
        px, py = make_task(task, recipe.n_pretrain, seed + 2, "train", recipe.noise)
        tx, ty = make_task(task, recipe.n_test + 20, seed + 3, "test", recipe.noise)
        tx, ty = drop_duplicates(tx, ty, np.concatenate([x, px]))
        c, v = recipe.n_calib, recipe.n_calib + recipe.n_val
        arrays[task] = {
            "calib": (x[:c], y[:c]),
            "val": (x[c:v], y[c:v]),
            "test": (tx[: recipe.n_test], ty[: recipe.n_test]),
            "train": (x, y),
        }
        pretrain[task] = (px, py)
    return arrays, pretrain


def train_minus_val(splits: Arrays, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The train rows outside ``val`` (``calib`` included): uint8 images ``(n, H, W, 3)``
    and labels, as tensors on ``device`` (images become pixels batch by batch)."""
    x, y = splits["train"]
    n_calib, n_val = len(splits["calib"][1]), len(splits["val"][1])
    keep = np.r_[0:n_calib, n_calib + n_val : len(y)]
    return torch.from_numpy(x[keep]).to(device), torch.from_numpy(y[keep]).long().to(device)


def new_model(recipe: Recipe) -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(**recipe.vision))


def pretrain_base(
    recipe: Recipe,
    pools: Arrays,
    classes: Mapping[str, list[str]],
    progress: bool = True,
    device: str | torch.device = "cpu",
    track: Tracker | None = None,
) -> nn.Module:
    """Train a fresh model on all pools at once, labels ``class // coarse`` per task
    (one joint softmax over every task's coarse classes)."""
    torch.manual_seed(recipe.seed)
    model = new_model(recipe).to(device)
    xs, ys, offset = [], [], 0
    for task in recipe.tasks:
        x, y = pools[task]
        xs.append(torch.from_numpy(x))
        ys.append(torch.from_numpy(y).long() // recipe.coarse + offset)
        offset += math.ceil(len(classes[task]) / recipe.coarse)
    x, y = torch.cat(xs).to(device), torch.cat(ys).to(device)
    head = nn.Linear(model.config.hidden_size, offset).to(device)
    params = list(model.parameters()) + list(head.parameters())
    _train(
        model,
        head,
        params,
        x,
        y,
        recipe.pretrain_steps,
        recipe.pretrain_lr,
        recipe.batch_size,
        seed=recipe.seed + 1,
        weight_decay=0.05,
        track=track or Tracker(recipe.pretrain_steps, show=progress),
        desc="pretrain the base",
    )
    return model.eval()


def per_class(x: torch.Tensor, y: torch.Tensor, shots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``shots`` rows of each class (all rows when ``shots`` is 0)."""
    if shots <= 0:
        return x, y
    keep = torch.cat([torch.nonzero(y == c).flatten()[:shots] for c in torch.unique(y)]).sort().values
    return x[keep], y[keep]


def make_head(recipe: Recipe, base: nn.Module, x: torch.Tensor, y: torch.Tensor, n_classes: int) -> nn.Linear:
    """The task's frozen head on ``base``'s features of ``recipe.head_shots`` examples per class:
    class prototypes (``recipe.head == "prototype"``) or a fitted linear classifier (``"logistic"``)."""
    xs, ys = per_class(x, y, recipe.head_shots)
    if recipe.head == "prototype":
        return prototype_head(base, xs, ys, n_classes, recipe.logit_scale)
    if recipe.head == "logistic":
        return fit_head(base, xs, ys, n_classes)
    raise ValueError(f"unknown head {recipe.head!r}; choose 'prototype' or 'logistic'.")


def prototype_head(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_classes: int, scale: float) -> nn.Linear:
    """A zero-shot-like head: the logit of class c is ``scale`` times the projection of the
    centred feature on the unit direction of class c's mean, in units of the mean centred norm,

        logit_c(f) = scale * <u_c, f - mu> / r,   u_c = (mu_c - mu) / |mu_c - mu|,

    with ``mu`` the mean feature, ``mu_c`` class c's and ``r`` the mean ``|f - mu|``, all on
    ``model``'s features of ``x``. Like CLIP's class-name embeddings it is fixed before any
    fine-tuning and knows each class by one direction only, so the base scores modestly
    through it and the experts must move their features towards it. Returned frozen."""
    feats = features(model, x)  # (n, d)
    mu = feats.mean(0)
    dirs = torch.stack([F.normalize(feats[y == c].mean(0) - mu, dim=0) for c in range(n_classes)])  # (classes, d)
    weight = dirs * (scale / (feats - mu).norm(dim=1).mean())
    head = nn.Linear(feats.shape[1], n_classes).to(feats.device)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(-weight @ mu)
    return head.requires_grad_(False).eval()


def fit_head(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    n_classes: int,
    l2: float = 1e-3,
    steps: int = 100,
    max_rows: int = 3000,
) -> nn.Linear:
    """A linear head on ``model``'s frozen features of the first ``max_rows`` images
    (uint8 ``x``; multinomial logistic regression, full-batch L-BFGS, small L2),
    returned frozen."""
    x, y = x[:max_rows], y[:max_rows]
    feats = features(model, x)
    head = nn.Linear(feats.shape[1], n_classes).to(feats.device)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    opt = torch.optim.LBFGS(head.parameters(), max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(head(feats), y) + l2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return head.requires_grad_(False).eval()


def finetune(
    base: nn.Module,
    head: nn.Linear,
    x: torch.Tensor,
    y: torch.Tensor,
    recipe: Recipe,
    seed: int,
    track: Tracker | None = None,
    task: str = "",
) -> nn.Module:
    """A copy of ``base`` fine-tuned end to end on one task through its frozen ``head``.

    Every parameter is trained; those outside the transformer blocks (patch and
    position embeddings, the pre- and post-LayerNorms) at ``stem_lr_scale`` times
    the learning rate, as layer-wise learning-rate decay does for ViTs. This keeps
    most of each task vector inside the blocks, where FeatCal works (it leaves the
    stem at its merged value).
    """
    model = copy.deepcopy(base)
    blocks = [p for n, p in model.named_parameters() if n.startswith("encoder.layers.")]
    stem = [p for n, p in model.named_parameters() if not n.startswith("encoder.layers.")]
    groups = [
        {"params": blocks, "lr": recipe.finetune_lr},
        {"params": stem, "lr": recipe.finetune_lr * recipe.stem_lr_scale},
    ]
    _train(
        model,
        head,
        groups,
        x,
        y,
        recipe.finetune_steps,
        recipe.finetune_lr,
        recipe.batch_size,
        seed=seed,
        weight_decay=0.0,
        track=track or Tracker(recipe.finetune_steps, show=False),
        desc=f"fine-tune the {task} expert" if task else "fine-tune an expert",
    )
    return model.eval()


@torch.no_grad()
def features(model: nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """``(n, d)`` features of uint8 images ``x`` ``(n, H, W, 3)``."""
    model.eval()
    return torch.cat([pooler_output(model, to_pixels(xb)) for xb in x.split(batch_size)])


def _train(
    model: nn.Module,
    head: nn.Module,
    params: list,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    weight_decay: float,
    track: Tracker,
    desc: str = "",
) -> None:
    """Train ``model`` (and whatever else ``params`` holds: tensors or AdamW parameter
    groups) through ``head`` on uint8 images ``x`` ``(n, H, W, 3)``: AdamW, 5% linear
    warm-up then cosine decay, gradient norm clipped at 1, batches drawn with
    replacement from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)  # on the CPU: the same batches on any device
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    flat = [p for g in opt.param_groups for p in g["params"]]
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    for _ in track.steps(range(steps), desc):
        idx = torch.randint(len(y), (batch_size,), generator=gen).to(y.device)
        loss = F.cross_entropy(head(pooler_output(model, to_pixels(x[idx]))), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(flat, 1.0)
        opt.step()
        sched.step()
    model.eval()

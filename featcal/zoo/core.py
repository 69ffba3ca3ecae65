"""The ``Zoo``: one base model, its task experts, frozen per-task heads and data.

A zoo is everything featcal needs to merge, calibrate and score models on a
set of tasks. Heads are frozen and shared by every model evaluated on a task
(as CLIP zero-shot heads are), so a merged or calibrated model is scored with
exactly the head its experts were trained against.

Data flows one way: a zoo builder (the embedded demo, a YAML spec) makes a
``Zoo``; merging, calibration, evaluation and diagnostics only read it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from torch import nn

from featcal.baselines.registry import merge
from featcal.model.streams import device_of
from featcal.zoo.tokens import as_batch

SPLITS = ("calib", "val", "test")
GIVEN = "given"  # the merger name of a zoo's own merged model (Zoo.given_merged)


@dataclass
class TaskData:
    """One task's classes and splits.

    ``splits`` maps a split name (``calib``, ``val``, ``test``) to a pair
    ``(inputs, labels)``: inputs ``(n, C, H, W)`` float (images) or
    :class:`~featcal.zoo.tokens.TokenRows` (text), labels ``(n,)`` long.
    ``calib`` and ``val`` are carved from the task's train data and never
    overlap ``test``. Any mapping will do: a dict, or a lazy one that decodes a
    split's images on first access (:class:`featcal.zoo.load.data.LazySplits`).
    """

    name: str
    classes: list[str]
    splits: Mapping[str, tuple[torch.Tensor, torch.Tensor]]

    def split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split not in self.splits:
            raise KeyError(f"task {self.name!r} has no split {split!r}; it has {sorted(self.splits)}.")
        return self.splits[split]


FeatureFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


@dataclass
class Zoo:
    """Base model, experts, frozen heads and data for a set of tasks.

    Attributes:
        name: short identifier (``demo``, ``clip-vit-b32-ta8``, ...).
        base: the pretrained model ``M_0``.
        experts: ``{task: M_i}``, each fine-tuned from ``base`` (same architecture).
        heads: ``{task: nn.Linear}``, frozen, shared by every model scored on the task.
        data: ``{task: TaskData}``.
        features: ``features(model, inputs) -> (n, d)``: the representation the heads read
            (CLIP: the projected, normalised image embedding, or the pooled output).
        fmt: the format the models were loaded in (``hf``, ``open_clip``), so that an
            exported model is written the same way.
        meta: free-form facts about the zoo (content hash, build time, sources).
        given_merged: the user's own merged model (a spec's ``merged:``, e.g. a mergekit
            output), the merger :data:`GIVEN` that :meth:`merged` returns; ``None`` without one.
    """

    name: str
    base: nn.Module
    experts: dict[str, nn.Module]
    heads: dict[str, nn.Linear]
    data: dict[str, TaskData]
    features: FeatureFn
    fmt: str = "hf"
    meta: dict = field(default_factory=dict)
    given_merged: nn.Module | None = None

    @property
    def tasks(self) -> list[str]:
        return list(self.experts)

    @property
    def unscored(self) -> list[str]:
        """Tasks merged and calibrated on but not scored (a generative zoo's ``scorer: none``)."""
        return []

    def task_facts(self, task: str) -> dict:
        """What a table of the zoo's tasks shows of ``task`` beside its split sizes: its classes
        (a generative zoo's task: how its replies are scored, :meth:`LMZoo.task_facts`)."""
        return {"classes": len(self.data[task].classes)}

    def input_paths(self) -> dict[str, str]:
        """``{what: path}`` of the files and directories this zoo was read from (its directory,
        or its spec's models, heads and data): an output must lie apart from all of them."""
        if "inputs" in self.meta:
            return dict(self.meta["inputs"])
        return {"the zoo": self.meta["path"]} if "path" in self.meta else {}

    def split(self, task: str, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)`` of one task's split."""
        return self.data[task].split(split)

    def calib_data(
        self, n_per_task: int, seed: int = 42, batch_size: int = 16, split: str = "calib"
    ) -> dict[str, list[torch.Tensor]]:
        """The ``calib_data`` mapping that :func:`featcal.calibrate` takes:
        ``{task: [batch, ...]}`` with ``n_per_task`` examples drawn without
        replacement from the task's ``split`` (seeded), in batches of ``batch_size`` (a text
        task's batches are dicts ``{input_ids, attention_mask}``)."""
        if n_per_task < 1:
            raise ValueError(f"n_per_task must be at least 1, got {n_per_task}.")
        out: dict[str, list[torch.Tensor]] = {}
        for task in self.tasks:
            x, y = self.split(task, split)
            if n_per_task > len(y):
                raise ValueError(
                    f"task {task!r}: asked for {n_per_task} calibration examples but its "
                    f"{split!r} split has {len(y)}; lower n_per_task."
                )
            gen = torch.Generator().manual_seed(seed)
            idx = torch.randperm(len(x), generator=gen)[:n_per_task]
            out[task] = [as_batch(b) for b in x[idx].split(batch_size)]
        return out

    @torch.no_grad()
    def logits(self, model: nn.Module, task: str, inputs: torch.Tensor) -> torch.Tensor:
        """Class logits of ``model`` on ``task`` through the task's frozen head."""
        head = self.heads[task]
        feats = self.features(model, inputs.to(device_of(model)))
        return head(feats.to(head.weight.dtype).to(head.weight.device))

    @torch.no_grad()
    def score(
        self,
        model: nn.Module,
        split: str = "test",
        batch_size: int = 256,
        tasks: Mapping[str, object] | list[str] | None = None,
        max_per_task: int | None = None,
    ) -> dict[str, float]:
        """Top-1 accuracy (in percent) of ``model`` on each task's ``split`` (:func:`evaluate`)."""
        out: dict[str, float] = {}
        for task in list(tasks) if tasks is not None else self.tasks:
            x, y = self.split(task, split)
            if max_per_task is not None:
                x, y = x[:max_per_task], y[:max_per_task]
            correct = 0
            for xb, yb in zip(x.split(batch_size), y.split(batch_size)):
                pred = self.logits(model, task, xb).argmax(-1).cpu()
                correct += int((pred == yb).sum())
            out[task] = 100.0 * correct / max(len(y), 1)
        return out

    def merged(self, method: str = "task_arithmetic", **params) -> nn.Module:
        """A new model holding ``featcal.merge(method, base, experts, **params)``, or a copy of
        the zoo's own merged model for ``method="given"`` (:data:`GIVEN`)."""
        if method == GIVEN:
            if self.given_merged is None:
                raise ValueError(f"zoo {self.name!r} has no merged model of its own (a spec's `merged:`).")
            return copy.deepcopy(self.given_merged)
        sd = merge(method, self.base.state_dict(), {t: m.state_dict() for t, m in self.experts.items()}, **params)
        model = copy.deepcopy(self.base)
        model.load_state_dict(sd)
        return model


@torch.no_grad()
def evaluate(
    model: nn.Module,
    zoo: Zoo,
    split: str = "test",
    batch_size: int = 256,
    tasks: Mapping[str, object] | list[str] | None = None,
    max_per_task: int | None = None,
) -> dict[str, float]:
    """``model``'s score (percent) on each task's ``split``: ``{task: score}``; top-1 accuracy
    through the frozen heads, or the zoo's own metrics (an LLM zoo's, :mod:`featcal.zoo.score.lm`)."""
    model.eval()
    return zoo.score(model, split=split, batch_size=batch_size, tasks=tasks, max_per_task=max_per_task)

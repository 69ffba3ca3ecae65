"""The part of a spec only generative zoos have: ``modality: causal_lm | seq2seq`` and ``tasks:``.

A generative zoo is scored on the model's own text, so it has no heads; instead each task says how
its examples become prompts and how a reply is scored (a :class:`~featcal.zoo.spec.schema.GenTaskSpec`)::

    modality: seq2seq
    tasks:
      sst2:
        prompt: "sst2 sentence: {sentence}"
        target: label
        labels: [negative, positive]
        scorer: exact_match
        max_new_tokens: 8

Checked here, before anything loads: every task has one entry, every key is known, the scorer is
one featcal has (:data:`~featcal.zoo.spec.schema.SCORER_NAMES`), a ``choice`` task names its
``options`` column, the data are tables (parquet or ``datasets.save_to_disk`` arrow) whose columns
the prompt can read, and a ready-made ``calib_split`` / ``val_split`` overlaps no other split.
"""

from __future__ import annotations

import string
from types import MappingProxyType
from typing import Any, Mapping

from featcal.zoo.spec.schema import GENERATIVE, SCORER_NAMES, DataSpec, GenTaskSpec

TABLE_FORMATS = ("auto", "parquet", "arrow")


def prompt_fields(template: str) -> list[str]:
    """The ``{column}`` names a prompt template reads (``{{`` and ``}}`` are literal braces)."""
    return [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]


def _task(ctx, task: str, raw: Any, modality: str) -> GenTaskSpec:
    where = f"tasks.{task}"
    d = ctx.check_keys(raw, "task", where)
    for key in ("prompt", "target", "scorer"):
        if not isinstance(d.get(key), str) or not d[key]:
            raise ctx.fail(f"{where}.{key}", f"required: a string (got {d.get(key)!r}).")
    try:
        fields = prompt_fields(d["prompt"])
    except ValueError as err:
        raise ctx.fail(f"{where}.prompt", f"not a template ({err}); write {{column}} fields, {{{{ for a brace.")
    if any(not f or not f.replace("_", "").replace("-", "").isalnum() for f in fields):
        raise ctx.fail(f"{where}.prompt", f"fields must name columns, got {fields}.")
    if d["scorer"] not in SCORER_NAMES:
        raise ctx.fail(f"{where}.scorer", f"{d['scorer']!r} is not one of {list(SCORER_NAMES)}.")
    if (d["scorer"] == "choice") != ("options" in d):
        fix = "add `options: COLUMN`" if d["scorer"] == "choice" else "remove `options` (a choice task's only)"
        raise ctx.fail(where, f"scorer {d['scorer']!r}: {fix}.")
    labels = d.get("labels", [])
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise ctx.fail(f"{where}.labels", f"expected a list of strings, got {labels!r}.")
    if d.get("format") is not None:
        try:
            str(d["format"]).format(1.0)
        except (ValueError, IndexError, KeyError) as err:
            raise ctx.fail(f"{where}.format", f"not a format for one value ({err}); e.g. '{{:.1f}}'.")
    if d["scorer"] == "choice" and modality == "seq2seq":
        raise ctx.fail(f"{where}.scorer", "choice (options by log-likelihood) is scored on decoder LLMs only.")
    for key in ("reference", "options"):
        if key in d and (not isinstance(d[key], str) or not d[key]):
            raise ctx.fail(f"{where}.{key}", f"expected a column name, got {d[key]!r}.")
    return GenTaskSpec(
        task=task,
        prompt=d["prompt"],
        target=d["target"],
        scorer=d["scorer"],
        labels=tuple(labels),
        reference=d.get("reference"),
        options=d.get("options"),
        max_new_tokens=ctx.int(d.get("max_new_tokens", 64), f"{where}.max_new_tokens", 1),
        format=d.get("format"),
    )


def parse_tasks(ctx, raw: Any, tasks: list[str], modality: str) -> Mapping[str, GenTaskSpec]:
    """The ``tasks:`` section: one entry per expert's task for a generative zoo, none otherwise."""
    if modality not in GENERATIVE:
        if raw is not None:
            raise ctx.fail("tasks", "only a generative zoo (modality causal_lm or seq2seq) has `tasks:`; remove it.")
        return MappingProxyType({})
    if not isinstance(raw, Mapping):
        raise ctx.fail("tasks", f"modality {modality} needs `tasks: {{task: {{prompt, target, scorer, ...}}}}`.")
    if sorted(map(str, raw)) != sorted(tasks):
        raise ctx.fail(
            "tasks",
            f"tasks differ from the experts': none for {sorted(set(tasks) - set(map(str, raw)))}, "
            f"no expert for {sorted(set(map(str, raw)) - set(tasks))}.",
        )
    return MappingProxyType({t: _task(ctx, t, raw[t], modality) for t in tasks})


def check_generative(ctx, raw: Mapping, fmt: str, data: Mapping[str, DataSpec]) -> None:
    """A generative zoo: HF models, no heads, no image or text-zoo keys, tables for data."""
    if fmt != "hf":
        raise ctx.fail("format", "a generative zoo's models are HF save_pretrained directories: use format: hf.")
    extra = [k for k in ("heads", "features", "preprocess") if k in raw]
    if extra:
        raise ctx.fail(
            extra[0], "a generative zoo is scored on its replies (no heads, image or text features); remove it."
        )
    for t, e in data.items():
        if e.format not in TABLE_FORMATS:
            raise ctx.fail(f"data.{t}.format", f"a generative zoo reads tables: one of {list(TABLE_FORMATS)}.")
        _check_named_splits(ctx, t, e)


def _check_named_splits(ctx, task: str, e: DataSpec) -> None:
    """A ready-made calib or val split must be a split of its own: not the test split, not the other
    named one, and not the train split while the other of calib and val is drawn from it (the
    examples would overlap)."""
    others = {"test_split": e.test_split}
    if e.calib_split is None or e.val_split is None:
        others["train_split"] = e.train_split
    for key in ("calib_split", "val_split"):
        name = getattr(e, key)
        if name is None:
            continue
        clash = [k for k, v in others.items() if v == name]
        if clash:
            raise ctx.fail(
                f"data.{task}.{key}",
                f"{name!r} is also the {clash[0]}: their examples would overlap. Name a split of its own "
                f"(e.g. {key.split('_')[0]!r}), or remove {key} to draw it from the train split.",
            )
        others[key] = name

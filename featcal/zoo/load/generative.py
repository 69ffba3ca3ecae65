"""A generative zoo from a spec (``modality: causal_lm | seq2seq``): models, tokenizer, examples.

The models are Hugging Face ``save_pretrained`` directories (local, or in the HF cache): a decoder
LLM (``AutoModelForCausalLM``: Llama, Qwen, Gemma, ...) or an encoder-decoder (``AutoModelForSeq2SeqLM``:
FLAN-T5), experts dense or PEFT LoRA adapters merged onto the base as peft merges them. Each task's
data is a table (parquet files as the hub caches them, or a ``datasets.save_to_disk`` folder); every
row becomes an :class:`~featcal.zoo.builtin.llm_tasks.Example` through the spec's task entry
(:class:`~featcal.zoo.spec.schema.GenTaskSpec`): the prompt template filled from its columns, the
target the scorer reads, the reference reply calibration reads.

Splits: ``calib`` and ``val`` are drawn (seeded, disjoint) from the train split and ``test`` from the
test split; a data set with one split only (MATH-500, IFEval, HumanEval) names it as both, and then
test is what calib and val left. A data entry's ``calib_split`` / ``val_split`` name ready-made splits
instead (a calibration set of one's own; the built-in smollm2 zoo's generated ones): each is used as
given, every row in its order, and nothing is drawn for it.

A decoder LLM's inputs are the chat-formatted prompt plus the reference reply
(:func:`featcal.zoo.score.lm.encode_chats`); an encoder-decoder's are the prompt for the encoder and the
reference reply as the decoder's target (:mod:`featcal.zoo.score.seq2seq`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from featcal.model.loading import as_model
from featcal.zoo.builtin.llm_tasks import Example
from featcal.zoo.core import TaskData
from featcal.zoo.load.data import arrow_tables, split_indices
from featcal.zoo.load.loaders import _DTYPES
from featcal.zoo.load.text import load_tokenizer
from featcal.zoo.score import scorers
from featcal.zoo.score.lm import LMZoo, encode_chats, lm_mean_hidden
from featcal.zoo.score.seq2seq import Seq2SeqZoo, encode_pairs, encoder_mean_hidden
from featcal.zoo.spec.generative import prompt_fields
from featcal.zoo.spec.locate import Found, LocatedData, parquet_files
from featcal.zoo.spec.schema import GenTaskSpec, ZooSpec

MAX_TOKENS = 1024  # a decoder LLM's calibration sequence, prompt and reply (MergeBench's length)
MAX_SOURCE, MAX_TARGET = 512, 128  # an encoder-decoder's prompt and reply, in tokens


# ------------------------------------------------------------------ tables to examples


def read_rows(located: LocatedData, split: str) -> list[dict]:
    """The rows of one split of a table data set, as dicts (parquet files or a save_to_disk folder)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = located.root
    if located.format == "parquet":
        tables = [pq.read_table(str(f)) for f in parquet_files(root, split)]
    elif located.format == "arrow":
        tables = arrow_tables(root / split)
    else:
        raise ValueError(f"{root}: {located.format} data; a generative zoo reads parquet or save_to_disk tables.")
    if not tables:
        raise ValueError(f"{root}: no rows for split {split!r}.")
    return pa.concat_tables(tables, promote_options="default").to_pylist()


def column(row: Mapping, path: str, where: str) -> Any:
    """``row[path]``, ``a.b`` reaching into a nested field; a missing column names the columns there are."""
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, Mapping) or part not in value:
            have = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise ValueError(f"{where}: no column {path!r} (there: {have}); fix the task's column names in the spec.")
        value = value[part]
    return value


def target_of(row: Mapping, task: GenTaskSpec, where: str) -> Any:
    """The example's target: a column (through ``labels`` for an integer class, then ``format``), or
    for ``key=column, column`` a mapping of several columns (a code task's tests, IFEval's kwargs)."""
    if "," in task.target or "=" in task.target:
        out = {}
        for item in (i.strip() for i in task.target.split(",") if i.strip()):
            key, _, col = item.partition("=")
            out[key.strip()] = column(row, (col or key).strip(), where)
        return out
    value = column(row, task.target, where)
    if task.labels and task.scorer != "choice":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(task.labels):
            raise ValueError(f"{where}: target {value!r} is not an index into labels {list(task.labels)}.")
        value = task.labels[value]
    return task.format.format(value) if task.format else value


def example(row: Mapping, task: GenTaskSpec, where: str) -> Example:
    """One row as an :class:`Example` of ``task``."""
    prompt = task.prompt.format_map({k: row[k] for k in row})
    target = target_of(row, task, where)
    if task.scorer == "choice":
        options = tuple(str(o) for o in column(row, task.options, where))
        label = _option_index(target, options, task.labels, where)
        reference = options[label] if task.reference is None else str(column(row, task.reference, where))
        return Example(prompt, reference, target=str(options[label]), options=options, label=label)
    if task.reference is not None:
        reference = str(column(row, task.reference, where))
    else:  # a text target is the reply; a structured one (IFEval's checks, code tests) has none: the prompt alone
        reference = target if isinstance(target, str) else ""
    return Example(prompt, reference, target=target)


def _option_index(target: Any, options: tuple[str, ...], names: tuple[str, ...], where: str) -> int:
    """Which option is right: an integer target is its index; a text one is an option, one of the
    options' ``labels`` (ARC's answer key ``"B"`` for ``labels: [A, B, C, D]``) or a digit from 1."""
    if isinstance(target, int) and not isinstance(target, bool) and 0 <= target < len(options):
        return target
    if isinstance(target, str) and target.isdigit() and 1 <= int(target) <= len(options):
        return int(target) - 1  # ARC's numeric answer keys count from 1
    for names_here in (options, names):
        if str(target) in names_here and names_here.index(str(target)) < len(options):
            return names_here.index(str(target))
    raise ValueError(
        f"{where}: target {target!r} is neither an option's index, an option, nor one of labels {list(names)}."
    )


def _examples(rows: list[dict], task: GenTaskSpec, where: str) -> list[Example]:
    missing = [f for f in prompt_fields(task.prompt) if rows and f not in rows[0]]
    if missing:
        raise ValueError(f"{where}: the prompt reads column(s) {missing}, the data has {sorted(rows[0])}.")
    return [example(r, task, f"{where}, row {i}") for i, r in enumerate(rows)]


def _draw(where: str, n_train: int, n_test: int, calib: int, val: int, s) -> dict:
    """:func:`split_indices` for one task, its refusal naming the task's data (a one-split set such as
    HumanEval+'s 164 problems cannot give 256 calibration examples and a test)."""
    try:
        return split_indices(n_train, n_test, calib, val, s.test, s.seed)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def task_examples(spec: ZooSpec, task: str, located: LocatedData) -> dict[str, list[Example]]:
    """``{calib, val, test}`` examples of one task (see the module docstring for the splits): a
    ready-made ``calib_split`` / ``val_split`` as given, the others drawn."""
    d, s, gen = spec.data[task], spec.splits, spec.generation[task]
    where = f"data {task!r} ({located.root})"

    def rows(split: str) -> list[Example]:
        return _examples(read_rows(located, split), gen, where)

    given = {name: rows(split) for name, split in (("calib", d.calib_split), ("val", d.val_split)) if split}
    calib, val = (0 if "calib" in given else s.calib), (0 if "val" in given else s.val)
    if d.train_split == d.test_split:  # one split: calib and val first, test from what is left
        drawn = _drawn_from_one(where, rows(d.test_split), calib, val, s)
    else:
        train = rows(d.train_split) if calib or val else []
        test = rows(d.test_split)
        idx = _draw(where, len(train), len(test), calib, val, s)
        drawn = {name: [(test if name == "test" else train)[i] for i in ids] for name, ids in idx.items()}
    parts = {**drawn, **given}
    for exs in parts.values():
        scorers.check_targets(gen, exs)
    return {name: parts[name] for name in ("calib", "val", "test") if name in parts}


def _drawn_from_one(where: str, rows: list[Example], calib: int, val: int, s) -> dict[str, list[Example]]:
    """A one-split data set's ``calib`` and ``val`` drawn from its rows, and ``test`` the first
    ``splits.test`` of the rows they left (refused when they leave none)."""
    idx = _draw(where, len(rows), 0, calib, val, s) if calib or val else {}
    picked = {name: [rows[i] for i in idx[name]] for name in ("calib", "val") if name in idx}
    taken = {i for name in picked for i in idx[name]}
    rest = [row for i, row in enumerate(rows) if i not in taken][: s.test]
    if not rest:
        raise ValueError(f"{where}: {len(rows)} rows, all in calib and val; lower splits.calib / splits.val.")
    return {**picked, "test": rest}


# ------------------------------------------------------------------ models


def load_models(spec: ZooSpec, found: Found, device: str) -> dict[str, nn.Module]:
    """``{role: model}`` (base, ``expert:TASK``, ``merged``): the base through the Auto class of the
    modality, every other model strictly into a copy of it (a LoRA adapter merged onto the base)."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    auto = AutoModelForCausalLM if spec.modality == "causal_lm" else AutoModelForSeq2SeqLM
    dtype = _DTYPES[spec.dtype]
    base = auto.from_pretrained(
        str(found.models["base"]), local_files_only=True, trust_remote_code=False, dtype=dtype
    ).eval()
    out = {"base": base}
    for role, path in found.models.items():
        if role != "base":  # a LoRA adapter is merged onto the base as peft merges it
            out[role] = as_model(str(path), base, f"{role} ({path})", base=base).to(dtype).eval()
    return {r: m.to(device) for r, m in out.items()}


# ------------------------------------------------------------------ the zoo


def load_parts(spec: ZooSpec, found: Found, device: str = "cpu") -> tuple[type, dict]:
    """``(zoo class, its keywords but name and meta)``: an :class:`LMZoo` or a :class:`Seq2SeqZoo`."""
    tokenizer = load_tokenizer(Path(spec.tokenizer or found.models["base"]))
    if spec.modality == "causal_lm" and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{found.models['base']}: the tokenizer has no chat template; a causal_lm zoo prompts an instruction-"
            "tuned model through it. Use the instruct model's tokenizer files (tokenizer_config.json's chat_template)."
        )
    if tokenizer.pad_token is None:  # Llama's tokenizers have none: pad with end-of-sequence, masked out
        tokenizer.pad_token = tokenizer.eos_token
    examples = {t: task_examples(spec, t, found.data[t]) for t in spec.tasks}
    models = load_models(spec, found, device)
    start = getattr(models["base"].config, "decoder_start_token_id", None)  # an encoder-decoder's
    data = {}
    for t, parts in examples.items():
        splits = {}
        for name, exs in parts.items():
            if spec.modality == "causal_lm":
                rows, _ = encode_chats(tokenizer, exs, MAX_TOKENS)
            else:
                rows = encode_pairs(tokenizer, exs, MAX_SOURCE, MAX_TARGET, start)
            splits[name] = (rows, torch.tensor([ex.label for ex in exs], dtype=torch.long))
        data[t] = TaskData(t, [], splits)
    cls = LMZoo if spec.modality == "causal_lm" else Seq2SeqZoo
    return cls, {
        "base": models["base"],
        "experts": {t: models[f"expert:{t}"] for t in spec.tasks},
        "heads": {},
        "data": data,
        "features": lm_mean_hidden if spec.modality == "causal_lm" else encoder_mean_hidden,
        "given_merged": models.get("merged"),
        "tokenizer": tokenizer,
        "examples": examples,
        "task_table": {t: scorers.task(spec.generation[t]) for t in spec.tasks},
    }

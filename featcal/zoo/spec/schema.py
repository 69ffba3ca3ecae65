"""Zoo specs: the YAML schema, parsed and validated into frozen dataclasses.

Nothing here looks for or loads anything: :func:`featcal.zoo.spec.parsing.parse` reads a spec
file, :func:`featcal.zoo.spec.parsing.from_dict` validates a mapping, and both return a
:class:`ZooSpec`. :mod:`featcal.zoo.spec.locate` then finds what it names, and
:func:`featcal.zoo.load.from_spec.load` builds the zoo.

A spec is documented, with complete worked examples (an image zoo, a ``modality: text`` zoo, a
merged model of one's own), in docs/zoos.md; paths may use ``~``, ``$VAR``, ``${VAR}`` and
``${VAR:-default}``, relative paths are relative to the spec file. See :data:`SCHEMA` for every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

FORMATS = ("hf", "open_clip")
HEAD_TYPES = ("zero_shot", "file")
DATA_FORMATS = ("auto", "image_folder", "arrow", "parquet", "tensors", "text", "tokens")
MODALITIES = ("image", "text", "causal_lm", "seq2seq")
GENERATIVE = ("causal_lm", "seq2seq")  # scored on the model's own text, no heads: the spec's `tasks:` says how
# The scorers a generative task may name (the functions: featcal.zoo.score.scorers.SCORERS, held equal by a test).
SCORER_NAMES = (
    *("exact_match", "strict_match", "final_number", "ifeval", "code_pass_at_1", "spearman", "choice", "none"),
    *("answer_is_number", "first_line", "constraint"),  # the built-in smollm2 zoo's tasks'
)
TEXT_FORMATS = ("auto", "text", "tokens")
FEATURES = ("embedding", "projection", "pooled")
DTYPES = ("float32", "float16", "bfloat16")

# Every key the spec accepts, with its one-line meaning (also the source of "unknown key" errors).
SCHEMA: dict[str, dict[str, str]] = {
    "zoo": {
        "name": "short identifier of the zoo (default: the file name)",
        "format": "hf | open_clip: how every model is stored (default hf)",
        "arch": "open_clip architecture name (default for every model entry)",
        "config": "open_clip model-config JSON for an architecture open_clip does not ship",
        "quick_gelu": "open_clip: build the model with QuickGELU (OpenAI weights need it)",
        "base": "the pretrained model M_0 (a model entry)",
        "experts": "{task: model entry}: the fine-tuned experts M_i",
        "heads": "how each task's frozen head is made",
        "data": "{task: data entry}",
        "splits": "sizes and seed of the calib/val/test splits",
        "preprocess": "image size, mean and std (default: from the base model, CLIP's mean/std)",
        "features": "embedding | projection | pooled: what the heads read (default embedding)",
        "dtype": "float32 | float16 | bfloat16 for the models (default float32)",
        "modality": "image | text | causal_lm | seq2seq: what the models are (default image: CLIP towers; text: an "
        "HF text encoder; causal_lm: a decoder LLM, seq2seq: an encoder-decoder such as FLAN-T5, both scored on "
        "their greedy replies)",
        "tasks": "causal_lm / seq2seq: {task: how its examples are prompted and scored} (a task entry)",
        "merged": "optional: your own merged model (a model entry, e.g. a mergekit output), the merger `given`",
        "tokenizer": "text, causal_lm, seq2seq: the directory of the tokenizer the data is tokenised with "
        "(default: the base's)",
    },
    "model": {
        "path": "local directory (HF save_pretrained; an expert's may be a PEFT LoRA adapter) or file (open_clip)",
        "id": "Hugging Face model id (an expert's may be a LoRA adapter's), looked up in the local HF cache only",
        "revision": "HF revision (branch, tag or commit) in the cache (default main)",
        "format": "hf | open_clip (must match the zoo's format)",
        "arch": "open_clip architecture name",
        "config": "open_clip model-config JSON",
        "quick_gelu": "open_clip QuickGELU switch",
        "pretrained": "open_clip pretrained tag (e.g. openai), read from the HF cache only",
    },
    "heads": {
        "type": "zero_shot | file",
        "path": "file heads: safetensors with <task>.weight and optional <task>.bias",
        "text_model": "zero-shot: the CLIP model whose text tower encodes the prompts (default: base)",
        "logit_scale": "zero-shot: scale logits by CLIP's exp(logit_scale) (default true)",
        "classes": "{task: [class names]} overriding the built-in ones",
        "templates": "{task: [prompt templates with one {}]} overriding the built-in ones",
    },
    "data": {
        "path": "local dataset: image folder, datasets.save_to_disk dir, parquet dir, .safetensors/.npz",
        "hub": "HF dataset id whose parquet files are in the local HF cache (tried after path)",
        "revision": "HF revision of the hub dataset (default main)",
        "subset": "sub-folder of the hub dataset holding the splits (its config, e.g. cropped_digits for svhn)",
        "format": "auto | image_folder | arrow | parquet | tensors | text | tokens (default auto: detected)",
        "train_split": "name of the split calib and val are carved from (default train)",
        "test_split": "name of the split test comes from (default test)",
        "calib_split": "causal_lm / seq2seq: name of a ready-made calib split, used as given (every row, in "
        "order; nothing drawn from train)",
        "val_split": "causal_lm / seq2seq: name of a ready-made val split, used as given (as calib_split)",
        "image_column": "image column of an arrow/parquet dataset (default image)",
        "label_column": "label column of an arrow/parquet dataset (default label)",
    },
    "task": {
        "prompt": "the prompt, a template whose {column} fields are filled from each example's columns",
        "target": "the column holding what the reply is scored against (a.b: a nested field; 'key=col, col2': "
        "a mapping of several columns, e.g. 'tests=test, entry_point, prompt' for code_pass_at_1)",
        "labels": "names of an integer target: the reply the label k stands for is labels[k] (GLUE's classes)",
        "reference": "the column holding the reply calibration reads (default: a text target; else the prompt alone)",
        "format": "a format for the target's text, e.g. '{:.1f}' (STS-B's scores as FusionBench writes them)",
        "scorer": "exact_match | strict_match | final_number | ifeval | code_pass_at_1 | spearman | choice | none "
        "(none: merged and calibrated on, not scored; the tables say so) | answer_is_number | first_line | constraint "
        "(the built-in smollm2 zoo's)",
        "options": "choice: the column holding each example's options (the target is the right one's index)",
        "max_new_tokens": "the longest greedy reply, in tokens (default 64)",
    },
    "splits": {
        "calib": "examples per task in the calib split, from train (default 256; not for a data entry's calib_split)",
        "val": "examples per task in the val split, from train, disjoint from calib (default 256; not for a "
        "data entry's val_split)",
        "test": "examples per task in the test split (default null: all of test)",
        "seed": "seed of the split draws (default 42)",
    },
    "preprocess": {
        "image_size": "resize the shorter side to this, then center-crop a square",
        "mean": "per-channel mean (default CLIP's)",
        "std": "per-channel std (default CLIP's)",
        "interpolation": "bicubic | bilinear | nearest (default bicubic)",
        "max_length": "text: tokens per example, special tokens included (default 128)",
    },
}


class SpecError(ValueError):
    """The spec is malformed; the message names the file and the key."""


@dataclass(frozen=True)
class ModelSpec:
    """Where one model comes from: its local ``path``, else the HF ``id`` in the cache (either or
    both, tried in that order), or an open_clip ``pretrained`` tag."""

    format: str
    path: str | None = None
    id: str | None = None
    revision: str | None = None
    arch: str | None = None
    config: str | None = None
    quick_gelu: bool = False
    pretrained: str | None = None


@dataclass(frozen=True)
class HeadSpec:
    """How the frozen heads are made (``zero_shot`` through a CLIP text tower, or a ``file``)."""

    type: str = "zero_shot"
    path: str | None = None
    text_model: ModelSpec | None = None
    logit_scale: bool = True
    classes: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    templates: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class DataSpec:
    """Where one task's data comes from; ``path`` is tried first, then ``hub``."""

    task: str
    path: str | None = None
    hub: str | None = None
    revision: str | None = None
    subset: str | None = None
    format: str = "auto"
    train_split: str = "train"
    test_split: str = "test"
    image_column: str = "image"
    label_column: str = "label"
    calib_split: str | None = None  # a ready-made calib split (a generative zoo's table), used as given
    val_split: str | None = None  # likewise for val

    @property
    def splits_read(self) -> tuple[str, ...]:
        """The splits this entry reads: the train split while calib or val is drawn from it, the
        test split, and the named calib and val splits (each once, in that order)."""
        drawn = self.calib_split is None or self.val_split is None
        names = ([self.train_split] if drawn else []) + [self.test_split, self.calib_split, self.val_split]
        return tuple(dict.fromkeys(n for n in names if n is not None))


@dataclass(frozen=True)
class GenTaskSpec:
    """How one task of a generative zoo (``modality: causal_lm | seq2seq``) is prompted and scored:
    each example's ``prompt`` is the template filled from its columns, its reply is scored by the
    scorer named ``scorer`` against the ``target`` column (through ``labels`` when it is an integer
    class), and ``reference`` (default: the target's text) is the reply calibration reads."""

    task: str
    prompt: str
    target: str
    scorer: str
    labels: tuple[str, ...] = ()
    reference: str | None = None
    options: str | None = None
    max_new_tokens: int = 64
    format: str | None = None


@dataclass(frozen=True)
class SplitSpec:
    """Split sizes: ``calib`` and ``val`` carved from train (seeded, disjoint), ``test`` from test
    (a data entry's ``calib_split`` / ``val_split`` replace the draw: those tables are used whole)."""

    calib: int = 256
    val: int = 256
    test: int | None = None
    seed: int = 42


@dataclass(frozen=True)
class PreprocessSpec:
    """Image preprocessing; ``None`` fields come from the base model (CLIP defaults)."""

    image_size: int | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    interpolation: str = "bicubic"
    max_length: int = 128


@dataclass(frozen=True)
class ZooSpec:
    """A validated zoo spec. ``source`` is the spec file (relative paths were resolved against it)."""

    name: str
    format: str
    base: ModelSpec
    experts: Mapping[str, ModelSpec]
    heads: HeadSpec
    data: Mapping[str, DataSpec]
    splits: SplitSpec = SplitSpec()
    preprocess: PreprocessSpec = PreprocessSpec()
    features: str = "embedding"
    dtype: str = "float32"
    source: str | None = None
    modality: str = "image"
    merged: ModelSpec | None = None  # the user's own merged model, if given
    tokenizer: str | None = None  # a text or generative zoo's tokenizer directory, when not the base's
    generation: Mapping[str, GenTaskSpec] = field(default_factory=lambda: MappingProxyType({}))  # `tasks:`

    @property
    def tasks(self) -> list[str]:
        return list(self.experts)

"""A text zoo from a spec (``modality: text``): HF text encoders, their tokenizer, text or token data.

The models are ``save_pretrained`` directories of one encoder architecture (``AutoModel``: BERT,
RoBERTa, MiniLM, ...), experts dense or PEFT LoRA adapters merged onto the base. The heads read the
mean-pooled, L2-normalised last hidden states (:func:`featcal.zoo.store.mean_pooled`); zero-shot
heads are the same embedding of a prompt per class ("This text is about {class}.") through the
base, times 100 when ``logit_scale`` is on (CLIP's scale, as the real text zoo uses). Data per task:

- ``text``: a ``.txt`` / ``.tsv`` file of ``label<TAB>text`` lines (a seeded fifth of it is the
  test split), or a folder of ``train.txt`` and ``test.txt``; tokenised with the base's tokenizer;
- ``tokens``: a ``.safetensors`` / ``.npz`` file of ``<split>_input_ids``, optional
  ``<split>_attention_mask`` (default: all tokens) and ``<split>_labels``.

Labels of a text file are class names (those of ``heads.classes`` when given, else the file's,
sorted); a token file's are integers, named by ``heads.classes`` or its ``classes`` metadata.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from featcal.model import lora
from featcal.model.checkpoints import read_state_dict
from featcal.zoo.core import TaskData
from featcal.zoo.load import heads as heads_mod
from featcal.zoo.load.data import split_indices
from featcal.zoo.load.loaders import _DTYPES, load_strict, no_init
from featcal.zoo.spec.locate import Found, LocatedData, text_split_file
from featcal.zoo.spec.schema import ZooSpec
from featcal.zoo.store import mean_pooled
from featcal.zoo.tokens import TokenRows

TEMPLATE = "This text is about {}."
LOGIT_SCALE = 100.0  # CLIP's exp(logit_scale), fixed: a text encoder has none
TEST_FRACTION = 5  # a single text file: one example in five is test


def read_lines(path: Path) -> list[tuple[str, str]]:
    """``[(label, text)]`` of a ``label<TAB>text`` file (blank lines skipped)."""
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        label, sep, text = line.partition("\t")
        if not sep or not label.strip() or not text.strip():
            raise ValueError(f"{path}, line {i}: write one example per line as label<TAB>text; got {line[:60]!r}.")
        out.append((label.strip(), text.strip()))
    if not out:
        raise ValueError(f"{path}: no examples (one label<TAB>text line each).")
    return out


def text_splits(located: LocatedData, seed: int) -> dict[str, list[tuple[str, str]]]:
    """``{train, test}`` examples: a folder's two files, or a single file split (seeded, a fifth test)."""
    root = located.root
    if root.is_dir():
        return {s: read_lines(text_split_file(root, s)) for s in ("train", "test")}
    rows = read_lines(root)
    if len(rows) < 2:
        raise ValueError(f"{root}: one example only; a text file needs at least two (train and test).")
    perm = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed + 2)).tolist()
    n_test = max(1, len(rows) // TEST_FRACTION)
    test = set(perm[:n_test])
    return {
        "test": [r for i, r in enumerate(rows) if i in test],
        "train": [r for i, r in enumerate(rows) if i not in test],
    }


def tokenize(tokenizer, texts: list[str], max_length: int) -> TokenRows:
    tok = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    return TokenRows(tok["input_ids"], tok["attention_mask"])


def token_splits(path: Path) -> tuple[dict[str, tuple[TokenRows, torch.Tensor]], list[str] | None]:
    """``({split: (rows, labels)}, class names or None)`` of a token file."""
    import numpy as np

    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: torch.from_numpy(z[k]) for k in z.files if z[k].dtype.kind in "iu"}
            classes = [str(c) for c in z["classes"]] if "classes" in z.files else None
    else:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            arrays = {k: f.get_tensor(k) for k in f.keys()}
            classes = json.loads((f.metadata() or {}).get("classes", "null"))
    out = {}
    for s in ("train", "test"):
        ids, y = arrays.get(f"{s}_input_ids"), arrays.get(f"{s}_labels")
        if ids is None or y is None or ids.dim() != 2:
            raise ValueError(
                f"{path}: a token file needs {s}_input_ids (n, L), {s}_labels (n,) and optionally "
                f"{s}_attention_mask; it has {sorted(arrays)}."
            )
        mask = arrays.get(f"{s}_attention_mask", torch.ones_like(ids))
        out[s] = (TokenRows(ids, mask), y.long())
    return out, classes


def _labelled(task: str, located: LocatedData, spec: ZooSpec, tokenizer) -> tuple[dict, list[str]]:
    """``({train, test}: (TokenRows, labels), class names)`` of one task."""
    named = list(spec.heads.classes.get(task, ()))
    if located.format == "tokens":
        splits, classes = token_splits(located.root)
        classes = named or classes
        if not classes:
            raise ValueError(
                f"data {task!r}: the token file names no classes; give heads.classes.{task} (or file heads)."
            )
        return splits, list(classes)
    if located.format != "text":
        raise ValueError(f"data {task!r}: a {located.format} dataset; a text zoo reads text or token files.")
    rows = text_splits(located, spec.splits.seed)
    classes = named or sorted({label for part in rows.values() for label, _ in part})
    index = {c: i for i, c in enumerate(classes)}
    unknown = sorted({label for part in rows.values() for label, _ in part} - set(index))
    if unknown:
        raise ValueError(f"data {task!r}: labels {unknown[:5]} are not in heads.classes.{task}.")
    out = {}
    for s, part in rows.items():
        ids = tokenize(tokenizer, [t for _, t in part], spec.preprocess.max_length)
        out[s] = (ids, torch.tensor([index[label] for label, _ in part], dtype=torch.long))
    return out, classes


def task_data(task: str, located: LocatedData, spec: ZooSpec, tokenizer) -> TaskData:
    """The task's calib and val (seeded, disjoint, from train) and test splits, tokenised."""
    parts, classes = _labelled(task, located, spec, tokenizer)
    (x_tr, y_tr), (x_te, y_te) = parts["train"], parts["test"]
    for s, y in (("train", y_tr), ("test", y_te)):
        if len(y) and (int(y.max()) >= len(classes) or int(y.min()) < 0):
            raise ValueError(f"data {task!r}: {s} labels in [{int(y.min())}, {int(y.max())}], {len(classes)} classes.")
    s = spec.splits
    idx = split_indices(len(y_tr), len(y_te), s.calib, s.val, s.test, s.seed)
    out = {}
    for name, ids in idx.items():
        x, y = (x_te, y_te) if name == "test" else (x_tr, y_tr)
        out[name] = (x[ids], y[ids])
    return TaskData(task, classes, out)


def load_encoders(paths: dict[str, Path], dtype: torch.dtype, device: str) -> dict[str, nn.Module]:
    """``{role: encoder}`` built from the base's config (``AutoModel``), each loaded strictly; a
    LoRA expert is merged onto the base's weights."""
    from transformers import AutoConfig, AutoModel

    base = paths["base"]
    cfg = AutoConfig.from_pretrained(str(base), local_files_only=True, trust_remote_code=False)
    raw = read_state_dict(base)
    with no_init():
        template = AutoModel.from_config(cfg)
        if not any(".pooler." in f".{k}" for k in raw) and getattr(template, "pooler", None) is not None:
            template = AutoModel.from_config(cfg, add_pooling_layer=False)  # saved without one: unused here
    base_sd = _encoder_weights(template, raw)
    models = {}
    for role, path in paths.items():
        model = copy.deepcopy(template)
        if lora.is_adapter_dir(path):
            sd = lora.LoraAdapter(path, role).merged(base_sd, lora.base_names(base))
        else:
            sd = base_sd if role == "base" else _encoder_weights(template, read_state_dict(path))
        load_strict(model, sd, role)
        models[role] = model.to(device=device, dtype=dtype).eval()
    return models


def _encoder_weights(model: nn.Module, sd: dict) -> dict:
    """A checkpoint's keys on the bare encoder's layout: a task model's (``bert.*``,
    ``roberta.*``) prefix dropped, its task head and position-id buffers left out."""
    own = set(model.state_dict())
    prefix = getattr(model, "base_model_prefix", "") + "."
    out = {}
    for k, v in sd.items():
        key = k.removeprefix(prefix) if k.removeprefix(prefix) in own else k
        if key in own:
            out[key] = v
    return out


def zero_shot_heads(base: nn.Module, tokenizer, spec: ZooSpec, classes: dict[str, list[str]]) -> dict[str, nn.Linear]:
    """Per task, each class's prompt through the base (mean-pooled, normalised) as its head row."""
    scale = LOGIT_SCALE if spec.heads.logit_scale else 1.0
    length = spec.preprocess.max_length

    def encode(texts: list[str]) -> torch.Tensor:
        return mean_pooled(base, tokenize(tokenizer, texts, length))

    out = {}
    for t, names in classes.items():
        templates = list(spec.heads.templates.get(t, (TEMPLATE,)))
        out[t] = heads_mod.linear_head(heads_mod.zero_shot_weights(encode, names, templates), scale=scale)
    return out


# A directory holding one of these has tokenizer files for transformers to read.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
TOKENIZER_FIX = (
    "Fix: give the spec's `tokenizer:` (the Your models form's tokenizer field) the directory of the tokenizer "
    "the base was trained with (e.g. the original model's save_pretrained directory, tokenizer.json in it), "
    "or save it next to the base (tokenizer.save_pretrained)."
)


def load_tokenizer(folder: Path):
    """The tokenizer in ``folder`` (``AutoTokenizer``, offline, no remote code). A folder without
    tokenizer files, or whose files transformers cannot read, is a ``ValueError`` naming the folder,
    what is wrong in a sentence and :data:`TOKENIZER_FIX` (never transformers' own wording alone)."""
    from transformers import AutoTokenizer

    if not folder.exists():
        raise ValueError(f"{folder}: no such directory for the tokenizer. {TOKENIZER_FIX}")
    if folder.is_dir() and not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"{folder}: no tokenizer files there (no {', '.join(TOKENIZER_FILES[:3])}, ...). {TOKENIZER_FIX}"
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as err:  # transformers raises ValueError, OSError, ImportError, TypeError for unreadable files
        text = str(err)
        why = (
            "its tokenizer is a sentencepiece one and the sentencepiece package is not installed "
            "(pip install sentencepiece), and it has no tokenizer.json"
            if "sentencepiece" in text or "tiktoken" in text
            else f"transformers cannot read its tokenizer files ({type(err).__name__}: "
            f"{(text.strip().splitlines() or [''])[0][:200]})"
        )
        raise ValueError(f"{folder}: {why}. {TOKENIZER_FIX}") from None


def load_parts(spec: ZooSpec, found: Found, device: str = "cpu") -> dict:
    """The zoo's parts, keywords of :class:`featcal.zoo.core.Zoo` (without ``name`` and ``meta``)."""
    roles = ["base"] + [f"expert:{t}" for t in spec.tasks] + (["merged"] if spec.merged else [])
    models = load_encoders({r: found.models[r] for r in roles}, _DTYPES[spec.dtype], device)
    tokenizer = load_tokenizer(Path(spec.tokenizer) if spec.tokenizer else found.models["base"])
    data = {t: task_data(t, found.data[t], spec, tokenizer) for t in spec.tasks}
    classes = {t: data[t].classes for t in spec.tasks}
    if spec.heads.type == "file":
        heads = heads_mod.load_file_heads(found.heads_file, spec.tasks)
    else:
        with torch.no_grad():
            heads = zero_shot_heads(models["base"], tokenizer, spec, classes)
    for t in spec.tasks:
        if heads[t].out_features != len(classes[t]):
            n, m = len(classes[t]), heads[t].out_features
            raise ValueError(f"task {t!r}: {n} classes in the data, {m} outputs in its head.")
    return {
        "base": models["base"],
        "experts": {t: models[f"expert:{t}"] for t in spec.tasks},
        "heads": heads,
        "data": data,
        "features": mean_pooled,
        "given_merged": models.get("merged"),
    }

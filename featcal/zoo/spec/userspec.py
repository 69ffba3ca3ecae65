"""A zoo spec for the user's own models, from folders: what the app's "Your models" form
writes (the YAML format: docs/zoos.md, :mod:`featcal.zoo.spec.schema`).

- :func:`find_tasks`: the tasks of a data folder, one entry per task: ``<task>/`` holding
  ``train/`` and ``test/`` class folders of images (or a ``datasets`` / parquet layout, or
  ``train.txt`` and ``test.txt``), a ``<task>.safetensors`` / ``<task>.npz`` file of images
  (``<split>_inputs``) or tokens (``<split>_input_ids``), or a ``<task>.txt`` / ``.tsv`` file of
  ``label<TAB>text`` lines; :func:`data_kind` says which (image, text, tokens);
- :func:`model_kind`: a model directory's kind (a dense ``save_pretrained`` directory, a
  PEFT LoRA adapter, which the zoo's loader merges onto the base, an open_clip checkpoint
  file), checked before anything is written;
- :func:`user_spec` builds the spec dict (validated by :func:`featcal.zoo.spec.parsing.from_dict`;
  text or token data make a ``modality: text`` zoo; an optional merged model of the user's own
  is the spec's ``merged:``), :func:`spec_text` its YAML, :func:`write_spec` writes it, never
  over a file featcal did not write;
- before writing, :func:`load_checked` loads the zoo with the zoo loader itself (what stops it is a
  :class:`UserSpecError` in the loader's words), :func:`preset_of` names the preset the app
  calibrates it with, and :func:`refuse_generative` turns a Llama-family or T5 base, which makes no
  zoo spec yet, into the ``featcal calibrate`` command line (after that command's own checks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

import yaml

from featcal.model import lora
from featcal.zoo.io import one_load_at_a_time
from featcal.zoo.spec import locate, parsing, schema

HEADER = "# featcal zoo spec, written by featcal's app (docs/zoos.md documents every key)\n"
TENSOR_SUFFIXES = (".safetensors", ".npz")
TEXT_SUFFIXES = locate.TEXT_SUFFIXES


class UserSpecError(ValueError):
    """What the form was given cannot make a zoo; the message names the entry and the fix, and
    ``command`` is the ``featcal`` command line to run instead, where there is one."""

    def __init__(self, message: str, command: str | None = None):
        super().__init__(message)
        self.command = command


def _path(p: str | os.PathLike) -> Path:
    return Path(os.path.expandvars(str(p))).expanduser()


def find_tasks(root: str | os.PathLike) -> dict[str, str]:
    """``{task: path}`` of the datasets in ``root`` (sorted by task): sub-folders holding
    ``train/`` and ``test/`` (image class folders, a ``save_to_disk`` or parquet layout), and
    ``.safetensors`` / ``.npz`` files (the task is the file's stem)."""
    folder = _path(root)
    if not folder.is_dir():
        raise UserSpecError(f"data folder {str(folder)!r} does not exist (or is not a folder).")
    tasks = {}
    for p in sorted(folder.iterdir()):
        split_dirs = (p / "train").exists() and (p / "test").exists()
        text_dir = all(locate.text_split_file(p, s) for s in ("train", "test"))
        if p.is_dir() and (split_dirs or text_dir or (p / "dataset_dict.json").is_file()):
            tasks[p.name] = str(p)
        elif p.is_file() and p.suffix in TENSOR_SUFFIXES + TEXT_SUFFIXES:
            tasks[p.stem] = str(p)
    if not tasks:
        raise UserSpecError(
            f"data folder {str(folder)!r} holds no dataset: give one sub-folder per task with train/ and test/ "
            "class folders of images (<task>/train/<class>/<image>), a <task>.safetensors / <task>.npz file "
            "of train_inputs, train_labels, test_inputs, test_labels (or of train_input_ids, ... for tokens), "
            "or a <task>.txt file of label<TAB>text lines."
        )
    return tasks


def data_kind(path: str | os.PathLike) -> str:
    """``image``, ``text`` (``label<TAB>text`` lines: a ``.txt`` / ``.tsv`` file, or a folder of
    ``train.txt`` and ``test.txt``) or ``tokens`` (a tensors file of ``train_input_ids``); a
    tensors file of bare ``input_ids`` (the streamed ``featcal calibrate`` format) is refused."""
    p = _path(path)
    if p.is_dir():
        return "text" if all(locate.text_split_file(p, s) for s in ("train", "test")) else "image"
    if p.suffix in TEXT_SUFFIXES:
        return "text"
    keys = locate.tensor_keys(p) if p.suffix in TENSOR_SUFFIXES and p.is_file() else []
    if "train_input_ids" in keys:
        return "tokens"
    if any(k.split(".")[-1] == "input_ids" for k in keys):
        raise UserSpecError(
            f"{str(p)!r} holds bare input_ids (featcal calibrate's --data format): a zoo's token file needs "
            "train_input_ids, train_labels, test_input_ids, test_labels (and optionally *_attention_mask)."
        )
    return "image"


def folder_classes(path: str | os.PathLike) -> list[str]:
    """The class names of an image-folder dataset (its ``train/`` sub-folders, sorted; the
    order the labels follow), ``[]`` for other layouts."""
    train = _path(path) / "train"
    return sorted(p.name for p in train.iterdir() if p.is_dir()) if train.is_dir() else []


def train_size(path: str | os.PathLike) -> int | None:
    """Examples in a dataset's train split (image folders, text and tensor files; None for others;
    a single text file's: the four fifths that are not test)."""
    p = _path(path)
    if p.is_dir() and locate.text_split_file(p, "train"):
        return _lines(locate.text_split_file(p, "train"))
    if (p / "train").is_dir() and not (p / "dataset_dict.json").is_file():
        return sum(1 for c in (p / "train").iterdir() if c.is_dir() for f in c.iterdir() if f.is_file())
    if p.suffix in TEXT_SUFFIXES and p.is_file():
        n = _lines(p)
        return n - max(1, n // 5)  # text_spec.TEST_FRACTION
    if p.suffix == ".npz":
        import numpy as np

        with np.load(p) as arrays:
            return len(arrays["train_labels"]) if "train_labels" in arrays else None
    if p.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(p), "pt") as f:
            return f.get_slice("train_labels").get_shape()[0] if "train_labels" in f.keys() else None
    return None


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text(errors="replace").splitlines() if line.strip())


def token_classes(path: str | os.PathLike) -> list[str] | None:
    """The class names a token file stores (``classes``: an npz array or safetensors metadata)."""
    p = _path(path)
    if p.suffix == ".npz":
        import numpy as np

        with np.load(p, allow_pickle=False) as z:
            return [str(c) for c in z["classes"]] if "classes" in z.files else None
    from safetensors import safe_open

    with safe_open(str(p), "pt") as f:
        raw = (f.metadata() or {}).get("classes")
    return json.loads(raw) if raw else None


def default_splits(data: Mapping[str, str]) -> dict:
    """The spec's splits for ``data``: calib and val 256 examples per task each, or halves of
    the smallest train split when it holds fewer than 512; all of test."""
    sizes = [n for n in (train_size(p) for p in data.values()) if n]
    n = min(sizes) if sizes else 512
    calib = min(256, max(1, n // 2))
    return {"calib": calib, "val": max(1, min(256, n - calib)), "test": None, "seed": 42}


def model_kind(path: str | os.PathLike) -> str:
    """``dense`` (a ``save_pretrained`` directory: ``config.json`` and weights), ``lora`` (a PEFT
    adapter directory: ``adapter_config.json``) or ``file`` (a checkpoint file, open_clip's);
    raises :class:`UserSpecError` for anything else."""
    p = _path(path)
    if p.is_file():
        return "file"
    if not p.is_dir():
        raise UserSpecError(f"model {str(p)!r} does not exist.")
    if lora.is_adapter_dir(p):
        return "lora"
    if (p / "config.json").is_file():
        return "dense"
    raise UserSpecError(
        f"{str(p)!r} is not a model directory: no config.json (a save_pretrained directory) and no "
        "adapter_config.json (a PEFT LoRA adapter) in it."
    )


def lora_supported() -> bool:
    """Whether this featcal's zoo specs load LoRA adapter experts (:mod:`featcal.model.lora`)."""
    return hasattr(lora, "LoraAdapter")


def user_spec(
    name: str,
    base: str,
    experts: Mapping[str, str],
    data: Mapping[str, str],
    heads: Mapping[str, str] | None = None,
    fmt: str = "hf",
    splits: Mapping[str, int] | None = None,
    merged: str | None = None,
    features: str = "embedding",
    tokenizer: str | None = None,
) -> dict:
    """The spec dict of a zoo of the user's models: ``base`` and ``experts`` (``{task: path}``,
    dense directories, or LoRA adapters where this featcal loads them), ``data``
    (``{task: path}``, e.g. :func:`find_tasks`; text or token data make a text zoo), ``heads``
    (default zero-shot: through the base's text tower, prompted with the class folders' names, or
    for text the base itself on the files' labels; ``{"type": "file", "path": ...}`` for trained
    heads), ``merged`` (optional: a merged model of the user's own, e.g. a mergekit output, which
    the app offers as the merger "given"), ``features`` (what the heads read: ``pooled`` for a
    ``CLIPVisionModel`` base, which has no projection, with file heads), ``tokenizer`` (a text zoo's
    tokenizer directory, when the base has none). Every path is checked and made absolute; the dict is
    validated as a spec (:func:`featcal.zoo.spec.parsing.from_dict`) before it is returned; whether it
    loads is :func:`load_checked`'s to tell."""
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise UserSpecError(f"zoo name {name!r}: use letters, digits, '-' and '_' only.")
    if not experts:
        raise UserSpecError("no experts: give at least one task's expert.")
    missing = sorted(set(experts) - set(data))
    if missing:
        raise UserSpecError(f"expert(s) {missing} have no data: add a dataset per task to the data folder.")
    kinds = {t: data_kind(data[t]) for t in experts}
    text = sorted(t for t, k in kinds.items() if k != "image")
    if text and len(text) < len(kinds):
        raise UserSpecError(f"the tasks mix image and text data ({kinds}): a zoo reads one or the other.")
    spec = {"name": name, "format": fmt, **({"modality": "text"} if text else {})}
    spec.update(_model_entries(base, experts, merged, fmt))
    spec.update({"features": features} if features != "embedding" else {})
    spec.update({"tokenizer": str(_path(tokenizer))} if tokenizer else {})
    spec["heads"] = dict(heads or {"type": "zero_shot"})
    spec["data"] = {t: {"path": str(_path(data[t]))} for t in experts}
    spec["splits"] = dict(splits or default_splits({t: data[t] for t in experts}))
    if spec["heads"].get("type", "zero_shot") == "zero_shot":  # the prompts name the classes
        named = {t: (token_classes if kinds[t] == "tokens" else folder_classes)(data[t]) for t in experts}
        unnamed = [t for t in experts if kinds[t] == "tokens" and not named[t]]
        if unnamed:
            raise UserSpecError(
                f"token file(s) of {unnamed} name no classes, which zero-shot heads need: store them (an npz "
                "`classes` array, safetensors metadata `classes`), or give a heads file."
            )
        spec["heads"].setdefault("classes", {t: c for t, c in named.items() if c})
    if spec["heads"].get("path"):
        spec["heads"]["path"] = str(_path(spec["heads"]["path"]))
    try:
        parsing.from_dict(spec, root=Path.cwd(), source=f"{name}.yaml")
    except schema.SpecError as exc:
        raise UserSpecError(str(exc)) from exc
    return spec


def _model_entries(base: str, experts: Mapping[str, str], merged: str | None, fmt: str) -> dict:
    """``{base, experts, merged}`` entries of the spec, each path checked (kind, LoRA rules)."""
    roles = [("base", base), *((f"expert {t!r}", p) for t, p in experts.items())]
    entries = {}
    for role, path in roles + ([("merged", merged)] if merged else []):
        kind = model_kind(path)
        if kind == "lora" and not role.startswith("expert"):
            raise UserSpecError(
                f"{role}: {path!r} is a LoRA adapter; the {role} model must be dense (a save_pretrained directory)."
            )
        if kind == "lora" and not lora_supported():
            raise UserSpecError(
                f"{role}: {path!r} is a LoRA adapter, which this version of featcal does not load yet; "
                "merge it into its base (peft's merge_and_unload, then save_pretrained) and give that directory."
            )
        if kind == "file" and fmt != "open_clip":
            raise UserSpecError(f"{role}: {path!r} is a file; hf models are save_pretrained directories.")
        entries[role] = {"path": str(_path(path))}  # an adapter directory too: the loader merges it onto the base
    out = {"base": entries["base"], "experts": {t: entries[f"expert {t!r}"] for t in experts}}
    return {**out, "merged": entries["merged"]} if merged else out


def spec_text(spec: dict) -> str:
    """The spec as YAML, keys in the order written, under featcal's header line."""
    return HEADER + yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)


def check_writable(path: str | os.PathLike) -> Path:
    """``path``, expanded, when :func:`write_spec` may write it: it does not exist, or featcal
    wrote it (it starts with :data:`HEADER`)."""
    p = _path(path)
    if p.exists() and not (p.is_file() and p.read_text(errors="replace").startswith(HEADER)):
        raise UserSpecError(f"{str(p)!r} exists and featcal did not write it: choose another zoo name or folder.")
    return p


def write_spec(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (folders made); an existing file is replaced only when
    featcal wrote it (:func:`check_writable`)."""
    p = check_writable(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, p)
    return p


# ----------------------------------------------------------------------------- before writing


@one_load_at_a_time
def load_checked(spec: dict, path: str | os.PathLike, device: str = "cpu"):
    """The :class:`~featcal.zoo.core.Zoo` that ``spec`` makes once written to ``path``, loaded by the
    zoo loader itself (:func:`featcal.zoo.load.from_spec.load`, which the app and every command run on the
    written file) before anything is written, its models on ``device``: whatever would stop it loading is a
    :class:`UserSpecError` carrying the loader's own message."""
    from featcal.zoo.load import from_spec as spec_mod

    p = _path(path)
    try:
        return spec_mod.load(parsing.from_dict(spec, root=p.parent, source=str(p)), device=device)
    except Exception as exc:  # the loader's ValueErrors, missing files, LoRA and shape errors alike
        kind = "" if isinstance(exc, (ValueError, FileNotFoundError)) else f" ({type(exc).__name__})"
        raise UserSpecError(f"Nothing was written: the zoo would not load{kind}. {exc}") from exc


def preset_of(zoo) -> tuple[str, str]:
    """``(preset, why)``: the preset the app calibrates ``zoo`` with (:func:`featcal.config.preset_for_zoo`)
    and the architecture it was read from (:func:`featcal.config.preset_for_model`)."""
    from featcal.config import preset_for_model, preset_for_zoo

    return preset_for_zoo(zoo), preset_for_model(zoo.base)[1]


def base_preset(base: str | os.PathLike) -> tuple[str, str] | None:
    """:func:`featcal.config.preset_for` of the base directory's ``config.json`` (what
    ``featcal calibrate --base`` picks), None when it has none."""
    from featcal.config import preset_for

    cfg = _path(base) / "config.json"
    return preset_for(json.loads(cfg.read_text())) if cfg.is_file() else None


def refuse_generative(base: str, experts: Mapping[str, str]) -> None:
    """A generative language model's base (Llama-family, T5: a language preset) cannot make a zoo
    spec yet (those are CLIP or text-encoder classifiers): raise :class:`UserSpecError` with the
    ``featcal calibrate`` command that calibrates it. The command's own checks of the base and its
    experts (:func:`featcal.streaming.run.open_checkpoints`, LoRA adapters included) run first, so
    an expert it would refuse is refused here in its words, and one it takes is taken here too."""
    from featcal.config import LANGUAGE_PRESETS
    from featcal.streaming.run import open_checkpoints

    found = base_preset(base)
    if found is None or found[0] not in LANGUAGE_PRESETS:
        return
    preset, why = found
    try:
        open_checkpoints(str(_path(base)), {t: str(_path(p)) for t, p in experts.items()}, None, None)
    except (ValueError, OSError) as exc:
        raise UserSpecError(f"{exc} (featcal calibrate --expert refuses it too.)") from exc
    pairs = " ".join(f"--expert {t}={_path(p)}" for t, p in experts.items()) or "--expert TASK=DIR"
    command = f"featcal calibrate --base {_path(base)} {pairs} --data TOKENS.safetensors --out OUT_DIR"
    checked = "its experts fit it (featcal calibrate's own checks passed)" if experts else "give its experts"
    raise UserSpecError(
        f"{str(_path(base))!r} is a generative language model ({why}; preset {preset}), and zoos are "
        f"image (CLIP) or text-encoder classifiers for now, so this form cannot make one of it; {checked}. "
        "Calibrate it from the command line with the command below, where TOKENS.safetensors holds "
        "<task>.input_ids (and optionally <task>.attention_mask) of each task's calibration text "
        "(featcal.model.checkpoints.save_token_data writes one; docs/zoos.md, 'Data'). The built-in smollm2 "
        "zoo (sidebar) shows the app's LLM pages.",
        command=command,
    )

"""Finding, offline, everything a zoo spec names: models, head files and datasets.

Nothing here loads a model or decodes an image, and nothing touches the network.
A model entry is found

- at its local ``path`` (an HF ``save_pretrained`` directory, or an open_clip
  checkpoint file), or
- for an HF ``id`` (or an open_clip ``pretrained`` tag, which names an HF repo),
  in the local Hugging Face cache (:func:`featcal.zoo.spec.resolve.hf_snapshot`);

a data entry at its local ``path`` or, for an HF ``hub`` dataset, in the same
cache, in one of four formats:

- ``image_folder``: ``<split>/<class>/<image>`` folders;
- ``arrow``: a ``datasets.save_to_disk`` directory;
- ``parquet``: parquet files per split;
- ``tensors``: a ``.safetensors`` or ``.npz`` file with ``<split>_inputs`` / ``<split>_labels``;
- ``text`` (a text zoo): a ``.txt`` / ``.tsv`` file of ``label<TAB>text`` lines, or a folder of
  ``<split>.txt`` files; ``tokens``: a ``.safetensors`` / ``.npz`` file of ``<split>_input_ids``.

:func:`locate` finds every model, head file and dataset of a spec and lists what is
missing; :func:`locate_all` raises one :class:`MissingResourcesError` for all of it.
Loading what was found is :mod:`featcal.zoo.load.loaders`' (models), :mod:`featcal.zoo.load.heads`'
and :mod:`featcal.zoo.load.data`'s job.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from featcal.model import lora
from featcal.model.checkpoints import HF_WEIGHTS
from featcal.zoo.spec.resolve import Missing, MissingResourcesError, hf_fix, hf_snapshot
from featcal.zoo.spec.schema import DataSpec, ModelSpec, ZooSpec

OPEN_CLIP_HUB_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.bin")
TEXT_SUFFIXES = (".txt", ".tsv")


# ----------------------------------------------------------------------------- data


@dataclass(frozen=True)
class LocatedData:
    """A task's dataset on disk: ``format`` and its ``root`` (a directory or a tensors file)."""

    spec: DataSpec
    format: str
    root: Path


def _detect_format(root: Path, spec: DataSpec) -> tuple[str | None, str]:
    """``(format, '')`` for a usable dataset at ``root`` (every split it reads there), else ``(None, why not)``."""
    splits = spec.splits_read
    if root.is_file():
        if root.suffix in (".safetensors", ".npz"):
            return ("tokens" if f"{spec.train_split}_input_ids" in tensor_keys(root) else "tensors"), ""
        if root.suffix in TEXT_SUFFIXES:
            return "text", ""
        return None, f"a {root.suffix or 'plain'} file; tensors must be .safetensors or .npz, text .txt or .tsv"
    if not root.is_dir():
        return None, "does not exist"
    if all(text_split_file(root, s) for s in splits):
        return "text", ""
    if (root / "dataset_dict.json").is_file() or all((root / s / "state.json").is_file() for s in splits):
        absent = [s for s in splits if not (root / s / "state.json").is_file()]
        return ("arrow", "") if not absent else (None, f"datasets.save_to_disk dir without split(s) {absent}")
    if any(root.rglob("*.parquet")):
        absent = [s for s in splits if not parquet_files(root, s)]
        there = sorted({p.stem.split("-")[0] for p in root.rglob("*.parquet")})
        why = f"parquet files, none for split(s) {absent} (file names begin {there})"
        return ("parquet", "") if not absent else (None, why)
    if all((root / s).is_dir() for s in splits):
        return "image_folder", ""
    return None, (
        f"not a dataset: expected {spec.train_split}/ and {spec.test_split}/ class folders, a "
        "datasets.save_to_disk dir, parquet files, or a .safetensors/.npz file"
    )


def tensor_keys(path: Path) -> list[str]:
    """The array names in a ``.safetensors`` or ``.npz`` file (nothing else is read)."""
    if path.suffix == ".npz":
        import numpy as np

        with np.load(path, allow_pickle=False) as z:
            return list(z.files)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def text_split_file(root: Path, split: str) -> Path | None:
    """``root/<split>.txt`` (or ``.tsv``) when it exists: one split of a text folder."""
    return next((root / f"{split}{s}" for s in TEXT_SUFFIXES if (root / f"{split}{s}").is_file()), None)


def parquet_files(root: Path, split: str) -> list[Path]:
    """Parquet files of one split: ``<split>-*.parquet``, ``<split>.parquet`` or under a ``<split>/`` dir."""
    out = []
    for p in sorted(root.rglob("*.parquet")):
        rel = p.relative_to(root).parts
        if split in rel[:-1] or p.stem == split or p.stem.startswith(f"{split}-"):
            out.append(p)
    return out


def locate_data(spec: DataSpec) -> tuple[LocatedData | None, Missing | None]:
    """Find one task's data: its local ``path`` first, then the HF ``hub`` dataset in the cache."""
    looked = []
    if spec.path is not None:
        root = Path(spec.path)
        fmt, why = _detect_format(root, spec)
        if fmt is not None and spec.format not in ("auto", fmt):
            fmt, why = None, f"found {fmt}, the spec says format {spec.format}"
        if fmt is not None:
            return LocatedData(spec, fmt, root), None
        looked.append(f"local path {root} ({why})")
    if spec.hub:
        snap, where = hf_snapshot(spec.hub, "dataset", spec.revision)
        if snap is not None:
            root = snap / (spec.subset or "")
            fmt, why = _detect_format(root, spec)
            if fmt is not None:
                return LocatedData(spec, fmt, root), None
            where = f"{where} ({why})"
        looked.append(where)
    src = spec.hub or spec.path
    splits = " and ".join(spec.splits_read)
    fix = (hf_fix(spec.hub, "dataset", spec.revision) + "; or " if spec.hub else "") + (
        f"put it at {spec.path} (its {splits} split(s): parquet files, a save_to_disk dir, class folders of "
        "images, or a .safetensors/.npz file)"
        if spec.path
        else "give a local `path:`"
    )
    named = [f"{k}: {getattr(spec, k)}" for k in ("calib_split", "val_split") if getattr(spec, k) is not None]
    if named:
        fix += f"; or fix {', '.join(named)} in the spec to name a split the data has"
    return None, Missing(f"data {spec.task!r}: {src}", tuple(looked), fix)


# ----------------------------------------------------------------------------- models and the whole spec


@dataclass
class Found:
    """Local paths of everything a spec needs (the output of :func:`locate_all`)."""

    models: dict[str, Path] = field(default_factory=dict)  # "base", "expert:<task>", "merged", "text_model"
    data: dict[str, LocatedData] = field(default_factory=dict)
    heads_file: Path | None = None

    def describe(self) -> dict[str, str]:
        out = {role: str(p) for role, p in self.models.items()}
        out.update({f"data:{t}": f"{d.format} {d.root}" for t, d in self.data.items()})
        if self.heads_file:
            out["heads"] = str(self.heads_file)
        return out

    def paths(self) -> dict[str, str]:
        """``{what: path}`` of every model, head file and dataset found (what an output must not touch)."""
        out = {f"model {role}": str(p) for role, p in self.models.items()}
        out.update({f"the data of task {t!r}": str(d.root) for t, d in self.data.items()})
        if self.heads_file:
            out["the heads file"] = str(self.heads_file)
        return out


def _hf_dir_problem(path: Path) -> str | None:
    if not path.is_dir():
        return "not a directory" if path.exists() else "does not exist"
    if lora.is_adapter_dir(path):  # a PEFT LoRA adapter on the base (an expert only)
        return None if any((path / w).is_file() for w in lora.WEIGHTS) else f"no {' or '.join(lora.WEIGHTS)}"
    if not (path / "config.json").is_file():
        return "no config.json"
    if not any((path / w).is_file() for w in HF_WEIGHTS):
        return f"no weights ({', '.join(HF_WEIGHTS)})"
    return None


def locate_model(spec: ModelSpec, what: str) -> tuple[Path | None, Missing | None]:
    """Find one model entry on this machine: ``(path, None)`` or ``(None, Missing)``."""
    if spec.pretrained:
        return _locate_open_clip_tag(spec, what)
    looked = []
    if spec.path is not None:
        p = Path(spec.path)
        if spec.format == "hf":
            problem = _hf_dir_problem(p)
        else:
            problem = (
                None if p.is_file() else ("a directory, expected a checkpoint file" if p.is_dir() else "does not exist")
            )
        if problem is None:
            return p, None
        looked.append(f"local path {p} ({problem})")
    if spec.id is not None:
        snap, where = hf_snapshot(spec.id, "model", spec.revision)
        problem = _hf_dir_problem(snap) if snap is not None else None
        if snap is not None and problem is None:
            return snap, None
        looked.append(where if problem is None else f"{where} ({problem}: incomplete download)")
        return None, Missing(f"{what}: HF model {spec.id}", tuple(looked), hf_fix(spec.id, "model", spec.revision))
    return None, Missing(
        f"{what}: {spec.format} model at {spec.path}",
        tuple(looked),
        "check the path (and the environment variables in it), or give an HF `id`.",
    )


def _locate_open_clip_tag(spec: ModelSpec, what: str) -> tuple[Path | None, Missing | None]:
    import open_clip

    cfg = open_clip.get_pretrained_cfg(spec.arch, spec.pretrained)
    label = f"{what}: open_clip {spec.arch} pretrained={spec.pretrained!r}"
    if not cfg:
        tags = open_clip.list_pretrained_tags_by_model(spec.arch)
        return None, Missing(
            label,
            ("open_clip's list of pretrained weights",),
            f"use one of the tags open_clip knows for {spec.arch}: {tags}.",
        )
    hub = cfg.get("hf_hub", "").strip("/")
    if not hub:
        return None, Missing(
            label,
            ("open_clip's pretrained config (no HF hub copy)",),
            "download the checkpoint yourself and give it as `path:` with `arch:`.",
        )
    parts = hub.split("/")
    repo, fname = "/".join(parts[:2]), "/".join(parts[2:]) or None
    snap, where = hf_snapshot(repo, "model")
    names = (fname,) if fname else OPEN_CLIP_HUB_FILES
    if snap is not None:
        for name in names:
            if (snap / name).is_file():
                return snap / name, None
        where = f"{where} (none of {list(names)})"
    return None, Missing(label, (where,), hf_fix(repo))


def locate(spec: ZooSpec) -> tuple[Found, list[Missing]]:
    """Look for every model, head file and dataset of ``spec``; never raises for a missing one."""
    os.environ["HF_HUB_OFFLINE"] = "1"  # any later transformers/huggingface_hub call stays offline
    found, missing = Found(), []
    entries = [("base", "base", spec.base)] + [(f"expert:{t}", f"expert {t!r}", m) for t, m in spec.experts.items()]
    if spec.merged is not None:
        entries.append(("merged", "merged", spec.merged))
    if spec.heads.type == "zero_shot" and spec.heads.text_model is not None:
        entries.append(("text_model", "heads.text_model", spec.heads.text_model))
    for role, what, m in entries:
        path, miss = locate_model(m, what)
        if miss is None and role != "expert" and not role.startswith("expert:") and lora.is_adapter_dir(path):
            miss = Missing(f"{what}: {path}", (f"{path} (a LoRA adapter)",), "a LoRA adapter can be an expert only.")
        if miss:
            missing.append(miss)
        else:
            found.models[role] = path
    if spec.heads.type == "file":
        p = Path(spec.heads.path)
        if p.is_file():
            found.heads_file = p
        else:
            missing.append(
                Missing(
                    f"heads file {p}",
                    (f"local path {p} (does not exist)",),
                    "check heads.path; it is a safetensors file with <task>.weight / <task>.bias.",
                )
            )
    for task, d in spec.data.items():
        loc, miss = locate_data(d)
        if miss:
            missing.append(miss)
        else:
            found.data[task] = loc
    return found, missing


def locate_all(spec: ZooSpec) -> Found:
    """:func:`locate`, raising one :class:`MissingResourcesError` when anything is missing."""
    found, missing = locate(spec)
    if missing:
        raise MissingResourcesError(missing, spec.source)
    return found

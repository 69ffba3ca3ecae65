"""A zoo on disk: the directory layout the demo zoo is cached in.

::

    <zoo>/meta.json              kind, tasks and classes, pixel transform, content hash, build facts
    <zoo>/base/                  the pretrained model (``save_pretrained``, safetensors; float16
                                 when ``meta["storage_dtype"]`` says so, loaded back as float32)
    <zoo>/experts/<task>/        one fine-tuned expert per task (same format)
    <zoo>/heads.safetensors      ``<task>.weight`` (classes, d) and ``<task>.bias`` (classes,)
    <zoo>/data.npz               ``<task>/<split>/x`` (n, H, W, 3) uint8, ``<task>/<split>/y`` (n,) int64
                                 (text zoos: ``x`` (n, L) int32 token ids and ``mask`` (n, L) uint8)
    <zoo>/tokenizer/             text zoos: the tokenizer the token ids come from

An LLM zoo (``meta["scoring"] == "lm"``, the built-in smollm2) keeps its examples as a generative
zoo spec and its tables instead of data.npz and heads (``spec/``: :mod:`featcal.zoo.load.lm_dir`,
which loads it; :func:`read_zoo_dir` refuses it, naming that loader).

``meta["content_sha256"]`` is the sha256 over the paths and sha256s of every
file except ``meta.json``; :func:`read_zoo_dir` checks it, so a corrupted
cache is reported rather than silently used. Any directory in this layout can
be passed where a zoo name is expected (``featcal eval --zoo DIR``).
"""

from __future__ import annotations

import copy
import datetime as _dt
import io
import json
import os
import zipfile
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
from torch import nn

from featcal.model.allowed import check_model_kwargs, library_model_class
from featcal.util import outdir
from featcal.zoo.core import SPLITS, TaskData, Zoo
from featcal.zoo.io import atomic_dir, quiet_transformers, tree_sha256
from featcal.zoo.score.lm import lm_mean_hidden
from featcal.zoo.tokens import TokenRows, as_batch, masked_mean

KIND = "featcal-zoo"
LAYOUT_VERSION = 1
META = "meta.json"


class ZooCorruptedError(ValueError):
    """A cached zoo's files do not match the hash recorded when it was built."""


# ------------------------------------------------------------------ features


def pooler_output(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """``(n, d)``: the post-LayerNorm class token of a HF ``CLIPVisionModel``."""
    return model(pixel_values=inputs).pooler_output


def mean_pooled(model: nn.Module, inputs) -> torch.Tensor:
    """``(n, d)``: a text encoder's last hidden states averaged over each example's tokens
    (padding left out), L2-normalised: the sentence embedding of sentence-transformers'
    MiniLM models. ``inputs``: :class:`~featcal.zoo.tokens.TokenRows` or a dict batch."""
    batch = as_batch(inputs)
    device = next(model.parameters()).device
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state  # (n, T, d)
    return torch.nn.functional.normalize(masked_mean(hidden, mask), dim=-1)


FEATURES = {"pooler_output": pooler_output, "mean_pooled": mean_pooled, "lm_mean_hidden": lm_mean_hidden}


# ------------------------------------------------------------------ pixels


def to_pixels(images: np.ndarray | torch.Tensor, mean: float = 0.5, std: float = 0.5) -> torch.Tensor:
    """uint8 ``(n, H, W, 3)`` -> float ``(n, 3, H, W)``, scaled to [0, 1] then normalised
    (a tensor stays on its device)."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    x = images.permute(0, 3, 1, 2).float() / 255.0
    return (x - mean) / std


# ------------------------------------------------------------------ write


def write_zoo_dir(
    path: str | os.PathLike,
    *,
    name: str,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    heads: Mapping[str, nn.Linear],
    arrays: Mapping[str, Mapping[str, tuple[np.ndarray, np.ndarray]]],
    classes: Mapping[str, list[str]],
    features: str = "pooler_output",
    extra_meta: dict | None = None,
    force: bool = False,
    tokenizer=None,
    storage_dtype: str = "float32",
    extra_files: Mapping[str, str | bytes] | None = None,
) -> Path:
    """Write a zoo atomically (see the module docstring for the layout).

    ``arrays[task][split] = (images uint8 (n, H, W, 3), labels int64 (n,))``, or for a
    text zoo ``(TokenRows, labels)`` (then pass the ``tokenizer`` the ids come from).
    ``storage_dtype="float16"`` stores the models at half the size (the loader casts
    them back to float32, so the loaded zoo *is* the rounded one; heads stay float32).
    ``extra_files``: ``{relative name: text or bytes}`` written beside (and hashed with) the rest.
    Without ``heads`` or ``arrays`` (an LLM zoo: its examples are in ``extra_files``), no
    heads.safetensors or data.npz is written.
    """
    from safetensors.torch import save_file

    if features not in FEATURES:
        raise ValueError(f"unknown feature reader {features!r}; choose one of {sorted(FEATURES)}.")
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"unknown storage_dtype {storage_dtype!r}; choose one of {sorted(STORAGE_DTYPES)}.")
    with atomic_dir(path, force=force, kind="zoo", wait=True) as tmp, quiet_transformers():
        _save_model(base, tmp / "base", storage_dtype)
        for task, model in experts.items():
            _save_model(model, tmp / "experts" / task, storage_dtype)
        if heads:
            tensors = {f"{t}.{k}": v.detach().float() for t, h in heads.items() for k, v in h.state_dict().items()}
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "heads.safetensors"))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp / "tokenizer"))
        if arrays:
            save_npz(tmp / "data.npz", _flat_arrays(arrays))
        write_files(tmp, extra_files or {})
        digest, files = tree_sha256(tmp)
        meta = {
            "kind": KIND,
            "layout_version": LAYOUT_VERSION,
            "name": name,
            "fmt": "hf",
            "model_class": type(base).__name__,
            "features": features,
            "storage_dtype": storage_dtype,
            **({"inputs": "tokens"} if tokenizer is not None else {"pixels": {"mean": 0.5, "std": 0.5}}),
            "tasks": {
                t: {"classes": list(classes[t]), "sizes": {s: int(len(y)) for s, (_, y) in arrays.get(t, {}).items()}}
                for t in experts
            },
            "content_sha256": digest,
            "files": files,
            "disk_bytes": sum((tmp / f).stat().st_size for f in files),
            "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            **(extra_meta or {}),
        }
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
    return Path(path)


def _flat_arrays(arrays: Mapping[str, Mapping[str, tuple]]) -> dict[str, np.ndarray]:
    """Every split as named arrays for data.npz: ``TASK/SPLIT/x`` (uint8 pixels, or int32 token
    ids with their uint8 ``TASK/SPLIT/mask``) and ``TASK/SPLIT/y`` (int64 labels)."""
    flat = {}
    for task, splits in arrays.items():
        for split, (x, y) in splits.items():
            if isinstance(x, TokenRows):
                flat[f"{task}/{split}/x"] = x.input_ids.numpy().astype(np.int32)
                flat[f"{task}/{split}/mask"] = x.attention_mask.numpy().astype(np.uint8)
            else:
                flat[f"{task}/{split}/x"] = np.asarray(x, dtype=np.uint8)
            flat[f"{task}/{split}/y"] = np.asarray(y, dtype=np.int64)
    return flat


def write_files(root: Path, files: Mapping[str, str | bytes]) -> None:
    """``{relative name: text or bytes}`` written under ``root`` (folders made as needed)."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            (root / rel).write_bytes(text)
        else:
            (root / rel).write_text(text)


STORAGE_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def _save_model(model: nn.Module, path: Path, storage_dtype: str) -> None:
    """``save_pretrained`` (safetensors) in ``storage_dtype``; ``model`` itself is not changed."""
    dtype = STORAGE_DTYPES[storage_dtype]
    if next(model.parameters()).dtype != dtype:
        model = copy.deepcopy(model).to(dtype)
    model.save_pretrained(path, safe_serialization=True)


def save_npz(path: str | os.PathLike, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez_compressed`` with fixed zip timestamps, so equal arrays give equal bytes
    (and the zoo's content hash depends on the content alone)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, arr in arrays.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            buf = io.BytesIO()
            np.lib.format.write_array(buf, np.ascontiguousarray(arr), allow_pickle=False)
            zf.writestr(info, buf.getvalue())


# ------------------------------------------------------------------ read


def is_zoo_dir(path: str | os.PathLike) -> bool:
    meta = Path(path) / META
    if not meta.is_file():
        return False
    try:
        return json.loads(meta.read_text()).get("kind") == KIND
    except (OSError, ValueError):
        return False


def read_meta(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / META).read_text())


def verify_zoo_dir(path: str | os.PathLike) -> None:
    """Raise :class:`ZooCorruptedError` if the files differ from the recorded hash."""
    meta = read_meta(path)
    digest, files = tree_sha256(path, exclude=(META, outdir.MARKER))
    if digest != meta.get("content_sha256"):
        changed = sorted(set(files.items()) ^ set(meta.get("files", {}).items()))
        first = changed[0][0] if changed else "?"
        raise ZooCorruptedError(
            f"zoo at {str(path)!r} does not match its recorded content hash (first difference: "
            f"{first}); rebuild it (featcal zoo build {meta.get('name', 'demo')} --rebuild) or delete the directory."
        )


def read_zoo_dir(path: str | os.PathLike, verify: bool = True) -> Zoo:
    """Load a zoo written by :func:`write_zoo_dir`."""
    from safetensors.torch import load_file

    path = Path(path)
    if not is_zoo_dir(path):
        raise FileNotFoundError(f"{str(path)!r} is not a featcal zoo directory (no {META} of kind {KIND!r}).")
    meta = read_meta(path)
    if meta.get("scoring") == "lm":
        raise ValueError(
            f"{str(path)!r} is an LLM zoo, loaded through its spec: use featcal.zoo.load_any({str(path)!r}) "
            "(or featcal.zoo.load.lm_dir.load)."
        )
    if verify:
        verify_zoo_dir(path)
    # meta.json is data: its class and keyword arguments pass allow-lists, and no code is run.
    cls = library_model_class(meta["model_class"], f"zoo {str(path)!r}: meta.json's model_class")
    kw = check_model_kwargs(meta.get("model_kwargs", {}), f"zoo {str(path)!r}: meta.json's model_kwargs")
    kw |= {"use_safetensors": True, "trust_remote_code": False, "local_files_only": True}
    with quiet_transformers():
        base = _load_model(cls, path / "base", meta, kw)
        experts = {t: _load_model(cls, path / "experts" / t, meta, kw) for t in meta["tasks"]}
    heads = _read_heads(load_file(str(path / "heads.safetensors")), meta["tasks"])
    pix = meta.get("pixels", {"mean": 0.5, "std": 0.5})
    data: dict[str, TaskData] = {}
    with np.load(path / "data.npz") as npz:
        for task, info in meta["tasks"].items():
            splits = {
                s: (
                    _inputs(npz, f"{task}/{s}", meta, pix),
                    torch.from_numpy(npz[f"{task}/{s}/y"]).long(),
                )
                for s in SPLITS
                if f"{task}/{s}/y" in npz.files
            }
            data[task] = TaskData(task, list(info["classes"]), splits)
    meta = {**meta, "path": str(path)}
    return Zoo(
        name=meta["name"],
        base=base,
        experts=experts,
        heads=heads,
        data=data,
        features=FEATURES[meta["features"]],
        fmt=meta.get("fmt", "hf"),
        meta=meta,
    )


def _inputs(npz, key: str, meta: dict, pix: dict):
    """One split's inputs: normalised pixels, or token rows in a text zoo."""
    if meta.get("inputs") == "tokens":
        return TokenRows(torch.from_numpy(npz[f"{key}/x"]).long(), torch.from_numpy(npz[f"{key}/mask"]).long())
    return to_pixels(npz[f"{key}/x"], pix["mean"], pix["std"])


def _load_model(cls, path: Path, meta: dict, kw: dict) -> nn.Module:
    """A stored model in eval mode, cast back to float32 if it was stored in float16."""
    model = cls.from_pretrained(path, **kw)  # (kw: trust_remote_code=False, local files only)
    if meta.get("storage_dtype", "float32") != "float32":
        model = model.float()
    return model.eval()


def read_arrays(path: str | os.PathLike) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """The stored uint8 images and labels: ``{task: {split: (x, y)}}``."""
    out: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    with np.load(Path(path) / "data.npz") as npz:
        for key in npz.files:
            task, split, kind = key.rsplit("/", 2)
            if kind == "x":  # (text zoos: token ids; their masks are left out)
                out.setdefault(task, {})[split] = (npz[key], npz[f"{task}/{split}/y"])
    return out


def _read_heads(tensors: dict[str, torch.Tensor], tasks) -> dict[str, nn.Linear]:
    heads = {}
    for task in tasks:
        w, b = tensors[f"{task}.weight"], tensors.get(f"{task}.bias")
        head = nn.Linear(w.shape[1], w.shape[0], bias=b is not None)
        with torch.no_grad():
            head.weight.copy_(w)
            if b is not None:
                head.bias.copy_(b)
        heads[task] = head.requires_grad_(False).eval()
    return heads

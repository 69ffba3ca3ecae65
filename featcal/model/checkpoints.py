"""Model directories in Hugging Face ``save_pretrained`` layout, read and written tensor by
tensor (for :mod:`featcal.streaming.run`: merges bigger than memory).

A model directory holds ``config.json`` and either one ``model.safetensors`` or shards
``model-0000k-of-0000n.safetensors`` listed by ``model.safetensors.index.json``. Reading
opens a shard memory-mapped with safetensors' ``safe_open`` for just the tensors asked for and
closes it again (a mapping kept open would keep every page read so far resident). Writing
streams tensor by tensor into the safetensors format (an 8-byte little-endian header length,
a JSON header of dtypes, shapes and byte offsets, then the raw bytes), so no shard is ever
held whole in memory. The model skeletons are built from the config with their parameters on
the ``meta`` device (no memory; :mod:`featcal.model.skeletons`); :mod:`featcal.streaming.run` fills
one block at a time.

Calibration data for the command line (:func:`load_token_data`): one safetensors file with
``TASK.input_ids`` (``(N, T)`` integers) and optionally ``TASK.attention_mask`` per task.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
from safetensors import safe_open

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# The weight files a save_pretrained directory may hold (safetensors first).
HF_WEIGHTS = (SINGLE, INDEX, "pytorch_model.bin", "pytorch_model.bin.index.json")

# safetensors' dtype names
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
_FROM_NAME = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class Spec:
    """One tensor's dtype and shape, as a checkpoint's header gives it."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


class CorruptShardError(ValueError):
    """A safetensors file whose header or size is not what the format says."""


def read_header(path: str | os.PathLike) -> dict[str, Spec]:
    """``{name: Spec}`` of one safetensors file, from its header only, checked against the
    format and the file's size (a corrupted header or a truncated file raises
    :class:`CorruptShardError` naming the file)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 2 <= n <= min(size - 8, 100 << 20):
                raise ValueError(f"a header length of {n} bytes in a file of {size}")
            header = json.loads(f.read(n).decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        out, spans = {}, []
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _FROM_NAME:
                raise ValueError(f"tensor {name!r} has dtype {entry['dtype']}, which featcal does not read")
            shape = tuple(int(d) for d in entry["shape"])
            if any(d < 0 for d in shape):
                raise ValueError(f"tensor {name!r} has a negative dimension in its shape {list(shape)}")
            spec = Spec(_FROM_NAME[entry["dtype"]], shape)
            start, stop = (int(o) for o in entry["data_offsets"])
            if start < 0 or stop - start != spec.nbytes:
                raise ValueError(
                    f"tensor {name!r} spans bytes {start} to {stop}, its shape and dtype need {spec.nbytes}"
                )
            out[name] = spec
            spans.append((start, stop, name))
        _check_spans(spans)
        end = max((stop for _, stop, _ in spans), default=0)
    except (struct.error, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise CorruptShardError(
            f"{str(path)!r} is not a readable safetensors file ({type(err).__name__}: {err}); the file is "
            "corrupted or not safetensors: write it again (save_pretrained(..., safe_serialization=True))."
        ) from None
    if 8 + n + end > size:
        raise CorruptShardError(
            f"{str(path)!r} is truncated: its header describes {8 + n + end} bytes, the file has {size}; "
            "copy or download it again."
        )
    return out


def _check_spans(spans: list[tuple[int, int, str]]) -> None:
    """Tensors' byte ranges ``(start, stop, name)`` must not overlap: two tensors reading the same bytes
    are a forged or corrupted header (safetensors itself refuses them, with no file named)."""
    spans = sorted(s for s in spans if s[1] > s[0])
    for (_, stop, a), (start, _, b) in zip(spans, spans[1:]):
        if start < stop:
            raise ValueError(f"tensors {a!r} and {b!r} overlap (bytes from {start} to {stop})")


def model_dir_problem(path: str | os.PathLike, role: str = "model") -> str | None:
    """Why ``path`` is not a model directory (a file given for its directory, no config.json), or None."""
    path = Path(path).expanduser()
    if path.is_file():
        return (
            f"{role} {str(path)!r} is a file; give the model's directory (written by save_pretrained), "
            f"here probably {str(path.parent)!r}."
        )
    if not (path / "config.json").is_file():
        return (
            f"{role} {str(path)!r} is not a model directory: no config.json there "
            "(give a directory written by save_pretrained)."
        )
    return None


class Checkpoint:
    """A model directory: its config, which shard holds each tensor, and each tensor's spec."""

    def __init__(self, path: str | os.PathLike, role: str = "model"):
        self.path = Path(path).expanduser()
        self.role = role
        problem = model_dir_problem(self.path, role)
        if problem:
            raise FileNotFoundError(problem)
        if (self.path / INDEX).is_file():
            weight_map = json.loads((self.path / INDEX).read_text())["weight_map"]
        elif (self.path / SINGLE).is_file():
            weight_map = {name: SINGLE for name in read_header(self.path / SINGLE)}
        else:
            raise FileNotFoundError(
                f"{role} {str(self.path)!r} has neither {INDEX} nor {SINGLE}; featcal reads safetensors "
                "checkpoints (save the model with save_pretrained(..., safe_serialization=True))."
            )
        self.files: dict[str, str] = dict(weight_map)
        self.specs: dict[str, Spec] = {}
        for file in sorted(set(weight_map.values())):
            if not (self.path / file).is_file():
                raise FileNotFoundError(f"{role} {str(self.path)!r}: shard {file!r} named by {INDEX} is missing.")
            header = read_header(self.path / file)
            wrong = next((n for n, f in weight_map.items() if f == file and n not in header), None)
            if wrong is not None:
                raise ValueError(
                    f"{role}: {INDEX} in {str(self.path)!r} puts {wrong!r} in {file!r}, which does not hold it; "
                    "the index does not match the shards (save the model again)."
                )
            self.specs.update({n: spec for n, spec in header.items() if weight_map.get(n) == file})
        self.config = json.loads((self.path / "config.json").read_text())
        self.config_dir = self.path  # where config.json is (a LoRA expert's is its base's)
        self.rows: dict[str, int] = {}  # tensors read cut to their first rows (see check_same_tensors)

    @property
    def names(self) -> list[str]:
        return list(self.files)

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs.values())

    def read(self, names: Iterable[str], device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The tensors ``names`` (those in :attr:`rows` cut to their first rows), on ``device``."""
        out = self.read_raw(names)
        return {n: (t[: self.rows[n]] if n in self.rows else t).to(device) for n, t in out.items()}

    def read_raw(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors ``names`` as stored, each shard opened (memory-mapped) once and closed again."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            if name not in self.files:
                raise KeyError(
                    f"{self.role} {str(self.path)!r} has no tensor {name!r}; featcal streams checkpoints whose "
                    "tensor names are the model's state_dict names (as save_pretrained writes them)."
                )
            by_file.setdefault(self.files[name], []).append(name)
        out = {}
        for file, ns in by_file.items():
            with safe_open(str(self.path / file), framework="pt", device="cpu") as f:
                for n in ns:
                    out[n] = f.get_tensor(n)
        return out


def check_same_tensors(ref: Checkpoint, other: Checkpoint, common_rows: bool = False) -> None:
    """``other`` has ``ref``'s tensor names and shapes (an expert of the same base). Embeddings
    with more rows than ``ref``'s (tokens added to the vocabulary) are an error naming both
    sizes, or, with ``common_rows``, read cut to ``ref``'s rows (:func:`vocab_rows`)."""
    for name, spec in ref.specs.items():
        if name not in other.specs:
            raise ValueError(
                f"{other.role} {str(other.path)!r} has no tensor {name!r} that {ref.role} has; "
                "the base, the experts and the merged model must share one architecture."
            )
        if vocab_rows(name, spec.shape, other.specs[name].shape, other.role, ref.role, common_rows):
            other.rows[name] = spec.shape[0]
            other.specs[name] = Spec(other.specs[name].dtype, spec.shape)
        if other.specs[name].shape != spec.shape:
            raise ValueError(
                f"{other.role}: tensor {name!r} has shape {other.specs[name].shape}, {ref.role} has "
                f"{spec.shape}; experts must be fine-tuned from this base."
            )
        if other.specs[name].dtype.is_floating_point != spec.dtype.is_floating_point:
            raise ValueError(
                f"{other.role} {str(other.path)!r}: tensor {name!r} is {other.specs[name].dtype}, {ref.role}'s is "
                f"{spec.dtype}; a float tensor of one model cannot be merged with an integer one of another."
            )
    extra = next((n for n in other.specs if n not in ref.specs), None)
    if extra is not None:
        raise ValueError(f"{other.role} {str(other.path)!r} has a tensor {extra!r} that {ref.role} lacks.")


VOCAB_HINT = "common_rows=True (calibrate_checkpoints; featcal calibrate --common-rows)"


def vocab_rows(name: str, want: tuple, got: tuple, role: str, ref: str, common_rows: bool) -> bool:
    """Whether ``name`` is an embedding (or output head) of ``role`` that differs from ``ref``'s
    only in its number of rows (a vocabulary with added tokens, e.g. 128320 vs 128256). Such a
    mismatch raises, naming both sizes, unless ``common_rows``: then True, and the caller uses
    the first ``want[0]`` rows, the tokens both vocabularies share."""
    if tuple(want) == tuple(got) or len(want) != 2 or tuple(want[1:]) != tuple(got[1:]):
        return False
    if not any(k in name for k in ("embed", "wte", "lm_head", "shared", "word_embeddings")):
        return False
    if common_rows and got[0] > want[0]:
        return True
    fix = (
        f"pass {VOCAB_HINT} to calibrate the {want[0]} rows both share (the added tokens are dropped)"
        if got[0] > want[0]
        else "give the model with the larger vocabulary as the base, or resize the others' embeddings"
    )
    raise ValueError(
        f"{role}: {name!r} has {got[0]} rows (vocabulary entries), {ref} has {want[0]}: the vocabularies "
        f"differ (tokens added after training?). {fix[0].upper()}{fix[1:]}."
    )


# ------------------------------------------------------------------ writing


def write_safetensors(
    path: str | os.PathLike,
    specs: Mapping[str, Spec],
    get: Callable[[str], torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write the tensors ``specs`` (in that order) to one safetensors file, fetching each one
    with ``get(name)`` only when its bytes are written: one tensor in memory at a time."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, spec in specs.items():
        header[name] = {
            "dtype": _DTYPES[spec.dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, spec in specs.items():
            t = get(name)
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
                raise ValueError(f"{name}: got {t.dtype} {tuple(t.shape)}, expected {spec.dtype} {spec.shape}.")
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def write_sharded(
    out: str | os.PathLike, specs: Mapping[str, Spec], get: Callable[[str], torch.Tensor], max_shard_bytes: int
) -> list[str]:
    """Write the tensors ``specs`` as ``save_pretrained`` does: one ``model.safetensors``, or
    shards of at most ``max_shard_bytes`` (a bigger tensor gets a shard of its own) and the
    index. Returns the shard file names."""
    groups: list[dict[str, Spec]] = [{}]
    size = 0
    for name, spec in specs.items():
        if groups[-1] and size + spec.nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = spec
        size += spec.nbytes
    out = Path(out)
    if len(groups) == 1:
        write_safetensors(out / SINGLE, groups[0], get)
        return [SINGLE]
    files = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    for file, group in zip(files, groups):
        write_safetensors(out / file, group, get)
    index = {
        "metadata": {"total_size": sum(s.nbytes for s in specs.values())},
        "weight_map": {name: file for file, group in zip(files, groups) for name in group},
    }
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return files


def copy_side_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy every file of a model directory but its weights (config, generation config,
    tokenizer files, ...) to ``dst``; returns their names."""
    copied = []
    for p in sorted(Path(src).iterdir()):
        if p.is_file() and not p.name.endswith((".safetensors", ".bin", ".pt", ".pth")) and p.name != INDEX:
            shutil.copy2(p, Path(dst) / p.name)
            copied.append(p.name)
    return copied


# ------------------------------------------------------------------ calibration data


def save_token_data(path: str | os.PathLike, data: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Write ``{task: {"input_ids": (N, T), "attention_mask": (N, T) optional}}`` for
    ``featcal calibrate --data``."""
    from safetensors.torch import save_file

    flat = {}
    for task, d in data.items():
        if "input_ids" not in d:
            raise ValueError(f"task {task!r}: give input_ids (and optionally attention_mask).")
        for key in ("input_ids", "attention_mask"):
            if key in d:
                flat[f"{task}.{key}"] = d[key].contiguous()
    save_file(flat, str(path))


def load_token_data(path: str | os.PathLike, batch_size: int = 8) -> dict[str, list[dict[str, torch.Tensor]]]:
    """``{task: [batch, ...]}`` from a file of :func:`save_token_data`: per task ``TASK.input_ids``
    ``(N, T)`` and optionally ``TASK.attention_mask``, cut into batches of ``batch_size`` rows."""
    from safetensors.torch import load_file

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}.")
    flat = load_file(str(path))
    tasks: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in flat.items():
        task, _, what = key.rpartition(".")
        if not task or what not in ("input_ids", "attention_mask"):
            raise ValueError(f"{path}: tensor {key!r} is not TASK.input_ids or TASK.attention_mask.")
        tasks.setdefault(task, {})[what] = t
    out = {}
    for task, d in tasks.items():
        if "input_ids" not in d:
            raise ValueError(f"{path}: task {task!r} has an attention_mask but no input_ids.")
        ids = d["input_ids"]
        if ids.dim() != 2 or ids.is_floating_point():
            raise ValueError(f"{path}: {task}.input_ids must be (N, T) integers, got {ids.dtype} {tuple(ids.shape)}.")
        mask = d.get("attention_mask")
        if mask is not None and mask.shape != ids.shape:
            raise ValueError(f"{path}: {task}.attention_mask is {tuple(mask.shape)}, input_ids {tuple(ids.shape)}.")
        out[task] = [
            {"input_ids": ids[i : i + batch_size]}
            | ({} if mask is None else {"attention_mask": mask[i : i + batch_size]})
            for i in range(0, ids.shape[0], batch_size)
        ]
    if not out:
        raise ValueError(f"{path} holds no tasks; write it with featcal.model.checkpoints.save_token_data.")
    return out


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Weights of an HF directory (single or sharded) or of one checkpoint file, on the CPU."""
    from safetensors.torch import load_file

    if path.is_dir():
        for name in HF_WEIGHTS:
            if (path / name).is_file():
                path = path / name
                break
    if path.name.endswith(".index.json"):
        shards = sorted(set(json.loads(path.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(read_state_dict(path.parent / shard))
        return out
    if path.suffix == ".safetensors":
        return load_file(str(path), device="cpu")
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as err:  # a pickle of a whole model, a TorchScript archive, ...
        raise ValueError(
            f"{path}: not a plain state dict loadable with torch.load(weights_only=True) "
            f"({type(err).__name__}: {str(err)[:200]}); convert it to safetensors."
        ) from None
    for key in ("state_dict", "model_state_dict", "model"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(torch.is_tensor(v) for v in obj.values()):
        raise ValueError(f"{path}: expected a state dict of tensors.")
    return {k.removeprefix("module."): v for k, v in obj.items()}

"""What the weights' names and shapes cannot tell apart between the base and an expert, told with its
size (:func:`check_experts`, run before any work by :func:`featcal.calibrate` and
:func:`featcal.calibrate_checkpoints`, so by every CLI command that calibrates too):

- **dtypes**: an expert saved in bfloat16 over a float32 base (or the other way round) is merged and
  calibrated as given, but its task vector ``expert - base`` then holds the rounding of the lower
  precision. The warning says how large: :func:`rounding_share`, the rounding step of the lower dtype
  measured on the higher-precision model's block 0, over the task vector there (e.g. 3.3%: that share
  of what the expert "learned" is rounding noise).
- **tokenizers**: an expert whose tokenizer numbers the tokens otherwise (the same vocabulary in
  another order, or other tokens) has embedding rows that mean other tokens than the base's. The
  tokenizer files of model directories are compared id by id (:func:`ids_that_differ`): a warning
  naming how many ids differ, refused when the calibration data uses any of them (the expert would
  read those tokens as others).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from featcal.model import arch
from featcal.model.checkpoints import read_header

SHOWN = 3  # differing ids named in a message


# ------------------------------------------------------------------ dtypes


def stored_dtype(obj) -> torch.dtype | None:
    """The float dtype most of ``obj``'s tensors are stored in: a model's parameters, a state
    dict's tensors, a model directory's or file's safetensors headers; None where that is not
    read cheaply (``pytorch_model.bin``, an adapter) or there is no float tensor."""
    if isinstance(obj, nn.Module):
        dtypes = [p.dtype for p in obj.parameters()]
    elif isinstance(obj, Mapping):
        dtypes = [v.dtype for v in obj.values() if torch.is_tensor(v)]
    elif isinstance(obj, (str, os.PathLike)):
        path = Path(obj)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.suffix == ".safetensors" else []
        files = [f for f in files if "adapter" not in f.name]
        try:
            dtypes = [s.dtype for f in files for s in read_header(f).values()]
        except (OSError, ValueError):
            return None
    else:
        return None
    counts = Counter(d for d in dtypes if d.is_floating_point)
    return counts.most_common(1)[0][0] if counts else None


def rounding_share(
    base: Mapping[str, torch.Tensor], expert: Mapping[str, torch.Tensor], low: torch.dtype, of_base: bool
) -> float:
    """``||low(w) - w|| / ||expert - base||`` over the tensors both hold, ``w`` the model stored
    at the higher precision (the base when ``of_base``): the size of one rounding to ``low`` (what
    the other model went through) as a share of the task vector. ``inf`` for an expert equal to the base."""
    step = diff = 0.0
    for name, b in base.items():
        b, e = b.double(), expert[name].double()
        w = b if of_base else e
        step += float((w.to(low).double() - w).square().sum())
        diff += float((e - b).square().sum())
    return math.sqrt(step / diff) if diff > 0 else math.inf


def dtype_notes(
    stored: Mapping[str, torch.dtype | None], read: Callable[[str], Mapping[str, torch.Tensor]]
) -> list[str]:
    """A note for each expert whose ``stored`` dtype is not the base's (``stored["base"]``), with
    its :func:`rounding_share` on ``read(role)`` (block 0's weight matrices of that model)."""
    notes, base = [], None
    base_dtype = stored.get("base")
    for role, dtype in stored.items():
        if role == "base" or dtype is None or base_dtype is None or dtype == base_dtype:
            continue
        base = base if base is not None else read("base")
        low_is_expert = torch.finfo(dtype).eps > torch.finfo(base_dtype).eps
        low = dtype if low_is_expert else base_dtype
        share = rounding_share(base, read(role), low, of_base=low_is_expert)
        notes.append(
            f"{role} is stored in {str(dtype).removeprefix('torch.')}, the base in "
            f"{str(base_dtype).removeprefix('torch.')}: the {str(low).removeprefix('torch.')} rounding is "
            f"{100 * share:.3g}% of the task vector's size (block 0), noise the merge and calibration take for "
            "what the expert learned. Give both in one dtype: the expert as saved in float32 (loading a rounded expert "
            "in float32 does not undo its rounding), or the base in the expert's dtype if it was trained in it."
        )
    return notes


# ------------------------------------------------------------------ tokenizers


def tokenizer_vocab(model_dir: str | os.PathLike | None) -> dict[str, int] | None:
    """``{token: id}`` of a model directory's tokenizer (``tokenizer.json``: its model's vocabulary
    and added tokens; else ``vocab.json`` and ``added_tokens.json``), None where it has neither."""
    if model_dir is None or not Path(model_dir).is_dir():
        return None
    root = Path(model_dir)
    try:
        if (root / "tokenizer.json").is_file():
            doc = json.loads((root / "tokenizer.json").read_text())
            vocab = (doc.get("model") or {}).get("vocab") or {}
            if isinstance(vocab, list):  # Unigram: [piece, score] pairs, the id is the position
                vocab = {piece[0]: i for i, piece in enumerate(vocab)}
            return dict(vocab) | {t["content"]: int(t["id"]) for t in doc.get("added_tokens") or []}
        if (root / "vocab.json").is_file():
            vocab = json.loads((root / "vocab.json").read_text())
            added = root / "added_tokens.json"
            return vocab | (json.loads(added.read_text()) if added.is_file() else {})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return None


def ids_that_differ(base: Mapping[str, int], expert: Mapping[str, int]) -> dict[int, tuple]:
    """``{id: (base's token, expert's token)}`` for every id both vocabularies use with another token."""
    inv_b = {i: t for t, i in base.items()}
    inv_e = {i: t for t, i in expert.items()}
    return {i: (inv_b[i], inv_e[i]) for i in sorted(inv_b.keys() & inv_e.keys()) if inv_b[i] != inv_e[i]}


def token_ids(calib_data: Mapping[str, list]) -> set[int]:
    """Every token id of the calibration data: the ``input_ids`` of the dict batches, and their
    ``decoder_input_ids`` / ``labels`` on encoder-decoders (an id that differs between tokenizers
    harms the decoder's statistics as much as the encoder's). Negative ids (``-100``, the ignored
    label) are not tokens."""
    seen: set[int] = set()
    for batches in calib_data.values():
        for b in batches:
            for key in ("input_ids", "decoder_input_ids", "labels"):
                ids = b.get(key) if isinstance(b, Mapping) else None
                if torch.is_tensor(ids) and ids.numel():
                    seen.update(i for i in torch.unique(ids).tolist() if i >= 0)
    return seen


def check_tokenizers(dirs: Mapping[str, str | os.PathLike | None], calib_data: Mapping[str, list]) -> list[str]:
    """Each expert's tokenizer against the base's (``dirs``: ``{"base": dir, role: dir}``; a role
    whose directory or tokenizer files are unknown is skipped): a note naming how many ids differ,
    or a ValueError when the calibration data uses one of them."""
    base = tokenizer_vocab(dirs.get("base"))
    notes, used = [], None
    for role, d in dirs.items():
        other = None if role == "base" or base is None else tokenizer_vocab(d)
        if other is None:
            continue
        differ = ids_that_differ(base, other)
        sizes = "" if len(base) == len(other) else f"; vocabularies of {len(base)} and {len(other)} tokens"
        if not differ:
            if sizes:
                notes.append(f"{role}'s tokenizer has another vocabulary size than the base's{sizes}.")
            continue
        used = token_ids(calib_data) if used is None else used
        hit = [i for i in differ if i in used]
        show = ", ".join(f"id {i}: {differ[i][0]!r} vs {differ[i][1]!r}" for i in (hit or list(differ))[:SHOWN])
        what = f"{role}'s tokenizer gives {len(differ)} token ids other tokens than the base's ({show}{sizes})"
        if hit:
            raise ValueError(
                f"{what}; {len(hit)} of them are in the calibration data, where the expert would read them as "
                "other tokens. Give an expert fine-tuned with the base's tokenizer (or re-map its embeddings to the "
                "base's ids)."
            )
        notes.append(f"{what}; its embedding rows for them mean other tokens, and the merge mixes them.")
    return notes


def check_experts(
    stored: Mapping[str, torch.dtype | None],
    read: Callable[[str], Mapping[str, torch.Tensor]],
    dirs: Mapping[str, str | os.PathLike | None],
    calib_data: Mapping[str, list],
    warn: bool = True,
) -> None:
    """Both checks of the module docstring, before any work: a warning for each note (unless not
    ``warn``: a process group's ranks other than 0), an error for a tokenizer that would make the
    calibration data mean other tokens."""
    notes = check_tokenizers(dirs, calib_data)  # the refusal first, on every rank
    for note in (dtype_notes(stored, read) + notes) if warn else []:
        warnings.warn(note, stacklevel=3)


def model_dir(obj) -> str | os.PathLike | None:
    """The local directory ``obj`` was given as or loaded from (a model's ``config._name_or_path``), else None."""
    if isinstance(obj, nn.Module):
        obj = getattr(getattr(obj, "config", None), "_name_or_path", None)
    return obj if isinstance(obj, (str, os.PathLike)) and obj and Path(obj).is_dir() else None


def block0_weights(tensors: Mapping, path: str, read: Callable[[list[str]], dict] | None = None) -> dict:
    """The weight matrices of block 0 of the blocks at ``path`` (the first stack's): of ``tensors``
    (``{name: tensor}``), or ``read(names)`` of those names when ``tensors`` holds a checkpoint's specs."""
    prefix = path.split(arch.STACK_SEP)[0] + ".0."
    names = [n for n, x in tensors.items() if n.startswith(prefix) and n.endswith("weight") and len(x.shape) == 2]
    return read(names) if read is not None else {n: tensors[n].detach() for n in names}

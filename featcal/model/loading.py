"""``base`` and ``experts`` given as something other than a model: a state dict, a checkpoint
file or a local model directory (Hugging Face ``save_pretrained`` layout, single or sharded,
safetensors or ``pytorch_model.bin``). Each is loaded into a deep copy of the merged model's
architecture, strictly: every weight present, none extra, every shape the merged model's.
Files are read through safetensors or ``torch.load(weights_only=True)``, never a bare unpickle.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

from featcal.model import lora
from featcal.model.checkpoints import HF_WEIGHTS, read_state_dict, vocab_rows
from featcal.model.validate import config_diffs

SHOWN = 5  # keys named per kind of mismatch in an error


def _names(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(repr(k) for k in keys[:SHOWN]) + more


def _tied(own: dict[str, torch.Tensor], sd: Mapping[str, torch.Tensor], missing: list[str]) -> list[str]:
    """The missing keys that are tied in the template to a key ``sd`` has (HF saves a tied
    weight, e.g. an LM head tied to the embedding, once): filled from it by ``load_state_dict``'s
    shared storage, so not missing."""
    ptr = {own[k].data_ptr(): k for k in own if k in sd and own[k].numel()}
    return [k for k in missing if own[k].numel() and own[k].data_ptr() in ptr]


def load_into(template: nn.Module, sd: Mapping[str, torch.Tensor], role: str, common_rows: bool = False) -> nn.Module:
    """A deep copy of ``template`` holding the state dict ``sd``; the error names the missing,
    unexpected and mis-shaped keys (an embedding with added rows: see
    :func:`featcal.model.checkpoints.vocab_rows`, which ``common_rows`` passes to)."""
    model = copy.deepcopy(template)
    own = model.state_dict()
    cut = [
        k
        for k in own
        if k in sd and vocab_rows(k, tuple(own[k].shape), tuple(sd[k].shape), role, "the merged model", common_rows)
    ]
    sd = {**sd, **{k: sd[k][: own[k].shape[0]] for k in cut}}
    missing = [k for k in own if k not in sd]
    missing = [k for k in missing if k not in set(_tied(own, sd, missing))]
    extra = [k for k in sd if k not in own]
    bad = [k for k in own if k in sd and tuple(sd[k].shape) != tuple(own[k].shape)]
    if missing or extra or bad:
        parts = []
        if missing:
            parts.append(f"missing {_names(missing)}")
        if extra:
            parts.append(f"unexpected {_names(extra)}")
        if bad:
            parts += [f"{k!r} is {tuple(sd[k].shape)}, the merged model's {tuple(own[k].shape)}" for k in bad[:SHOWN]]
        raise ValueError(
            f"{role}: its weights do not fit the merged model's architecture ({'; '.join(parts)}); give the "
            "state dict of a model fine-tuned from the same base (same keys as merged.state_dict())."
        )
    with torch.no_grad():
        for k, v in own.items():
            if k in sd:
                v.copy_(sd[k])
    return model


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint file or a local model directory, on the CPU."""
    if path.is_dir() and not any((path / n).is_file() for n in HF_WEIGHTS):
        raise FileNotFoundError(
            f"{path}: a model directory must hold one of {', '.join(HF_WEIGHTS)} (a Hugging Face "
            "save_pretrained directory); found none."
        )
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory (a state dict file or a model directory).")
    return read_state_dict(path)


def check_saved_config(template: nn.Module, path: Path, role: str) -> None:
    """A model directory's ``config.json`` must agree with the merged model's Hugging Face config
    where it changes the computation (:func:`featcal.model.validate.config_diffs`): the weights alone
    cannot tell 2 attention heads from 4."""
    cfg = getattr(template, "config", None)
    file = path / "config.json"
    if not (path.is_dir() and file.is_file() and hasattr(cfg, "to_dict") and hasattr(cfg, "from_json_file")):
        return
    diffs = config_diffs(cfg.to_dict(), type(cfg).from_json_file(str(file)).to_dict())
    if diffs:
        raise ValueError(
            f"{role}: its config.json differs from the merged model's config ({'; '.join(diffs[:6])}): "
            "merged vs this one. Base and experts must share the merged model's architecture."
        )


def as_model(obj, template: nn.Module, role: str, base: nn.Module | None = None) -> nn.Module:
    """``obj`` as a model of ``template``'s architecture: a model as it is; a state dict, a
    checkpoint file or a model directory loaded into a copy of ``template`` (:func:`load_into`);
    a PEFT LoRA adapter directory merged onto ``base`` (:mod:`featcal.model.lora`)."""
    if isinstance(obj, nn.Module):
        return obj
    if isinstance(obj, (str, os.PathLike)) and lora.is_adapter_dir(obj):
        if base is None:
            raise ValueError(f"{role} ({obj}): a LoRA adapter is an expert only on its base model; give base=.")
        adapter = lora.LoraAdapter(obj, role)
        return load_into(template, adapter.merged(base.state_dict(), lora.base_names(model=base)), role)
    if isinstance(obj, (str, os.PathLike)):
        path, what = Path(obj), f"{role} ({obj})"
        check_saved_config(template, path, what)
        return load_into(template, read_weights(path), what)
    if isinstance(obj, Mapping):
        bad = next((k for k, v in obj.items() if not torch.is_tensor(v)), None)
        if bad is None and obj:
            return load_into(template, obj, role)
        what = "is empty" if not obj else f"has a non-tensor entry {bad!r} ({type(obj[bad]).__name__})"
        raise TypeError(f"{role}: a state dict must map names to tensors, but it {what}.")
    raise TypeError(
        f"{role}: expected an nn.Module, a state dict (name -> tensor), a checkpoint file or a local "
        f"model directory, got {type(obj).__name__}."
    )

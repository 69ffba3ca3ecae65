"""The streamed run's result: the calibrated model assembled in the work directory, shard by shard,
from the saved calibrated blocks and the merged model's other tensors."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from featcal.baselines import registry
from featcal.model.checkpoints import Checkpoint, Spec, copy_side_files, read_header, write_sharded


def _block_of(name: str, path: str) -> int | None:
    """The block index of a tensor name under ``path`` (``model.layers.3.mlp...`` -> 3), else None."""
    if not name.startswith(path + "."):
        return None
    head = name[len(path) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def write_model(
    work: Path, ckpts: dict[str, Checkpoint], tasks: list[str], merge, path: str, max_shard_bytes: int
) -> Path:
    """The calibrated model in ``work/model``: every tensor of ``src`` (the merged checkpoint,
    or the base's names when merging on the fly) in its order, the blocks' from the saved
    calibrated blocks, the rest from the merged model; the config and tokenizer files copied."""
    src = ckpts.get("merged", ckpts["base"])
    model_dir = work / "model"
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir()
    block_file = {}
    specs: dict[str, Spec] = {}
    for name in src.names:
        b = _block_of(name, path)
        if b is None:
            specs[name] = src.specs[name]
        else:
            file = work / "blocks" / f"{b:05d}.safetensors"
            if b not in block_file:
                block_file[b] = (file, read_header(file))
            specs[name] = block_file[b][1][name]

    def get(name: str) -> torch.Tensor:
        b = _block_of(name, path)
        if b is not None:
            with safe_open(str(block_file[b][0]), framework="pt", device="cpu") as f:
                return f.get_tensor(name)
        if merge is None:
            return ckpts["merged"].read([name])[name]
        method, params = merge
        base = ckpts["base"].read([name])
        return registry.merge(method, base, {t: ckpts[t].read([name]) for t in tasks}, **params)[name]

    write_sharded(model_dir, specs, get, max_shard_bytes)
    copy_side_files(src.path, model_dir)
    return model_dir

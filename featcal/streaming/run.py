"""Calibrate merges bigger than memory: every model streamed block by block from its
checkpoint shards (:func:`calibrate_checkpoints`).

FeatCal's forward order needs block l of each model only while it visits block l. So the models
are skeletons on the meta device, a :class:`~featcal.streaming.source.CheckpointSource` hooked into
the engine fills block l of the base, of every expert and of the merged model just before the engine
visits it and empties them after, and the calibrated blocks go to a work directory
(:mod:`featcal.streaming.workdir`) from which :mod:`featcal.streaming.output` assembles the model.
Peak memory: one block of every model, the streams and one block's statistics.

The run, step by step: check the arguments -> open the checkpoints -> open (or resume) the work
directory -> calibrate the blocks not done yet -> write the model -> rename it to ``out``. A killed
run never leaves a complete-looking ``out``; ``resume=True`` continues from its work directory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from featcal.baselines import merging
from featcal.config import FastPaths, FeatCalConfig
from featcal.engine.blocksource import check_device
from featcal.engine.report import BlockRecord, CalibrationReport, ModuleRecord
from featcal.engine.run import calibrate
from featcal.model import arch, validate
from featcal.model.checkpoints import Checkpoint, check_same_tensors, skeleton
from featcal.streaming.output import write_model
from featcal.streaming.source import CheckpointSource
from featcal.streaming.workdir import data_digest, open_work, partial_dir, peak_rss_mb

__all__ = ["calibrate_checkpoints", "open_checkpoints", "partial_dir", "peak_rss_mb", "CheckpointSource"]


def calibrate_checkpoints(
    base: str | os.PathLike,
    experts: Mapping[str, str | os.PathLike],
    *,
    calib_data: Mapping[str, list],
    out: str | os.PathLike,
    merge: tuple[str, dict] | str | None = None,
    merged: str | os.PathLike | None = None,
    config: FeatCalConfig | None = None,
    device: str | torch.device = "cpu",
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    blocks: str | None = None,
    fast: FastPaths | None = None,
    checkpoint_every: int = 1,
    max_shard_bytes: int = 4 << 30,
    on_block: Callable[[int, dict], None] | None = None,
) -> CalibrationReport:
    """Calibrate a merge with FeatCal, streaming every model from its checkpoint one block at a
    time, and write the calibrated model to ``out`` (``save_pretrained`` layout).

    Args:
        base: the pretrained model's directory (``config.json`` and ``*.safetensors``).
        experts: ``{task: directory}`` of the experts.
        calib_data: ``{task: [batch, ...]}`` as for :func:`featcal.calibrate` (token batches:
            dicts with ``input_ids`` and optionally ``attention_mask``).
        out: the directory to write; must not exist unless ``force``.
        merge: ``(method, params)`` (or a method name) of :data:`featcal.MERGERS`, to merge the
            base and the experts block by block (the same merge as on whole state dicts, but for
            ``dare``, whose seeded masks are drawn block by block); or
        merged: the merged model's directory.
        config: FeatCal's hyper-parameters (:class:`FeatCalConfig`).
        device: where each block runs (``"cuda"``: one block of every model on the GPU at a time).
        resume: continue the run killed part-way that left its work directory beside ``out``.
        force: replace an existing ``out`` (and a stale work directory).
        progress: a progress bar and one line per block (time, peak memory).
        blocks: dotted path of the blocks, for architectures featcal does not know.
        fast: the engine's fast paths (:class:`FastPaths`).
        checkpoint_every: save the streams (for ``resume``) every this many blocks (each save
            writes every task's hidden states; the calibrated blocks are saved every block).
        max_shard_bytes: the largest output shard.
        on_block: called as ``on_block(block, {"seconds", "peak_rss_mb"[, "peak_gpu_mb"]})``
            after each block.

    Returns:
        The :class:`CalibrationReport` (every block's, a resumed run's included).
    """
    t_start = time.perf_counter()
    cfg = config or FeatCalConfig()
    device = check_device(device)
    merge = _check_merge(merge, merged)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}.")
    tasks = validate.check_tasks(experts, calib_data)
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise FileExistsError(f"output {str(out)!r} already exists; pass force=True (--force) to replace it.")
    calib_data = {t: calib_data[t] for t in tasks}

    ckpts, skels, path = open_checkpoints(base, {t: experts[t] for t in tasks}, merged, blocks)
    work = partial_dir(out)
    state = open_work(work, _fingerprint(ckpts, merge, cfg, path, calib_data), resume=resume, force=force)
    report = _calibrate_blocks(
        ckpts,
        skels,
        path,
        calib_data,
        merge,
        cfg,
        state,
        work,
        dict(device=device, fast=fast, progress=progress, checkpoint_every=checkpoint_every, on_block=on_block),
    )
    model_dir = write_model(work, ckpts, tasks, merge, path, max_shard_bytes)
    report.seconds = time.perf_counter() - t_start
    report.save_json(model_dir / "featcal_report.json")
    if out.exists():  # force
        shutil.rmtree(out)
    os.rename(model_dir, out)
    shutil.rmtree(work)
    return report


def _check_merge(merge, merged) -> tuple[str, dict] | None:
    """``merge`` as ``(method, params)`` (or None with ``merged``): exactly one of the two given."""
    if (merge is None) == (merged is None):
        raise ValueError("give exactly one of merge=(method, params) (merge on the fly) or merged=DIR.")
    if merge is None:
        return None
    if isinstance(merge, str):
        merge = (merge, {})
    if merge[0] not in merging.MERGERS:
        raise ValueError(f"unknown merge method {merge[0]!r}; choose one of {sorted(merging.MERGERS)}.")
    return (merge[0], dict(merge[1]))


def open_checkpoints(base, experts: Mapping, merged, blocks: str | None):
    """Every model's checkpoint (headers only, the same tensors as the base's), its skeleton on the
    meta device (the merged model's from the base's when merging on the fly), and the blocks' path."""
    ckpts = {"base": Checkpoint(base, "the base")}
    ckpts |= {t: Checkpoint(d, f"expert {t!r}") for t, d in experts.items()}
    if merged is not None:
        ckpts["merged"] = Checkpoint(merged, "the merged model")
    for role, ck in ckpts.items():
        if role != "base":
            check_same_tensors(ckpts["base"], ck)
    skels = {role: skeleton(ck) for role, ck in ckpts.items()}
    if "merged" not in skels:
        skels["merged"] = skeleton(ckpts["base"])
    path = arch.resolve_blocks(skels["merged"], blocks)[0]
    return ckpts, skels, path


def _fingerprint(ckpts: dict, merge, cfg: FeatCalConfig, path: str, calib_data: Mapping) -> dict:
    """What a resumed run must share with the run that left the work directory."""
    doc = {
        "base": str(ckpts["base"].path.absolute()),
        "experts": {t: str(ckpts[t].path.absolute()) for t in calib_data},
        "merged": str(ckpts["merged"].path.absolute()) if "merged" in ckpts else None,
        "merge": merge,
        "config": cfg.to_dict(),
        "blocks": path,
        "data": data_digest(calib_data),
    }
    return json.loads(json.dumps(doc, default=str))


def _calibrate_blocks(ckpts, skels, path, calib_data, merge, cfg, state, work, run: dict) -> CalibrationReport:
    """The engine over the blocks not done yet (the skeletons filled block by block by a
    :class:`CheckpointSource`), and the report of the whole run, a resumed run's earlier blocks included."""
    tasks = list(calib_data)
    n_blocks = len(arch.resolve_blocks(skels["merged"], path)[1])
    report = None
    if state["done"] < n_blocks - 1:
        source = CheckpointSource(
            ckpts=ckpts,
            skels=skels,
            tasks=tasks,
            merge=merge,
            path=path,
            device=run["device"],
            work=work,
            state=state,
            checkpoint_every=run["checkpoint_every"],
            on_block=run["on_block"],
            progress=run["progress"],
        )
        _, report = calibrate(
            skels["merged"],
            base=skels["base"],
            experts={t: skels[t] for t in tasks},
            calib_data=calib_data,
            config=cfg,
            blocks=path,
            inplace=True,
            progress=run["progress"],
            fast=run["fast"],
            device=run["device"],
            block_source=source,
        )
    full = CalibrationReport(cfg, path, tasks)
    full.modules = [ModuleRecord(**m) for m in state["prior_modules"]] + ([] if report is None else report.modules)
    full.blocks = [BlockRecord(**b) for b in state["prior_blocks"]] + ([] if report is None else report.blocks)
    full.warnings = [] if report is None else report.warnings
    full.check_residuals()  # over every block, not only this run's
    return full

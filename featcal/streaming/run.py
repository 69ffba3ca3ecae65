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

import contextlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Mapping

from featcal.baselines import registry
from featcal.config import FastPaths, FeatCalConfig
from featcal.engine import distributed
from featcal.engine.blocksource import check_device
from featcal.engine.report import BlockRecord, CalibrationReport, ModuleRecord
from featcal.engine.run import calibrate
from featcal.model import arch, compat, validate
from featcal.model.checkpoints import Checkpoint, check_same_tensors
from featcal.model.export import copy_base_files, drift_summary, model_name, write_hub_files
from featcal.model.fingerprint import content_fingerprint, fingerprint_checkpoint
from featcal.model.lora import LoraCheckpoint, is_adapter_dir
from featcal.model.skeletons import skeleton
from featcal.streaming import memory
from featcal.streaming.options import StreamOptions
from featcal.streaming.output import write_model
from featcal.streaming.source import CheckpointSource, needed_names
from featcal.streaming.workdir import data_digest, open_work, partial_dir
from featcal.util import outdir
from featcal.util.memory import peak_rss_mb

__all__ = [
    "calibrate_checkpoints",
    "StreamOptions",
    "open_checkpoints",
    "partial_dir",
    "peak_rss_mb",
    "CheckpointSource",
]


def calibrate_checkpoints(
    base: str | os.PathLike,
    experts: Mapping[str, str | os.PathLike],
    *,
    calib_data: Mapping[str, list],
    out: str | os.PathLike,
    merge: tuple[str, dict] | str | None = None,
    merged: str | os.PathLike | None = None,
    config: FeatCalConfig | None = None,
    options: StreamOptions | None = None,
) -> CalibrationReport:
    """Calibrate a merge with FeatCal, streaming every model from its checkpoint one block at a
    time, and write the calibrated model to ``out`` (``save_pretrained`` layout).

    Args:
        base: the pretrained model's directory (``config.json`` and ``*.safetensors``).
        experts: ``{task: directory}`` of the experts: model directories, or PEFT LoRA adapter
            directories on ``base`` (merged block by block as they are read, :mod:`featcal.model.lora`).
        calib_data: ``{task: [batch, ...]}`` as for :func:`featcal.calibrate` (token batches:
            dicts with ``input_ids`` and optionally ``attention_mask``).
        out: the directory to write; must not exist unless ``options.force``.
        merge: ``(method, params)`` (or a method name) of :data:`featcal.MERGERS`, to merge the
            base and the experts block by block (the same merge as on whole state dicts, but for
            ``dare``, whose seeded masks are drawn block by block); or
        merged: the merged model's directory.
        config: FeatCal's hyper-parameters (:class:`FeatCalConfig`).
        options: how the checkpoints are read, the run goes and the output is written
            (:class:`~featcal.streaming.options.StreamOptions`: ``device``, ``resume``, ``force``,
            ``on_block``, ...; default: a plain CPU run with a progress bar).

    ``out`` may not be, contain or lie inside an input; ``force`` replaces only a directory featcal
    wrote (:mod:`featcal.util.outdir`), and one run per ``out`` holds its lock at a time.

    Returns:
        The :class:`CalibrationReport` (every block's, a resumed run's included).
    """
    t_start = time.perf_counter()
    # 1. Check the arguments, before anything is read or written.
    opts = options or StreamOptions()
    cfg, device, merge = config or FeatCalConfig(), check_device(opts.device), _check_merge(merge, merged)
    tasks = validate.check_tasks(experts, calib_data)
    inputs = {"the base": base, "the merged model": merged} | {f"expert {t!r}": experts[t] for t in tasks}
    out = outdir.check_output(out, opts.force, inputs)
    # 2. Open the checkpoints (headers and skeletons) of the tasks the data has.
    experts, calib_data = {t: experts[t] for t in tasks}, {t: calib_data[t] for t in tasks}
    reading = (opts.blocks, opts.common_rows, opts.lora_any_base, opts.trust_remote_code)
    ckpts, skels, path = open_checkpoints(base, experts, merged, *reading)
    check_token_ids(skels["merged"], calib_data)
    _check_experts(ckpts, tasks, path, calib_data)  # dtypes and tokenizers, as the in-memory run checks them
    work = partial_dir(out)
    dist = distributed.current(device, (opts.fast or FastPaths()).dist_solve)  # a process group: rank 0 writes
    digest = data_digest(calib_data)  # (read once: the ranks compare it, the work directory records it)
    if dist is not None:  # the same inputs on every rank, compared by content, before any work
        dist.check_same(_rank_digests(ckpts, merge, cfg, path, calib_data, digest))
    _check_memory(ckpts, skels, path, calib_data, cfg, opts, dist)
    writer = dist is None or dist.rank == 0
    with outdir.output_lock(out) if writer else contextlib.nullcontext():
        # 3. Open (or resume) the work directory, and 4. calibrate the blocks not done yet.
        run = dict(
            device=device,
            fast=opts.fast,
            progress=opts.progress,
            checkpoint_every=opts.checkpoint_every,
            on_block=opts.on_block,
        )
        report = _in_work_dir(
            work,
            _fingerprint(ckpts, merge, cfg, path, calib_data, digest),
            lambda state: _calibrate_blocks(ckpts, skels, path, calib_data, merge, cfg, state, work, run, dist),
            resume=opts.resume,
            force=opts.force,
            dist=dist,
        )
        if not writer:  # rank 0 writes the model
            dist.barrier("waiting for rank 0 to write the model")
            return report
        model_dir = write_model(work, ckpts, tasks, merge, path, opts.max_shard_bytes)  # 5. write; 6. commit
        report.seconds = time.perf_counter() - t_start
        report.save_json(model_dir / "featcal_report.json")
        card = _card(ckpts, merge, cfg, calib_data, report) | dict(opts.card or {})
        _hub_files(model_dir, out.name, ckpts, card)
        _commit(model_dir, out, work, lambda: outdir.check_output(out, opts.force, inputs))
    if dist is not None:
        dist.barrier("writing the model")
    return report


def _in_work_dir(
    work: Path, fingerprint: dict, calibrate_in: Callable, *, resume: bool, force: bool, dist
) -> CalibrationReport:
    """Open (or resume) the work directory (:func:`featcal.streaming.workdir.open_work`) and run
    ``calibrate_in(state)`` in it; when that fails before a block is saved, rank 0 removes a work
    directory this run made or replaced (nothing there to resume, nothing left in the way)."""
    fresh = not work.exists()
    state = open_work(work, fingerprint, resume=resume, force=force, dist=dist)
    try:
        return calibrate_in(state)
    except BaseException:
        writer = dist is None or dist.rank == 0
        if writer and (fresh or force) and state["done"] < 0:
            shutil.rmtree(work, ignore_errors=True)
        raise


def _commit(model_dir: Path, out: Path, work: Path, check_out: Callable) -> None:
    """Rename the written model to ``out`` once ``check_out`` passes again (something may have
    appeared there meanwhile), then remove the work directory."""
    check_out()
    outdir.commit_dir(model_dir, out, "model")
    shutil.rmtree(work)


def check_token_ids(model, calib_data: Mapping[str, list]) -> None:
    """Every token id of every batch within the model's vocabulary (before block 0: an id past it
    would fail deep inside the embedding, or index another row on some devices)."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(emb, "num_embeddings", None)
    if vocab is None:
        return
    for task, batches in calib_data.items():
        for i, batch in enumerate(batches):
            for key in ("input_ids", "decoder_input_ids"):
                ids = batch.get(key) if isinstance(batch, Mapping) else None
                if ids is None or ids.numel() == 0:
                    continue
                low, high = int(ids.min()), int(ids.max())
                if low < 0 or high >= vocab:
                    raise ValueError(
                        f"task {task!r}, batch {i}: {key} holds token ids from {low} to {high}, the model's "
                        f"vocabulary has {vocab} (ids 0 to {vocab - 1}); tokenize the data with this model's tokenizer."
                    )


def _check_experts(ckpts: dict, tasks: list[str], path: str, calib_data: Mapping) -> None:
    """:func:`featcal.model.compat.check_experts` on the checkpoints (block 0 read for the dtypes' note only)."""
    roles = {"base": ckpts["base"]} | {ckpts[t].role: ckpts[t] for t in tasks}

    def read(role: str) -> dict:
        ck = roles[role]
        return compat.block0_weights(ck.specs, path, ck.read)

    stored = {role: compat.stored_dtype(ck.path) for role, ck in roles.items()}
    compat.check_experts(stored, read, {role: ck.path for role, ck in roles.items()}, calib_data, distributed.is_main())


def _check_merge(merge, merged) -> tuple[str, dict] | None:
    """``merge`` as ``(method, params)`` (or None with ``merged``): exactly one of the two given."""
    if (merge is None) == (merged is None):
        raise ValueError("give exactly one of merge=(method, params) (merge on the fly) or merged=DIR.")
    if merge is None:
        return None
    if isinstance(merge, str):
        merge = (merge, {})
    if merge[0] not in registry.MERGERS:
        raise ValueError(f"unknown merge method {merge[0]!r}; choose one of {sorted(registry.MERGERS)}.")
    params = registry.check_params(merge[0], merge[1], "merger")  # names, types, finite numbers
    return (merge[0], params)


def open_checkpoints(
    base,
    experts: Mapping,
    merged,
    blocks: str | None,
    common_rows=False,
    lora_any_base=False,
    trust_remote_code: bool = False,
):
    """Every model's checkpoint (headers only, the same tensors as the base's; a LoRA adapter as
    the expert it makes of the base), its skeleton on the meta device (the merged model's from the
    base's when merging on the fly), and the blocks' path. The architectures are compared as the
    in-memory run compares them (:mod:`featcal.model.validate`: configs, classes, heads, epsilons),
    and every tensor a run reads is found in every checkpoint. See :func:`calibrate_checkpoints`."""
    ckpts = {"base": Checkpoint(base, "the base")}
    for t, d in experts.items():
        if is_adapter_dir(d):
            ckpts[t] = LoraCheckpoint(d, ckpts["base"], f"expert {t!r}", strict_name=not lora_any_base)
        else:
            ckpts[t] = Checkpoint(d, f"expert {t!r}")
    if merged is not None:
        ckpts["merged"] = Checkpoint(merged, "the merged model")
    for role, ck in ckpts.items():
        if role != "base":
            check_same_tensors(ckpts["base"], ck, common_rows)
    # a checkpoint read cut to the base's vocabulary is built as the base is
    skels = {role: skeleton(ckpts["base"] if ck.rows else ck, trust_remote_code) for role, ck in ckpts.items()}
    if "merged" not in skels:
        skels["merged"] = skeleton(ckpts["base"], trust_remote_code)
    ref = validate.architecture(skels["merged"])
    for role, ck in ckpts.items():
        if role != "merged":
            validate.check_same_architecture(skels["merged"], skels[role], f"{ck.role} ({str(ck.path)!r})", ref)
    path = _stream_path(skels["merged"], blocks)
    for role, ck in ckpts.items():
        missing = [n for n in needed_names(skels[role], path) if n not in ck.files]
        if missing:
            raise ValueError(
                f"{ck.role} {str(ck.path)!r} lacks {len(missing)} tensor(s) its architecture needs (first "
                f"{missing[0]!r}); the checkpoint and its config.json do not match (save the model again)."
            )
    return ckpts, skels, path


def _stream_path(model, blocks: str | None) -> str:
    """The blocks' path, refused up front for models streaming cannot run: more than one stack
    (an encoder-decoder) or stems that read the unloaded head."""
    stacks = [p for p, _ in arch.resolve_stacks(model, blocks)]
    if len(stacks) > 1:
        raise ValueError(
            f"{type(model).__name__} has {len(stacks)} stacks of blocks ({', '.join(stacks)}); streaming "
            "calibrates one stack: load the model in memory (featcal.calibrate) or give blocks=PATH."
        )
    return arch.resolve_blocks(model, blocks)[0]


def _hub_files(model_dir: Path, name: str, ckpts: dict, card: dict) -> None:
    """The base's tokenizer files and the model card beside the written model
    (:func:`featcal.model.export.write_hub_files`); a merged model cut to the base's vocabulary
    takes the base's config and tokenizer over its own (they say the grown vocabulary)."""
    if "merged" in ckpts and ckpts["merged"].rows:
        copy_base_files(ckpts["base"].path, model_dir, replace=True)
    write_hub_files(model_dir, base_dir=ckpts["base"].path, name=name, **card)


def _card(ckpts: dict, merge, cfg: FeatCalConfig, calib_data: Mapping, report: CalibrationReport) -> dict:
    """The model card's facts (:func:`featcal.model.export.write_hub_files`) this run knows."""
    rows = {}
    for t, batches in calib_data.items():
        rows[t] = sum(int((next(iter(b.values())) if isinstance(b, Mapping) else b).shape[0]) for b in batches)
    return {
        "experts": {t: model_name(ckpts[t].path) for t in calib_data},
        "merge": {"method": merge[0], "params": merge[1]} if merge else {"merged": model_name(ckpts["merged"].path)},
        "settings": cfg.to_dict(),
        "calibration": rows,
        "drift": drift_summary(report),
    }


def _fingerprint(ckpts: dict, merge, cfg: FeatCalConfig, path: str, calib_data: Mapping, digest: str) -> dict:
    """What a resumed run must share with the run that left the work directory: the models' paths
    and contents (:func:`fingerprint_checkpoint`), the merge, the config, the blocks and the data
    (``digest``: its :func:`data_digest`, computed once by the caller)."""

    def files(ck: Checkpoint) -> dict:
        return {"path": str(ck.path.absolute()), "files": fingerprint_checkpoint(ck)}

    doc = {
        "base": files(ckpts["base"]),
        "experts": {t: files(ckpts[t]) for t in calib_data},
        "merged": files(ckpts["merged"]) if "merged" in ckpts else None,
        "merge": merge,
        "config": cfg.to_dict(),
        "blocks": path,
        "data": digest,
    }
    return json.loads(json.dumps(doc, default=str))


def _rank_digests(ckpts: dict, merge, cfg: FeatCalConfig, path: str, calib_data: Mapping, digest: str) -> dict:
    """What every rank of a process group must agree on (:meth:`Dist.check_same`): each model's
    weights by content (:func:`content_fingerprint`: blind to the directory's name and the files'
    times, which may differ between nodes; a swapped pair of experts differs), the merge, the
    config and blocks, the tasks and the calibration data."""
    models = {f"{ck.role} (weights)": content_fingerprint(ck.path) or "" for ck in ckpts.values()}
    return models | {
        "merge": repr(merge),
        "config": repr(cfg.to_dict()) + path,
        "tasks": repr(list(calib_data)),
        "calibration data": digest,
    }


def _check_memory(ckpts, skels, path, calib_data, cfg, opts: StreamOptions, dist) -> None:
    """The run's estimated peak memory (this rank's share of the batches) against the memory
    available, before any work (:mod:`featcal.streaming.memory`; ``force``: a warning)."""
    mine = calib_data if dist is None else dist.my_share(calib_data)
    on_gpu = check_device(opts.device).type != "cpu"
    size = memory.run_size(
        ckpts, skels["merged"], path, mine, cfg.stats_dtype, (opts.fast or FastPaths()).pool_rows, on_gpu
    )
    memory.check_memory(memory.estimate_peak(size), memory.available_bytes(), opts.force)


def _with_memory(on_block: Callable[[int, dict], None], source) -> Callable[[int, dict], None]:
    """The engine's ``on_block`` with the streamed block's wall time and peak memory added."""
    return lambda block, info: on_block(block, {**info, **source.last})


def _calibrate_blocks(ckpts, skels, path, calib_data, merge, cfg, state, work, run: dict, dist) -> CalibrationReport:
    """The engine over the blocks not done yet (the skeletons filled block by block by a
    :class:`CheckpointSource`), and the report of the whole run, a resumed run's earlier blocks
    included. Under a process group, each rank's source keeps the streams of its own batches."""
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
            progress=run["progress"] and (dist is None or dist.rank == 0),
            dist=dist,
            batches=None if dist is None else distributed.share(_counts(calib_data), dist.rank, dist.size),
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
            on_block=None if run["on_block"] is None else _with_memory(run["on_block"], source),
        )
    full = CalibrationReport(cfg, path, tasks)
    full.modules = [ModuleRecord(**m) for m in state["prior_modules"]] + ([] if report is None else report.modules)
    full.blocks = [BlockRecord(**b) for b in state["prior_blocks"]] + ([] if report is None else report.blocks)
    full.warnings = [] if report is None else report.warnings
    full.notes = [] if report is None else report.notes
    full.check_residuals()  # over every block, not only this run's
    return full


def _counts(calib_data: Mapping) -> dict[str, int]:
    return {t: len(b) for t, b in calib_data.items()}

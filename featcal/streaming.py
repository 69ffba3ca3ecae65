"""Calibrate merges bigger than memory: every model streamed block by block from its
checkpoint shards (:func:`calibrate_checkpoints`).

FeatCal's forward order needs block l of each model only while it visits block l. So the
models are skeletons (parameters on ``meta``, :mod:`featcal.checkpoints`) and a
:class:`CheckpointSource` hooked into the engine (:class:`featcal.blocksource.BlockSource`)
fills block l of the base, of every expert and of the merged model (read from its directory,
or merged on the fly from the base's and the experts' block l with :mod:`featcal.merging`)
just before the engine visits it, writes the calibrated block to a work directory after, and
empties them all again. The stems run once at the start (their parameters loaded, then
released); the heads are never loaded. Peak memory: one block of every model, the streams and
one block's statistics.

The work directory ``.NAME.featcal-partial`` beside ``out`` holds the calibrated blocks so far,
the streams at the input of the next block (the calibrating and the experts' hidden states)
and ``state.json``; ``resume=True`` continues from it. The finished model is written there and
renamed to ``out`` at the very end, so a killed run never leaves a complete-looking ``out``.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import resource
import shutil
import time
from pathlib import Path
from typing import Callable, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from featcal import arch, merging, validate
from featcal.blocksource import BlockSource, check_device, move_streams, streams_fit, to_host
from featcal.checkpoints import (
    Checkpoint,
    Spec,
    check_same_tensors,
    copy_side_files,
    fill,
    read_header,
    release,
    skeleton,
    write_sharded,
)
from featcal.config import FastPaths, FeatCalConfig
from featcal.engine import calibrate
from featcal.model.export import drift_summary, write_hub_files
from featcal.model.lora import LoraCheckpoint, is_adapter_dir
from featcal.progress import note
from featcal.report import BlockRecord, CalibrationReport, ModuleRecord

log = logging.getLogger(__name__)

PARTIAL = ".featcal-partial"
STATE = "state.json"
STREAMS = "streams.safetensors"


def partial_dir(out: str | os.PathLike) -> Path:
    """The work directory of a run writing ``out`` (beside it, hidden)."""
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{PARTIAL}"


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _data_digest(calib_data: Mapping[str, list]) -> str:
    """A hash of every batch's tensors (shapes, dtypes and bytes): a resumed run must see the same data."""
    h = hashlib.sha256()

    def add(x):
        if torch.is_tensor(x):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, Mapping):
            for k in sorted(x):
                h.update(str(k).encode())
                add(x[k])
        else:
            h.update(repr(x).encode())

    for task in calib_data:
        h.update(task.encode())
        for b in calib_data[task]:
            add(b)
    return h.hexdigest()


class CheckpointSource(BlockSource):
    """Block l of every model filled from its checkpoint before the engine visits it, and the
    calibrated block saved (and every block emptied) after; see the module's docstring."""

    loaded = False

    def __init__(
        self,
        *,
        ckpts: dict[str, Checkpoint],  # "merged" (unless merging on the fly), "base", and every task
        skels: dict[str, nn.Module],  # the same roles' skeletons
        tasks: list[str],
        merge: tuple[str, dict] | None,
        path: str,
        device: torch.device,
        work: Path,
        state: dict,
        checkpoint_every: int,
        on_block: Callable[[int, dict], None] | None,
        progress: bool,
    ):
        self.ckpts, self.skels, self.tasks, self.merge = ckpts, skels, tasks, merge
        self.path, self.device, self.work, self.state = path, device, work, state
        self.every, self.on_block, self.progress = checkpoint_every, on_block, progress
        self.blocks = {role: arch.resolve_blocks(m, path)[1] for role, m in skels.items()}
        self.first = state["done"] + 1
        self._fit = True
        self._t0 = time.perf_counter()

    # ---- reading

    def _read(self, role: str, full: list[str]) -> dict[str, torch.Tensor]:
        return self.ckpts[role].read(full)

    def _merged(self, full: list[str], base: dict, experts: dict) -> dict[str, torch.Tensor]:
        """The merged model's tensors ``full``: read, or merged from the base's and experts'."""
        if self.merge is None:
            return self._read("merged", full)
        method, params = self.merge
        return merging.merge(method, base, experts, **params)

    def _fill(self, role: str, module: nn.Module, tensors: dict, prefix: str, device) -> None:
        validate._finite_params(tensors, f"the {role} checkpoint", self.path)
        rel = {name[len(prefix) :]: t.to(device) for name, t in tensors.items()}
        fill(module, rel)
        module.to(device)  # the non-persistent buffers too

    # ---- the hook

    def streams(self, make: Callable[[], dict]) -> dict:
        """Run the stems (of the merged model and the experts; their non-block parameters but
        the output embeddings filled on the CPU, then emptied again); on a resumed run, the saved
        hidden states replace the stems' outputs (the stems still give the blocks' other arguments)."""
        roles = ["merged", *self.tasks]
        for role in roles:
            skel = self.skels[role]
            skip = _head_only(skel)
            names = [n for n, p in skel.named_parameters() if not n.startswith(self.path + ".") and id(p) not in skip]
            if role == "merged":
                base = self._read("base", names)
                tensors = self._merged(names, base, {t: self._read(t, names) for t in self.tasks})
            else:
                tensors = self._read(role, names)
            validate._finite_params(tensors, f"the {role} checkpoint", self.path)
            skel.load_state_dict(tensors, strict=False, assign=True)
        try:
            streams = make()
        finally:
            for role in roles:
                release(self.skels[role])
            _trim_heap()
        if any(c.hidden.is_meta for st in streams.values() for c in st.cal + st.exp):
            raise RuntimeError(
                "a stem's output is on the meta device: its forward pass used the output embeddings, which "
                "featcal leaves unloaded; please report the architecture."
            )
        if self.first > 0:
            self._load_streams(streams)
        self._fit = streams_fit(streams, self.device)
        if self._fit and self.device.type != "cpu":
            move_streams(streams, self.device)
        return streams

    def offload(self, streams: dict) -> bool:
        return not self._fit

    def enter(self, block: int) -> None:
        self._t0 = time.perf_counter()
        prefix = f"{self.path}.{block}."
        full = [prefix + k for k in self.blocks["base"][block].state_dict()]
        base = self._read("base", full)
        experts = {t: self._read(t, full) for t in self.tasks}
        merged = self._merged(full, base, experts)
        self._fill("merged", self.blocks["merged"][block], merged, prefix, self.device)
        self._fill("base", self.blocks["base"][block], base, prefix, self.device)
        for t in self.tasks:
            self._fill(f"expert {t!r}", self.blocks[t][block], experts[t], prefix, self.device)

    def leave(self, block: int, streams: dict, report: CalibrationReport) -> None:
        prefix = f"{self.path}.{block}."
        calibrated = {
            prefix + k: v.detach().cpu().contiguous() for k, v in self.blocks["merged"][block].state_dict().items()
        }
        _save_atomic(calibrated, self.work / "blocks" / f"{block:05d}.safetensors")
        for blocks in self.blocks.values():
            release(blocks[block])
        _trim_heap()
        last = block == len(self.blocks["base"]) - 1
        if (block + 1) % self.every == 0 or last:
            if not last:
                self._save_streams(streams)
            self.state["done"] = block
            self.state["modules"] = self.state["prior_modules"] + [vars(m) for m in report.modules]
            self.state["blocks"] = self.state["prior_blocks"] + [vars(b) for b in report.blocks]
            _write_json_atomic({k: v for k, v in self.state.items() if not k.startswith("prior_")}, self.work / STATE)
        info = {"seconds": time.perf_counter() - self._t0, "peak_rss_mb": peak_rss_mb()}
        if self.device.type == "cuda":
            info["peak_gpu_mb"] = torch.cuda.max_memory_allocated(self.device) / 2**20
        if self.progress:
            gpu = f", GPU peak {info['peak_gpu_mb']:.0f} MB" if "peak_gpu_mb" in info else ""
            note(
                f"block {block + 1}/{len(self.blocks['base'])}: {info['seconds']:.1f} s, "
                f"peak RSS so far {info['peak_rss_mb']:.0f} MB{gpu}"
            )
        if self.on_block is not None:
            self.on_block(block, info)

    # ---- the streams on disk

    def _save_streams(self, streams: dict) -> None:
        flat = {}
        for i, task in enumerate(self.tasks):
            for kind in ("cal", "exp"):
                for b, c in enumerate(getattr(streams[task], kind)):
                    flat[f"{kind}.{i}.{b}"] = to_host(c.hidden).contiguous()
        _save_atomic(flat, self.work / STREAMS)

    def _load_streams(self, streams: dict) -> None:
        with safe_open(str(self.work / STREAMS), framework="pt", device="cpu") as f:
            for i, task in enumerate(self.tasks):
                for kind in ("cal", "exp"):
                    calls = getattr(streams[task], kind)
                    setattr(
                        streams[task],
                        kind,
                        [c.with_hidden(f.get_tensor(f"{kind}.{i}.{b}")) for b, c in enumerate(calls)],
                    )


def _head_only(model: nn.Module) -> set[int]:
    """The ids of the output embeddings' parameters that the input embeddings do not share (the
    head, which the stems never run; tied to the input embeddings, it is loaded with them)."""
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if get_out is not None else None
    if head is None:
        return set()
    get_in = getattr(model, "get_input_embeddings", None)
    shared = {id(p) for p in get_in().parameters()} if get_in is not None and get_in() is not None else set()
    return {id(p) for p in head.parameters()} - shared


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim``; nothing elsewhere). Without
    it, blocks of every model allocated and freed one after another fragment the heap and the
    resident memory creeps up by about two blocks' worth per block."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _save_atomic(tensors: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path.with_suffix(".part")))
    os.replace(path.with_suffix(".part"), path)


def _write_json_atomic(doc: dict, path: Path) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(part, path)


def _rows(batches: list) -> int:
    """The examples in a task's calibration batches (a batch: a tensor or a dict of them)."""
    n = 0
    for b in batches:
        n += int((next(iter(b.values())) if isinstance(b, Mapping) else b).shape[0])
    return n


def _block_of(name: str, path: str) -> int | None:
    """The block index of a tensor name under ``path`` (``model.layers.3.mlp...`` -> 3), else None."""
    if not name.startswith(path + "."):
        return None
    head = name[len(path) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _write_model(
    work: Path, src: Checkpoint, ckpts: dict, tasks: list[str], merge, path: str, max_shard_bytes: int
) -> Path:
    """The calibrated model in ``work/model``: every tensor of ``src`` (the merged checkpoint,
    or the base's names when merging on the fly) in its order, the blocks' from the saved
    calibrated blocks, the rest from the merged model; the config and tokenizer files copied."""
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
        return merging.merge(method, base, {t: ckpts[t].read([name]) for t in tasks}, **params)[name]

    write_sharded(model_dir, specs, get, max_shard_bytes)
    copy_side_files(src.path, model_dir)
    return model_dir


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
    common_rows: bool = False,
    lora_any_base: bool = False,
    card: Mapping | None = None,
) -> CalibrationReport:
    """Calibrate a merge with FeatCal, streaming every model from its checkpoint one block at a
    time, and write the calibrated model to ``out`` (``save_pretrained`` layout).

    Args:
        base: the pretrained model's directory (``config.json`` and ``*.safetensors``).
        experts: ``{task: directory}`` of the experts: model directories, or PEFT LoRA adapter
            directories on ``base`` (merged block by block as they are read, :mod:`featcal.model.lora`).
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
        common_rows: an expert (or the merged model) whose embeddings have more rows than the
            base's (tokens added) is calibrated on the rows the base has; without it, an error.
        lora_any_base: accept a LoRA adapter whose ``base_model_name_or_path`` names another
            model than ``base`` (its shapes are still checked).
        card: more facts for the model card (:func:`featcal.model.export.write_hub_files`:
            ``merge``, ``scores``, ...) than this run knows itself.

    Returns:
        The :class:`CalibrationReport` (every block's, a resumed run's included).
    """
    t_start = time.perf_counter()
    cfg = config or FeatCalConfig()
    device = check_device(device)
    if (merge is None) == (merged is None):
        raise ValueError("give exactly one of merge=(method, params) (merge on the fly) or merged=DIR.")
    if isinstance(merge, str):
        merge = (merge, {})
    if merge is not None:
        if merge[0] not in merging.MERGERS:
            raise ValueError(f"unknown merge method {merge[0]!r}; choose one of {sorted(merging.MERGERS)}.")
        merge = (merge[0], dict(merge[1]))
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int) or checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be an integer >= 1, got {checkpoint_every!r}.")
    tasks = validate.check_tasks(experts, calib_data)
    out = Path(out).expanduser().absolute()
    if out.exists() and not force:
        raise FileExistsError(f"output {str(out)!r} already exists; pass force=True (--force) to replace it.")

    # The checkpoints (headers only) and their skeletons.
    ckpts = {"base": Checkpoint(base, "the base")}
    for t in tasks:
        what = f"expert {t!r}"
        if is_adapter_dir(experts[t]):
            ckpts[t] = LoraCheckpoint(experts[t], ckpts["base"], what, strict_name=not lora_any_base)
        else:
            ckpts[t] = Checkpoint(experts[t], what)
    if merged is not None:
        ckpts["merged"] = Checkpoint(merged, "the merged model")
    for role, ck in ckpts.items():
        if role != "base":
            check_same_tensors(ckpts["base"], ck, common_rows)
    src = ckpts.get("merged", ckpts["base"])
    # a checkpoint read cut to the base's vocabulary is built as the base is
    skels = {role: skeleton(ckpts["base"] if ck.rows else ck) for role, ck in ckpts.items()}
    if "merged" not in skels:
        skels["merged"] = skeleton(ckpts["base"])
    path = arch.resolve_blocks(skels["merged"], blocks)[0]

    # The work directory: a fresh one, or the one a killed run left.
    work = partial_dir(out)
    fingerprint = {
        "base": str(ckpts["base"].path.absolute()),
        "experts": {t: str(ckpts[t].path.absolute()) for t in tasks},
        "merged": None if merged is None else str(ckpts["merged"].path.absolute()),
        "merge": merge,
        "config": cfg.to_dict(),
        "blocks": path,
        "data": _data_digest({t: calib_data[t] for t in tasks}),
    }
    fingerprint = json.loads(json.dumps(fingerprint, default=str))
    state = {"fingerprint": fingerprint, "done": -1, "modules": [], "blocks": []}
    if work.exists():
        if resume and (work / STATE).is_file():
            saved = json.loads((work / STATE).read_text())
            if saved["fingerprint"] != fingerprint:
                diff = sorted(k for k in fingerprint if saved["fingerprint"].get(k) != fingerprint[k])
                raise ValueError(
                    f"resume: the run in {str(work)!r} was made with other {', '.join(diff)}; resume it with "
                    "the same models, merge, config and data, or pass force=True to start afresh."
                )
            state = saved
            log.info("resuming after block %d from %s", state["done"], work)
        elif resume or force:
            shutil.rmtree(work)
        else:
            raise FileExistsError(
                f"{str(work)!r} holds a run that did not finish; pass resume=True (--resume) to continue it "
                "or force=True (--force) to start afresh."
            )
    work.mkdir(parents=True, exist_ok=True)
    state["prior_modules"], state["prior_blocks"] = list(state["modules"]), list(state["blocks"])
    n_blocks = len(arch.resolve_blocks(skels["merged"], path)[1])

    report = None
    if state["done"] < n_blocks - 1:
        source = CheckpointSource(
            ckpts=ckpts,
            skels=skels,
            tasks=tasks,
            merge=merge,
            path=path,
            device=device,
            work=work,
            state=state,
            checkpoint_every=checkpoint_every,
            on_block=on_block,
            progress=progress,
        )
        exps = {t: skels[t] for t in tasks}
        _, report = calibrate(
            skels["merged"],
            base=skels["base"],
            experts=exps,
            calib_data={t: calib_data[t] for t in tasks},
            config=cfg,
            blocks=path,
            inplace=True,
            progress=progress,
            fast=fast,
            device=device,
            block_source=source,
        )
    full = CalibrationReport(cfg, path, tasks)
    full.modules = [ModuleRecord(**m) for m in state["prior_modules"]] + ([] if report is None else report.modules)
    full.blocks = [BlockRecord(**b) for b in state["prior_blocks"]] + ([] if report is None else report.blocks)
    full.warnings = [] if report is None else report.warnings

    # The model, written in the work directory and renamed into place.
    model_dir = _write_model(work, src, ckpts, tasks, merge, path, max_shard_bytes)
    full.seconds = time.perf_counter() - t_start
    full.save_json(model_dir / "featcal_report.json")
    facts = {
        "experts": {t: str(ckpts[t].path) for t in tasks},
        "merge": {"method": merge[0], "params": merge[1]} if merge else {"merged": str(ckpts["merged"].path)},
        "settings": cfg.to_dict(),
        "calibration": {t: _rows(calib_data[t]) for t in tasks},
        "drift": drift_summary(full),
    }
    write_hub_files(model_dir, base_dir=ckpts["base"].path, name=out.name, **(facts | dict(card or {})))
    if out.exists():  # force
        shutil.rmtree(out)
    os.rename(model_dir, out)
    shutil.rmtree(work)
    return full

"""The block source of a streamed run: block l of every model filled from its checkpoint just
before the engine visits it, the calibrated block saved and every block emptied after.

The models are skeletons (parameters on ``meta``, :mod:`featcal.model.checkpoints`); the merged
model's block is read from its directory or merged on the fly from the base's and the experts'
block l with :mod:`featcal.baselines.merging`. The stems run once at the start (their parameters
loaded, then released); the heads are never loaded.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn

from featcal.baselines import registry
from featcal.engine import distributed
from featcal.engine.blocksource import BlockSource, move_streams, streams_fit, to_host
from featcal.engine.report import CalibrationReport
from featcal.model import arch, validate
from featcal.model.checkpoints import Checkpoint
from featcal.model.skeletons import fill, release
from featcal.streaming.workdir import check_streams, commit, save_atomic, save_streams, streams_files
from featcal.util.memory import peak_rss_mb, trim_heap
from featcal.util.progress import note


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
        progress: bool,
        dist: distributed.Dist | None = None,
        batches: dict[str, list[int]] | None = None,  # this rank's batches of each task (global indices)
    ):
        self.dist, self.batches = dist, batches
        self.ckpts, self.skels, self.tasks, self.merge = ckpts, skels, tasks, merge
        self.path, self.device, self.work, self.state = path, device, work, state
        self.every, self.progress = checkpoint_every, progress
        self.last: dict[str, float] = {}  # the last block's wall seconds and peak memory (MB)
        self.blocks = {role: arch.resolve_blocks(m, path)[1] for role, m in skels.items()}
        self.first = state["done"] + 1
        self._fit = True
        self._t0 = time.perf_counter()

    # ---- reading

    def _read(self, role: str, full: list[str]) -> dict[str, torch.Tensor]:
        """Tensors ``full`` of one model's checkpoint, checked finite (a NaN or Inf is blamed on
        the file that holds it, before anything is merged from it)."""
        ck = self.ckpts[role]
        tensors = ck.read(full)
        try:
            validate._finite_params(tensors, ck.role, self.path)
        except FloatingPointError as err:
            bad = next(n for n, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all()))
            raise FloatingPointError(f"{err} It is in {str(ck.path / ck.files[bad])!r}.") from None
        return tensors

    def _merged(self, full: list[str], base: dict, experts: dict) -> dict[str, torch.Tensor]:
        """The merged model's tensors ``full``: read, or merged from the base's and experts'."""
        if self.merge is None:
            return self._read("merged", full)
        method, params = self.merge
        return registry.merge(method, base, experts, **params)

    def _fill(self, role: str, module: nn.Module, tensors: dict, prefix: str, device) -> None:
        if role == "merged":  # (the models read were checked as they were read)
            validate._finite_params(tensors, "the merged model", self.path)
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
            names = stem_names(skel, self.path)
            if role == "merged":
                base = self._read("base", names)
                tensors = self._merged(names, base, {t: self._read(t, names) for t in self.tasks})
            else:
                tensors = self._read(role, names)
            validate._finite_params(tensors, "the merged model" if role == "merged" else f"expert {role!r}", self.path)
            skel.load_state_dict(with_aliases(skel, tensors), strict=False, assign=True)
        try:
            streams = make()
        finally:
            for role in roles:
                release(self.skels[role])
            trim_heap()  # else every model's blocks, loaded and freed in turn, fragment the heap
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
        if self.dist is None or self.dist.rank == 0:  # the same block on every rank: rank 0 writes it
            save_atomic(calibrated, self.work / "blocks" / f"{block:05d}.safetensors")
        for blocks in self.blocks.values():
            release(blocks[block])
        trim_heap()
        last = block == len(self.blocks["base"]) - 1
        if (block + 1) % self.every == 0 or last:  # a checkpoint (workdir.commit): streams, then the state
            files = [] if last else streams_files(self.dist, block)
            if not last:
                self._save_streams(streams, files[0 if self.dist is None else self.dist.rank], block)
            self.state["done"] = block
            self.state["modules"] = self.state["prior_modules"] + [vars(m) for m in report.modules]
            self.state["blocks"] = self.state["prior_blocks"] + [vars(b) for b in report.blocks]
            if self.dist is not None:  # every rank's streams and the block are written
                self.dist.barrier(f"block {block}: waiting for every rank's streams")
            if self.dist is None or self.dist.rank == 0:
                commit(self.work, self.state, files)
        info = self.last = block_info(time.perf_counter() - self._t0, self.device)
        if self.progress:
            gpu = f", GPU peak {info['peak_gpu_mb']:.0f} MB" if "peak_gpu_mb" in info else ""
            note(
                f"block {block + 1}/{len(self.blocks['base'])}: {info['wall_seconds']:.1f} s, "
                f"peak RSS so far {info['peak_rss_mb']:.0f} MB{gpu}"
            )

    # ---- the streams on disk

    def _global(self, task: str, b: int) -> int:
        """The index among all of ``task``'s batches of this rank's batch ``b``."""
        return b if self.batches is None else self.batches[task][b]

    def _save_streams(self, streams: dict, name: str, generation: int) -> None:
        """This rank's streams, each batch under its index among all of its task's batches (so
        that a run resumed on another number of ranks finds every batch's)."""
        flat = {}
        for i, task in enumerate(self.tasks):
            for kind in ("cal", "exp"):
                for b, c in enumerate(getattr(streams[task], kind)):
                    flat[f"{kind}.{i}.{self._global(task, b)}"] = to_host(c.hidden).contiguous()
        save_streams(self.work, name, flat, generation)

    def _load_streams(self, streams: dict) -> None:
        where = {}
        for name in check_streams(self.work, self.state):  # a run saved on any number of ranks
            with safe_open(str(self.work / name), framework="pt", device="cpu") as f:
                where |= dict.fromkeys(f.keys(), name)
        for i, task in enumerate(self.tasks):
            for kind in ("cal", "exp"):
                calls = getattr(streams[task], kind)
                loaded = []
                for b, c in enumerate(calls):
                    key = f"{kind}.{i}.{self._global(task, b)}"
                    with safe_open(str(self.work / where[key]), framework="pt", device="cpu") as f:
                        loaded.append(c.with_hidden(f.get_tensor(key)))
                setattr(streams[task], kind, loaded)


def with_aliases(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` plus every other name of a tied parameter (T5's ``shared.weight`` is also
    ``encoder.embed_tokens.weight``): loading by assignment would otherwise fill one name and leave
    the other on the meta device."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    out = dict(tensors)
    for names in by_id.values():
        given = next((n for n in names if n in tensors), None)
        if given is not None:
            out.update({n: tensors[given] for n in names if n not in out})
    return out


def stem_names(model: nn.Module, path: str) -> list[str]:
    """The parameters outside the blocks at ``path`` that the stems read (the head left out)."""
    skip = _head_only(model)
    return [n for n, p in model.named_parameters() if not n.startswith(path + ".") and id(p) not in skip]


def needed_names(model: nn.Module, path: str) -> list[str]:
    """Every tensor name a streamed run reads of a model: the stems' parameters and its blocks'
    state dicts."""
    names = stem_names(model, path)
    for i, blk in enumerate(arch.resolve_blocks(model, path)[1]):
        names += [f"{path}.{i}.{k}" for k in blk.state_dict()]
    return names


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


def block_info(seconds: float, device: torch.device) -> dict[str, float]:
    """What ``on_block`` hears of a streamed block: its wall seconds and the peak memory so far
    (MB): the process's resident set, and on CUDA the device's peak allocation."""
    info = {"wall_seconds": seconds, "peak_rss_mb": peak_rss_mb()}
    if device.type == "cuda":
        info["peak_gpu_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    return info

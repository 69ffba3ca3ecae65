"""How a streamed calibration (:func:`featcal.calibrate_checkpoints`) reads, runs and writes: one
frozen options object, so the call itself says only what is calibrated (the checkpoints, the data,
the merge, FeatCal's :class:`~featcal.config.FeatCalConfig`) and where it goes (``out``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from featcal.config import FastPaths
from featcal.model.export import MAX_SHARD_BYTES
from featcal.util.options import option


@dataclass(frozen=True)
class StreamOptions:
    """The options of :func:`featcal.calibrate_checkpoints`, by what they govern: reading the
    checkpoints (``blocks``, ``common_rows``, ``lora_any_base``, ``trust_remote_code``), running
    (``device``, ``fast``, ``progress``, ``on_block``) and writing (``force``, ``resume``,
    ``checkpoint_every``, ``max_shard_bytes``, ``card``). The defaults are a plain CPU run."""

    # Reading the checkpoints.
    blocks: str | None = option(None, "dotted path of the blocks, for architectures featcal does not know")
    common_rows: bool = option(
        False,
        "an expert (or the merged model) whose embeddings have more rows than the base's (tokens added) is "
        "calibrated on the rows the base has; without it, an error",
    )
    lora_any_base: bool = option(
        False, "accept a LoRA adapter whose base_model_name_or_path names another model than base (shapes checked)"
    )
    trust_remote_code: bool = option(
        False,
        "build a model class from the checkpoint's own Python code (its auto_map); never taken from a file, "
        "only from this option (--trust-remote-code)",
    )
    # Running.
    device: str | torch.device = option("cpu", 'where each block runs ("cuda": one block of every model at a time)')
    fast: FastPaths | None = option(None, "the engine's fast paths (FastPaths)")
    progress: bool = option(True, "a progress bar and one line per block (time, peak memory)")
    on_block: Callable[[int, dict], None] | None = option(
        None,
        'called after each block as featcal.calibrate calls it ("done", "blocks", "seconds"), with the block\'s '
        '"wall_seconds" (reading and saving included) and "peak_rss_mb" ["peak_gpu_mb"] added; an exception '
        "from it stops the run there, resumable from the last saved block",
    )
    # Writing.
    force: bool = option(False, "replace an existing out (and a stale work directory) that featcal wrote")
    resume: bool = option(False, "continue the run killed part-way that left its work directory beside out")
    checkpoint_every: int = option(
        1,
        "save the streams (for resume) every this many blocks (each save writes every task's hidden states; "
        "the calibrated blocks are saved every block)",
    )
    max_shard_bytes: int = option(MAX_SHARD_BYTES, "the largest output shard")
    card: Mapping | None = option(None, "more facts for the model card (merge, scores, ...) than the run knows itself")

    def __post_init__(self):
        every = self.checkpoint_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every must be an integer >= 1, got {every!r}.")

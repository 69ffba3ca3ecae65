"""The work directory of a streamed run: where it is, what a resumed run must match, atomic writes.

``.NAME.featcal-partial`` beside ``out`` holds the calibrated blocks so far (``blocks/``), the streams
at the input of the next block (``streams.safetensors``: the calibrating and the experts' hidden
states; a run on W ranks: ``streams-R-of-W.safetensors``, rank R's batches, each under its index
among all of its task's batches) and ``state.json`` (the fingerprint of the run's inputs, the last
block done, the report so far).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
from pathlib import Path

from safetensors.torch import save_file

from featcal.model.validate import data_digest  # noqa: F401  (the same digest the ranks compare)

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


def save_atomic(tensors: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path.with_suffix(".part")))
    os.replace(path.with_suffix(".part"), path)


def write_json_atomic(doc: dict, path: Path) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(part, path)


def open_work(work: Path, fingerprint: dict, *, resume: bool, force: bool, dist=None) -> dict:
    """The run's state: fresh, or the one a killed run left in ``work`` (``resume``), which must
    have the same ``fingerprint``; a stale work directory is removed only with ``resume`` or ``force``.
    Under a process group (``dist``) every rank reads it, then rank 0 alone changes it."""
    state = {"fingerprint": fingerprint, "done": -1, "modules": [], "blocks": []}
    stale = False
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
            stale = True
        else:
            raise FileExistsError(
                f"{str(work)!r} holds a run that did not finish; pass resume=True (--resume) to continue it "
                "or force=True (--force) to start afresh."
            )
    if dist is not None:  # every rank has read the work directory before rank 0 changes it
        dist.barrier("reading the work directory")
    if dist is None or dist.rank == 0:
        if stale:
            shutil.rmtree(work)
        work.mkdir(parents=True, exist_ok=True)
    if dist is not None:
        dist.barrier("making the work directory")
    state["prior_modules"], state["prior_blocks"] = list(state["modules"]), list(state["blocks"])
    return state

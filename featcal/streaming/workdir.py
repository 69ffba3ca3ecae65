"""The work directory of a streamed run: where it is, what a resumed run must match, atomic writes.

``.NAME.featcal-partial`` beside ``out`` holds the calibrated blocks so far (``blocks/``), the streams
at the input of the next block (``streams-GGGGG.safetensors``: the calibrating and the experts' hidden
states after block GGGGG; a run on W ranks: ``streams-GGGGG-R-of-W.safetensors``, rank R's batches,
each under its index among all of its task's batches) and ``state.json`` (the fingerprint of the run's
inputs, the last block done, the report so far, the names of its streams files).

A checkpoint is one atomic commit (:func:`commit`): the new streams go to files of their own, carrying
the generation (the last block done) in their metadata, then ``state.json`` naming those files is
renamed into place (the commit), and only then are older streams files deleted. A failure between
the writes leaves the previous state and its streams intact; on load the generations must agree
(:func:`check_streams`).

The fingerprint (:func:`featcal.model.fingerprint.fingerprint_checkpoint`) covers the inputs' contents,
not only their paths: each file's size and modification time, each shard's header and a sample of its
bytes, so that experts overwritten in place are refused on resume.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from featcal.model.validate import data_digest  # noqa: F401  (the same digest the ranks compare)
from featcal.util import outdir

log = logging.getLogger(__name__)

PARTIAL = ".featcal-partial"
STATE = "state.json"


def partial_dir(out: str | os.PathLike) -> Path:
    """The work directory of a run writing ``out`` (beside it, hidden)."""
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{PARTIAL}"


# ------------------------------------------------------------------ writes and the commit


def save_atomic(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path.with_suffix(".part")), metadata=metadata)
    os.replace(path.with_suffix(".part"), path)


def write_json_atomic(doc: dict, path: Path) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(part, path)


def streams_files(dist, generation: int) -> list[str]:
    """The streams files of generation ``generation`` of a run on ``dist``'s ranks (one process: one file)."""
    if dist is None:
        return [f"streams-{generation:05d}.safetensors"]
    return [f"streams-{generation:05d}-{r}-of-{dist.size}.safetensors" for r in range(dist.size)]


def save_streams(work: Path, name: str, flat: dict, generation: int) -> None:
    """One rank's streams of ``generation`` (in the file's metadata, checked on load)."""
    save_atomic(flat, work / name, metadata={"generation": str(generation)})


def commit(work: Path, state: dict, files: list[str]) -> None:
    """The checkpoint: ``state`` naming its streams ``files`` (saved before) renamed into place,
    then every other streams file deleted."""
    state["streams"] = files
    write_json_atomic({k: v for k, v in state.items() if not k.startswith("prior_")}, work / STATE)
    for old in work.glob("streams*.safetensors"):
        if old.name not in files:
            old.unlink()


def check_streams(work: Path, state: dict) -> list[str]:
    """The streams files of the committed ``state``, each checked to carry its generation."""
    files = state.get("streams")
    for name in files or [None]:
        gen = None
        if name is not None and (work / name).is_file():
            with safe_open(str(work / name), framework="pt", device="cpu") as f:
                gen = (f.metadata() or {}).get("generation")
        if gen != str(state["done"]):
            raise ValueError(
                f"resume: the work directory {str(work)!r} is inconsistent (state after block {state['done']}, "
                f"streams {name!r} of generation {gen}); pass force=True (--force) to start afresh."
            )
    return files


# ------------------------------------------------------------------ opening it


def open_work(work: Path, fingerprint: dict, *, resume: bool, force: bool, dist=None) -> dict:
    """The run's state: fresh, or the one a killed run left in ``work`` (``resume``), which must
    have the same ``fingerprint`` and consistent streams; a stale work directory is removed only with
    ``resume`` or ``force``, and only if featcal made it (its marker, or a state.json). Under a
    process group (``dist``) every rank reads it, then rank 0 alone changes it."""
    state = {"fingerprint": fingerprint, "done": -1, "modules": [], "blocks": [], "streams": []}
    stale = False
    if work.exists():
        if resume and (work / STATE).is_file():
            saved = json.loads((work / STATE).read_text())
            if saved.get("fingerprint") != fingerprint:
                diff = sorted(k for k in fingerprint if saved.get("fingerprint", {}).get(k) != fingerprint[k])
                raise ValueError(
                    f"resume: the run in {str(work)!r} was made with other {', '.join(diff)} (or their files "
                    "changed since); resume it with the same models, merge, config and data, or pass "
                    "force=True to start afresh."
                )
            if saved["done"] >= 0 and saved.get("streams") != []:
                check_streams(work, saved)  # the generations agree
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
            _remove_work(work)
        if not work.exists():
            work.mkdir(parents=True)
            outdir.mark(work, "work", listed=False)
    if dist is not None:
        dist.barrier("making the work directory")
    state["prior_modules"], state["prior_blocks"] = list(state["modules"]), list(state["blocks"])
    return state


def _remove_work(work: Path) -> None:
    """Delete a work directory featcal made (a state.json of an older featcal counts as its mark)."""
    if (work / STATE).is_file() and not (work / outdir.MARKER).is_file():
        shutil.rmtree(work)
    else:
        outdir.remove_own(work)

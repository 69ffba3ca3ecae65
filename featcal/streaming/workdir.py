"""The work directory of a streamed run: where it is, what a resumed run must match, atomic writes.

``.NAME.featcal-partial`` beside ``out`` holds the calibrated blocks so far (``blocks/``), the streams
at the input of the next block (``streams-GGGGG.safetensors``: the calibrating and the experts' hidden
states after block GGGGG) and ``state.json`` (the fingerprint of the run's inputs, the last block done,
the report so far, the name of its streams file).

A checkpoint is one atomic commit (:func:`commit`): the new streams go to a file of their own, carrying
the generation (the last block done) in their metadata, then ``state.json`` naming that file is renamed
into place (the commit), and only then are older streams files deleted. A failure between the two
writes leaves the previous state and its streams intact; on load the generations must agree.

The fingerprint (:func:`fingerprint_checkpoint`) covers the inputs' contents, not only their paths:
each file's size and modification time, each shard's header and a sample of its bytes, so that
experts overwritten in place are refused on resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
from pathlib import Path
from typing import Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from featcal.model.checkpoints import INDEX
from featcal.util import outdir

log = logging.getLogger(__name__)

PARTIAL = ".featcal-partial"
STATE = "state.json"
STREAMS = "streams-{:05d}.safetensors"
SAMPLE_WINDOWS, WINDOW_BYTES = 32, 1 << 16  # the bytes of each shard that the fingerprint hashes


def partial_dir(out: str | os.PathLike) -> Path:
    """The work directory of a run writing ``out`` (beside it, hidden)."""
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{PARTIAL}"


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def data_digest(calib_data: Mapping[str, list]) -> str:
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


def file_fingerprint(path: Path, data_start: int = 0) -> str:
    """Size, modification time and a hash of ``path``'s bytes: all of them up to
    ``SAMPLE_WINDOWS * WINDOW_BYTES`` past ``data_start``, else its first ``data_start`` bytes (a
    shard's header) and that many windows spread evenly over the rest (2 MiB read per file)."""
    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        if st.st_size - data_start <= SAMPLE_WINDOWS * WINDOW_BYTES:
            h.update(f.read())
        else:
            h.update(f.read(data_start))
            step = (st.st_size - data_start - WINDOW_BYTES) // (SAMPLE_WINDOWS - 1)
            for k in range(SAMPLE_WINDOWS):
                f.seek(data_start + k * step)
                h.update(f.read(WINDOW_BYTES))
    return h.hexdigest()


def fingerprint_checkpoint(ckpt) -> dict:
    """``{file: fingerprint}`` of a model directory's config, index and shards (see the module's
    docstring): what a resumed run must find unchanged."""
    out = {}
    for name in sorted({"config.json", INDEX, *ckpt.files.values()}):
        p = ckpt.path / name
        if not p.is_file():
            continue
        start = 0
        if name.endswith(".safetensors"):
            with open(p, "rb") as f:
                start = 8 + int.from_bytes(f.read(8), "little")
        out[name] = file_fingerprint(p, start)
    return out


def save_atomic(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path.with_suffix(".part")), metadata=metadata)
    os.replace(path.with_suffix(".part"), path)


def commit(work: Path, state: dict, streams: dict | None) -> None:
    """One checkpoint: ``streams`` (None after the last block) saved under the generation
    ``state["done"]``, then ``state`` (naming them) renamed into place, then older streams deleted."""
    gen = state["done"]
    name = None
    if streams is not None:
        name = STREAMS.format(gen)
        save_atomic(streams, work / name, metadata={"generation": str(gen)})
    state["streams"] = name
    write_json_atomic({k: v for k, v in state.items() if not k.startswith("prior_")}, work / STATE)
    for old in work.glob("streams-*.safetensors"):
        if old.name != name:
            old.unlink()


def streams_file(work: Path, state: dict) -> Path:
    """The streams file of the committed ``state``, checked to carry its generation."""
    name = state.get("streams")
    path = work / name if name else None
    gen = None
    if path is not None and path.is_file():
        with safe_open(str(path), framework="pt", device="cpu") as f:
            gen = (f.metadata() or {}).get("generation")
    if gen != str(state["done"]):
        raise ValueError(
            f"resume: the work directory {str(work)!r} is inconsistent (state after block {state['done']}, "
            f"streams of generation {gen}); pass force=True (--force) to start afresh."
        )
    return path


def write_json_atomic(doc: dict, path: Path) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(part, path)


def open_work(work: Path, fingerprint: dict, *, resume: bool, force: bool) -> dict:
    """The run's state: fresh, or the one a killed run left in ``work`` (``resume``), which must
    have the same ``fingerprint``; a stale work directory is removed only with ``resume`` or ``force``,
    and only if featcal made it (its marker, or a state.json)."""
    state = {"fingerprint": fingerprint, "done": -1, "modules": [], "blocks": [], "streams": None}
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
            if saved["done"] >= 0 and saved.get("streams") is not None:
                streams_file(work, saved)  # the generations agree
            state = saved
            log.info("resuming after block %d from %s", state["done"], work)
        elif resume or force:
            _remove_work(work)
        else:
            raise FileExistsError(
                f"{str(work)!r} holds a run that did not finish; pass resume=True (--resume) to continue it "
                "or force=True (--force) to start afresh."
            )
    if not work.exists():
        work.mkdir(parents=True)
        outdir.mark(work, "work", listed=False)
    state["prior_modules"], state["prior_blocks"] = list(state["modules"]), list(state["blocks"])
    return state


def _remove_work(work: Path) -> None:
    """Delete a work directory featcal made (a state.json of an older featcal counts as its mark)."""
    if (work / STATE).is_file() and not (work / outdir.MARKER).is_file():
        shutil.rmtree(work)
    else:
        outdir.remove_own(work)

"""What a model directory's files hold, cheaply: a hash of each safetensors file's header and of a sample
of its bytes (2 MiB read per file, whatever its size), so that big checkpoints are identified in a
second.

Two fingerprints are made of it: :func:`fingerprint_checkpoint` (each file's, with its size and
modification time: a streamed run resumed on files changed in place is refused) and
:func:`content_fingerprint` (the weights' alone: the same model copied to another directory has the
same one, which is how a LoRA adapter's base is recognised whatever its directory is called).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SAMPLE_WINDOWS, WINDOW_BYTES = 32, 1 << 16  # the bytes of each file that the fingerprint hashes


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begins (after its 8-byte length and its header); 0 for others."""
    if path.suffix != ".safetensors":
        return 0
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def file_fingerprint(path: Path, data_start: int = 0, stamp: bool = True) -> str:
    """A hash of ``path``'s bytes: all of them up to ``SAMPLE_WINDOWS * WINDOW_BYTES`` past
    ``data_start``, else its first ``data_start`` bytes (a shard's header) and that many windows spread
    evenly over the rest; its size, and (``stamp``) its modification time."""
    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns if stamp else ''}".encode())
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
    """``{file: fingerprint}`` of every JSON and safetensors file of a model directory (config,
    index, shards; a LoRA adapter's config and weights): what a resumed run must find unchanged."""
    return {
        p.name: file_fingerprint(p, _data_start(p))
        for p in sorted(ckpt.path.iterdir())
        if p.is_file() and p.suffix in (".json", ".safetensors")
    }


def content_fingerprint(model_dir: str | os.PathLike) -> str | None:
    """A hash of the weights in ``model_dir`` (its safetensors files' headers and sampled bytes, by
    name), blind to where the directory is and when it was written; None when it holds none."""
    files = sorted(p for p in Path(model_dir).expanduser().iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}:{file_fingerprint(p, _data_start(p), stamp=False)}".encode())
    return h.hexdigest()

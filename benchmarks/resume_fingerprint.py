"""What the streamed run's resume fingerprint costs (featcal.model.fingerprint.fingerprint_checkpoint:
each file's size and modification time, each shard's header and 32 windows of 64 KiB of its bytes)
against hashing every byte of the checkpoint, on a model directory of random float32 shards.

    python benchmarks/resume_fingerprint.py                       # 4 shards of 256 MB
    python benchmarks/resume_fingerprint.py --shards 8 --mb 512   # a 4 GB checkpoint

Both are timed twice: the first read may come from the disk, the second from the page cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch
from safetensors.torch import save_file

from featcal.model.checkpoints import Checkpoint
from featcal.model.fingerprint import fingerprint_checkpoint


def _write(root: Path, shards: int, mb: int) -> None:
    weight_map = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        t = torch.randn(mb * 2**20 // 4 // 1024, 1024)
        save_file({f"layer.{k}.weight": t}, str(root / name), metadata={"format": "pt"})
        weight_map[f"layer.{k}.weight"] = name
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text("{}")


def _full_hash(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.iterdir()):
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--mb", type=int, default=256, help="MB per shard")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _write(root, args.shards, args.mb)
        ckpt = Checkpoint(root, "bench")
        for what, fn in (
            ("fingerprint (featcal)", lambda: fingerprint_checkpoint(ckpt)),
            ("sha256 of every byte", lambda: _full_hash(root)),
        ):
            for attempt in ("first", "second"):
                t0 = time.perf_counter()
                fn()
                rows.append(
                    {
                        "checkpoint": f"{args.shards} x {args.mb} MB",
                        "what": what,
                        "read": attempt,
                        "seconds": f"{time.perf_counter() - t0:.3f}",
                    }
                )
    print(C.environment())
    print(C.markdown_table(rows))


if __name__ == "__main__":
    main()

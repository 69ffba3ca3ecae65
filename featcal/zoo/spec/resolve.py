"""What a zoo spec needs and cannot find, and where the local Hugging Face cache keeps things.

Shared by :mod:`featcal.zoo.load.loaders` (models) and :mod:`featcal.zoo.load.data`
(datasets). Nothing here touches the network: an HF repo is found in the local
cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``) by reading the cache layout directly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# ----------------------------------------------------------------------------- missing things


@dataclass(frozen=True)
class Missing:
    """One thing a spec needs that is not on this machine."""

    what: str  # "expert 'sun397': HF model tanganke/clip-vit-base-patch32_sun397"
    looked: tuple[str, ...]  # every place looked, with why it did not do
    fix: str  # how to make it available


class MissingResourcesError(FileNotFoundError):
    """Models, head files or datasets a zoo needs are missing; ``missing`` lists them all."""

    def __init__(self, missing: list[Missing], source: str | None = None):
        self.missing = list(missing)
        super().__init__(format_missing(self.missing, source))


def format_missing(missing: list[Missing], source: str | None = None) -> str:
    head = f"zoo spec {source}: " if source else ""
    lines = [f"{head}{len(missing)} thing(s) this zoo needs are not on this machine; nothing was loaded."]
    for m in missing:
        lines.append(f"  - {m.what}")
        lines += [f"      looked: {place}" for place in m.looked]
        lines.append(f"      fix: {m.fix}")
    downloads = [m.fix.split("`")[1] for m in missing if "huggingface-cli download" in m.fix]
    if downloads:
        lines.append("On a machine with network access run (`hf download` works the same):")
        lines += [f"    {cmd}" for cmd in downloads]
        lines.append(
            "then copy its Hugging Face cache folder (~/.cache/huggingface) here and set HF_HOME to it "
            "(or HF_HUB_CACHE to its hub/ folder); or download with --local-dir DIR and give DIR "
            "as `path:`."
        )
    lines.append(f"featcal never downloads (HF_HUB_OFFLINE=1); the HF cache searched was {hf_cache_dir()}.")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the HF cache


def hf_cache_dir() -> Path:
    """The HF hub cache, read from the environment now (``HF_HUB_CACHE``, ``HF_HOME``, default)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hf_snapshot(repo_id: str, repo_type: str = "model", revision: str | None = None) -> tuple[Path | None, str]:
    """``(snapshot dir or None, where it was looked)`` for a repo in the local HF cache."""
    folder = hf_cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}"
    rev = revision or "main"
    ref = folder / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snap = folder / "snapshots" / commit
    if snap.is_dir():
        return snap, f"HF cache {snap}"
    snaps = sorted(p for p in (folder / "snapshots").glob("*") if p.is_dir()) if folder.is_dir() else []
    if revision is None and len(snaps) == 1:
        return snaps[0], f"HF cache {snaps[0]}"
    why = "not there" if not folder.exists() else f"no snapshot for revision {rev!r}"
    return None, f"HF cache {folder} ({why})"


def hf_fix(repo_id: str, repo_type: str = "model", revision: str | None = None) -> str:
    """The ``fix`` of a :class:`Missing` HF repo: the download command :func:`format_missing` collects."""
    flag = " --repo-type dataset" if repo_type == "dataset" else ""
    flag += f" --revision {revision}" if revision not in (None, "main") else ""
    return f"`huggingface-cli download {repo_id}{flag}` on a connected machine (see below)"

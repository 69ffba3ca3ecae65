"""The embedded demo zoo: a small CLIP-format ViT, seven synthetic tasks, built offline.

``load_demo()`` loads, in this order:

1. the copy shipped in the repository (``assets/zoos/demo/``), when it was built by
   this recipe and version and its files match their recorded sha256;
2. the cache, ``<cache>/zoos/demo-<version>/`` (``$FEATCAL_CACHE``, default
   ``~/.cache/featcal``);
3. else it builds the zoo into the cache (a few minutes on two CPU cores, nothing
   downloaded; ``featcal zoo build-demo --rebuild`` does so on demand).

How it is made: :mod:`featcal.zoo.builtin.demo_recipe`. The models are stored in float16
(loaded back as float32), which keeps the shipped copy small.

The ``fashion`` variant (:mod:`featcal.zoo.builtin.fashion`) adds two real
Fashion-MNIST tasks to the default zoo, with the recipe's heads and fine-tuning
on the same base.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from featcal.util.progress import Progress
from featcal.zoo.builtin.demo_recipe import DEMO_VERSION, Recipe, build_parts, recipe_sha256
from featcal.zoo.builtin.fashion import build_fashion_parts, find_fashion_mnist
from featcal.zoo.core import Zoo
from featcal.zoo.store import ZooCorruptedError, is_zoo_dir, read_meta, read_zoo_dir, verify_zoo_dir, write_zoo_dir

__all__ = [
    "DEMO_VERSION",
    "VARIANTS",
    "SHIPPED",
    "Recipe",
    "recipe_sha256",
    "cache_dir",
    "demo_path",
    "shipped_path",
    "needs_build",
    "load_demo",
    "build_demo",
]

VARIANTS = ("default", "fashion")
SHIPPED = Path(__file__).resolve().parents[3] / "assets" / "zoos" / "demo"  # the default variant, prebuilt
STORAGE_DTYPE = "float16"


def cache_dir() -> Path:
    """featcal's cache root: ``$FEATCAL_CACHE`` or ``~/.cache/featcal``."""
    return Path(os.environ.get("FEATCAL_CACHE") or Path.home() / ".cache" / "featcal").expanduser()


def demo_path(variant: str = "default") -> Path:
    _check_variant(variant)
    stem = "demo" if variant == "default" else f"demo-{variant}"
    return cache_dir() / "zoos" / f"{stem}-{DEMO_VERSION}"


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown demo variant {variant!r}; choose one of {VARIANTS}.")


def shipped_path(variant: str = "default") -> Path | None:
    """The shipped prebuilt zoo of ``variant`` if it is current (this recipe and demo
    version) and its files match their recorded sha256, else None (with a warning when
    it is there but does not match)."""
    _check_variant(variant)
    if variant != "default" or not is_zoo_dir(SHIPPED):
        return None
    meta = read_meta(SHIPPED)
    if meta.get("demo_version") != DEMO_VERSION or meta.get("recipe_sha256") != recipe_sha256(Recipe()):
        return None  # an older recipe's copy: the cache or a build stands in for it
    try:
        verify_zoo_dir(SHIPPED)  # hashing ~15 MB takes a few tens of ms: cheap against a checkout gone wrong
    except ZooCorruptedError as exc:
        warnings.warn(f"the shipped demo zoo is not used: {exc}", stacklevel=3)
        return None
    return SHIPPED


def _current(path: Path) -> bool:
    return is_zoo_dir(path) and read_meta(path).get("recipe_sha256") == recipe_sha256(Recipe())


def needs_build(variant: str = "default") -> bool:
    """Whether :func:`load_demo` would have to build ``variant`` (no current shipped copy or cache)."""
    return shipped_path(variant) is None and not _current(demo_path(variant))


def load_demo(
    rebuild: bool = False,
    progress: bool = True,
    variant: str = "default",
    verify: bool = True,
    on_step: Callable[[Progress], None] | None = None,
) -> Zoo:
    """The demo zoo: the shipped copy, else the cache, else built into the cache.

    Args:
        rebuild: build afresh into the cache, even if shipped or cached (the old cache
            is replaced only once the new build is complete).
        progress: show a progress bar per build stage in the terminal.
        variant: ``default`` (seven synthetic tasks) or ``fashion`` (plus two
            Fashion-MNIST tasks; needs the Debian package ``dataset-fashion-mnist``).
        verify: check the cached files against their recorded sha256 (the shipped
            copy is always checked).
        on_step: called with the build's :class:`~featcal.util.progress.Progress` (stage,
            step, estimated time left), e.g. to drive an app's progress bar.

    A cache built from another recipe (an older featcal) is rebuilt.
    """
    if not rebuild and (shipped := shipped_path(variant)) is not None:
        return read_zoo_dir(shipped, verify=False)  # verified by shipped_path
    path = demo_path(variant)
    stale = is_zoo_dir(path) and not _current(path)
    if rebuild or stale or not is_zoo_dir(path):
        build_demo(path, variant=variant, progress=progress, force=rebuild or stale, on_step=on_step)
    return read_zoo_dir(path, verify=verify)


def build_demo(
    path: str | os.PathLike,
    variant: str = "default",
    progress: bool = True,
    force: bool = False,
    recipe: Recipe | None = None,
    device: str | torch.device = "cpu",
    threads: int | None = None,
    on_step: Callable[[Progress], None] | None = None,
) -> Path:
    """Build a demo zoo into ``path`` (atomically; see :func:`featcal.zoo.io.atomic_dir`).

    ``threads``: torch CPU threads while building (restored afterwards); by default
    every core on an idle machine and 1 on a busy one (load average above the
    core count), where extra threads of these small matrix products mostly wait
    for each other (many times slower per step).

    ``on_step`` receives the build's progress (see :func:`load_demo`). If another process
    finished the same build first (and ``force`` is false), its result is kept and this
    one discarded.
    """
    _check_variant(variant)
    recipe = recipe or Recipe()
    t0 = time.perf_counter()
    threads = threads if threads is not None else _default_threads()
    with _torch_threads(threads):
        if variant == "fashion":
            find_fashion_mnist()  # fails early, before the default zoo is built
            default = load_demo(progress=progress, variant="default", on_step=on_step)
            parts = build_fashion_parts(recipe, default, progress, device, on_step=on_step)
        else:
            parts = build_parts(recipe, progress, device, on_step=on_step)
    parts["extra_meta"]["threads"] = threads
    parts["extra_meta"]["build_seconds"] = round(time.perf_counter() - t0, 1)
    parts["extra_meta"]["built_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        return write_zoo_dir(path, force=force, storage_dtype=STORAGE_DTYPE, **parts)
    except FileExistsError:
        if not force and is_zoo_dir(path):
            return Path(path)
        raise


def _default_threads() -> int:
    cores = os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0] > cores
    except OSError:
        busy = False
    return 1 if busy else torch.get_num_threads()


@contextlib.contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, n))
    try:
        yield
    finally:
        torch.set_num_threads(before)

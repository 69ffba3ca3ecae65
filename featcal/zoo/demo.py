"""The embedded demo zoo: a small CLIP-format ViT, seven synthetic tasks, built offline.

``load_demo()`` builds the zoo on first use (about three minutes on two CPU
cores, nothing downloaded) and caches it under ``<cache>/zoos/demo-<version>/``
(``$FEATCAL_CACHE``, default ``~/.cache/featcal``); later calls load the cache
in a few seconds. How it is made: :mod:`featcal.zoo.demo_recipe`.

The ``fashion`` variant (:mod:`featcal.zoo.fashion`) adds two real
Fashion-MNIST tasks to the default zoo, with the recipe's heads and fine-tuning
on the same base.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import time
from pathlib import Path

import torch

from featcal.zoo.core import Zoo
from featcal.zoo.demo_recipe import DEMO_VERSION, Recipe, build_parts, recipe_sha256
from featcal.zoo.fashion import build_fashion_parts, find_fashion_mnist
from featcal.zoo.store import is_zoo_dir, read_meta, read_zoo_dir, write_zoo_dir

__all__ = ["DEMO_VERSION", "VARIANTS", "Recipe", "recipe_sha256", "cache_dir", "demo_path", "load_demo", "build_demo"]

VARIANTS = ("default", "fashion")


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


def load_demo(rebuild: bool = False, progress: bool = True, variant: str = "default", verify: bool = True) -> Zoo:
    """The demo zoo, built and cached on first use.

    Args:
        rebuild: build afresh even if cached (the old cache is replaced only once
            the new build is complete).
        progress: show tqdm progress bars while building.
        variant: ``default`` (seven synthetic tasks) or ``fashion`` (plus two
            Fashion-MNIST tasks; needs the Debian package ``dataset-fashion-mnist``).
        verify: check the cached files against their recorded sha256.

    A cache built from another recipe (an older featcal) is rebuilt.
    """
    path = demo_path(variant)
    stale = is_zoo_dir(path) and read_meta(path).get("recipe_sha256") != recipe_sha256(Recipe())
    if rebuild or stale or not is_zoo_dir(path):
        build_demo(path, variant=variant, progress=progress, force=rebuild or stale)
    return read_zoo_dir(path, verify=verify)


def build_demo(
    path: str | os.PathLike,
    variant: str = "default",
    progress: bool = True,
    force: bool = False,
    recipe: Recipe | None = None,
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> Path:
    """Build a demo zoo into ``path`` (atomically; see :func:`featcal.zoo.io.atomic_dir`).

    ``threads``: torch CPU threads while building (restored afterwards); by default
    every core on an idle machine and 1 on a busy one (load average above the
    core count), where extra threads of these small matrix products mostly wait
    for each other (many times slower per step).

    If another process finished the same build first (and ``force`` is false),
    its result is kept and this one discarded.
    """
    _check_variant(variant)
    recipe = recipe or Recipe()
    t0 = time.perf_counter()
    threads = threads if threads is not None else _default_threads()
    with _torch_threads(threads):
        if variant == "fashion":
            find_fashion_mnist()  # fails early, before the default zoo is built
            default = load_demo(progress=progress, variant="default")
            parts = build_fashion_parts(recipe, default, progress, device)
        else:
            parts = build_parts(recipe, progress, device)
    parts["extra_meta"]["threads"] = threads
    parts["extra_meta"]["build_seconds"] = round(time.perf_counter() - t0, 1)
    parts["extra_meta"]["built_at"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        return write_zoo_dir(path, force=force, **parts)
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

"""The ``fashion`` demo variant: the default demo zoo plus two real Fashion-MNIST tasks.

The images come from Debian's ``dataset-fashion-mnist`` package (IDX ``.gz``
files under ``/usr/share/datasets/fashion-mnist/``; ``$FEATCAL_FASHION_MNIST``
may point elsewhere). Nothing is downloaded.

Tasks added (on the default zoo's base, heads and fine-tuning as in
:mod:`featcal.zoo.builtin.demo_recipe`):
    fashion        the 10 Fashion-MNIST classes
    fashion-group  4 groups: tops, bottoms and dresses, footwear, bags
Both draw train rows from the package's 60k train file (disjoint index sets)
and test rows from its 10k test file. 28x28 greyscale is padded to 32x32 RGB.
"""

from __future__ import annotations

import glob
import gzip
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from featcal.util.progress import Progress, Tracker
from featcal.zoo.builtin.demo_recipe import HEAD_WORK, Recipe, finetune, make_head, train_minus_val
from featcal.zoo.core import Zoo
from featcal.zoo.store import read_arrays

APT_PACKAGE = "dataset-fashion-mnist"
SEARCH_GLOBS = (
    "/usr/share/datasets*/**/train-images-idx3-ubyte.gz",
    "/usr/local/share/datasets*/**/train-images-idx3-ubyte.gz",
)

CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
GROUPS = ("top", "bottom or dress", "footwear", "bag")
GROUP_OF = np.array([0, 1, 0, 1, 0, 2, 0, 2, 3, 2])  # class -> group
TASK_NAMES = ("fashion", "fashion-group")


class FashionMNISTMissing(FileNotFoundError):
    """The Fashion-MNIST files are not installed."""


def find_fashion_mnist() -> Path:
    """The directory holding the four Fashion-MNIST IDX ``.gz`` files."""
    env = os.environ.get("FEATCAL_FASHION_MNIST")
    candidates = [Path(env)] if env else []
    for pattern in SEARCH_GLOBS:
        candidates += [Path(p).parent for p in sorted(glob.glob(pattern, recursive=True)) if "fashion" in p.lower()]
    for d in candidates:
        if all((d / f).is_file() for f in _FILES.values()):
            return d
    raise FashionMNISTMissing(
        f"Fashion-MNIST not found (looked in $FEATCAL_FASHION_MNIST and {', '.join(SEARCH_GLOBS)}); "
        f"install the Debian package: apt-get install -y {APT_PACKAGE}"
    )


_FILES = {
    "train_x": "train-images-idx3-ubyte.gz",
    "train_y": "train-labels-idx1-ubyte.gz",
    "test_x": "t10k-images-idx3-ubyte.gz",
    "test_y": "t10k-labels-idx1-ubyte.gz",
}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (optionally gzipped) as a uint8 array of its stated shape."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[:2] != b"\0\0" or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file.")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    return data.reshape(shape)


def load_fashion_mnist() -> dict[str, np.ndarray]:
    """``{train_x (60000, 28, 28), train_y, test_x (10000, 28, 28), test_y}`` uint8."""
    root = find_fashion_mnist()
    return {k: read_idx(root / f) for k, f in _FILES.items()}


def to_rgb32(images: np.ndarray) -> np.ndarray:
    """``(n, 28, 28)`` greyscale -> ``(n, 32, 32, 3)``, padded with black."""
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(padded[..., None], 3, axis=-1)


def make_fashion_arrays(
    n_train: int, n_calib: int, n_val: int, n_test: int, seed: int = 0
) -> dict[str, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """``{task: {train, calib, val, test}}`` uint8 arrays for both Fashion-MNIST tasks."""
    raw = load_fashion_mnist()
    rng = np.random.default_rng(seed)
    train_perm = rng.permutation(len(raw["train_y"]))
    test_perm = rng.permutation(len(raw["test_y"]))
    out = {}
    for k, task in enumerate(TASK_NAMES):
        tr = train_perm[k * n_train : (k + 1) * n_train]
        te = test_perm[k * n_test : (k + 1) * n_test]
        x, y = to_rgb32(raw["train_x"][tr]), raw["train_y"][tr].astype(np.int64)
        tx, ty = to_rgb32(raw["test_x"][te]), raw["test_y"][te].astype(np.int64)
        if task == "fashion-group":
            y, ty = GROUP_OF[y], GROUP_OF[ty]
        c, v = n_calib, n_calib + n_val
        out[task] = {"train": (x, y), "calib": (x[:c], y[:c]), "val": (x[c:v], y[c:v]), "test": (tx, ty)}
    return out


def build_fashion_parts(
    recipe: Recipe,
    default: Zoo,
    progress: bool = True,
    device="cpu",
    on_step: Callable[[Progress], None] | None = None,
) -> dict:
    """The ``default`` demo zoo plus the Fashion-MNIST experts, as the keyword arguments of
    :func:`featcal.zoo.store.write_zoo_dir` (``default``'s base is moved to ``device`` and back;
    ``progress`` and ``on_step`` as in :func:`featcal.zoo.builtin.demo_recipe.build_parts`)."""
    new = make_fashion_arrays(recipe.n_train, recipe.n_calib, recipe.n_val, recipe.n_test, seed=recipe.seed)
    arrays = read_arrays(default.meta["path"])
    classes = {t: list(default.data[t].classes) for t in default.tasks}
    heads, experts = dict(default.heads), dict(default.experts)
    torch.manual_seed(recipe.seed + 7)
    track = Tracker(len(TASK_NAMES) * (HEAD_WORK + recipe.finetune_steps), on_step=on_step, show=progress)
    for i, task in enumerate(TASK_NAMES):
        classes[task] = list(CLASSES if task == "fashion" else GROUPS)
        x, y = train_minus_val(new[task], device)
        base = default.base.to(device)
        heads[task] = make_head(recipe, base, x, y, len(classes[task])).cpu()
        track.advance(HEAD_WORK)
        seed = recipe.seed + 200 + i
        experts[task] = finetune(base, heads[task].to(device), x, y, recipe, seed, track=track, task=task).cpu()
        default.base.cpu()
        arrays[task] = {s: new[task][s] for s in ("calib", "val", "test")}
    meta = {k: v for k, v in default.meta.items() if k in ("demo_version", "recipe", "recipe_sha256", "torch")}
    meta.update(variant="fashion", sources={"fashion-mnist": str(find_fashion_mnist()), "apt": APT_PACKAGE})
    return dict(
        name="demo-fashion",
        base=default.base,
        experts=experts,
        heads=heads,
        arrays=arrays,
        classes=classes,
        features="pooler_output",
        extra_meta=meta,
    )

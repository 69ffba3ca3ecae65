"""Reading a located dataset (:mod:`featcal.zoo.spec.locate`) into lazily decoded splits.

:func:`task_data` wraps a task's dataset (an image folder, an ``arrow`` or
``parquet`` dataset, or a tensors file) into a :class:`~featcal.zoo.core.TaskData`
whose :class:`LazySplits` decode (CLIP geometry, :func:`to_clip_input`) and
normalise the images of a split on first access. ``calib`` and ``val`` are
seeded, disjoint draws from the train split (:func:`split_indices`).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Mapping

import torch

from featcal.util.progress import bar
from featcal.zoo.core import TaskData
from featcal.zoo.load.loaders import ModelInfo
from featcal.zoo.spec.locate import LocatedData, parquet_files
from featcal.zoo.spec.schema import DataSpec, ZooSpec

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


# ----------------------------------------------------------------------------- reading


def to_clip_input(img, size: int, interpolation: str = "bicubic") -> torch.Tensor:
    """CLIP's geometry on a PIL image: RGB, shorter side resized to ``size``, center crop
    ``size`` x ``size``. Returns uint8 ``(3, size, size)``; normalisation comes later."""
    from PIL import Image

    resample = {"bicubic": Image.BICUBIC, "bilinear": Image.BILINEAR, "nearest": Image.NEAREST}[interpolation]
    img = img.convert("RGB")
    w, h = img.size
    if (w, h) != (size, size):
        short, long = min(w, h), max(w, h)
        new_long = max(size, int(size * long / short))
        img = img.resize((size, new_long) if w < h else (new_long, size), resample)
        w, h = img.size
        left, top = (w - size) // 2, (h - size) // 2
        img = img.crop((left, top, left + size, top + size))
    return torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1)


def _to_pil(item):
    """A decoded dataset item (path, bytes, ``{'bytes','path'}`` struct, uint8 array) as a PIL image."""
    import io

    import numpy as np
    from PIL import Image

    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if isinstance(item, (bytes, bytearray)):
        return Image.open(io.BytesIO(item))
    if isinstance(item, (str, Path)):
        return Image.open(item)
    arr = np.asarray(item)
    return Image.fromarray(arr[..., 0] if arr.ndim == 3 and arr.shape[-1] == 1 else arr)


class _Split:
    """One split of a dataset on disk: all labels up front, images fetched by index."""

    def __init__(self, labels: list[int], fetch, classes: list[str] | None = None):
        self.labels = torch.as_tensor(labels, dtype=torch.long)
        self.fetch = fetch  # fetch(indices) -> items (see _to_pil) or a float tensor
        self.classes = classes

    def __len__(self) -> int:
        return len(self.labels)


def _folder_split(root: Path, classes: list[str] | None) -> _Split:
    """``root/<class>/<image>``. Labels: folder names matched to ``classes`` when they all
    match (case, ``_`` and ``-`` ignored), integer folder names as labels, else sorted order."""
    folders = sorted(p.name for p in root.iterdir() if p.is_dir())

    def norm(s):
        return s.lower().replace("_", " ").replace("-", " ").strip()

    wanted = {norm(c): i for i, c in enumerate(classes or [])}
    if classes and all(norm(f) in wanted for f in folders):
        index = {f: wanted[norm(f)] for f in folders}
    elif folders and all(f.isdigit() for f in folders):
        index = {f: int(f) for f in folders}
    else:
        index = {f: i for i, f in enumerate(folders)}
        if classes:
            logging.getLogger(__name__).warning(
                "%s: folder names do not match the task's class names; label k is the k-th folder in "
                "sorted order, make sure that is the class order of the head.",
                root,
            )
    files, labels = [], []
    for f in folders:
        for p in sorted((root / f).iterdir()):
            if p.suffix.lower() in IMAGE_SUFFIXES:
                files.append(p)
                labels.append(index[f])
    names = None if classes else [f for f, _ in sorted(index.items(), key=lambda kv: kv[1])]
    return _Split(labels, lambda idx: [files[i] for i in idx], names)


def _label_names(features: Mapping | None, label_column: str) -> list[str] | None:
    feat = (features or {}).get(label_column) or {}
    names = feat.get("names") if isinstance(feat, Mapping) else None
    return list(names) if names else None


def arrow_tables(split_dir: Path) -> list:
    """The Arrow tables of a split written by ``datasets.save_to_disk`` (stream or file format),
    read memory-mapped."""
    import pyarrow as pa

    state = json.loads((split_dir / "state.json").read_text())
    tables = []
    for f in state["_data_files"]:
        src = pa.memory_map(str(split_dir / f["filename"]))
        try:
            tables.append(pa.ipc.open_stream(src).read_all())
        except pa.ArrowInvalid:
            tables.append(pa.ipc.open_file(src).read_all())
    return tables


def _arrow_split(split_dir: Path, spec: DataSpec) -> _Split:
    """A split written by ``datasets.save_to_disk``: Arrow stream files, read memory-mapped."""
    import pyarrow as pa

    table = pa.concat_tables(arrow_tables(split_dir))
    info = split_dir / "dataset_info.json"
    features = json.loads(info.read_text()).get("features") if info.is_file() else None
    return _table_split(table, spec, _label_names(features, spec.label_column), split_dir)


def _table_split(table, spec: DataSpec, names: list[str] | None, where: Path) -> _Split:
    for col in (spec.image_column, spec.label_column):
        if col not in table.column_names:
            raise ValueError(
                f"{where}: no column {col!r} (columns: {table.column_names}); set "
                "image_column / label_column in the spec's data entry."
            )
    images = table.column(spec.image_column)
    labels = table.column(spec.label_column).to_pylist()
    return _Split(labels, lambda idx: images.take(list(idx)).to_pylist(), names)


def _parquet_split(files: list[Path], spec: DataSpec) -> _Split:
    """Parquet files of one split; images are read row group by row group, only those asked for."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pfs = [pq.ParquetFile(str(f)) for f in files]
    labels, where = [], []  # where[i] = (file, row group, row in group)
    for fi, pf in enumerate(pfs):
        labels += pf.read(columns=[spec.label_column]).column(0).to_pylist()
        for rg in range(pf.num_row_groups):
            where += [(fi, rg, j) for j in range(pf.metadata.row_group(rg).num_rows)]
    meta = pfs[0].schema_arrow.metadata or {}
    hf = json.loads(meta[b"huggingface"]) if b"huggingface" in meta else {}
    names = _label_names(hf.get("info", {}).get("features"), spec.label_column)

    def fetch(idx):
        groups: dict[tuple[int, int], list[int]] = {}
        for i in idx:
            groups.setdefault(where[i][:2], []).append(where[i][2])
        got = {}
        for (fi, rg), rows in groups.items():
            col = pfs[fi].read_row_group(rg, columns=[spec.image_column]).column(0)
            for r, item in zip(rows, col.take(pa.array(rows)).to_pylist()):
                got[(fi, rg, r)] = item
        return [got[where[i]] for i in idx]

    return _Split(labels, fetch, names)


def _tensor_splits(path: Path, spec: DataSpec, size: int) -> dict[str, _Split]:
    """``<split>_inputs`` / ``<split>_labels`` from a .safetensors or .npz file. uint8 inputs are
    images (NHWC, NHW or NCHW) and get CLIP preprocessing; float inputs are used as they are."""
    import numpy as np

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            arrays = {k: f.get_tensor(k) for k in f.keys()}
            classes = json.loads((f.metadata() or {}).get("classes", "null"))
    else:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: torch.from_numpy(z[k]) for k in z.files if z[k].dtype.kind in "uif"}
            classes = [str(c) for c in z["classes"]] if "classes" in z.files else None
    out = {}
    for split in (spec.train_split, spec.test_split):
        x, y = arrays.get(f"{split}_inputs"), arrays.get(f"{split}_labels")
        if x is None or y is None:
            raise ValueError(f"{path}: needs tensors {split}_inputs and {split}_labels; has {sorted(arrays)}.")
        if x.dtype == torch.uint8:
            if x.ndim == 4 and x.shape[1] in (1, 3) and x.shape[-1] not in (1, 3):
                x = x.permute(0, 2, 3, 1)
            fetch = (lambda xs: lambda idx: [xs[i].numpy() for i in idx])(x)
        elif x.is_floating_point() and x.ndim == 4 and tuple(x.shape[1:]) == (3, size, size):
            fetch = (lambda xs: lambda idx: xs[list(idx)].float())(x)
        else:
            raise ValueError(
                f"{path}: {split}_inputs is {x.dtype} {tuple(x.shape)}; expected uint8 images or "
                f"preprocessed float (n, 3, {size}, {size})."
            )
        out[split] = _Split(y.long().tolist(), fetch, classes)
    return out


def _open_splits(located: LocatedData, classes: list[str] | None, size: int) -> dict[str, _Split]:
    spec, root = located.spec, located.root
    names = (spec.train_split, spec.test_split)
    if located.format == "tensors":
        return _tensor_splits(root, spec, size)
    if located.format == "image_folder":
        return {s: _folder_split(root / s, classes) for s in names}
    if located.format == "arrow":
        return {s: _arrow_split(root / s, spec) for s in names}
    return {s: _parquet_split(parquet_files(root, s), spec) for s in names}


def _decode(
    split: _Split, idx: list[int], size: int, interpolation: str, chunk: int = 1024, desc: str = ""
) -> torch.Tensor:
    """Images ``idx`` of a split: uint8 ``(n, 3, size, size)`` (or float, if stored preprocessed),
    fetched and decoded ``chunk`` at a time on a few threads."""
    from concurrent.futures import ThreadPoolExecutor

    out = torch.empty(len(idx), 3, size, size, dtype=torch.uint8)

    def one(item):
        return to_clip_input(_to_pil(item), size, interpolation)

    with (
        ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool,
        bar(total=len(idx), desc=desc, unit="img", show=len(idx) >= 2048) as progress,
    ):
        for lo in range(0, len(idx), chunk):
            items = split.fetch(idx[lo : lo + chunk])
            if torch.is_tensor(items):  # stored preprocessed: float, used as it is
                return split.fetch(idx)
            for j, img in enumerate(pool.map(one, items)):
                out[lo + j] = img
            progress.update(len(items))
    return out


def split_indices(n_train: int, n_test: int, calib: int, val: int, test: int | None, seed: int) -> dict[str, list[int]]:
    """Seeded, disjoint ``calib`` and ``val`` index sets from train; ``test`` from test (all, or a
    seeded subset of at most ``test``). Each index list is sorted."""
    if calib + val > n_train:
        raise ValueError(
            f"calib ({calib}) + val ({val}) examples asked, the train split has {n_train}; "
            "lower splits.calib / splits.val."
        )
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed)).tolist()
    out = {"calib": sorted(perm[:calib]), "val": sorted(perm[calib : calib + val])}
    if test is None or test >= n_test:
        out["test"] = list(range(n_test))
    else:
        out["test"] = sorted(torch.randperm(n_test, generator=torch.Generator().manual_seed(seed + 1))[:test].tolist())
    if not val:
        del out["val"]
    return out


class LazySplits(Mapping):
    """``{split: (inputs, labels)}`` whose images are decoded on first access.

    The decoded images are kept as uint8 (4x smaller than float); each access
    returns freshly normalised float32 ``(n, 3, H, W)`` inputs and long labels.
    """

    def __init__(self, makers: Mapping[str, object], mean: tuple, std: tuple):
        self._makers = dict(makers)  # split -> () -> (uint8 or float images, labels)
        self._cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._mean = torch.tensor(mean).view(1, 3, 1, 1)
        self._std = torch.tensor(std).view(1, 3, 1, 1)

    def __getitem__(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split not in self._makers:
            raise KeyError(split)
        if split not in self._cache:
            self._cache[split] = self._makers[split]()
        x, y = self._cache[split]
        if x.dtype == torch.uint8:
            x = x.float().div_(255).sub_(self._mean).div_(self._std)
        return x, y

    def __iter__(self):
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)

    def loaded(self) -> list[str]:
        """The splits decoded so far."""
        return list(self._cache)


def task_data(
    spec: ZooSpec,
    task: str,
    located: LocatedData,
    classes: list[str] | None,
    info: ModelInfo,
    n_classes: int | None = None,
):
    """The task's :class:`~featcal.zoo.core.TaskData`; its splits are decoded on first access.

    ``classes`` are the head's class names (label ``k`` is ``classes[k]``); without
    them the dataset's own names are used, else ``"0"``, ``"1"``, ... (``n_classes``
    of them: the head's width, else one past the largest train label).
    """
    d = located.spec
    splits = _open_splits(located, classes, info.image_size)
    train, test = splits[d.train_split], splits[d.test_split]
    n = n_classes or (int(train.labels.max()) + 1 if len(train) else 0)
    names = list(classes or train.classes or [str(i) for i in range(n)])
    for s, part in ((d.train_split, train), (d.test_split, test)):
        if len(part) and (int(part.labels.max()) >= len(names) or int(part.labels.min()) < 0):
            raise ValueError(
                f"data {task!r} ({located.root}): split {s!r} has labels in "
                f"[{int(part.labels.min())}, {int(part.labels.max())}], "
                f"the task has {len(names)} classes."
            )
    s = spec.splits
    idx = split_indices(len(train), len(test), s.calib, s.val, s.test, s.seed)
    size, interp = info.image_size, spec.preprocess.interpolation

    def maker(part: _Split, ids: list[int], name: str):
        return lambda: (_decode(part, ids, size, interp, desc=f"{task}/{name}"), part.labels[ids])

    makers = {name: maker(test if name == "test" else train, ids, name) for name, ids in idx.items()}
    return TaskData(name=task, classes=names, splits=LazySplits(makers, info.mean, info.std))

"""Writing and reading models and directories safely.

Two guarantees hold for everything written here:

1. **No half-written output.** A directory is written into a temporary sibling
   (``.<name>.tmp-*``) and renamed into place only once complete; a failure
   removes the temporary directory and leaves any existing target untouched.
2. **No silent overwrite, nothing of the user's lost.** An existing target is replaced only
   with ``force=True``, only if featcal wrote it, never over an input, and one run per
   output at a time (:mod:`featcal.util.outdir`); the old directory stays in place until
   the new one is complete.

Weights are written as safetensors and read back only through safetensors (or
``torch.load(weights_only=True)`` for a legacy ``.bin``): never a pickle.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import shutil
import tempfile
import threading
from pathlib import Path, PurePosixPath
from typing import Iterator, Mapping

from featcal.model.export import MAX_SHARD_BYTES, drift_summary, model_name, write_hub_files
from featcal.util import outdir
from featcal.util.outdir import OutputExistsError as OutputExistsError
from featcal.util.outdir import OutputLockedError as OutputLockedError
from featcal.util.outdir import UnsafeOutputError as UnsafeOutputError

FORMATS = ("hf", "open_clip", "torch")
MARKER = "featcal_model.json"  # written beside every saved model: its format and origin
WEIGHTS = "model.safetensors"


@contextlib.contextmanager
def atomic_dir(
    target: str | os.PathLike,
    force: bool = False,
    inputs: Mapping[str, str | os.PathLike | None] | None = None,
    kind: str = "output",
    wait: bool = False,
) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``target`` on success.

    The output's lock is held throughout (:func:`featcal.util.outdir.output_lock`). On an
    exception inside the block the temporary directory is removed and ``target`` is left as it
    was. ``target`` must lie apart from ``inputs`` (``{what: path}``); an existing ``target``
    raises :class:`OutputExistsError` unless ``force``, and with ``force`` it is replaced only
    if featcal wrote it (:func:`featcal.util.outdir.check_replaceable`), once the new one is in
    place. The finished directory carries featcal's marker (``kind`` recorded in it).
    ``wait``: wait for another process's lock on ``target`` instead of failing.
    """
    target = Path(target).expanduser().absolute()
    outdir.check_output(target, force, inputs)
    target.parent.mkdir(parents=True, exist_ok=True)
    with outdir.output_lock(target, wait=wait):
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            yield tmp
            _normalise_permissions(tmp)
            outdir.check_output(target, force, inputs)  # something may have appeared meanwhile
            outdir.commit_dir(tmp, target, kind)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise


def _normalise_permissions(root: Path) -> None:
    """Give the tree the modes a plain ``mkdir``/``open`` would (``mkdtemp`` and some
    writers create owner-only directories and files)."""
    umask = _current_umask()
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def _current_umask() -> int:
    """The process umask, read without changing it (``os.umask`` would, briefly, for
    every thread); 0o022 where /proc does not tell."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


# One zoo load at a time in a process. Two loads side by side (the app: a zoo picked in the sidebar while
# another still loads; a user's own threads) import transformers' lazily loaded submodules from two
# threads, and transformers' lazy module is not thread-safe: on a cold start the second load failed with
# "cannot import name 'AutoTokenizer' from 'transformers'" (or read a T5 expert without its tied
# embeddings); and :func:`offline` sets a process-wide variable. Reentrant: a load may call another.
_LOADS = threading.RLock()


def one_load_at_a_time(load):
    """``load`` made to wait for any other zoo load of this process to finish first (:data:`_LOADS`)."""

    @functools.wraps(load)
    def serialised(*args, **kwargs):
        with _LOADS:
            return load(*args, **kwargs)

    return serialised


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE=1`` inside the block (transformers never reaches for the hub), the
    previous value restored afterwards."""
    before = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = before


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' per-file progress bars ("Loading weights", "Writing model
    shards") inside the block, restoring the previous setting afterwards."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ------------------------------------------------------------------ models


def save_model(
    model,
    out_dir: str | os.PathLike,
    fmt: str = "hf",
    force: bool = False,
    extra_files: Mapping[str, str | bytes | dict | list] | None = None,
    config: dict | None = None,
    hub: Mapping | None = None,
    inputs: Mapping[str, str | os.PathLike | None] | None = None,
) -> Path:
    """Write ``model`` to ``out_dir`` in the format it was loaded in.

    Args:
        model: an ``nn.Module`` (for ``hf``: a ``transformers`` ``PreTrainedModel``).
        out_dir: the directory to create (must not exist unless ``force``).
        fmt: ``hf`` (``save_pretrained(safe_serialization=True)``) or ``open_clip`` /
            ``torch`` (``model.safetensors`` state dict plus ``config`` as JSON).
        force: replace an existing ``out_dir`` (only once the new one is complete).
        extra_files: ``{relative name: content}`` written beside the model; dicts and
            lists are written as JSON (e.g. ``{"report.json": report.to_dict()}``).
        config: for ``open_clip``/``torch``: how to rebuild the module (model name,
            constructor arguments); written into the marker file.
        hub: the keywords of :func:`featcal.model.export.write_hub_files` (``base_dir``, the
            merge, settings, scores, ...): the base's tokenizer files and a model card beside it.
        inputs: ``{what: path}`` the output must lie apart from (the zoo, the models read).

    Returns the path written. Raises :class:`OutputExistsError` (naming ``--force``)
    when ``out_dir`` exists and ``force`` is false, :class:`UnsafeOutputError` when it
    overlaps an input or is not featcal's to replace (see :func:`atomic_dir`).
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown model format {fmt!r}; choose one of {FORMATS}.")
    with atomic_dir(out_dir, force=force, inputs=inputs, kind="model") as tmp:
        if fmt == "hf":
            if not hasattr(model, "save_pretrained"):
                raise ValueError(
                    "fmt='hf' needs a transformers model with save_pretrained; "
                    f"got {type(model).__name__}. Use fmt='torch'."
                )
            with quiet_transformers():
                model.save_pretrained(tmp, safe_serialization=True, max_shard_size=MAX_SHARD_BYTES)
        else:
            from safetensors.torch import save_model as _st_save

            _st_save(model, str(tmp / WEIGHTS))
        marker = {"format": fmt, "class": f"{type(model).__module__}.{type(model).__qualname__}"}
        if config is not None:
            marker["config"] = config
        _write_json(tmp / MARKER, marker)
        for name, content in (extra_files or {}).items():
            _write_extra(tmp, name, content)
        if hub is not None:
            write_hub_files(tmp, **({"name": Path(out_dir).name} | dict(hub)))
    return Path(out_dir).expanduser().absolute()


def zoo_card(zoo, merge: Mapping, report: Mapping | None = None, **facts) -> dict:
    """The model card facts (``save_model(hub=...)``, :func:`featcal.model.export.write_hub_files`)
    of a model made from ``zoo``: its base's directory (for the tokenizer files), the experts, the
    ``merge``; with a calibration ``report`` (its ``to_dict()``), the settings and the residuals'
    summary; ``facts`` (``scores``, ``calibration``, ``drift``, ...) where given."""
    sources = zoo.meta.get("sources", {})
    card = {
        "base_dir": sources.get("base"),
        "base": None if sources.get("base") else f"featcal zoo {zoo.name} (base)",
        "experts": {t: model_name(sources[f"expert:{t}"]) if f"expert:{t}" in sources else zoo.name for t in zoo.tasks},
        "merge": dict(merge),
    }
    if report is not None:
        card["settings"] = report["config"]
        card["drift"] = drift_summary(report)
    return card | {k: v for k, v in facts.items() if v is not None}


def load_model(model_dir: str | os.PathLike, like=None):
    """Load a model written by :func:`save_model`.

    ``hf`` models are rebuilt with the class's ``from_pretrained`` (``like``'s class
    when given, else the class ``config.json`` names); ``open_clip``/``torch``
    models need ``like``, a module of the same architecture, whose copy receives
    the weights (strictly: every key must match).
    """
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} does not exist.")
    marker = read_marker(model_dir)
    fmt = marker.get("format", "hf")
    if fmt == "hf":
        cls = type(like) if like is not None else _hf_class(model_dir)
        with quiet_transformers():
            return cls.from_pretrained(model_dir, use_safetensors=True, trust_remote_code=False, local_files_only=True)
    if like is None:
        raise ValueError(
            f"{str(model_dir)!r} holds a {fmt!r} state dict; loading it needs "
            "a model of the same architecture (like=...)."
        )
    from safetensors.torch import load_model as _st_load

    model = copy.deepcopy(like)
    _st_load(model, str(model_dir / WEIGHTS), strict=True)
    return model


def read_marker(model_dir: str | os.PathLike) -> dict:
    """The ``featcal_model.json`` of a saved model (``{"format": "hf"}`` when it has none
    but holds a ``config.json``, as any ``save_pretrained`` directory does)."""
    model_dir = Path(model_dir)
    if (model_dir / MARKER).is_file():
        return json.loads((model_dir / MARKER).read_text())
    if (model_dir / "config.json").is_file():
        return {"format": "hf"}
    raise FileNotFoundError(f"{str(model_dir)!r} holds no saved model (neither {MARKER} nor config.json).")


def load_legacy_state_dict(path: str | os.PathLike) -> dict:
    """A state dict from ``.safetensors`` or, for old checkpoints, a ``.bin``/``.pt``
    read with ``torch.load(weights_only=True)`` (no arbitrary pickles)."""
    path = str(path)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def _hf_class(model_dir: Path):
    """The library class config.json's ``architectures`` names (never the directory's own code)."""
    from featcal.model.allowed import library_model_class

    names = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    if not names:
        raise ValueError(f"{str(model_dir)!r}: config.json names no architecture; load it with like=MODEL.")
    return library_model_class(names[0], f"{str(model_dir)!r}: config.json's architectures")


# ------------------------------------------------------------------ files


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def _write_extra(root: Path, name: str, content) -> None:
    dest = (root / name).resolve()
    if root.resolve() not in dest.parents:
        raise ValueError(f"extra file {name!r} would be written outside the output directory.")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, (dict, list)):
        _write_json(dest, content)
    elif isinstance(content, bytes):
        dest.write_bytes(content)
    else:
        dest.write_text(str(content))


def write_json(path: str | os.PathLike, obj) -> Path:
    """Write ``obj`` as indented JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tree_sha256(root: str | os.PathLike, exclude: tuple[str, ...] = ()) -> tuple[str, dict[str, str]]:
    """``(digest, {relative path: sha256})`` over every file under ``root`` (sorted by
    path; names in ``exclude`` skipped). The digest covers paths and contents."""
    root = Path(root)
    files = {
        p.relative_to(root).as_posix(): file_sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.relative_to(root).as_posix() not in exclude
    }
    return files_digest(files), files


def files_digest(files: Mapping[str, str]) -> str:
    """The digest :func:`tree_sha256` gives a tree of ``{relative path: sha256}`` (in path order,
    folder by folder), so files added to a hashed tree can be recorded without hashing it all again."""
    h = hashlib.sha256()
    for rel in sorted(files, key=lambda r: PurePosixPath(r).parts):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()

"""An LLM zoo's directory (the built-in smollm2 zoo's) is a generative zoo spec beside its models.

::

    <zoo>/meta.json, base/, experts/<task>/, adapters/<task>/, tokenizer/   (featcal.zoo.store's layout)
    <zoo>/spec/zoo.yaml                     the zoo as a spec: ``modality: causal_lm``, the models above
                                            (``../base``, ``../experts/<task>``, ``../tokenizer``: paths
                                            relative to the spec file) and one ``tasks:`` entry per task
    <zoo>/spec/data/<task>/<split>.parquet  the calib, val and test examples, one row each
                                            (:meth:`~featcal.zoo.builtin.llm_tasks.Example.row`), in order

The spec names the tables as ready-made splits (``calib_split: calib``, ``val_split: val``), so the
examples are exactly those the recipe generated, in their order; loading the zoo (:func:`load`) is
loading its spec (:func:`featcal.zoo.load.from_spec.load`) as any user's spec is loaded: one path. The
spec and tables are part of the zoo's recorded content hash like every other file.

A cache written before zoos had a spec (smollm2 version 3: the examples in ``examples.json``, their token
ids in ``data.npz``) gets its spec and tables written from its ``examples.json`` the first time it is
loaded (:func:`add_spec`: a second, no retraining). Only new files are added, under ``spec/``; the
cache's own records of its files (meta.json's file list and content hash, featcal's marker) are extended
by exactly those files, so the cache still verifies and stays replaceable by a rebuild. A ``spec/``
folder that is not the one featcal would write is refused, never overwritten.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from featcal.util import outdir
from featcal.zoo.builtin.llm_tasks import TASKS, Example, constraint_text
from featcal.zoo.io import files_digest, write_json
from featcal.zoo.load import from_spec
from featcal.zoo.score.lm import LMZoo
from featcal.zoo.store import META, is_zoo_dir, read_meta, verify_zoo_dir, write_files

SPEC_DIR = "spec"
SPEC = f"{SPEC_DIR}/zoo.yaml"
OLD_EXAMPLES = "examples.json"  # a cache from before specs: {task: {split: [example as a dict]}}
SPLITS = ("calib", "val", "test")


def is_lm_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a zoo directory of an LLM zoo (scored on its replies)."""
    return is_zoo_dir(path) and read_meta(path).get("scoring") == "lm"


# ------------------------------------------------------------------ writing the spec


def spec_doc(name: str, entries: Mapping[str, Mapping[str, Any]]) -> dict:
    """The spec of an LLM zoo directory whose tasks have the ``tasks:`` ``entries``."""
    tables = {"format": "parquet", "calib_split": "calib", "val_split": "val", "test_split": "test"}
    return {
        "name": name,
        "modality": "causal_lm",
        "format": "hf",
        "dtype": "float32",
        "base": "../base",
        "tokenizer": "../tokenizer",
        "experts": {t: f"../experts/{t}" for t in entries},
        "data": {t: {"path": f"data/{t}", **tables} for t in entries},
        "tasks": {t: dict(e) for t, e in entries.items()},
    }


def spec_files(name: str, examples: Mapping[str, Mapping[str, Sequence[Example]]]) -> dict[str, bytes]:
    """``{path in the zoo: bytes}`` of the spec and its tables for ``examples[task][split]``
    (the tasks are :data:`~featcal.zoo.builtin.llm_tasks.TASKS`'; the same examples give the same bytes)."""
    unknown = sorted(set(examples) - set(TASKS))
    if unknown:
        raise ValueError(f"no spec entry for LLM task(s) {unknown}; the built-in ones are {sorted(TASKS)}.")
    head = f"# The {name} zoo as a zoo spec, written by featcal; paths are relative to this file.\n"
    doc = spec_doc(name, {t: TASKS[t].entry for t in examples})
    out = {SPEC: (head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True, width=120)).encode()}
    for task, splits in examples.items():
        for split in SPLITS:
            out[f"{SPEC_DIR}/data/{task}/{split}.parquet"] = table_bytes(splits[split])
    return out


def table_bytes(examples: Sequence[Example]) -> bytes:
    """The examples as one parquet table (columns prompt, answer, target, options, label)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [("prompt", pa.string()), ("answer", pa.string()), ("target", pa.string()), ("options", pa.list_(pa.string()))]
        + [("label", pa.int64())]
    )
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([ex.row() for ex in examples], schema=schema), buf)
    return buf.getvalue()


# ------------------------------------------------------------------ loading


def load(path: str | os.PathLike, verify: bool = True, device: str = "cpu") -> LMZoo:
    """The LLM zoo in directory ``path``, through its spec (written first for a cache from before specs,
    :func:`add_spec`); ``verify``: check the files against the recorded content hash first."""
    path = Path(path)
    if not is_lm_dir(path):
        raise ValueError(f"{str(path)!r} is not an LLM zoo directory (no {META} with scoring 'lm').")
    if verify:
        verify_zoo_dir(path)
    if SPEC not in read_meta(path).get("files", {}):
        add_spec(path)
    zoo = from_spec.load(path / SPEC, device=device)
    inputs = {"the zoo": str(path), **zoo.meta.get("inputs", {})}  # an output lies apart from the whole directory
    zoo.meta = {**zoo.meta, **read_meta(path), "path": str(path), "inputs": inputs}
    return zoo


# ------------------------------------------------------------------ a cache from before specs


def add_spec(path: str | os.PathLike) -> None:
    """Write the spec and tables of a zoo directory from before specs, from its ``examples.json``
    (see the module docstring); nothing when another process did it meanwhile."""
    path = Path(path)
    try:
        _add_spec(path)
    except PermissionError as err:
        raise PermissionError(
            f"{path}: this LLM zoo was built before zoos had a spec, and featcal adds one (spec/, from its "
            f"{OLD_EXAMPLES}) on its first load, which needs write access there ({err}). Load it once as a user "
            "who may write there, or rebuild it (featcal zoo build smollm2 --rebuild)."
        ) from None


def _add_spec(path: Path) -> None:
    with outdir.output_lock(path, wait=True):
        meta = read_meta(path)
        if SPEC in meta.get("files", {}):
            return
        old = path / OLD_EXAMPLES
        if not old.is_file():
            raise FileNotFoundError(
                f"{path}: an LLM zoo with neither {SPEC} nor {OLD_EXAMPLES}; rebuild it "
                f"(featcal zoo build {meta.get('name', 'smollm2')} --rebuild)."
            )
        examples = old_examples(old)
        files = spec_files(meta["name"], {t: examples[t] for t in meta["tasks"]})
        _put_spec_dir(path, files)
        added = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
        outdir.add_listed(path, sorted(added))  # first: a stop before meta.json is re-recorded redoes only that
        _record(path, meta, added)


def old_examples(path: Path) -> dict[str, dict[str, list[Example]]]:
    """``examples.json`` of a cache from before specs, as :class:`Example` s (its instructions'
    constraints, a field of their own then, become their targets' JSON text as the generator now makes them)."""

    def example(d: dict) -> Example:
        target = constraint_text(d["constraint"]) if d.get("constraint") else d.get("target", "")
        return Example(d["prompt"], d["answer"], target, tuple(d.get("options", ())), d.get("label", -1))

    doc = json.loads(path.read_text())
    return {t: {s: [example(d) for d in exs] for s, exs in splits.items()} for t, splits in doc.items()}


def _put_spec_dir(path: Path, files: Mapping[str, bytes]) -> None:
    """Put ``files`` (all under ``spec/``) into the zoo in one rename; a ``spec/`` already there is
    accepted only when it holds exactly these files (a load stopped before it re-recorded meta.json)."""
    target = path / SPEC_DIR
    if target.exists():
        there = {p.relative_to(path).as_posix() for p in target.rglob("*") if p.is_file()}
        if there != set(files) or any((path / rel).read_bytes() != data for rel, data in files.items()):
            raise FileExistsError(
                f"{target} is in the way: the LLM zoo's spec goes there, and that folder is not the one featcal "
                "writes. Move it away (featcal never overwrites a folder it did not write), then load the zoo again."
            )
        return
    tmp = path.parent / f".{path.name}.{SPEC_DIR}-{os.getpid()}.tmp"
    tmp.mkdir()
    try:
        write_files(tmp, {Path(rel).relative_to(SPEC_DIR).as_posix(): data for rel, data in files.items()})
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _record(path: Path, meta: dict, added: Mapping[str, str]) -> None:
    """meta.json with the ``added`` files (``{path: sha256}``) in its file list and content hash,
    replaced in one rename (:func:`featcal.zoo.io.write_json`)."""
    files = {**meta["files"], **added}
    meta = {
        **meta,
        "files": files,
        "content_sha256": files_digest(files),
        "disk_bytes": int(meta.get("disk_bytes", 0)) + sum((path / rel).stat().st_size for rel in added),
        "spec_added": {
            "from": OLD_EXAMPLES,
            "at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        },
    }
    write_json(path / META, meta)

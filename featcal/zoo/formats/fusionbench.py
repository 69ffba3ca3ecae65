"""FusionBench model pools as featcal zoo specs (``featcal zoo from-fusionbench``).

A FusionBench CLIP model pool (``fusion_bench.modelpool.CLIPVisionModelPool``) names the base
as ``models._pretrained_`` and each task's expert by its hub id (``tanganke/clip-vit-base-
patch32_sun397``), or as a LoRA adapter (``load_lora_vision_model_hf`` with ``peft_name``);
its ``train_datasets`` and a task pool's ``test_datasets`` name each task's data set
(``datasets.load_dataset`` with ``path``, or ``_args_: [id, subset]``, and ``split``), directly
or through Hydra ``defaults`` that point into FusionBench's ``config/dataset/`` folder. That
folder is found beside the YAML (its config tree), in ``--config-dir``, or in the installed
``fusion_bench_config`` package (read as files; FusionBench is never imported).

:func:`from_fusionbench` turns them into a featcal spec (zero-shot heads from the base CLIP's
text tower, data from the Hugging Face cache) that :func:`featcal.zoo.load.from_spec.load` loads offline;
:func:`write_spec` writes it with the download lines of whatever the cache lacks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Mapping

import yaml

from featcal.zoo.formats import lm_pools
from featcal.zoo.load import classnames
from featcal.zoo.spec import locate
from featcal.zoo.spec.parsing import from_dict
from featcal.zoo.spec.resolve import format_missing, hf_snapshot
from featcal.zoo.spec.schema import SpecError

POOL_TARGET = "CLIPVisionModelPool"
LM_POOLS = ("Seq2SeqLMPool", "CausalLMPool")  # read by featcal.zoo.formats.lm_pools
ENV_DEFAULT = re.compile(r"\$\{[A-Z_][A-Z0-9_]*:-[^}]*\}")  # featcal's own ${VAR:-default} (Hydra never writes :-)
LORA_TARGET = "load_lora_vision_model_hf"
DENSE_TARGETS = ("load_fft_vision_model_hf", "CLIPVisionModel.from_pretrained", "CLIPModel.from_pretrained")
NAME_KEYS = ("pretrained_model_name_or_path", "model_name", "path")
DATA_PACKAGES = ("train_datasets", "test_datasets", "val_datasets")


class FusionBenchError(ValueError):
    """A FusionBench config featcal cannot turn into a zoo spec; the message names the file and key."""


# ----------------------------------------------------------------------------- Hydra, the little we need


def config_roots(yaml_path: Path, config_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where FusionBench's config tree may be: ``config_dir``, the YAML's ancestors holding a
    ``dataset/`` folder, the installed ``fusion_bench_config`` package."""
    roots = [Path(config_dir).expanduser()] if config_dir else []
    roots += [p for p in yaml_path.absolute().parents if (p / "dataset").is_dir()]
    spec = importlib.util.find_spec("fusion_bench_config")
    if spec is not None and spec.submodule_search_locations:
        roots += [Path(p) for p in spec.submodule_search_locations]
    return roots


def _read(path: Path) -> dict:
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, Mapping):
        raise FusionBenchError(f"{path}: expected a mapping at the top level.")
    return dict(doc)


def _group_file(group: str, name: str, here: Path, roots: list[Path]) -> Path:
    """The file of Hydra config ``group/name``: an absolute ``/group`` under a config root, a relative
    one beside ``here``'s own group (``here.parent.parent``), no group in ``here``'s folder."""
    if group.startswith("/"):
        places = [r / group[1:] for r in roots]
    else:
        places = [here.parent.parent / group] if group else [here.parent]
    for place in places:
        if (place / f"{name}.yaml").is_file():
            return place / f"{name}.yaml"
    raise FusionBenchError(
        f"{here}: defaults entry {group or '.'}/{name}: no {name}.yaml under {[str(p) for p in places]}; give "
        "FusionBench's config folder with --config-dir (or install fusion_bench_config)."
    )


def compose(path: Path, roots: list[Path]) -> dict:
    """``path``'s YAML with its Hydra ``defaults`` merged in (they first, the file's own keys on top):
    ``GROUP@PACKAGE: NAME(S)`` into ``PACKAGE``, ``GROUP@: NAME`` at the top, a plain ``NAME`` from
    the same folder (a dataset group file listing its members)."""
    doc = _read(path)
    out: dict = {}
    for entry in doc.pop("defaults", None) or []:
        if entry == "_self_":
            continue
        items = entry.items() if isinstance(entry, Mapping) else [(f"@:{entry}", None)]
        for key, names in items:
            if names is None:
                group, package, names = "", "", key.split(":", 1)[1]
            else:
                group, _, package = str(key).partition("@")
            for name in names if isinstance(names, list) else [names]:
                sub = compose(_group_file(group, str(name).strip(), path, roots), roots)
                if package and package != "_here_":
                    if not isinstance(out.get(package), Mapping):  # unset, or Hydra's ??? placeholder
                        out[package] = {}
                    out[package].update(sub)
                else:
                    out.update(sub)
    for key, value in doc.items():
        if value == "???" and key in out:  # Hydra's "to be filled": keep what the defaults gave
            continue
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _interpolated(value, doc: Mapping):
    """``${..key}`` / ``${.a.b}`` / ``${key}``: the value at that key path of ``doc`` (top-level keys only)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\$\{\.*([\w.]+)\}", value.strip())
        if m:
            node = doc
            for part in m.group(1).split("."):
                node = node.get(part) if isinstance(node, Mapping) else None
            return node
    return value


# ----------------------------------------------------------------------------- pools -> spec


def _model_ref(src: str, task: str, entry) -> tuple[str, str | None]:
    """``(hub id or path, LoRA base id or None)`` of a model pool entry."""
    if isinstance(entry, str):
        return entry, None
    if not isinstance(entry, Mapping):
        raise FusionBenchError(f"{src}: models.{task}: expected a hub id or a mapping, got {entry!r}.")
    target = str(entry.get("_target_", ""))
    if target.endswith(LORA_TARGET):
        return str(entry["peft_name"]), str(entry.get("base_model_name", ""))
    if target.endswith(DENSE_TARGETS) or not target:
        name = next((entry[k] for k in NAME_KEYS if entry.get(k)), None)
        if name is not None:
            return str(name), None
    raise FusionBenchError(
        f"{src}: models.{task}: {target or 'this entry'} is not a model featcal reads (a dense CLIP vision model "
        f"by hub id, or a LoRA adapter via {LORA_TARGET}); linearized and other wrapped models are not supported."
    )


def _model_entry(ref: str, root: Path) -> dict:
    p = Path(ref).expanduser()
    p = p if p.is_absolute() else root / p
    return {"path": str(p)} if p.exists() else {"id": ref}


# FusionBench's own data loaders (``_target_``) that are a ``load_dataset`` with renamed columns:
# {target: (its default hub id, {our column key: the data set's column})} (fusion_bench/dataset/*.py)
LOADERS = {
    "fusion_bench.dataset.fer2013.load_fer2013": (
        "clip-benchmark/wds_fer2013",
        {"image_column": "jpg", "label_column": "cls"},
    ),
}


def _dataset(src: str, task: str, entry) -> tuple[str, str | None, str, dict]:
    """``(hub id, subset or None, split, columns)`` of a ``datasets.load_dataset`` entry, or of one of
    FusionBench's loaders that wrap it (:data:`LOADERS`; ``columns`` then names the image and label
    columns it renames)."""
    target = str(entry.get("_target_", "")) if isinstance(entry, Mapping) else ""
    if not target.endswith("load_dataset") and target not in LOADERS:
        raise FusionBenchError(
            f"{src}: {task}: a data set must be a datasets.load_dataset entry (or one of FusionBench's loaders "
            f"featcal knows: {', '.join(LOADERS)}), got {entry!r}."
        )
    default, columns = LOADERS.get(target, (None, {}))
    args = list(entry.get("_args_") or [])
    hub = entry.get("path") or (args[0] if args else None) or default
    if not hub:
        raise FusionBenchError(f"{src}: {task}: load_dataset without a path.")
    subset = entry.get("name") or (args[1] if len(args) > 1 else None)
    return str(hub), subset, str(entry.get("split", "train")), dict(columns)


def _cached_class_names(hub: str, subset: str | None) -> list[str] | None:
    """The label names a cached parquet copy of ``hub`` records (HF's ``ClassLabel`` metadata)."""
    snap, _ = hf_snapshot(hub, "dataset")
    files = sorted((snap / (subset or "")).rglob("*.parquet")) if snap is not None else []
    if not files:
        return None
    import pyarrow.parquet as pq

    meta = pq.read_schema(files[0]).metadata or {}
    info = json.loads(meta.get(b"huggingface", b"{}"))
    names = (info.get("info", {}).get("features", {}).get("label") or {}).get("names")
    return list(names) if names else None


def from_fusionbench(
    modelpool: str | os.PathLike,
    taskpool: str | os.PathLike | None = None,
    *,
    config_dir: str | os.PathLike | None = None,
    root: str | os.PathLike | None = None,
    splits: Mapping | None = None,
) -> dict:
    """A featcal zoo spec (a dict :func:`featcal.zoo.spec.parsing.from_dict` accepts) from a FusionBench
    CLIP model pool and, optionally, its task pool; local paths are made absolute against ``root``
    (default: the model pool's folder)."""
    pool_path = Path(modelpool).expanduser()
    src = str(pool_path)
    roots = config_roots(pool_path, config_dir)
    pool = compose(pool_path, roots)
    if str(pool.get("_target_", "")).rsplit(".", 1)[-1] in LM_POOLS:  # FLAN-T5 / MergeBench: a generative spec
        return _lm_spec(pool_path, pool, taskpool, config_dir, Path(root) if root else pool_path.absolute().parent)
    _check_target(src, pool)
    models = _mapping(src, pool, "models")
    if "_pretrained_" not in models:
        raise FusionBenchError(f"{src}: models: no _pretrained_ (the base model).")
    here = Path(root) if root else pool_path.absolute().parent
    base_ref, _ = _model_ref(src, "_pretrained_", _interpolated(models.pop("_pretrained_"), pool))
    if not models:
        raise FusionBenchError(f"{src}: models: only _pretrained_; a zoo needs experts.")
    tp = compose(Path(taskpool).expanduser(), config_roots(Path(taskpool), config_dir)) if taskpool else {}
    train = _mapping(src, pool, "train_datasets")
    test = {**_mapping(src, pool, "test_datasets"), **_mapping(str(taskpool), tp, "test_datasets")}
    experts, data, classes = {}, {}, {}
    for task, entry in models.items():
        ref, lora_base = _model_ref(src, task, entry)
        if lora_base and lora_base != base_ref:
            raise FusionBenchError(f"{src}: models.{task}: LoRA on {lora_base!r}, the pool's base is {base_ref!r}.")
        experts[task] = _model_entry(ref, here)
        data[task] = _data_entry(src, task, train.get(task), test.get(task))
        if classnames.canonical_task(task) not in classnames.TASKS:
            names = _cached_class_names(data[task]["hub"], data[task].get("subset"))
            if names is None:
                raise FusionBenchError(
                    f"{src}: task {task!r}: featcal has no built-in class names for it and the data set "
                    f"{data[task]['hub']} is not in the HF cache to read them from; download it first, or add "
                    "heads.classes to the written spec."
                )
            classes[task] = names
    heads: dict = {"type": "zero_shot", "logit_scale": True}
    text = _text_model(tp)
    if text and text != base_ref:
        heads["text_model"] = _model_entry(str(text), here)
    if classes:
        heads["classes"] = classes
    spec = {
        "name": pool_path.stem,
        "format": "hf",
        "base": _model_entry(base_ref, here),
        "experts": experts,
        "heads": heads,
        "data": data,
        "splits": dict(splits or {"calib": 256, "val": 256, "test": None, "seed": 42}),
    }
    _check_resolved(src, spec)
    return spec


def _lm_spec(pool_path: Path, pool: dict, taskpool, config_dir, here: Path) -> dict:
    """A Seq2SeqLMPool or CausalLMPool (composed) as a generative spec (:mod:`featcal.zoo.formats.lm_pools`)."""
    tp = compose(Path(taskpool).expanduser(), config_roots(Path(taskpool), config_dir)) if taskpool else {}
    try:
        spec = lm_pools.lm_spec(
            str(pool_path),
            pool,
            tp,
            resolve=lambda v: _interpolated(v, pool),
            entry_of=lambda ref: _model_entry(ref, here),
            causal=str(pool["_target_"]).endswith("CausalLMPool"),
        )
    except lm_pools.PoolError as err:
        raise FusionBenchError(str(err)) from None
    _check_resolved(str(pool_path), spec)
    return spec


def _check_target(src: str, pool: Mapping) -> None:
    """The pool's class must be :data:`POOL_TARGET` itself (``OpenCLIPVisionModelPool`` contains its name)."""
    target = str(pool.get("_target_", POOL_TARGET)).rsplit(".", 1)[-1]
    if target != POOL_TARGET:
        why = ": OpenCLIP pools (pickle_path checkpoints and heads) are not read yet." if "OpenCLIP" in target else "."
        raise FusionBenchError(
            f"{src}: _target_ {pool['_target_']!r}; featcal reads {POOL_TARGET} pools (Hugging Face CLIP towers) and "
            f"the language-model pools {', '.join(LM_POOLS)}{why}"
        )


def _text_model(tp: Mapping):
    """The task pool's CLIP model for the zero-shot heads: ``clip_model`` as a mapping or a name (often
    ``${.base_model}``), interpolated; None without one."""
    clip_model = _interpolated(tp.get("clip_model"), tp)
    text = clip_model if not isinstance(clip_model, Mapping) else clip_model.get("pretrained_model_name_or_path")
    return _interpolated(text, tp)


def _mapping(src: str, doc: Mapping, key: str) -> dict:
    """``doc[key]`` as a dict (absent or null: empty); anything else, Hydra's ``???`` of a template among
    them, is refused naming the key."""
    value = doc.get(key) or {}
    if not isinstance(value, Mapping):
        raise FusionBenchError(f"{src}: {key}: {value!r} is not a mapping of task -> entry (a template to fill?).")
    return dict(value)


def _check_resolved(src: str, node, where: str = "") -> None:
    """Refuse a spec that still holds a Hydra interpolation (``${...}``) or placeholder (``???``): featcal
    resolves only references to keys of the same file, and never writes one into a spec as if it were a
    path or a split."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            _check_resolved(src, value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _check_resolved(src, value, f"{where}[{i}]")
    elif isinstance(node, str) and ("${" in ENV_DEFAULT.sub("", node) or node.strip() == "???"):
        raise FusionBenchError(
            f"{src}: {where} would be {node!r}, a Hydra value featcal does not resolve (it names another config "
            "or an override). Write the value itself in the pool or task pool, or give the task pool that sets it."
        )


def _data_entry(src: str, task: str, train, test) -> dict:
    if train is None and test is None:
        raise FusionBenchError(
            f"{src}: task {task!r} has no data set: the pool's train_datasets and the task pool's test_datasets "
            "name none; give --taskpool (or a pool with train_datasets)."
        )
    hub, subset, train_split, columns = _dataset(src, task, train) if train is not None else (None, None, "train", {})
    if test is not None:
        t_hub, t_subset, test_split, t_columns = _dataset(src, task, test)
        if hub is not None and (t_hub, t_subset, t_columns) != (hub, subset, columns):
            raise FusionBenchError(
                f"{src}: task {task!r}: train set {hub} and test set {t_hub} differ; featcal "
                "reads both splits from one data set."
            )
        hub, subset, columns = t_hub, t_subset, t_columns
    else:
        test_split = "test"
    entry = {"hub": hub, "train_split": train_split, "test_split": test_split, **columns}
    return entry | ({"subset": subset} if subset else {})


def write_spec(spec: Mapping, out: str | os.PathLike, sources: list[str], force: bool = False) -> list[str]:
    """Write ``spec`` as YAML to ``out`` (validated first; an existing file only with ``force``),
    headed by where it came from and the download commands of what the HF cache lacks. Returns
    the lines saying what is missing (empty when the zoo loads as it is)."""
    out = Path(out).expanduser()
    if out.exists() and not force:
        raise FileExistsError(f"{str(out)!r} exists; pass --force to replace it.")
    try:
        parsed = from_dict(spec, root=out.absolute().parent, source=str(out))
    except SpecError as err:
        raise FusionBenchError(f"the spec made from {sources[0]} does not validate: {err}") from None
    _, missing = locate.locate(parsed)
    head = [f"# featcal zoo spec written by `featcal zoo from-fusionbench` from {', '.join(sources)}."]
    head += ["# Everything is read offline from the Hugging Face cache (featcal never downloads)."]
    lines = format_missing(missing, str(out)).splitlines() if missing else []
    head += [f"# {line}" for line in lines]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(head) + "\n" + yaml.safe_dump(dict(spec), sort_keys=False))
    return lines


def is_pool(path: str | os.PathLike) -> bool:
    """Whether the YAML at ``path`` is a FusionBench model pool (not a featcal spec)."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(doc, Mapping) and (
        "modelpool" in str(doc.get("_target_", "")) or "_pretrained_" in (doc.get("models") or {})
    )


def pool_spec(path: str | os.PathLike, taskpool: str | os.PathLike | None = None):
    """A model pool as a validated :class:`~featcal.zoo.spec.schema.ZooSpec` (what ``featcal --zoo
    POOL.yaml`` and the app's "other (path)" load)."""
    path = Path(path).expanduser()
    return from_dict(from_fusionbench(path, taskpool), root=path.absolute().parent, source=str(path))

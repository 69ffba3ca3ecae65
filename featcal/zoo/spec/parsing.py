"""Zoo specs, parsed and validated: :func:`parse` reads a spec file, :func:`from_dict` validates
a mapping, and both return a :class:`~featcal.zoo.spec.schema.ZooSpec` (the schema and its frozen
dataclasses: :mod:`featcal.zoo.spec.schema`). Nothing here looks for or loads anything."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from featcal.zoo.load import classnames
from featcal.zoo.spec import generative
from featcal.zoo.spec.schema import (
    DATA_FORMATS,
    DTYPES,
    FEATURES,
    FORMATS,
    GENERATIVE,
    HEAD_TYPES,
    MODALITIES,
    SCHEMA,
    TEXT_FORMATS,
    DataSpec,
    HeadSpec,
    ModelSpec,
    PreprocessSpec,
    SpecError,
    SplitSpec,
    ZooSpec,
)

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_ENV = re.compile(rf"\$(?:\{{(?P<braced>{_NAME})(?::-(?P<default>[^}}]*))?\}}|(?P<bare>{_NAME}))")


def expand(value: str, env: Mapping[str, str] | None = None) -> str:
    """Expand ``$VAR``, ``${VAR}``, ``${VAR:-default}`` (the default used when VAR is unset
    or empty, itself expanded) and a leading ``~``. An unset variable without default is an error."""
    env = os.environ if env is None else env

    def sub(m: re.Match) -> str:
        name = m.group("braced") or m.group("bare")
        if env.get(name):
            return env[name]
        if m.group("default") is not None:
            return expand(m.group("default"), env)
        raise SpecError(
            f"environment variable ${name} is not set (in {value!r}); set it or write ${{{name}:-default}}."
        )

    return os.path.expanduser(_ENV.sub(sub, value))


class _Ctx:
    """The spec file's directory (for relative paths) and its name (for error messages)."""

    def __init__(self, source: str | None, root: Path):
        self.source, self.root = source, root

    def fail(self, where: str, msg: str) -> SpecError:
        return SpecError(f"{self.source or 'zoo spec'}: {where}: {msg}")

    def check_keys(self, obj: Any, section: str, where: str) -> dict:
        if not isinstance(obj, Mapping):
            raise self.fail(where, f"expected a mapping, got {type(obj).__name__} {obj!r}.")
        unknown = [k for k in obj if k not in SCHEMA[section]]
        if unknown:
            raise self.fail(where, f"unknown key(s) {unknown}; allowed: {sorted(SCHEMA[section])}.")
        return dict(obj)

    def int(self, value: Any, where: str, minimum: int = 0) -> int:
        return _int(self, value, where, minimum)

    def path(self, value: Any, where: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(where, f"expected a path string, got {value!r}.")
        p = Path(expand(value))
        return str(p if p.is_absolute() else (self.root / p))


def _choice(ctx: _Ctx, value: Any, allowed: tuple, where: str) -> str:
    if value not in allowed:
        raise ctx.fail(where, f"{value!r} is not one of {list(allowed)}.")
    return value


def _int(ctx: _Ctx, value: Any, where: str, minimum: int = 0, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ctx.fail(where, f"expected an integer >= {minimum}, got {value!r}.")
    return value


def _looks_like_hub_id(s: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+", s))


def _model(ctx: _Ctx, raw: Any, defaults: dict, where: str) -> ModelSpec:
    """A model entry: a string or a mapping. A string is a local path; one shaped like an HF id
    (``org/name``) that is not a local path is looked up as a local path first, then in the HF cache."""
    if isinstance(raw, str):
        text = expand(raw)
        local = Path(text) if Path(text).is_absolute() else ctx.root / text
        if local.exists() or not _looks_like_hub_id(text) or defaults["format"] == "open_clip":
            raw = {"path": raw}
        else:
            raw = {"path": raw, "id": text}
    d = ctx.check_keys(raw, "model", where)
    fmt = _choice(ctx, d.get("format", defaults["format"]), FORMATS, f"{where}.format")
    if fmt != defaults["format"]:
        raise ctx.fail(
            f"{where}.format",
            f"{fmt!r} differs from the zoo's format {defaults['format']!r}; "
            "all models of a zoo must share one format to be merged.",
        )
    given = [k for k in ("path", "id", "pretrained") if d.get(k) is not None]
    if not given or ("pretrained" in given and len(given) > 1):
        raise ctx.fail(
            where, f"give `path` and/or `id` (tried in that order), or `pretrained` alone (got {given or 'none'})."
        )
    config = d.get("config", defaults.get("config"))
    arch = d.get("arch", defaults.get("arch")) or (Path(str(config)).stem if config else None)
    if fmt == "open_clip" and not arch:
        raise ctx.fail(where, "an open_clip model needs `arch` (e.g. ViT-B-32), here or at the top level.")
    if config and Path(str(config)).stem != arch:
        raise ctx.fail(where, f"open_clip registers a config under its file name: name the file {arch}.json.")
    if fmt == "hf" and (d.get("pretrained") or d.get("arch") or d.get("config")):
        raise ctx.fail(where, "`pretrained`, `arch` and `config` apply to open_clip models only.")
    if fmt == "open_clip" and d.get("id"):
        raise ctx.fail(where, "open_clip models are a checkpoint `path` or a `pretrained` tag, not an HF `id`.")
    quick_gelu = d.get("quick_gelu", defaults.get("quick_gelu", False))
    if not isinstance(quick_gelu, bool):
        raise ctx.fail(f"{where}.quick_gelu", f"expected true or false, got {quick_gelu!r}.")
    return ModelSpec(
        format=fmt,
        path=ctx.path(d["path"], f"{where}.path") if d.get("path") is not None else None,
        id=expand(str(d["id"])) if d.get("id") is not None else None,
        revision=d.get("revision"),
        arch=arch,
        config=ctx.path(config, f"{where}.config") if config else None,
        quick_gelu=quick_gelu,
        pretrained=d.get("pretrained"),
    )


def _str_lists(ctx: _Ctx, raw: Any, tasks: list[str], where: str) -> Mapping[str, tuple[str, ...]]:
    if raw is None:
        return MappingProxyType({})
    if not isinstance(raw, Mapping):
        raise ctx.fail(where, "expected {task: [strings]}.")
    out = {}
    for task, items in raw.items():
        if task not in tasks:
            raise ctx.fail(f"{where}.{task}", f"no expert for task {task!r}; tasks: {tasks}.")
        if not isinstance(items, list) or not items or not all(isinstance(s, str) for s in items):
            raise ctx.fail(f"{where}.{task}", "expected a non-empty list of strings.")
        out[task] = tuple(items)
    return MappingProxyType(out)


def _heads(ctx: _Ctx, raw: Any, tasks: list[str], defaults: dict) -> HeadSpec:
    d = ctx.check_keys(raw if raw is not None else {}, "heads", "heads")
    kind = _choice(ctx, d.get("type", "zero_shot"), HEAD_TYPES, "heads.type")
    logit_scale = d.get("logit_scale", True)
    if not isinstance(logit_scale, bool):
        raise ctx.fail("heads.logit_scale", f"expected true or false, got {logit_scale!r}.")
    templates = _str_lists(ctx, d.get("templates"), tasks, "heads.templates")
    for task, ts in templates.items():
        bad = [t for t in ts if t.count("{}") != 1]
        if bad:
            raise ctx.fail(f"heads.templates.{task}", f"each template needs exactly one '{{}}': {bad}.")
    if kind == "file":
        if not d.get("path"):
            raise ctx.fail("heads", "type file needs `path` (a safetensors file with <task>.weight).")
        extra = [k for k in ("text_model", "templates") if k in d]
        if extra:
            raise ctx.fail("heads", f"{extra} apply to zero-shot heads only.")
    elif d.get("path"):
        raise ctx.fail("heads.path", "applies to type: file only.")
    return HeadSpec(
        type=kind,
        path=ctx.path(d["path"], "heads.path") if d.get("path") else None,
        text_model=_model(ctx, d["text_model"], defaults, "heads.text_model") if d.get("text_model") else None,
        logit_scale=logit_scale,
        classes=_str_lists(ctx, d.get("classes"), tasks, "heads.classes"),
        templates=templates,
    )


def _data(ctx: _Ctx, task: str, raw: Any) -> DataSpec:
    where = f"data.{task}"
    if isinstance(raw, str):
        raw = {"path": raw}
    d = ctx.check_keys(raw, "data", where)
    if not d.get("path") and not d.get("hub"):
        raise ctx.fail(where, "give `path` (a local dataset) and/or `hub` (an HF dataset id in the cache).")
    fmt = _choice(ctx, d.get("format", "auto"), DATA_FORMATS, f"{where}.format")
    named = ("train_split", "test_split", "calib_split", "val_split", "image_column", "label_column")
    for key in (*named, "hub", "revision", "subset"):
        if key in d and (not isinstance(d[key], str) or not d[key]):
            raise ctx.fail(f"{where}.{key}", f"expected a non-empty string, got {d[key]!r}.")
    kw = {k: d[k] for k in (*named, "revision", "subset") if k in d}
    return DataSpec(
        task=task,
        path=ctx.path(d["path"], f"{where}.path") if d.get("path") else None,
        hub=d.get("hub"),
        format=fmt,
        **kw,
    )


def _splits(ctx: _Ctx, raw: Any) -> SplitSpec:
    d = ctx.check_keys(raw if raw is not None else {}, "splits", "splits")
    return SplitSpec(
        calib=_int(ctx, d.get("calib", 256), "splits.calib", 1),
        val=_int(ctx, d.get("val", 256), "splits.val", 0),
        test=_int(ctx, d.get("test"), "splits.test", 1, allow_none=True),
        seed=_int(ctx, d.get("seed", 42), "splits.seed", 0),
    )


def _triple(ctx: _Ctx, value: Any, where: str) -> tuple[float, float, float] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) != 3
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ctx.fail(where, f"expected three numbers, got {value!r}.")
    if where.endswith("std") and min(value) <= 0:
        raise ctx.fail(where, f"std must be positive, got {value!r}.")
    return tuple(float(v) for v in value)


def _preprocess(ctx: _Ctx, raw: Any) -> PreprocessSpec:
    d = ctx.check_keys(raw if raw is not None else {}, "preprocess", "preprocess")
    return PreprocessSpec(
        image_size=_int(ctx, d.get("image_size"), "preprocess.image_size", 1, allow_none=True),
        mean=_triple(ctx, d.get("mean"), "preprocess.mean"),
        std=_triple(ctx, d.get("std"), "preprocess.std"),
        interpolation=_choice(
            ctx, d.get("interpolation", "bicubic"), ("bicubic", "bilinear", "nearest"), "preprocess.interpolation"
        ),
        max_length=_int(ctx, d.get("max_length", 128), "preprocess.max_length", 2),
    )


def from_dict(raw: Mapping[str, Any], root: str | os.PathLike = ".", source: str | None = None) -> ZooSpec:
    """Validate a spec given as a mapping; relative paths resolve against ``root``."""
    ctx = _Ctx(source, Path(root))
    d = ctx.check_keys(raw, "zoo", "top level")
    for key in ("base", "experts", "data"):
        if key not in d:
            raise ctx.fail("top level", f"missing required key `{key}`.")
    fmt = _choice(ctx, d.get("format", "hf"), FORMATS, "format")
    defaults = {
        "format": fmt,
        "arch": d.get("arch"),
        "config": d.get("config"),
        "quick_gelu": d.get("quick_gelu", False),
    }
    if not isinstance(d["experts"], Mapping) or not d["experts"]:
        raise ctx.fail("experts", "expected a non-empty mapping {task: model entry}.")
    tasks = [str(t) for t in d["experts"]]
    experts = {str(t): _model(ctx, m, defaults, f"experts.{t}") for t, m in d["experts"].items()}
    if not isinstance(d["data"], Mapping):
        raise ctx.fail("data", "expected a mapping {task: data entry}.")
    data_tasks = [str(t) for t in d["data"]]
    if sorted(data_tasks) != sorted(tasks):
        raise ctx.fail(
            "data",
            f"tasks differ from the experts': no data for {sorted(set(tasks) - set(data_tasks))}, "
            f"no expert for {sorted(set(data_tasks) - set(tasks))}.",
        )
    features = _choice(ctx, d.get("features", "embedding"), FEATURES, "features")
    modality = _choice(ctx, d.get("modality", "image"), MODALITIES, "modality")
    heads = _heads(ctx, d.get("heads"), tasks, defaults)
    data = {t: _data(ctx, t, d["data"][t]) for t in tasks}
    if modality in GENERATIVE:
        generative.check_generative(ctx, d, fmt, data)
    else:
        _no_named_splits(ctx, data)
    if modality == "text":
        _check_text(ctx, fmt, features, heads, data)
    elif modality not in GENERATIVE:
        _check_image(ctx, tasks, heads, data)
    _check_features(ctx, heads, features, fmt)
    name = d.get("name") or (Path(source).stem if source else "zoo")
    return ZooSpec(
        name=str(name),
        format=fmt,
        base=_model(ctx, d["base"], defaults, "base"),
        experts=MappingProxyType(experts),
        heads=heads,
        data=MappingProxyType(data),
        splits=_splits(ctx, d.get("splits")),
        preprocess=_preprocess(ctx, d.get("preprocess")),
        features=features,
        dtype=_choice(ctx, d.get("dtype", "float32"), DTYPES, "dtype"),
        source=source,
        modality=modality,
        merged=_model(ctx, d["merged"], defaults, "merged") if d.get("merged") is not None else None,
        tokenizer=_tokenizer(ctx, d.get("tokenizer"), modality),
        generation=generative.parse_tasks(ctx, d.get("tasks"), tasks, modality),
    )


def _check_features(ctx: _Ctx, heads: HeadSpec, features: str, fmt: str) -> None:
    """What the heads read must be what the models give."""
    if heads.type == "zero_shot" and features != "embedding":
        raise ctx.fail(
            "features",
            "zero-shot heads read the normalised image embedding; use features: embedding, or give file heads "
            "(heads: {type: file, path: ...}) for projection or pooled features.",
        )
    if features == "pooled" and fmt == "open_clip":
        raise ctx.fail("features", "open_clip models give the projected embedding; use embedding or projection.")


def _tokenizer(ctx: _Ctx, raw: Any, modality: str) -> str | None:
    """A text or generative zoo's tokenizer directory (None: the base's)."""
    if raw is not None and modality not in ("text", *GENERATIVE):
        raise ctx.fail(
            "tokenizer", "an image zoo tokenises nothing; remove `tokenizer` (or set the modality of your models)."
        )
    return None if raw is None else ctx.path(raw, "tokenizer")


def _no_named_splits(ctx: _Ctx, data: Mapping[str, DataSpec]) -> None:
    """Ready-made calib / val splits are tables of a generative zoo's examples; other zoos draw theirs."""
    for t, e in data.items():
        key = "calib_split" if e.calib_split is not None else "val_split" if e.val_split is not None else None
        if key:
            raise ctx.fail(
                f"data.{t}.{key}",
                "only a generative zoo (modality causal_lm or seq2seq) reads ready-made calib / val splits; "
                "remove it (splits.calib / splits.val draw them from the train split).",
            )


def _check_image(ctx: _Ctx, tasks: list[str], heads: HeadSpec, data: Mapping[str, DataSpec]) -> None:
    """An image zoo: image data; zero-shot heads need class names (given or built-in)."""
    texty = [t for t, e in data.items() if e.format in ("text", "tokens")]
    if texty:
        raise ctx.fail(f"data.{texty[0]}.format", "text and token data need `modality: text`.")
    if heads.type == "zero_shot":
        unnamed = [t for t in tasks if t not in heads.classes and classnames.canonical_task(t) not in classnames.TASKS]
        if unnamed:
            raise ctx.fail(
                "heads.classes",
                f"zero-shot heads need class names for {unnamed} (no built-in ones; "
                f"built-in: {sorted(classnames.TASKS)}).",
            )


def _check_text(ctx: _Ctx, fmt: str, features: str, heads: HeadSpec, data: Mapping[str, DataSpec]) -> None:
    """A text zoo: HF encoders, mean-pooled normalised features, text or token data; zero-shot
    heads encode their prompts through the base (class names: the text files' labels)."""
    if fmt != "hf":
        raise ctx.fail("format", "a text zoo's models are HF save_pretrained directories: use format: hf.")
    if features != "embedding":
        raise ctx.fail("features", "a text zoo's heads read the mean-pooled, normalised embedding: use embedding.")
    if heads.text_model is not None:
        raise ctx.fail("heads.text_model", "a text zoo's zero-shot prompts go through its base; remove text_model.")
    for t, e in data.items():
        if e.format not in TEXT_FORMATS:
            raise ctx.fail(f"data.{t}.format", f"a text zoo reads {list(TEXT_FORMATS)} data, not {e.format!r}.")


def parse(spec_path: str | os.PathLike) -> ZooSpec:
    """Read and validate a YAML spec file (nothing is loaded or looked up)."""
    path = Path(spec_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"zoo spec {str(path)!r} does not exist.")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from None
    if raw is None:
        raise SpecError(f"{path}: the file is empty.")
    return from_dict(raw, root=path.resolve().parent, source=str(path))

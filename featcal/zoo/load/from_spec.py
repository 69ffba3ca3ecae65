"""Zoo specs: a YAML file naming a base model, its task experts, heads and data.

:func:`load` turns a spec into a :class:`~featcal.zoo.core.Zoo`, fully offline:

1. parse and validate the YAML into frozen dataclasses (:mod:`featcal.zoo.spec.schema`);
2. locate every model, head file and dataset (:mod:`featcal.zoo.spec.locate`: local paths,
   then the Hugging Face cache; never the network) and, if anything is missing,
   raise ONE :class:`MissingResourcesError` listing all of it;
3. load the models (:mod:`featcal.zoo.load.loaders`), build the heads
   (:mod:`featcal.zoo.load.heads`), wire up the lazily decoded data (:mod:`featcal.zoo.load.data`).

The format of a spec, with an example: :mod:`featcal.zoo.spec.schema` (its names are
importable from here too).
"""

from __future__ import annotations

import os
from dataclasses import asdict

import torch

from featcal.zoo.core import Zoo
from featcal.zoo.load import data as data_mod
from featcal.zoo.load import heads as heads_mod
from featcal.zoo.load import loaders
from featcal.zoo.spec import locate
from featcal.zoo.spec.parsing import expand, from_dict, parse
from featcal.zoo.spec.resolve import Missing, MissingResourcesError
from featcal.zoo.spec.schema import (
    GENERATIVE,
    SCHEMA,
    DataSpec,
    HeadSpec,
    ModelSpec,
    PreprocessSpec,
    SpecError,
    SplitSpec,
    ZooSpec,
)

__all__ = [
    "load",
    "parse",
    "check",
    "from_dict",
    "expand",
    "ZooSpec",
    "ModelSpec",
    "HeadSpec",
    "DataSpec",
    "SplitSpec",
    "PreprocessSpec",
    "SpecError",
    "Missing",
    "MissingResourcesError",
    "SCHEMA",
]


def load(spec_path: str | os.PathLike | ZooSpec, device: str = "cpu") -> Zoo:
    """Build the :class:`Zoo` a spec describes, offline.

    Every model, head file and dataset is located before anything is loaded;
    if any is missing, one :class:`MissingResourcesError` lists them all with
    every place looked and how to fix it. Models are put on ``device``; data
    stays on the CPU and is decoded lazily, split by split.
    """
    spec = spec_path if isinstance(spec_path, ZooSpec) else parse(spec_path)
    # 1. Locate everything; fail once, listing all that is missing.
    found = locate.locate_all(spec)
    _check_data_kinds(spec, found)
    if spec.modality in GENERATIVE:  # decoder LLMs or encoder-decoders, scored on their replies
        from featcal.zoo.load import generative

        cls, parts = generative.load_parts(spec, found, device=device)
        return cls(name=spec.name, fmt=spec.format, meta=_meta(spec, found), **parts)
    if spec.modality == "text":  # encoders, tokenizer, text or token data
        from featcal.zoo.load import text as text_spec

        parts = text_spec.load_parts(spec, found, device=device)
        return Zoo(name=spec.name, fmt=spec.format, meta=_meta(spec, found), **parts)
    # 2. Models.
    base, experts, info, given = loaders.load_models(spec, found, device=device)
    # 3. Heads (zero-shot through the base CLIP text tower, or a file), checked against the features.
    heads, classes = heads_mod.build_heads(spec, found, device=device)
    with torch.no_grad():
        dim = info.features(base, torch.zeros(1, 3, info.image_size, info.image_size)).shape[-1]
    heads_mod.check_dims(heads, dim)
    # 4. Data, decoded lazily; its labels must fit the heads.
    data = {t: data_mod.task_data(spec, t, found.data[t], classes[t], info, heads[t].out_features) for t in spec.tasks}
    for t in spec.tasks:
        if len(data[t].classes) != heads[t].out_features:
            raise ValueError(
                f"task {t!r}: {len(data[t].classes)} classes in the data/spec, "
                f"{heads[t].out_features} outputs in its head."
            )
    meta = {**_meta(spec, found), "image_size": info.image_size, "mean": list(info.mean), "std": list(info.std)}
    return Zoo(
        name=spec.name,
        base=base,
        experts=experts,
        heads=heads,
        data=data,
        features=info.features,
        fmt=spec.format,
        meta=meta,
        given_merged=given,
    )


def _meta(spec: ZooSpec, found: locate.Found) -> dict:
    return {
        "spec": spec.source,
        "format": spec.format,
        "modality": spec.modality,
        "features": spec.features,
        "sources": found.describe(),
        "inputs": {**({"the zoo spec": str(spec.source)} if spec.source else {}), **found.paths()},
        "splits": asdict(spec.splits),
    }


def _check_data_kinds(spec: ZooSpec, found: locate.Found) -> None:
    """Text and token data go with ``modality: text``, images with the default."""
    if spec.modality in GENERATIVE:  # tables: the parsing checked the formats a spec states
        bad = {t: d.format for t, d in found.data.items() if d.format not in ("parquet", "arrow")}
        if bad:
            t = next(iter(bad))
            raise SpecError(
                f"{spec.source or 'zoo spec'}: data {t!r} ({found.data[t].root}) is {bad[t]} data; "
                "a generative zoo reads parquet files or a datasets.save_to_disk folder."
            )
        return
    for t, d in found.data.items():
        texty = d.format in ("text", "tokens")
        if texty != (spec.modality == "text"):
            fix = "set `modality: text`" if texty else "give text (.txt) or token files, or remove `modality: text`"
            raise SpecError(f"{spec.source or 'zoo spec'}: data {t!r} ({d.root}) is {d.format} data: {fix}.")


def check(spec_path: str | os.PathLike | ZooSpec) -> list[Missing]:
    """Everything a spec needs that cannot be found, as a list (empty when all is there)."""
    spec = spec_path if isinstance(spec_path, ZooSpec) else parse(spec_path)
    return locate.locate(spec)[1]

"""mergekit merges calibrated with FeatCal: a mergekit YAML (``merge_method``, ``base_model``,
``models`` with their ``parameters``, ``parameters``, ``dtype``, ``tokenizer``) read into
featcal's base, experts and merge.

Each model of ``models`` but the base is an expert; its task name is its directory's last path
component (``--task-name MODEL=NAME`` renames), which the calibration data's task keys must say.
``model: BASE+ADAPTER`` (mergekit's LoRA syntax) is the LoRA adapter ADAPTER on the base. The
merge is either the one mergekit wrote (``merged=DIR``) or, for the methods whose semantics
featcal's mergers share (:data:`SUPPORTED`), made by them with mergekit's parameters:

==============  ===============================================================================
mergekit        featcal
==============  ===============================================================================
linear          task_arithmetic(scale=1, weights=w_i / sum_j w_j) (the base's weight counted
                when the base is one of ``models``): ``sum_i w_i theta_i / sum_i w_i``
task_arithmetic task_arithmetic(scale=lambda, weights=w_i) (``normalize: true``: w_i / sum w)
ties            ties(density=d_i, weights=w_i, scale=lambda, disjoint=mean|sum by ``normalize``)
dare_ties       dare(drop=1-d_i, weights=w_i, scale=lambda, rescale=l1|none, elect=True,
                disjoint=mean|sum by ``normalize``)
dare_linear     dare(drop=1-d_i, weights=w_i, scale=lambda, rescale=l1|none) (``normalize``:
                w_i / sum w)
==============  ===============================================================================

docs/formats.md has the table with every parameter and where the two differ.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

# mergekit's defaults per method: (normalize, rescale) (mergekit/merge_methods/registry.py)
DEFAULTS = {
    "linear": (True, False),
    "task_arithmetic": (False, False),
    "ties": (True, False),
    "dare_ties": (False, True),
    "dare_linear": (False, True),
}
SUPPORTED = tuple(DEFAULTS)
GLOBAL = ("normalize", "rescale", "lambda", "int8_mask")  # mergekit's method-level parameters
PER_MODEL = ("weight", "density")


class MergekitError(ValueError):
    """A mergekit YAML featcal cannot take; the message names the file, the key and the fix."""


@dataclass(frozen=True)
class Recipe:
    """A mergekit YAML, read: where base and experts are, and the merge as featcal's."""

    source: str
    method: str
    base: str  # the base model's directory
    experts: Mapping[str, str]  # {task: model directory or LoRA adapter directory}
    weights: Mapping[str, float] = field(default_factory=dict)
    densities: Mapping[str, float] = field(default_factory=dict)
    params: Mapping = field(default_factory=dict)  # the method-level parameters as given
    base_weight: float | None = None  # linear: the base's weight when it is one of the models
    dtype: str | None = None
    tokenizer: object = None

    def featcal_merge(self) -> tuple[str, dict]:
        """The same merge as a featcal merger ``(method, params)`` (:data:`SUPPORTED` only)."""
        if self.method not in SUPPORTED:
            raise MergekitError(
                f"{self.source}: merge_method {self.method!r} has no featcal counterpart; featcal merges "
                f"{', '.join(SUPPORTED)} itself. Run mergekit and pass its output as --merged DIR (merged=)."
            )
        normalize, rescale = DEFAULTS[self.method]
        normalize = bool(self.params.get("normalize", normalize))
        rescale = bool(self.params.get("rescale", rescale))
        lam = float(self.params.get("lambda", 1.0))
        w = dict(self.weights)
        if self.method == "linear":
            total = sum(w.values()) + (self.base_weight or 0.0)
            if not normalize and abs(total - 1.0) > 1e-6:
                raise MergekitError(
                    f"{self.source}: linear with normalize: false and weights summing to {total:g} scales the "
                    "base itself; featcal's mergers keep theta_0 + (task vectors). Use normalize: true."
                )
            return "task_arithmetic", {"scale": 1.0, "weights": {t: v / total for t, v in w.items()}}
        if normalize and self.method in ("task_arithmetic", "dare_linear"):
            total = sum(w.values())
            w = {t: v / (total if abs(total) >= 1e-8 else 1.0) for t, v in w.items()}
        if self.method == "task_arithmetic":
            return "task_arithmetic", {"scale": lam, "weights": w}
        disjoint = "mean" if normalize else "sum"
        if self.method == "ties":
            return "ties", {"density": dict(self.densities), "scale": lam, "disjoint": disjoint, "weights": w}
        params = {"drop": {t: 1.0 - d for t, d in self.densities.items()}, "scale": lam, "weights": w}
        params["rescale"] = "l1" if rescale else "none"
        if self.method == "dare_ties":
            params |= {"elect": True, "disjoint": disjoint}
        return "dare", params

    def card(self) -> dict:
        """The model card's ``merge`` entry: mergekit's recipe as written."""
        per_model = {t: {"weight": self.weights.get(t), "density": self.densities.get(t)} for t in self.experts}
        doc = {"merge_method": self.method, "parameters": dict(self.params), "models": per_model}
        doc |= {k: v for k, v in (("dtype", self.dtype), ("tokenizer", self.tokenizer)) if v is not None}
        return {"mergekit": doc}


def _fail(src: str, where: str, msg: str) -> MergekitError:
    return MergekitError(f"{src}: {where}: {msg}")


def _number(src: str, where: str, value) -> float:
    """A parameter value: featcal takes one number (mergekit's gradients and filters vary it by layer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(src, where, f"{value!r}: featcal takes one number here (gradients and filters are not supported).")
    return float(value)


def resolve_model(ref: str, root: Path) -> str:
    """A mergekit model reference as a local directory: a path (relative to the YAML's directory,
    else to the working directory), or a Hugging Face id in the local cache (never downloaded)."""
    ref = ref.split("@", 1)[0]
    for p in (Path(ref).expanduser(), root / ref):
        if p.is_dir():
            return str(p.absolute())
    if ref.count("/") == 1 and not ref.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(ref, local_files_only=True)
        except Exception:  # not in the cache (offline)
            pass
    raise FileNotFoundError(
        f"mergekit model {ref!r}: no such directory (relative paths are tried from {root} and the working "
        f"directory) and no copy in the Hugging Face cache; `huggingface-cli download {ref}` on a connected machine."
    )


def task_name(ref: str) -> str:
    """An expert's task name: its model directory's last path component (``org/math-7b`` -> ``math-7b``)."""
    return Path(ref.split("@", 1)[0].rstrip("/")).name


def _read_doc(path: Path) -> dict:
    """The YAML, checked for what featcal needs at the top: a method, a ``models`` list, a base."""
    src = str(path)
    if not path.is_file():
        raise FileNotFoundError(f"mergekit config {src!r} does not exist.")
    doc = yaml.safe_load(path.read_text()) or {}
    if not isinstance(doc, Mapping) or "merge_method" not in doc:
        raise _fail(src, "top level", "not a mergekit config (no merge_method).")
    if doc.get("slices") or doc.get("modules") or not doc.get("models"):
        raise _fail(src, "models", "featcal reads `models:` lists (slices/modules frankenmerges have no experts).")
    if not doc.get("base_model"):
        raise _fail(src, "base_model", "FeatCal needs the base model (its anchor); add base_model: to the config.")
    for key in doc.get("parameters") or {}:
        if key not in GLOBAL + PER_MODEL:
            raise _fail(src, f"parameters.{key}", f"unknown parameter; mergekit's are {', '.join(GLOBAL + PER_MODEL)}.")
    return dict(doc)


def read_recipe(path: str | os.PathLike, task_names: Mapping[str, str] | None = None) -> Recipe:
    """Read and check a mergekit YAML; ``task_names`` renames experts (``{model ref or its task
    name: new name}``). Every model is found on disk before anything is loaded."""
    path = Path(path).expanduser()
    src, root = str(path), path.absolute().parent
    doc = _read_doc(path)
    method, base_ref, params = str(doc["merge_method"]), str(doc["base_model"]), dict(doc.get("parameters") or {})
    renames = dict(task_names or {})
    experts, weights, densities, base_weight = {}, {}, {}, None
    for i, entry in enumerate(doc["models"]):
        entry = {"model": entry} if isinstance(entry, str) else dict(entry)
        ref, where = str(entry.get("model", "")), f"models[{i}]"
        mp = {**{k: v for k, v in params.items() if k in PER_MODEL}, **(entry.get("parameters") or {})}
        bad = [k for k in mp if k not in PER_MODEL]
        if bad:
            raise _fail(src, f"{where}.parameters", f"{bad}: featcal takes {', '.join(PER_MODEL)} per model.")
        if ref == base_ref:
            base_weight = _number(src, f"{where}.weight", mp["weight"]) if "weight" in mp else None
            continue
        model, _, lora = ref.partition("+")
        if lora and model != base_ref:
            raise _fail(src, where, f"{ref!r}: a LoRA expert must be on base_model {base_ref!r}.")
        name = renames.pop(ref, None) or renames.pop(task_name(lora or model), None) or task_name(lora or model)
        if name in experts:
            raise _fail(src, where, f"two experts are named {name!r}; rename one with --task-name MODEL=NAME.")
        experts[name] = resolve_model(lora or model, root)
        if "weight" not in mp and method in SUPPORTED:
            raise _fail(src, where, f"{ref!r} has no weight (mergekit requires one for {method}).")
        if "weight" in mp:
            weights[name] = _number(src, f"{where}.weight", mp["weight"])
        densities[name] = _number(src, f"{where}.density", mp.get("density", 1.0))
        if not 0.0 < densities[name] <= 1.0:
            raise _fail(src, f"{where}.density", f"{densities[name]} is not in (0, 1].")
    if renames:
        raise _fail(src, "--task-name", f"{sorted(renames)} name no model of the config.")
    if base_weight is None and "weight" in params and method == "linear":
        base_weight = _number(src, "parameters.weight", params["weight"])  # mergekit adds the base to linear
    return Recipe(
        source=src,
        method=method,
        base=resolve_model(base_ref, root),
        experts=experts,
        weights=weights,
        densities=densities,
        params={k: v for k, v in params.items() if k in GLOBAL},
        base_weight=base_weight,
        dtype=doc.get("dtype"),
        tokenizer=doc.get("tokenizer") or doc.get("tokenizer_source"),
    )


def calibrate_mergekit(
    path: str | os.PathLike,
    *,
    calib_data: Mapping[str, list],
    out: str | os.PathLike,
    merged: str | os.PathLike | None = None,
    task_names: Mapping[str, str] | None = None,
    config=None,
    options=None,
):
    """Calibrate the merge the mergekit YAML at ``path`` describes with FeatCal, streamed block by block
    (:func:`featcal.calibrate_checkpoints`, with its ``config`` and ``options``, a
    :class:`~featcal.streaming.options.StreamOptions`): the merge mergekit wrote to ``merged``, or,
    without it, featcal's merge of the supported methods."""
    from featcal.streaming.options import StreamOptions
    from featcal.streaming.run import calibrate_checkpoints

    recipe = read_recipe(path, task_names)
    missing = [t for t in recipe.experts if t not in calib_data]
    if missing:
        raise ValueError(
            f"{recipe.source}: no calibration data for the experts {missing} (tasks are the model directories' "
            f"last path components; the data has {sorted(calib_data)}). Rename with task_names / --task-name."
        )
    merge = None if merged is not None else recipe.featcal_merge()
    card = {"merge": recipe.card() | ({"featcal": {"method": merge[0]}} if merge else {"merged": Path(merged).name})}
    opts = options or StreamOptions()
    return calibrate_checkpoints(
        recipe.base,
        dict(recipe.experts),
        calib_data=calib_data,
        out=out,
        merge=merge,
        merged=merged,
        config=config,
        options=dataclasses.replace(opts, card=card | dict(opts.card or {})),
    )

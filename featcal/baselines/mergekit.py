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

Every key of the YAML is read or refused by name before any model is loaded (:data:`TOP_LEVEL`;
with ``merged=`` mergekit made the merge, so its method and parameters are only recorded in the
model card). docs/formats.md has the table with every key and where the two differ.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import yaml

# mergekit 0.1.5's parameters of the methods featcal merges itself (mergekit/merge_methods: registry.py,
# generalized_task_arithmetic.py, linear.py): the method-level ones with their defaults, and the per-model ones.
_GTA = ("int8_mask", "normalize", "rescale", "lambda")


def _gta(normalize: bool, rescale: bool) -> dict:
    return {"int8_mask": False, "normalize": normalize, "rescale": rescale, "lambda": 1.0}


METHODS: dict[str, tuple[dict, tuple[str, ...]]] = {
    "linear": ({"normalize": True}, ("weight",)),
    "task_arithmetic": (_gta(normalize=False, rescale=False), ("weight", "density")),
    "ties": (_gta(normalize=True, rescale=False), ("weight", "density")),
    "dare_ties": (_gta(normalize=False, rescale=True), ("weight", "density")),
    "dare_linear": (_gta(normalize=False, rescale=True), ("weight", "density")),
}
SUPPORTED = tuple(METHODS)
BOOLEANS = ("int8_mask", "normalize", "rescale")
# Every top-level key of a mergekit config (mergekit's MergeConfiguration) and what featcal does with it.
TOP_LEVEL = {
    "merge_method": "read",
    "base_model": "read: the anchor of the calibration",
    "models": "read: every model but the base is an expert",
    "parameters": "read (featcal's merge) or recorded (--merged: mergekit's)",
    "dtype": "featcal merges in float32: absent or float32 without --merged",
    "out_dtype": "featcal writes the base's dtype: absent or that dtype without --merged",
    "tokenizer_source": "featcal writes the base's tokenizer files: absent or base",
    "tokenizer": "refused: featcal writes the base's tokenizer files",
    "chat_template": "refused: featcal writes the base's tokenizer files",
    "slices": "refused: no experts to calibrate toward",
    "modules": "refused: no experts to calibrate toward",
}


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
    params: Mapping = field(default_factory=dict)  # the method-level parameters as given (checked: featcal merges)
    base_weight: float | None = None  # linear: the base's weight when it is one of the models
    card_doc: Mapping = field(default_factory=dict)  # the recipe as written, for the model card
    merged: bool = False  # read for mergekit's own merge: its parameters only recorded, not read

    def featcal_merge(self) -> tuple[str, dict]:
        """The same merge as a featcal merger ``(method, params)`` (:data:`SUPPORTED` only)."""
        if self.method not in SUPPORTED:
            raise _unsupported(self.source, self.method)
        if self.merged:
            raise MergekitError(
                f"{self.source}: read for mergekit's own merge (merged=): its parameters were not read."
            )
        p = METHODS[self.method][0] | dict(self.params)
        normalize, rescale, lam = p["normalize"], p.get("rescale", False), float(p.get("lambda", 1.0))
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
        if self.method == "task_arithmetic":  # (no sparsification: mergekit reads neither density nor rescale)
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
        return {"mergekit": dict(self.card_doc)}


def _fail(src: str, where: str, msg: str) -> MergekitError:
    return MergekitError(f"{src}: {where}: {msg}")


def _unsupported(src: str, method: str) -> MergekitError:
    return _fail(
        src,
        "merge_method",
        f"{method!r} has no featcal counterpart; featcal merges {', '.join(SUPPORTED)} itself. Run mergekit and "
        "pass its output as --merged DIR (merged=): then only the models are read.",
    )


def _number(src: str, where: str, value) -> float:
    """A parameter value: one finite number (mergekit's gradients and filters vary it by layer)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(src, where, f"{value!r}: featcal takes one number here (gradients and filters are not supported).")
    if not math.isfinite(value):
        raise _fail(src, where, f"{value!r} is not a finite number.")
    return float(value)


def _boolean(src: str, where: str, value) -> bool:
    """A switch: a YAML boolean only (a quoted 'false' is a string, which Python reads as true)."""
    if not isinstance(value, bool):
        raise _fail(src, where, f"{value!r}: expected true or false, unquoted (a YAML boolean).")
    return value


def _method_params(src: str, method: str, params: Mapping) -> dict:
    """The method-level ``parameters`` of a merge featcal makes, each checked and typed; the per-model
    ones given at the top level (defaults for every model) are read with each model."""
    shared, per_model = METHODS[method]
    out = {}
    for key, value in params.items():
        if key in per_model:
            continue
        if key not in shared:
            raise _fail(
                src,
                f"parameters.{key}",
                f"not a parameter of mergekit's {method} (it takes {', '.join([*shared, *per_model])}).",
            )
        where = f"parameters.{key}"
        out[key] = _boolean(src, where, value) if key in BOOLEANS else _number(src, where, value)
    if method == "ties" and out.get("rescale", False):
        raise _fail(
            src,
            "parameters.rescale",
            "true: featcal's TIES does not rescale the kept entries. Set rescale: "
            "false, or run mergekit and pass its output as --merged DIR.",
        )
    return out


def resolve_model(ref: str, root: Path) -> str:
    """A mergekit model reference as a local directory: a path (relative to the YAML's directory,
    else to the working directory), or a Hugging Face id in the local cache (never downloaded),
    at its revision when the reference says one (``org/name@rev``)."""
    name, _, revision = ref.partition("@")
    if "@" in revision:
        raise MergekitError(f"mergekit model {ref!r}: more than one '@' (write ORG/NAME@REVISION).")
    for p in (Path(name).expanduser(), root / name):
        if p.is_dir():
            if revision:
                raise MergekitError(
                    f"mergekit model {ref!r}: {name!r} is a local directory, which has no revisions; "
                    f"drop '@{revision}', or give the Hugging Face id whose cached revision you mean."
                )
            return str(p.absolute())
    if name.count("/") == 1 and not name.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(name, revision=revision or None, local_files_only=True)
        except Exception:  # not in the cache (offline)
            pass
    at = f" at revision {revision!r}" if revision else ""
    raise FileNotFoundError(
        f"mergekit model {ref!r}: no such directory (relative paths are tried from {root} and the working "
        f"directory) and no copy{at} in the Hugging Face cache; `huggingface-cli download {name}"
        f"{f' --revision {revision}' if revision else ''}` on a connected machine."
    )


def task_name(ref: str) -> str:
    """An expert's task name: its model directory's last path component (``org/math-7b@v2`` -> ``math-7b``)."""
    return Path(ref.split("@", 1)[0].rstrip("/")).name


def _read_doc(path: Path) -> dict:
    """The YAML, checked at the top: one document, mergekit's keys only, a method, a ``models`` list,
    a base, and the base's tokenizer (the one featcal writes)."""
    src = str(path)
    if not path.is_file():
        raise FileNotFoundError(f"mergekit config {src!r} does not exist.")
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except yaml.YAMLError as e:
        raise MergekitError(f"{src}: not valid YAML ({e}).") from None
    if len(docs) > 1:
        raise _fail(
            src,
            "top level",
            f"{len(docs)} YAML documents (a mergekit-multi config); featcal reads one "
            "merge. Run mergekit-multi, then pass its final merge as --merged DIR with that merge's config.",
        )
    doc = docs[0] if docs else {}
    if not isinstance(doc, Mapping) or "merge_method" not in doc:
        raise _fail(src, "top level", "not a mergekit config (no merge_method).")
    unknown = sorted(str(k) for k in doc if k not in TOP_LEVEL)
    if unknown:
        raise _fail(src, ", ".join(unknown), f"not a mergekit key (mergekit's are {', '.join(TOP_LEVEL)}).")
    if doc.get("slices") or doc.get("modules") or not doc.get("models"):
        raise _fail(
            src,
            "models",
            "featcal reads `models:` lists (slices/modules frankenmerges have no experts); "
            "give such a merge as featcal calibrate --base DIR --expert TASK=DIR ... --merged DIR.",
        )
    if not doc.get("base_model"):
        raise _fail(src, "base_model", "FeatCal needs the base model (its anchor); add base_model: to the config.")
    for key in ("tokenizer", "chat_template"):
        if doc.get(key) is not None:
            raise _fail(
                src,
                key,
                "featcal writes the base's tokenizer files, so it cannot honour this; remove it "
                "and set the tokenizer of featcal's output yourself.",
            )
    if doc.get("tokenizer_source") not in (None, "base"):
        raise _fail(
            src,
            "tokenizer_source",
            f"{doc['tokenizer_source']!r}: featcal writes the base's tokenizer "
            "files, so only `base` is honoured; remove it or write tokenizer_source: base.",
        )
    return dict(doc)


def _check_dtypes(src: str, doc: Mapping, base_dir: str) -> None:
    """Without ``--merged`` featcal merges in float32 and writes the base's dtype: ``dtype`` and
    ``out_dtype`` are honoured only where they say the same."""
    from featcal.model.checkpoints import Checkpoint

    if doc.get("dtype") not in (None, "float32"):
        raise _fail(
            src,
            "dtype",
            f"{doc['dtype']!r}: featcal merges in float32. Write dtype: float32, or run "
            "mergekit and pass its output as --merged DIR.",
        )
    out = doc.get("out_dtype") or doc.get("dtype")
    if out is None:
        return
    floats = [s.dtype for s in Checkpoint(base_dir, "base").specs.values() if s.dtype.is_floating_point]
    base = str(max(set(floats), key=floats.count)).removeprefix("torch.") if floats else None
    if out != base:
        key = "out_dtype" if doc.get("out_dtype") else "dtype"
        raise _fail(
            src,
            key,
            f"{out!r}: featcal writes the base's dtype ({base}). Write {key}: {base}, or run "
            "mergekit and pass its output as --merged DIR.",
        )


@dataclass
class _Models:
    """What ``models:`` says, read entry by entry (:func:`_read_entry`)."""

    experts: dict = field(default_factory=dict)  # {task: directory}
    weights: dict = field(default_factory=dict)
    densities: dict = field(default_factory=dict)
    base_weight: float | None = None
    card: dict = field(default_factory=dict)  # {task: {"model": ref, **parameters as written}}
    missing: list = field(default_factory=list)  # the models not found, each as its message


def _read_entry(src, root, i, entry, doc, renames: dict, merged: bool, into: _Models) -> None:
    """One entry of ``models:``: the base's weight, or an expert found on disk with its parameters
    (checked and read when featcal merges; recorded only when mergekit merged)."""
    method, base_ref, params = str(doc["merge_method"]), str(doc["base_model"]), dict(doc.get("parameters") or {})
    per_model = () if merged else METHODS[method][1]
    entry = {"model": entry} if isinstance(entry, str) else dict(entry)
    ref, where = str(entry.get("model", "")), f"models[{i}]"
    extra = sorted(str(k) for k in entry if k not in ("model", "parameters"))
    if extra:
        raise _fail(src, f"{where}.{extra[0]}", "not a mergekit key (a model entry has model and parameters).")
    given = dict(entry.get("parameters") or {})
    mp = {**{k: v for k, v in params.items() if k in per_model}, **given}
    bad = [k for k in mp if k not in per_model]
    if bad and not merged:
        raise _fail(src, f"{where}.parameters", f"{bad}: mergekit's {method} takes {', '.join(per_model)} per model.")
    if ref == base_ref:
        into.base_weight = _number(src, f"{where}.weight", mp["weight"]) if "weight" in mp and not merged else None
        return
    model, _, lora = ref.partition("+")
    if lora and model != base_ref:
        raise _fail(src, where, f"{ref!r}: a LoRA expert must be on base_model {base_ref!r}.")
    name = renames.pop(ref, None) or renames.pop(task_name(lora or model), None) or task_name(lora or model)
    if name in into.experts:
        raise _fail(src, where, f"two experts are named {name!r}; rename one with --task-name MODEL=NAME.")
    try:
        into.experts[name] = resolve_model(lora or model, root)
    except FileNotFoundError as e:  # named with every other missing model once all are read
        into.experts[name] = ""
        into.missing.append(str(e))
        return
    into.card[name] = {"model": ref, **given}
    if merged:
        return
    if "weight" not in mp:
        raise _fail(src, where, f"{ref!r} has no weight (mergekit requires one for {method}).")
    into.weights[name] = _number(src, f"{where}.weight", mp["weight"])
    if "density" in per_model:
        into.densities[name] = d = _number(src, f"{where}.density", mp.get("density", 1.0))
        if not 0.0 < d <= 1.0:
            raise _fail(src, f"{where}.density", f"{d} is not in (0, 1].")


def read_recipe(path: str | os.PathLike, task_names: Mapping[str, str] | None = None, merged: bool = False) -> Recipe:
    """Read and check a mergekit YAML; ``task_names`` renames experts (``{model ref or its task
    name: new name}``). Every key is read or refused; every model is found on disk before anything
    is loaded (all missing ones named at once). ``merged``: mergekit's own output will be
    calibrated, so any method is taken and its parameters are only recorded."""
    path = Path(path).expanduser()
    src, root = str(path), path.absolute().parent
    doc = _read_doc(path)
    method, base_ref = str(doc["merge_method"]), str(doc["base_model"])
    params = dict(doc.get("parameters") or {})
    if not merged and method not in SUPPORTED:
        raise _unsupported(src, method)
    shared = {} if merged else _method_params(src, method, params)
    renames, models = dict(task_names or {}), _Models()
    for i, entry in enumerate(doc["models"]):
        _read_entry(src, root, i, entry, doc, renames, merged, models)
    if renames:
        raise _fail(src, "--task-name", f"{sorted(renames)} name no model of the config.")
    if not merged and models.base_weight is None and "weight" in params and method == "linear":
        models.base_weight = _number(src, "parameters.weight", params["weight"])  # mergekit adds the base to linear
    if not merged and method == "linear" and models.base_weight is None:
        raise _fail(
            src,
            "base_model",
            "mergekit's linear merges base_model with the models, so it needs the base's weight (mergekit "
            "stops with 'Missing required parameter weight'); list base_model under models with "
            "parameters: {weight: W} (W = 0 leaves it out of the average).",
        )
    try:
        base = resolve_model(base_ref, root)
    except FileNotFoundError as e:
        base, models.missing = "", [str(e), *models.missing]
    if models.missing:
        raise FileNotFoundError(f"{src}: {len(models.missing)} model(s) not found:\n  " + "\n  ".join(models.missing))
    if not merged:
        _check_dtypes(src, doc, base)
    card = {"merge_method": method, "base_model": base_ref, "parameters": params, "models": models.card}
    card |= {k: doc[k] for k in ("dtype", "out_dtype", "tokenizer_source") if doc.get(k) is not None}
    return Recipe(
        src, method, base, models.experts, models.weights, models.densities, shared, models.base_weight, card, merged
    )


def calibrate_mergekit(
    path: str | os.PathLike | Recipe,
    *,
    calib_data: Mapping[str, list],
    out: str | os.PathLike,
    merged: str | os.PathLike | None = None,
    task_names: Mapping[str, str] | None = None,
    config=None,
    options=None,
):
    """Calibrate the merge the mergekit YAML at ``path`` (or its :class:`Recipe`, read with ``merged``
    alike) describes with FeatCal, streamed block by block (:func:`featcal.calibrate_checkpoints`, with its
    ``config`` and ``options``, a :class:`~featcal.streaming.options.StreamOptions`): the merge mergekit
    wrote to ``merged``, or, without it, featcal's merge of the supported methods."""
    from featcal.streaming.options import StreamOptions
    from featcal.streaming.run import calibrate_checkpoints

    recipe = path if isinstance(path, Recipe) else read_recipe(path, task_names, merged=merged is not None)
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

"""PEFT LoRA adapters as experts: an adapter directory (``adapter_config.json`` and
``adapter_model.safetensors``) on a base model, merged into dense expert weights.

For every adapted module with weight ``W`` the expert's weight is

    W_e = W + s * B A,      s = lora_alpha / r       (use_rslora: lora_alpha / sqrt(r))

with ``A`` (r, in) and ``B`` (out, r) from the adapter; ``B A`` is transposed for
``fan_in_fan_out`` layers (GPT-2's ``Conv1D`` stores ``W`` as (in, out)) and for embeddings
(``lora_embedding_A`` (r, vocab), ``lora_embedding_B`` (dim, r)). ``rank_pattern`` and
``alpha_pattern`` give some modules their own ``r`` and ``lora_alpha``. Whole tensors the
adapter saves (``modules_to_save``, trained biases, a resized embedding's ``base_layer``)
replace the base's. :func:`merge_lora` is the rule for one tensor, so a streamed run merges
block by block (:class:`LoraAdapter.tensor`); DoRA and every other PEFT method are refused
by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch

from featcal.model.checkpoints import Checkpoint, Spec
from featcal.model.fingerprint import content_fingerprint

CONFIG = "adapter_config.json"
WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
PREFIX = "base_model.model."  # PeftModel's prefix of the wrapped model's names
# adapter_config.json switches featcal does not merge, with why (a true value is refused)
UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA) rescales each column by a learned magnitude",
    "use_qalora": "QA-LoRA pools the input before A",
    "layer_replication": "layer replication changes the number of blocks",
    "target_parameters": "LoRA on bare parameters (target_parameters)",
    "trainable_token_indices": "trainable token rows (trainable_token_indices)",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens",
    "use_bdlora": "block-diagonal LoRA",
}


# init_lora_weights modes that also rewrite the base's weights (peft's pissa_init, olora_init, corda_init,
# loftq_init, lora_ga_init): such an adapter belongs to the residual base peft made, not to the base on
# disk, unless it was saved with path_initial_model_for_weight_conversion (peft then writes a plain LoRA
# and init_lora_weights: true)
BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


class LoraError(ValueError):
    """An adapter featcal cannot merge onto this base; the message names the adapter and why."""


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a PEFT adapter directory (``adapter_config.json`` in it)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / CONFIG).is_file()


def lora_scale(r: int, alpha: float, rslora: bool = False) -> float:
    """PEFT's scaling of ``B A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rank-stabilised LoRA."""
    return alpha / math.sqrt(r) if rslora else alpha / r


def lora_delta(A: torch.Tensor, B: torch.Tensor, scale: float, transpose: bool = False) -> torch.Tensor:
    """``scale * B A`` (transposed when ``transpose``), in float32 (float64 if ``B`` is)."""
    work = torch.float64 if B.dtype == torch.float64 else torch.float32
    delta = B.to(work) @ A.to(work)
    return scale * (delta.T if transpose else delta)


def merge_lora(
    weight: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scale: float, transpose: bool = False
) -> torch.Tensor:
    """``W + scale * B A`` for one weight, computed in float32 and cast back to ``W``'s dtype."""
    delta = lora_delta(A, B, scale, transpose)
    if tuple(delta.shape) != tuple(weight.shape):
        raise LoraError(f"B A is {tuple(delta.shape)}, the weight {tuple(weight.shape)}")
    return (weight.to(delta.dtype) + delta).to(weight.dtype)


@dataclass(frozen=True)
class LoraModule:
    """One adapted weight: its factors and how they combine."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float
    transpose: bool  # fan_in_fan_out layers and embeddings
    bias: torch.Tensor | None = None  # lora_B's bias (PEFT's lora_bias), added scaled to the layer's bias


def _pattern_value(patterns: Mapping[str, float], module: str, default):
    """PEFT's ``rank_pattern``/``alpha_pattern`` lookup: the first key matching the end of
    the module's name (at a dot boundary), else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _targets(target_modules, module: str) -> bool:
    """Whether ``target_modules`` (a regex string, or a list of name suffixes) names ``module``."""
    if isinstance(target_modules, str):
        return target_modules == "all-linear" or re.fullmatch(target_modules, module) is not None
    return any(module == t or module.endswith("." + t) for t in target_modules or ())


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS[0]).is_file():
        from safetensors.torch import load_file

        return load_file(str(path / WEIGHTS[0]), device="cpu")
    if (path / WEIGHTS[1]).is_file():
        return torch.load(str(path / WEIGHTS[1]), map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"LoRA adapter {str(path)!r} has {CONFIG} but neither {' nor '.join(WEIGHTS)}.")


class LoraAdapter:
    """A PEFT LoRA adapter directory, read and checked: :meth:`tensor` gives the expert's value
    of one base tensor, :meth:`merged` a whole expert state dict."""

    def __init__(self, path: str | os.PathLike, role: str = "expert"):
        self.path = Path(path).expanduser()
        self.what = f"{role}: LoRA adapter {str(self.path)!r}"
        if not is_adapter_dir(self.path):
            raise FileNotFoundError(f"{self.what}: no {CONFIG} there (a PEFT save_pretrained directory).")
        self.config = json.loads((self.path / CONFIG).read_text())
        self._check_kind()
        self.modules: dict[str, LoraModule] = {}  # base weight name -> factors
        self.replaced: dict[str, torch.Tensor] = {}  # base tensor name -> the adapter's whole tensor
        self._parse(_read_weights(self.path))

    @property
    def base_name(self) -> str | None:
        """The base model the adapter was trained on (``base_model_name_or_path``)."""
        return self.config.get("base_model_name_or_path") or None

    def trained_on(self) -> str | None:
        """The directory of the base the adapter was trained on, where this machine has it: its
        ``base_model_name_or_path`` as a local directory, or as a Hugging Face id in the local cache."""
        name = str(self.base_name or "")
        if name and Path(name).expanduser().is_dir():
            return str(Path(name).expanduser().absolute())
        if name.count("/") == 1 and not name.startswith((".", "/")):
            from huggingface_hub import snapshot_download

            try:
                return snapshot_download(name, local_files_only=True)
            except Exception:  # not in the cache
                return None
        return None

    def same_weights(self, names: Iterable[str]) -> bool | None:
        """Whether a base (known by ``names``: one of them its directory) holds the weights of the base the
        adapter was trained on (:func:`featcal.model.fingerprint.content_fingerprint`, whatever either
        directory is called); None when this cannot be told (either directory is not here)."""
        trained = self.trained_on()
        given = next((Path(n) for n in names if Path(n).is_dir()), None)
        if trained is None or given is None:
            return None
        if Path(trained).resolve() == given.resolve():
            return True
        a, b = content_fingerprint(trained), content_fingerprint(given)
        return None if a is None or b is None else a == b

    def _check_kind(self) -> None:
        kind = self.config.get("peft_type", "LORA")
        if str(kind).upper() != "LORA":
            raise LoraError(
                f"{self.what} is a {kind} adapter (peft_type); featcal merges LoRA adapters only. Merge it "
                "with peft (model.merge_and_unload(); save_pretrained) and give that directory instead."
            )
        init = self.config.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
            raise LoraError(
                f"{self.what} was initialised with init_lora_weights={init!r}, which also changes the base's "
                "weights: the adapter applies to the residual base peft made, not to the base on disk. Save it "
                "with peft's save_pretrained(..., path_initial_model_for_weight_conversion=...) (a plain LoRA "
                "of the original base), or merge it with peft (merge_and_unload) and give that directory."
            )
        for key, why in UNSUPPORTED.items():
            if self.config.get(key):
                raise LoraError(
                    f"{self.what} uses {key}={self.config[key]!r}: {why}, which featcal does not merge. Merge "
                    "it with peft (merge_and_unload) and give the merged model's directory instead."
                )

    def _parse(self, sd: Mapping[str, torch.Tensor]) -> None:
        factors: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in sd.items():
            name = re.sub(r"\.modules_to_save\.[^.]+\.", ".", key.removeprefix(PREFIX))
            m = re.fullmatch(r"(.+)\.(lora_A\.weight|lora_B\.weight|lora_B\.bias|lora_embedding_[AB])", name)
            if m:
                factors.setdefault(m.group(1), {})[m.group(2)] = t
            elif ".lora_" in name or name.endswith("lora_magnitude_vector"):
                raise LoraError(f"{self.what}: tensor {key!r} is of a LoRA variant featcal does not merge.")
            else:  # modules_to_save, trained biases, a saved embedding's base layer
                self.replaced[name.replace(".base_layer.", ".")] = t
        cfg = self.config
        for module, f in factors.items():
            embedding = "lora_embedding_A" in f
            A = f.get("lora_embedding_A" if embedding else "lora_A.weight")
            B = f.get("lora_embedding_B" if embedding else "lora_B.weight")
            if A is None or B is None or A.dim() != 2:
                raise LoraError(
                    f"{self.what}: module {module!r} needs a 2-D A and B (Linear or Embedding LoRA; conv LoRA is "
                    "not supported)."
                )
            r = _pattern_value(cfg.get("rank_pattern") or {}, module, cfg.get("r", A.shape[0]))
            if r != A.shape[0]:
                raise LoraError(f"{self.what}: module {module!r} has rank {A.shape[0]}, {CONFIG} says r={r}.")
            alpha = _pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", r))
            self.modules[module + ".weight"] = LoraModule(
                A=A,
                B=B,
                scale=lora_scale(r, alpha, bool(cfg.get("use_rslora"))),
                transpose=embedding or bool(cfg.get("fan_in_fan_out")),
                bias=f.get("lora_B.bias"),
            )

    def align(self, names: Iterable[str]) -> "LoraAdapter":
        """Rename the tensors the adapter changes onto a base's ``names`` where they differ by a
        leading module path (an adapter trained on a model's inner module, e.g. FusionBench's on
        a CLIP ``vision_model``, applied to the whole model): a name the base lacks becomes the
        one base name ending in ``.NAME``. Returns ``self``."""
        names = list(names)
        have = set(names)

        def find(n: str) -> str:
            if n in have:
                return n
            hits = [k for k in names if k.endswith("." + n)]
            return hits[0] if len(hits) == 1 else n

        self.modules = {find(n): m for n, m in self.modules.items()}
        self.replaced = {find(n): t for n, t in self.replaced.items()}
        return self

    # ---- checks against the base

    def check_base(self, shapes: Mapping[str, tuple[int, ...]], names: Iterable[str] = (), strict_name=True) -> None:
        """The adapter fits a base with these tensor ``shapes``: every tensor it changes exists with
        the right shape, every module ``target_modules`` names has its factors, and (``strict_name``)
        its ``base_model_name_or_path`` is one of the base's ``names``."""
        names = [n for n in names if n]
        same = self.same_weights(names) if strict_name and self.base_name else True
        if same is False or (same is None and names and not _same_model(self.base_name, names)):
            found = "" if same is None else f", found at {self.trained_on()!r} with other weights"
            raise LoraError(
                f"{self.what} was trained on {self.base_name!r} (base_model_name_or_path in {CONFIG}){found}, but the "
                f"base given is {names[0]!r}. Give that base; if it is the same model under another name, pass "
                "lora_any_base=True (--lora-any-base)."
            )
        for name in [*self.modules, *self.replaced]:
            if name not in shapes:
                raise LoraError(
                    f"{self.what} changes {name!r}, which the base has not: it was trained on another architecture "
                    f"(base_model_name_or_path {self.base_name!r})."
                )
        for name, m in self.modules.items():
            if m.bias is not None and name[: -len("weight")] + "bias" not in shapes:
                raise LoraError(f"{self.what}: {name!r} has a LoRA bias (lora_bias), but the base's layer has no bias.")
            rows, cols = m.B.shape[0], m.A.shape[1]
            want = (cols, rows) if m.transpose else (rows, cols)
            have = tuple(self.replaced[name].shape) if name in self.replaced else tuple(shapes[name])
            if have != want:
                raise LoraError(
                    f"{self.what}: B A for {name!r} is {want}, the base's tensor is {have}; the "
                    f"adapter was trained on another base (base_model_name_or_path {self.base_name!r})."
                )
        targets = self.config.get("target_modules")
        if targets and targets != "all-linear" and not self.config.get("layers_to_transform"):
            skip = self.config.get("exclude_modules") or ()
            under = _common_prefix(list(self.modules))  # the adapted submodule (a CLIP's vision tower, say)
            lacking = [
                n
                for n in shapes
                if n.endswith(".weight")
                and n.startswith(under)
                and _targets(targets, n[: -len(".weight")])
                and not _targets(skip, n[: -len(".weight")])
                and n not in self.modules
                and n not in self.replaced
            ]
            if lacking:
                raise LoraError(
                    f"{self.what}: target_modules {targets!r} names {lacking[0]!r} of the base (and {len(lacking) - 1} "
                    "more), but the adapter has no LoRA factors for it: it was trained on another base."
                )

    # ---- merging

    def changes(self, name: str) -> bool:
        return name in self.modules or name in self.replaced or self._bias_of(name) is not None

    def _bias_of(self, name: str) -> LoraModule | None:
        if not name.endswith(".bias"):
            return None
        m = self.modules.get(name[: -len(".bias")] + ".weight")
        return m if m is not None and m.bias is not None else None

    def tensor(self, name: str, base: torch.Tensor) -> torch.Tensor:
        """The expert's value of the base tensor ``name`` (``base`` itself where the adapter leaves it)."""
        if name in self.replaced:  # a saved whole tensor (an embedding's base_layer: its LoRA goes on top)
            base = self.replaced[name].to(base.dtype)
        m = self.modules.get(name)
        if m is not None:
            try:
                return merge_lora(base, m.A, m.B, m.scale, m.transpose)
            except LoraError as err:
                raise LoraError(f"{self.what}: {name!r}: {err}; it was trained on another base.") from None
        m = self._bias_of(name)
        if m is not None:
            return (base.float() + m.scale * m.bias.float()).to(base.dtype)
        return base

    def merged(self, base_sd: Mapping[str, torch.Tensor], names: Iterable[str] = (), strict_name=True) -> dict:
        """The expert's state dict: ``base_sd`` with the adapter merged in (``base_sd`` is not modified)."""
        self.align(base_sd).check_base({k: tuple(v.shape) for k, v in base_sd.items()}, names, strict_name)
        return {k: self.tensor(k, v) for k, v in base_sd.items()}


def _common_prefix(names: list[str]) -> str:
    """The dotted path all ``names`` start with, up to a block number (``model.layers.``), ``""`` when
    they share none."""
    if not names:
        return ""
    parts = [n.split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1 or level[0].isdigit():  # stop at the blocks' numbers: every block counts
            break
        common.append(level[0])
    return ".".join(common) + "." if common else ""


def _same_model(adapter_base: str, names: list[str]) -> bool:
    """Whether the adapter's ``base_model_name_or_path`` is one of a base's names (a path, an
    HF id, or the last path component of either)."""
    want = {adapter_base.rstrip("/"), Path(adapter_base.rstrip("/")).name}
    have = set()
    for n in names:
        n = str(n).rstrip("/")
        have |= {n, Path(n).name}
    return bool(want & have)


def base_names(path: str | os.PathLike | None = None, model=None) -> list[str]:
    """What a base model is called: its directory (and the HF id of a Hugging Face cache
    snapshot ``models--ORG--NAME/snapshots/REV``), its config's ``_name_or_path``."""
    out = []
    if path is not None:
        p = Path(path).expanduser().absolute()
        out.append(str(p))
        cfg = p / "config.json"
        if cfg.is_file():
            out.append(json.loads(cfg.read_text()).get("_name_or_path") or "")
    if model is not None:
        out.append(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        out.append(getattr(model, "name_or_path", "") or "")
    return [n for name in out if name for n in (name, _hub_id(name)) if n]


def _hub_id(name: str) -> str:
    """The HF id of a Hugging Face cache snapshot path ``.../models--ORG--NAME/snapshots/REV`` ("" otherwise):
    a base loaded from the cache is named by its path, its adapters by the id."""
    p = Path(name)
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name.removeprefix("models--").replace("--", "/")
    return ""


# ------------------------------------------------------------------ streamed


class LoraCheckpoint(Checkpoint):
    """The expert a LoRA adapter makes of a base :class:`~featcal.model.checkpoints.Checkpoint`, read
    tensor by tensor like a checkpoint: each tensor the base's, the adapter merged in on reading
    (so a streamed run merges one block at a time)."""

    def __init__(self, path: str | os.PathLike, base: Checkpoint, role: str = "expert", strict_name: bool = True):
        self.adapter = LoraAdapter(path, role).align(base.specs)
        self.adapter.check_base({n: s.shape for n, s in base.specs.items()}, base_names(base.path), strict_name)
        self.base = base
        self.path, self.role, self.config_dir = self.adapter.path, role, base.config_dir
        self.config, self.files, self.rows = base.config, base.files, {}
        self.specs = dict(base.specs)
        for name, t in self.adapter.replaced.items():
            self.specs[name] = Spec(base.specs[name].dtype, tuple(t.shape))

    def read_raw(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: self.adapter.tensor(n, t) for n, t in self.base.read_raw(names).items()}

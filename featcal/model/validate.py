"""Checks of ``calibrate``'s inputs; each error names the problem and the fix."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import nn

from featcal.model import arch

SMALL = 1 << 16  # parameters with fewer elements are checked for NaN/Inf together


def _params(model: nn.Module, role: str) -> dict[str, torch.Tensor]:
    """``{name: parameter}`` (detached), after checking there are some and all are float."""
    params = {n: p.detach() for n, p in model.named_parameters()}
    if not params:
        raise ValueError(f"{role} has no parameters.")
    bad = next((n for n, p in params.items() if not torch.is_floating_point(p)), None)
    if bad is not None:
        raise TypeError(
            f"{role}: parameter {bad!r} is not floating point ({params[bad].dtype}); "
            "FeatCal calibrates float models (quantised models must be dequantised first)."
        )
    return params


def _same_params(ref: dict, oth: dict, role: str) -> None:
    for name, p in ref.items():
        if name not in oth:
            raise ValueError(
                f"{role} has no parameter {name!r} that the merged model has; base and experts "
                "must share the merged model's architecture."
            )
        if oth[name].shape != p.shape:
            raise ValueError(
                f"{role}: parameter {name!r} has shape {tuple(oth[name].shape)}, the merged model "
                f"{tuple(p.shape)}; base and experts must share the merged model's architecture."
            )
    extra = next((n for n in oth if n not in ref), None)
    if extra is not None:
        raise ValueError(f"{role} has a parameter {extra!r} that the merged model lacks.")


def check_same_params(
    reference: nn.Module, other: nn.Module, role: str, reference_arch: Architecture | None = None
) -> None:
    """``other`` must have the merged model's parameter names and shapes, and its architecture
    where shapes cannot tell (:func:`check_same_architecture`; ``reference_arch`` as there)."""
    _same_params(dict(reference.named_parameters()), dict(other.named_parameters()), role)
    check_same_architecture(reference, other, role, reference_arch)


# Config fields that do not change what the model computes in eval mode: names and paths,
# dtypes, versions, labels, token ids, output switches, dropout and initialisation.
CONFIG_IGNORED = {
    "_name_or_path",
    "name_or_path",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "architectures",
    "_commit_hash",
    "id2label",
    "label2id",
    "finetuning_task",
    "problem_type",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "use_cache",
    "torchscript",
    "tokenizer_class",
    "task_specific_params",
    "prefix",
    "_attn_implementation",
    "attn_implementation",
    "_attn_implementation_autoset",
    "_experts_implementation",
    "use_return_dict",
    "chunk_size_feed_forward",
    "gradient_checkpointing",
}
CONFIG_IGNORED_SUFFIXES = ("_token_id", "_token_ids", "dropout", "dropout_prob", "dropout_rate", "initializer_range")
CONFIG_IGNORED_PREFIXES = ("initializer_", "_")
# Module attributes that change the computation but no parameter's shape (heads, epsilons, layouts).
MODULE_ATTRS = (
    "num_heads",
    "num_attention_heads",
    "num_key_value_heads",
    "num_key_value_groups",
    "head_dim",
    "eps",
    "variance_epsilon",
    "batch_first",
    "is_causal",
    "scale",
    "scaling",
    "approximate",
)


def _config_ignored(name: str) -> bool:
    return name in CONFIG_IGNORED or name.endswith(CONFIG_IGNORED_SUFFIXES) or name.startswith(CONFIG_IGNORED_PREFIXES)


def config_diffs(a: Mapping, b: Mapping, where: str = "") -> list[str]:
    """``field: merged value vs other value`` for every differing config field (nested configs
    by dotted name), the fields of :data:`CONFIG_IGNORED` left out."""
    out = []
    for k in sorted(set(a) | set(b), key=str):
        if _config_ignored(str(k)):
            continue
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out += config_diffs(va, vb, f"{where}{k}.")
        elif va != vb:
            out.append(f"{where}{k}: {va!r} vs {vb!r}")
    return out


def _plain(v) -> bool:
    return isinstance(v, (bool, int, float, str)) or (isinstance(v, tuple) and all(_plain(x) for x in v))


@dataclass(frozen=True)
class Architecture:
    """What :func:`check_same_architecture` compares of a model, read once: its Hugging Face
    config (``config.to_dict()``, or None) and each submodule's class and values of
    :data:`MODULE_ATTRS` (in that order)."""

    config: dict | None
    modules: dict[str, tuple[type, tuple]]


def architecture(model: nn.Module) -> Architecture:
    cfg = getattr(model, "config", None)
    modules = {name: (type(m), tuple(getattr(m, a, None) for a in MODULE_ATTRS)) for name, m in model.named_modules()}
    return Architecture(cfg.to_dict() if hasattr(cfg, "to_dict") else None, modules)


def architecture_diffs(reference: Architecture, other: Architecture) -> list[str]:
    """The config fields (both configs given) and, per submodule the other also has, the class
    and the :data:`MODULE_ATTRS` values that differ: ``what: merged value vs other value``."""
    out = []
    if reference.config is not None and other.config is not None:
        out += [f"config.{d}" for d in config_diffs(reference.config, other.config)]
    for name, (cls, values) in reference.modules.items():
        hit = other.modules.get(name)
        if hit is None:
            continue  # a module without parameters the other lacks: its parameters were checked
        other_cls, other_values = hit
        label = name or "the model"
        # same class (by name: a reloaded module is fine), or a subclass that extends it (a block
        # with a trained calibrator's module added, featcal.baselines.trained.calibrators)
        if cls.__name__ != other_cls.__name__ and not (issubclass(other_cls, cls) or issubclass(cls, other_cls)):
            out.append(f"{label}: {cls.__name__} vs {other_cls.__name__}")
            continue
        for attr, va, vb in zip(MODULE_ATTRS, values, other_values):
            if _plain(va) and va != vb:
                out.append(f"{label}.{attr}: {va!r} vs {vb!r}")
    return out


def check_same_architecture(
    reference: nn.Module, other: nn.Module, role: str, reference_arch: Architecture | None = None
) -> None:
    """What shapes cannot see: the Hugging Face configs (``.config``, fields that change the
    computation) and, for any model, each submodule's class and head counts, epsilons and
    layouts (:data:`MODULE_ATTRS`); e.g. 2 attention heads instead of 4. The error names the
    differing fields (merged vs ``role``). ``reference_arch``: :func:`architecture` of
    ``reference``, when it is already read (one model checked against several)."""
    diffs = architecture_diffs(reference_arch or architecture(reference), architecture(other))
    if diffs:
        more = f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""
        raise ValueError(
            f"{role} differs from the merged model where the weights' shapes cannot tell ("
            + "; ".join(diffs[:6])
            + more
            + "): merged vs this one. Base and experts must share the merged model's architecture "
            "(build them from one config)."
        )


def _nonfinite(name: str, role: str, blocks_path: str) -> FloatingPointError:
    where = ""
    if name.startswith(blocks_path + "."):
        idx, _, rest = name[len(blocks_path) + 1 :].partition(".")
        where = f" (block {idx}, module {rest.rsplit('.', 1)[0]})"
    return FloatingPointError(f"{role}: parameter {name!r}{where} holds NaN or Inf values.")


def _finite_params(params: dict[str, torch.Tensor], role: str, blocks_path: str) -> None:
    """Small parameters in one fused check per device and dtype (one check each costs more
    than its arithmetic), large ones one by one (no copy)."""
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name, p in params.items():
        if p.numel() == 0:
            continue
        if p.numel() < SMALL:
            groups.setdefault((p.device, p.dtype), []).append((name, p))
            continue
        # A NaN or Inf makes the sum NaN or Inf: one streaming pass (cheaper than aminmax, and
        # much cheaper than isfinite().all()); a non-finite sum of finite values (overflow) is
        # told apart by the exact check.
        total = p.sum(dtype=torch.float64 if p.dtype == torch.float64 else torch.float32)
        if not bool(torch.isfinite(total)) and not bool(torch.isfinite(p).all()):
            raise _nonfinite(name, role, blocks_path)
    for group in groups.values():
        if not bool(torch.isfinite(torch.cat([p.reshape(-1) for _, p in group])).all()):
            bad = next(n for n, p in group if not bool(torch.isfinite(p).all()))
            raise _nonfinite(bad, role, blocks_path)


def check_models(merged: nn.Module, others: list[tuple[str, nn.Module]], blocks_path_of) -> str:
    """Every check of the models in one pass over each one's parameters: float, the merged
    model's names and shapes, no NaN/Inf. ``blocks_path_of(merged)`` resolves the blocks
    (after the float checks, before the finiteness ones, which name the block); returned."""
    ref = _params(merged, "the merged model")
    named = [(role, _params(m, role)) for role, m in others]
    merged_arch = architecture(merged)
    for (role, params), (_, m) in zip(named, others):
        _same_params(ref, params, role)
        check_same_architecture(merged, m, role, merged_arch)
    path = blocks_path_of(merged)
    for role, params in [("the merged model", ref), *named]:
        _finite_params(params, role, path)
    return path


def check_tasks(experts: Mapping, data: Mapping, name: str = "calib_data") -> list[str]:
    """The tasks, once ``experts`` and ``data`` (``{task: [batch, ...]}``, called ``name`` in
    the messages) are checked to pair up: the same tasks, each with a non-empty list of batches."""
    if not experts:
        raise ValueError("experts is empty; give at least one {task: expert model}.")
    te, td = list(experts), list(data)
    if set(te) != set(td):
        only_e = sorted(set(te) - set(td))
        only_d = sorted(set(td) - set(te))
        raise ValueError(
            f"the tasks of experts and {name} differ: "
            f"only in experts {only_e}, only in {name} {only_d}; give one list of batches per expert."
        )
    for t in te:
        batches = data[t]
        if isinstance(batches, (torch.Tensor, Mapping)):
            raise TypeError(
                f"{name}[{t!r}] must be a list of batches, got a single {type(batches).__name__}; "
                "wrap it in a list or split it into batches."
            )
        if len(batches) == 0 or all(batch_len(b) == 0 for b in batches):
            raise ValueError(f"task {t!r} has no examples in {name}; give at least one non-empty batch.")
    return te


def batch_len(batch) -> int:
    """Examples in a batch: a tensor's first axis (1 for a scalar), or a dict batch's first tensor's."""
    if torch.is_tensor(batch):
        return batch.shape[0] if batch.dim() else 1
    if isinstance(batch, Mapping):
        for v in batch.values():
            if torch.is_tensor(v):
                return v.shape[0] if v.dim() else 1
        raise ValueError(f"a dict batch must hold at least one tensor; got keys {sorted(map(str, batch))}.")
    raise TypeError(
        f"a batch is a tensor (model(batch)) or a dict of tensors (model(**batch)), got {type(batch).__name__}."
    )


def check_modules(first_blocks: list[nn.Module], only: tuple[str, ...] | None, linear: bool, layernorm: bool) -> None:
    """Every name of ``FeatCalConfig.modules`` (``only``) selects a calibrated module of some
    block (the first block of each stack given): a typo would calibrate nothing, silently."""
    if only is None:
        return
    names = sorted({t.name for b in first_blocks for t in arch.block_targets(b, linear=linear, layernorm=layernorm)})
    bad = [m for m in only if not any(n.endswith(m) or n == m for n in names)]
    if bad:
        raise ValueError(
            f"modules={tuple(only)!r}: {', '.join(repr(m) for m in bad)} matches no calibrated module of a block; "
            f"the names (or name endings) to choose from: {', '.join(names) or 'none'}."
        )


def data_digest(calib_data: Mapping[str, list]) -> str:
    """A hash of every batch's tensors (shapes, dtypes and bytes): a resumed run must see the same data."""
    h = hashlib.sha256()

    def add(x):
        if torch.is_tensor(x):
            h.update(f"{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, Mapping):
            for k in sorted(x):
                h.update(str(k).encode())
                add(x[k])
        else:
            h.update(repr(x).encode())

    for task in calib_data:
        h.update(task.encode())
        for b in calib_data[task]:
            add(b)
    return h.hexdigest()

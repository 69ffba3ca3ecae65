"""Loading a spec's models offline, and the CLIP feature function the heads read.

The models were found by :mod:`featcal.zoo.spec.locate`. Weights are read only
through safetensors or ``torch.load(weights_only=True)``; models are built from
their config and loaded strictly (a missing weight is an error, never a random
init). HF CLIP vision towers and open_clip ``VisionTransformer``s are supported.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from featcal.model import lora
from featcal.model.checkpoints import read_state_dict
from featcal.zoo.spec.locate import Found
from featcal.zoo.spec.schema import ModelSpec, ZooSpec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- state dicts


def read_tensor(path: Path, key: str) -> torch.Tensor | None:
    """One entry of a checkpoint (without reading the rest when it is a single safetensors file)."""
    from safetensors import safe_open

    file = path / "model.safetensors" if path.is_dir() else path
    if file.suffix == ".safetensors" and file.is_file():
        with safe_open(str(file), "pt") as f:
            return f.get_tensor(key) if key in f.keys() else None
    return read_state_dict(path).get(key)


def load_strict(model: nn.Module, sd: Mapping[str, torch.Tensor], what: str) -> None:
    """``load_state_dict`` that names the first missing/unexpected/mis-shaped weight."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    extra = [k for k in sd if k not in own]
    bad = [k for k in own if k in sd and sd[k].shape != own[k].shape]
    if missing or extra or bad:
        detail = (
            f"missing {missing[:3]}"
            if missing
            else f"unexpected {extra[:3]}"
            if extra
            else f"{bad[0]!r} is {tuple(sd[bad[0]].shape)}, the model has {tuple(own[bad[0]].shape)}"
        )
        raise ValueError(
            f"{what}: its weights do not fit the architecture ({detail}); experts must be "
            "fine-tuned from the base, and open_clip entries need the right `arch`."
        )
    model.load_state_dict(sd, strict=True)


@contextlib.contextmanager
def no_init() -> Iterator[None]:
    """Skip random initialisation while building a model whose weights are loaded next."""
    try:
        from transformers.initialization import no_init_weights  # transformers 5.x
    except ImportError:
        try:
            from transformers.modeling_utils import no_init_weights  # 4.x
        except ImportError:
            no_init_weights = contextlib.nullcontext
    with no_init_weights():
        yield


# ----------------------------------------------------------------------------- HF CLIP

_NOT_VISION = ("text_model.", "text_projection", "visual_projection", "logit_scale")


def hf_vision_config(path: Path):
    from transformers import AutoConfig, CLIPVisionConfig

    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    cfg = getattr(cfg, "vision_config", cfg)
    if not isinstance(cfg, CLIPVisionConfig):
        raise ValueError(
            f"{path}: {type(cfg).__name__} is not a CLIP vision config; the hf format expects "
            "a CLIPModel, CLIPVisionModel or CLIPVisionModelWithProjection directory."
        )
    return cfg


def hf_vision_weights(model: nn.Module, sd: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Map a checkpoint's vision-tower keys onto ``model``'s layout.

    Checkpoints name the tower ``vision_model.*`` (CLIPModel, transformers 4.x) or
    flat (transformers 5.x CLIPVisionModel); the model may be either, too.
    """
    own = {k.removeprefix("vision_model."): k for k in model.state_dict()}
    out, unexpected = {}, []
    for k, v in sd.items():
        c = k.removeprefix("vision_model.")
        if c in own:
            out[own[c]] = v
        elif not (k.startswith(_NOT_VISION) or k.endswith("position_ids")):
            unexpected.append(k)
    if unexpected:
        raise ValueError(f"{what}: unexpected weights {unexpected[:3]}; not a CLIP vision tower of this shape.")
    return out


def load_hf_vision(paths: Mapping[str, Path], dtype: torch.dtype, device: str) -> dict[str, nn.Module]:
    """``{role: CLIPVisionModel}`` built from the first path's config, each loaded strictly."""
    from transformers import CLIPVisionModel

    roles = list(paths)
    cfg = hf_vision_config(paths[roles[0]])
    with no_init():
        template = CLIPVisionModel(cfg)
    models = {}
    base_sd = None
    for role in roles:
        model = copy.deepcopy(template)
        if lora.is_adapter_dir(paths[role]):  # a LoRA expert: merged onto the base's tower
            if base_sd is None:
                base_sd = hf_vision_weights(model, read_state_dict(paths[roles[0]]), roles[0])
            sd = lora.LoraAdapter(paths[role], role).merged(base_sd, lora.base_names(paths[roles[0]]))
        else:
            sd = hf_vision_weights(model, read_state_dict(paths[role]), role)
        load_strict(model, sd, role)
        models[role] = model.to(device=device, dtype=dtype).eval()
    return models


# ----------------------------------------------------------------------------- open_clip


class _DropRandomInitWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "initialized randomly" not in record.getMessage()


def open_clip_model(arch: str, config: str | None, quick_gelu: bool) -> nn.Module:
    """An open_clip CLIP of architecture ``arch`` with placeholder weights (always loaded over next).

    Never asks open_clip for pretrained weights: offline it would log an error
    and silently fall back to random ones.
    """
    import open_clip

    if config:
        open_clip.add_model_config(config)
    if arch not in open_clip.list_models():
        raise ValueError(
            f"open_clip has no architecture {arch!r}; give `config:` (a model-config JSON named "
            f"{arch}.json) or one of open_clip.list_models()."
        )
    root, filt = logging.getLogger(), _DropRandomInitWarning()
    root.addFilter(filt)
    try:
        return open_clip.create_model(arch, pretrained=None, force_quick_gelu=quick_gelu).eval()
    finally:
        root.removeFilter(filt)


def split_open_clip(sd: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
    """``(visual, rest)``: a checkpoint's visual-tower weights (prefix stripped) and the others
    (CLIP text tower, ``logit_scale``), whatever wrapper prefix (``model.``) they carry."""
    vis_keys = [k for k in sd if k.startswith("visual.") or ".visual." in k]
    if not vis_keys:
        return dict(sd), {}
    prefix = vis_keys[0][: vis_keys[0].index("visual.")]
    visual = {k[len(prefix) + len("visual.") :]: v for k, v in sd.items() if k.startswith(prefix + "visual.")}
    rest = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix) and not k.startswith(prefix + "visual.")}
    return visual, rest


def open_clip_quick_gelu(spec: ModelSpec) -> bool:
    if spec.pretrained:
        import open_clip

        return spec.quick_gelu or bool(open_clip.get_pretrained_cfg(spec.arch, spec.pretrained).get("quick_gelu"))
    return spec.quick_gelu


def load_open_clip_visual(
    specs: Mapping[str, ModelSpec], paths: Mapping[str, Path], dtype: torch.dtype, device: str
) -> dict[str, nn.Module]:
    """``{role: open_clip VisionTransformer}`` (``model.visual``), each loaded strictly."""
    first = specs[next(iter(specs))]
    template = open_clip_model(first.arch, first.config, open_clip_quick_gelu(first)).visual
    models = {}
    for role, spec in specs.items():
        if (spec.arch, spec.config) != (first.arch, first.config):
            raise ValueError(f"{role}: arch {spec.arch!r} differs from the base's {first.arch!r}.")
        visual = copy.deepcopy(template)
        load_strict(visual, split_open_clip(read_state_dict(paths[role]))[0], role)
        models[role] = visual.to(device=device, dtype=dtype).eval()
    return models


# ----------------------------------------------------------------------------- features


class ClipFeatures:
    """``features(model, x)``: the CLIP image representation the heads read.

    ``kind``: ``embedding`` (projected and L2-normalised, what zero-shot heads
    expect), ``projection`` (projected only) or ``pooled`` (HF pooler output).
    HF vision towers carry no projection; the base's ``visual_projection`` is
    kept here, frozen and shared by every model (FusionBench's experts fine-tune
    the tower only). open_clip's ``VisionTransformer`` projects itself.
    """

    def __init__(self, fmt: str, kind: str, projection: torch.Tensor | None = None):
        if fmt == "hf" and kind != "pooled" and projection is None:
            raise ValueError(
                "features need the base's visual_projection; it has none (use features: pooled "
                "with file heads, or a base CLIPModel directory)."
            )
        self.fmt, self.kind = fmt, kind
        self.projection = None if projection is None else projection.detach().float().cpu()  # (d_proj, d)

    def __call__(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        p = next(model.parameters())
        x = x.to(device=p.device, dtype=p.dtype)
        if self.fmt == "hf":
            out = model(pixel_values=x).pooler_output  # (n, d)
            if self.kind != "pooled":
                out = out @ self.projection.to(out.device, out.dtype).T  # (n, d_proj)
        else:
            out = model(x)  # (n, d_proj)
        return F.normalize(out, dim=-1) if self.kind == "embedding" else out


@dataclass
class ModelInfo:
    """What the heads and data need to know about the loaded models."""

    features: ClipFeatures
    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]


def _preprocessor_stats(path: Path) -> tuple[tuple | None, tuple | None]:
    cfg = path / "preprocessor_config.json" if path.is_dir() else None
    if cfg is None or not cfg.is_file():
        return None, None
    d = json.loads(cfg.read_text())
    mean, std = d.get("image_mean"), d.get("image_std")
    return (tuple(mean) if mean else None), (tuple(std) if std else None)


def load_models(
    spec: ZooSpec, found: Found, device: str = "cpu"
) -> tuple[nn.Module, dict[str, nn.Module], ModelInfo, nn.Module | None]:
    """``(base, {task: expert}, info, the spec's own merged model or None)``: every model on
    ``device`` in the spec's dtype."""
    dtype = _DTYPES[spec.dtype]
    roles = ["base"] + [f"expert:{t}" for t in spec.tasks] + (["merged"] if spec.merged else [])
    paths = {r: found.models[r] for r in roles}
    base_path = paths["base"]
    if spec.format == "hf":
        models = load_hf_vision(paths, dtype, device)
        projection = read_tensor(base_path, "visual_projection.weight")
        image_size = int(hf_vision_config(base_path).image_size)
        mean, std = _preprocessor_stats(base_path)
    else:
        specs = {"base": spec.base, **{f"expert:{t}": m for t, m in spec.experts.items()}}
        specs.update({"merged": spec.merged} if spec.merged else {})
        models = load_open_clip_visual(specs, paths, dtype, device)
        projection = None
        size = models["base"].image_size
        image_size = int(size[0] if isinstance(size, (tuple, list)) else size)
        pcfg = getattr(models["base"], "preprocess_cfg", None) or {}
        mean, std = pcfg.get("mean"), pcfg.get("std")
    pre = spec.preprocess
    info = ModelInfo(
        features=ClipFeatures(spec.format, spec.features, projection),
        image_size=pre.image_size or image_size,
        mean=tuple(pre.mean or mean or CLIP_MEAN),
        std=tuple(pre.std or std or CLIP_STD),
    )
    return models["base"], {t: models[f"expert:{t}"] for t in spec.tasks}, info, models.get("merged")

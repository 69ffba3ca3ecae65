"""Frozen per-task heads: CLIP zero-shot heads, or linear heads read from a file.

A zero-shot head turns each class name into text prompts (``"a photo of a
{}."``), encodes them with the *base* CLIP text tower, and uses, for class k,

    t_k = normalize( mean_j normalize(text_embed(template_j(class_k))) )

as row k of an ``nn.Linear(d, n_classes, bias=False)`` (times CLIP's
``exp(logit_scale)`` when asked), applied to the normalised image embedding:
logits are (scaled) cosine similarities, as in CLIP.

:func:`zero_shot_weights` is the pure part (any ``encode_text``); the text
encoders wrap an HF ``CLIPModel`` or an open_clip ``CLIP``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from featcal.zoo.load import classnames, loaders
from featcal.zoo.spec.locate import Found
from featcal.zoo.spec.schema import ModelSpec, ZooSpec

TextEncoder = Callable[[list[str]], torch.Tensor]  # texts -> (n_texts, d) text embeddings
DEFAULT_TEMPLATES = ("a photo of a {}.",)


@torch.no_grad()
def zero_shot_weights(
    encode_text: TextEncoder, classes: Sequence[str], templates: Sequence[str], batch_size: int = 256
) -> torch.Tensor:
    """Unit-norm class embeddings ``(n_classes, d)``: per class, the renormalised mean over
    templates of the normalised text embeddings."""
    if not classes or not templates:
        raise ValueError("zero-shot weights need at least one class and one template.")
    texts = [t.format(c) for c in classes for t in templates]
    emb = torch.cat(
        [encode_text(texts[i : i + batch_size]).float().cpu() for i in range(0, len(texts), batch_size)]
    )  # (n_classes * n_templates, d)
    emb = F.normalize(emb, dim=-1).view(len(classes), len(templates), -1)  # (n_classes, n_templates, d)
    return F.normalize(emb.mean(1), dim=-1)  # (n_classes, d)


def linear_head(weight: torch.Tensor, bias: torch.Tensor | None = None, scale: float = 1.0) -> nn.Linear:
    """A frozen ``nn.Linear`` with ``weight * scale`` (``(n_classes, d)``) and ``bias * scale``."""
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        head.weight.copy_(weight.float() * scale)
        if bias is not None:
            head.bias.copy_(bias.float() * scale)
    return head.requires_grad_(False).eval()


class HFTextEncoder:
    """Text embeddings ``text_projection(text_model(ids).pooler_output)`` of an HF ``CLIPModel``."""

    def __init__(self, clip: nn.Module, tokenizer, device: str | torch.device = "cpu"):
        self.clip, self.tokenizer, self.device = clip, tokenizer, torch.device(device)
        self.max_length = int(clip.config.text_config.max_position_embeddings)

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        tok = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        out = self.clip.text_model(
            input_ids=tok["input_ids"].to(self.device), attention_mask=tok["attention_mask"].to(self.device)
        )
        return self.clip.text_projection(out.pooler_output)  # (n, d_proj)


class OpenClipTextEncoder:
    """Text embeddings ``model.encode_text(tokens)`` of an open_clip ``CLIP``."""

    def __init__(self, model: nn.Module, tokenizer, device: str | torch.device = "cpu"):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> torch.Tensor:
        return self.model.encode_text(self.tokenizer(texts).to(self.device))


def load_hf_text_encoder(path: Path, device: str = "cpu") -> tuple[HFTextEncoder, float]:
    """``(encoder, exp(logit_scale))`` from a full HF ``CLIPModel`` directory (and its tokenizer)."""
    from transformers import AutoConfig, AutoTokenizer, CLIPModel

    cfg = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if not hasattr(cfg, "text_config"):
        raise ValueError(
            f"{path}: a {type(cfg).__name__} has no text tower; zero-shot heads need a full "
            "CLIPModel (give heads.text_model, or use file heads)."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{path}: no usable CLIP tokenizer files (vocab.json/merges.txt or tokenizer.json): {err}"
        ) from None
    with loaders.no_init():
        clip = CLIPModel(cfg)
    loaders.load_strict(clip, loaders.read_state_dict(path), f"text model {path}")
    clip = clip.to(device).eval()
    return HFTextEncoder(clip, tokenizer, device), float(clip.logit_scale.detach().exp())


def load_open_clip_text_encoder(spec: ModelSpec, path: Path, device: str = "cpu") -> tuple[OpenClipTextEncoder, float]:
    """``(encoder, exp(logit_scale))`` from a full open_clip checkpoint (visual and text towers)."""
    import open_clip

    model = loaders.open_clip_model(spec.arch, spec.config, loaders.open_clip_quick_gelu(spec))
    visual, rest = loaders.split_open_clip(loaders.read_state_dict(path))
    if "token_embedding.weight" not in rest:
        raise ValueError(
            f"{path}: holds no open_clip text tower; zero-shot heads need a full CLIP checkpoint "
            "(give heads.text_model, or use file heads)."
        )
    sd = {**{f"visual.{k}": v for k, v in visual.items()}, **rest}
    loaders.load_strict(model, sd, f"text model {path}")
    model = model.to(device).eval()
    encoder = OpenClipTextEncoder(model, open_clip.get_tokenizer(spec.arch), device)
    return encoder, float(model.logit_scale.detach().exp())


def load_file_heads(path: Path, tasks: Sequence[str]) -> dict[str, nn.Linear]:
    """``{task: nn.Linear}`` from a safetensors file holding ``<task>.weight`` (``(n_classes, d)``)
    and, optionally, ``<task>.bias``."""
    from safetensors.torch import load_file

    sd = load_file(str(path), device="cpu")
    absent = [t for t in tasks if f"{t}.weight" not in sd]
    if absent:
        raise ValueError(
            f"heads file {path}: no head for task(s) {absent}; it has "
            f"{sorted({k.rsplit('.', 1)[0] for k in sd})} (keys <task>.weight, <task>.bias)."
        )
    return {t: linear_head(sd[f"{t}.weight"], sd.get(f"{t}.bias")) for t in tasks}


def task_classes(spec: ZooSpec, task: str) -> list[str] | None:
    """The spec's class names for ``task``, else the built-in ones, else ``None``."""
    if task in spec.heads.classes:
        return list(spec.heads.classes[task])
    if classnames.canonical_task(task) in classnames.TASKS:
        return classnames.classes_and_templates(task)[0]
    return None


def task_templates(spec: ZooSpec, task: str) -> list[str]:
    if task in spec.heads.templates:
        return list(spec.heads.templates[task])
    if classnames.canonical_task(task) in classnames.TASKS:
        return classnames.classes_and_templates(task)[1]
    return list(DEFAULT_TEMPLATES)


def build_heads(
    spec: ZooSpec, found: Found, device: str = "cpu"
) -> tuple[dict[str, nn.Linear], dict[str, list[str] | None]]:
    """``({task: frozen head}, {task: class names or None})`` as the spec asks."""
    classes = {t: task_classes(spec, t) for t in spec.tasks}
    if spec.heads.type == "file":
        return load_file_heads(found.heads_file, spec.tasks), classes
    text_spec = spec.heads.text_model or spec.base
    path = found.models["text_model" if spec.heads.text_model else "base"]
    if spec.format == "hf":
        encode, scale = load_hf_text_encoder(path, device)
    else:
        encode, scale = load_open_clip_text_encoder(text_spec, path, device)
    heads = {}
    for t in spec.tasks:
        w = zero_shot_weights(encode, classes[t], task_templates(spec, t))  # (n_classes, d)
        heads[t] = linear_head(w, scale=scale if spec.heads.logit_scale else 1.0)
    del encode  # free the text tower
    return heads, classes


def check_dims(heads: Mapping[str, nn.Linear], feature_dim: int) -> None:
    """Every head must read ``feature_dim``-wide features."""
    bad = {t: h.in_features for t, h in heads.items() if h.in_features != feature_dim}
    if bad:
        raise ValueError(
            f"heads read {bad} features but the models give {feature_dim}; check heads.path "
            "and `features` (embedding, projection or pooled)."
        )

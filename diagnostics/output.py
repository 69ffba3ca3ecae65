"""Output-side diagnostics: how far the model's final features and class
predictions are from each expert's (paper section 3).

- :func:`expert_cosine`: per example, ``cos(phi(M)(x), phi(M_i)(x))`` of the final
  features ``phi`` on task i's data;
- :func:`output_drift`: per task, ``KL(p_i || p)`` of the class probabilities
  (expert i's ``p_i``, the model's ``p``, both through task i's frozen head), top-1
  agreement with the expert, and accuracy of both where labels exist.

Both cost one full forward of the model and of the expert per batch. Tables
are tidy with ``block = -1`` (:data:`~diagnostics.similarity.WHOLE`, the whole model).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pandas as pd
import torch
from torch import nn

from diagnostics.decomposition import COLUMNS
from diagnostics.similarity import WHOLE, cosine_rows, pool_examples
from featcal.model.modes import eval_mode
from featcal.model.streams import call_model, device_of, to_device
from featcal.util.metrics import kl_rows

FeaturesFn = Callable[[nn.Module, Any], torch.Tensor]


# ----------------------------------------------------------------------------- pure maths


def top1_agreement(logits_exp: torch.Tensor, logits_mod: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: the model's top-1 class equals the expert's."""
    return logits_exp.argmax(-1) == logits_mod.argmax(-1)


# ----------------------------------------------------------------------------- final features


def default_features(model: nn.Module, batch: Any) -> torch.Tensor:
    """The model's final feature per example, ``(B, d)``.

    Tried in order on the model's output: ``image_embeds`` (HF
    ``CLIPVisionModelWithProjection``), ``pooler_output`` (HF ``CLIPVisionModel``: the
    post-LayerNorm class token), ``last_hidden_state`` mean-pooled over non-padding
    tokens. A plain tensor output (open_clip ``VisionTransformer``: the projected
    embedding) is used as it is, mean-pooled if it has a token axis; of a tuple, the
    first element.
    """
    out = call_model(model, to_device(batch, device_of(model)))
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    for key in ("image_embeds", "pooler_output", "last_hidden_state"):
        val = getattr(out, key, None)
        if val is not None:
            out = val
            break
    if isinstance(out, (tuple, list)):
        out = out[0]
    if not torch.is_tensor(out):
        raise TypeError(f"no feature tensor in the model's output ({type(out).__name__}); pass features_fn=...")
    return pool_examples(out, "all", mask) if out.dim() == 3 else out.reshape(out.shape[0], -1)


@torch.no_grad()
def expert_cosine(
    model: nn.Module, experts: Mapping[str, nn.Module], data: Mapping[str, list], features_fn: FeaturesFn | None = None
) -> pd.DataFrame:
    """Per example, the cosine of the model's and expert i's final features on task i's data.

    ``value = cos(phi(M)(x), phi(M_i)(x))`` with ``phi = features_fn(model, batch) -> (B, d)``
    (default :func:`default_features`; with a zoo, pass ``zoo.features``, the representation
    its heads read). Examples are numbered 0.. in the order of the task's batches.

    Returns a tidy DataFrame: ``task``, ``block`` (always -1), ``example``, ``metric``
    (``expert_cosine``), ``value``.
    """
    feats = features_fn or default_features
    frames = []
    with eval_mode(model, *experts.values()):
        for task, batches in data.items():
            start = 0
            for batch in batches:
                f_mod = feats(model, batch)  # (B, d)
                f_exp = feats(experts[task], batch)  # (B, d)
                cos = cosine_rows(f_mod.reshape(len(f_mod), -1), f_exp.reshape(len(f_exp), -1)).cpu()
                frames.append(
                    pd.DataFrame(
                        {
                            "task": task,
                            "block": WHOLE,
                            "example": range(start, start + len(cos)),
                            "metric": "expert_cosine",
                            "value": cos.numpy(),
                        }
                    )
                )
                start += len(cos)
    if not frames:
        return pd.DataFrame(columns=["task", "block", "example", "metric", "value"])
    return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------- class outputs


@torch.no_grad()
def output_drift(
    model: nn.Module,
    zoo,
    split: str = "test",
    max_per_task: int | None = None,
    batch_size: int = 256,
    tasks: list[str] | None = None,
) -> pd.DataFrame:
    """Output drift of ``model`` from each expert of ``zoo`` on a split, through the zoo's
    frozen heads (``zoo.logits``).

    Metrics per task (means over the split's first ``max_per_task`` examples):

    - ``kl``: ``KL(p_i || p)`` in nats, expert i's class probabilities against the model's;
    - ``agreement``: percent of examples whose top-1 class matches the expert's;
    - ``accuracy`` and ``expert_accuracy``: percent correct (as :func:`featcal.evaluate`),
      only when the split has labels;
    - ``examples``: how many examples were scored.

    Returns a tidy DataFrame: ``task``, ``block`` (always -1), ``metric``, ``value``.
    """
    rows = []
    with eval_mode(model, *zoo.experts.values()):
        for task in tasks or zoo.tasks:
            x, y = zoo.split(task, split)
            x, y = x[:max_per_task], (None if y is None else y[:max_per_task])  # [:None] keeps all
            n = len(x)
            kl = agree = right = right_e = 0.0
            for j, xb in enumerate(x.split(batch_size)):
                lm = zoo.logits(model, task, xb).cpu()  # (b, C)
                le = zoo.logits(zoo.experts[task], task, xb).cpu()  # (b, C)
                kl += float(kl_rows(le, lm).sum())
                agree += float(top1_agreement(le, lm).sum())
                if y is not None:
                    yb = y[j * batch_size : (j + 1) * batch_size]  # (b,)
                    right += float((lm.argmax(-1) == yb).sum())
                    right_e += float((le.argmax(-1) == yb).sum())

            def mean(total, scale=1.0):
                return scale * total / n if n else float("nan")

            rows += [(task, WHOLE, "kl", mean(kl)), (task, WHOLE, "agreement", mean(agree, 100.0))]
            if y is not None:
                rows += [
                    (task, WHOLE, "accuracy", mean(right, 100.0)),
                    (task, WHOLE, "expert_accuracy", mean(right_e, 100.0)),
                ]
            rows.append((task, WHOLE, "examples", float(n)))
    return pd.DataFrame(rows, columns=COLUMNS)

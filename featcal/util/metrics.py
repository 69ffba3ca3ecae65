"""Distances between class predictions, shared by the sweep's scores and the diagnostics."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_rows(logits_ref: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(p_ref || p)`` per example, in nats: ``(n, C)``, ``(n, C)`` -> ``(n,)`` float64,
    with ``p = softmax(logits)`` (computed in float64 from log-softmaxes, so 0 for equal logits)."""
    log_pr = F.log_softmax(logits_ref.double(), dim=-1)  # (n, C)
    log_p = F.log_softmax(logits.double(), dim=-1)  # (n, C)
    return (log_pr.exp() * (log_pr - log_p)).sum(-1)

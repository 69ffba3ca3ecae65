"""ProbSurgery (Wei et al., "Representation Surgery in Model Merging with Probabilistic Modeling",
ICML 2025) as its authors run it (github 1998v7/ProbSurgery, ``code/src_ours``, ``code/run``).

Representation Surgery models the representation bias of the merged model's final embedding
``z`` with a deterministic MLP; ProbSurgery models it as a Gaussian per example and subtracts a
sample of it. Per task, one module on the final embedding (where Surgery's is:
:func:`featcal.baselines.trained.surgery.final_embedding`), hidden width ``h``, no biases::

    a        = ReLU(W_in z)              W_in (h x d): kaiming-uniform, a = sqrt 5 (uniform in +-1/sqrt d)
    mu       = W_mu a                    W_mu (d x h): zero
    log s^2  = W_s a                     W_s (d x h): zero (so s = 1 at the start)
    training:   z' = z - (mu + s * eps),  eps ~ N(0, I), one draw per example and step
    inference:  z' = z - mu               (the mean; what the authors evaluate)

Loss per minibatch (expert i's final embedding ``z^(i)`` the target):
``L1(z', z^(i)) + beta KL``, ``KL = mean over examples of -1/2 sum_j (1 + log s_j^2 - mu_j^2 - s_j^2)``
(``KL(N(mu, s^2) || N(0, I))``), ``beta = 1e-4``. The merged model and the experts stay frozen.

The authors' schedule (``run.py``: ``--iter_number 50``; ``run_ProbSurgery.py``): 50 iterations
of 100 minibatches of 16 per task, i.e. **5000 Adam steps per task** (lr 1e-3, betas (0.9,
0.999), no weight decay), ``h = 128`` (``--hidden_layer``). Numbers per task: ``3 d h`` trained
and stored (196,608 on ViT-B/32), of which inference reads ``2 d h``.

The training is Surgery's (:func:`featcal.baselines.trained.surgery._train`: expert i's and the
merged model's final embeddings computed once, each step the module alone on a seeded minibatch),
each step through :func:`sampled_output`; the noise comes from its own generator seeded with
``seed + 1``, drawn on the CPU (the same noise on every device). docs/comparison.md sets ours
beside the authors' point by point.

The authors train on the unlabelled test inputs themselves; featcal trains on the calibration data
given, so the module must generalise to inputs it never saw. On an LLM (the module on every token
of the final norm's output) it did not: on the smollm2 zoo, 16 sequences per task, it scored as
the experts on those 16 examples and below Task Arithmetic on test, and still below it with 64
sequences or 500 steps (docs/comparison.md, the LLM zoo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from featcal.baselines.trained.calibrators import TaskCalibrated
from featcal.baselines.trained.modules import linear_init
from featcal.baselines.trained.surgery import SurgeryOptions, run_tasks
from featcal.util.options import option

# ----------------------------------------------------------------------------- maths


def bias_moments(
    z: torch.Tensor, W_in: torch.Tensor, W_mu: torch.Tensor, W_s: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mu, log s^2)`` of the representation bias for every row ``z`` of ``z`` (``(..., d)``):
    ``a = ReLU(W_in z)``, ``mu = W_mu a``, ``log s^2 = W_s a``."""
    a = F.relu(z @ W_in.T)  # (..., h)
    return a @ W_mu.T, a @ W_s.T  # (..., d) each


def reparameterised(mu: torch.Tensor, log_var: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """A sample of ``N(mu, s^2)`` from the standard normal draw ``eps``: ``mu + exp(log s^2 / 2) eps``
    (differentiable in ``mu`` and ``log s^2``)."""
    return mu + torch.exp(0.5 * log_var) * eps


def kl_to_standard_normal(mu: torch.Tensor, log_var: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``KL(N(mu, s^2) || N(0, I))`` per row, ``-1/2 sum_j (1 + log s_j^2 - mu_j^2 - s_j^2)``,
    averaged over the rows (the examples; with a token axis, the tokens whose ``mask`` is 1)."""
    per_row = -0.5 * (1 + log_var - mu.pow(2) - log_var.exp()).sum(-1)
    if mask is not None and per_row.dim() == 2:
        return per_row[mask.to(per_row.device).bool()].mean()
    return per_row.mean()


# ----------------------------------------------------------------------------- the module


class ProbSurgeryAdapter(nn.Module):
    """ProbSurgery's module on ``d``-wide embeddings, hidden width ``h``: ``forward`` is the
    inference (``z - mu``), :meth:`sampled` the training's (``z - (mu + s eps)`` and the KL term).
    ``W_in`` is drawn as an ``nn.Linear`` weight (uniform in +-1/sqrt(d)) from ``generator``;
    ``W_mu`` and ``W_s`` start at zero."""

    def __init__(self, d: int, h: int, generator: torch.Generator, dtype=torch.float32, device=None):
        super().__init__()
        self.W_in = linear_init(h, d, generator, dtype, device)  # (h, d)
        self.W_mu = nn.Parameter(torch.zeros(d, h, dtype=dtype, device=device))  # (d, h)
        self.W_s = nn.Parameter(torch.zeros(d, h, dtype=dtype, device=device))  # (d, h)

    def moments(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, log s^2)`` for every row of ``z`` (:func:`bias_moments`)."""
        return bias_moments(z, *(w.to(z.dtype) for w in (self.W_in, self.W_mu, self.W_s)))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z - self.moments(z)[0]

    def sampled(self, z: torch.Tensor, eps: torch.Tensor, mask=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(z - (mu + s eps), KL)``: the training's corrected embedding for the draw ``eps``
        (shaped as ``z``) and :func:`kl_to_standard_normal`."""
        mu, log_var = self.moments(z)
        return z - reparameterised(mu, log_var, eps.to(z)), kl_to_standard_normal(mu, log_var, mask)


def sampled_output(kl_weight: float, generator: torch.Generator):
    """The training output of :func:`featcal.baselines.trained.surgery._train` for ProbSurgery:
    ``train_out(module, z, mask) -> (z - (mu + s eps), kl_weight * KL)``, ``eps`` drawn from
    ``generator`` (on the CPU, float32) for each call."""

    def train_out(module: ProbSurgeryAdapter, z: torch.Tensor, mask) -> tuple[torch.Tensor, torch.Tensor]:
        eps = torch.randn(z.shape, generator=generator, dtype=torch.float32)
        out, kl = module.sampled(z, eps, mask)
        return out, kl_weight * kl.float()

    return train_out


# ----------------------------------------------------------------------------- the method


@dataclass(frozen=True)
class ProbSurgeryOptions(SurgeryOptions):
    """ProbSurgery's options (:func:`probsurgery`): Surgery's (:class:`SurgeryOptions`: where the
    final embedding is, Adam at lr 1e-3, minibatches of 16) with the authors' defaults: hidden
    width 128 (``rank``), 5000 ``steps`` per task, KL weight 1e-4."""

    rank: int = option(128, "hidden width h of the module (the authors' --hidden_layer)")
    steps: int = option(5000, "Adam steps per task (the authors': 50 iterations of 100 minibatches)")
    seed: int = option(0, "seed of the modules' start, of the minibatch order and (seed + 1) of the noise")
    kl_weight: float = option(1e-4, "weight beta of the KL term (>= 0; 0: no regulariser)")

    def check(self, owner: str) -> None:
        """:meth:`TrainOptions.check`, and ``kl_weight`` a finite number >= 0."""
        super().check(owner)
        if not (isinstance(self.kl_weight, (int, float)) and math.isfinite(self.kl_weight) and self.kl_weight >= 0):
            raise ValueError(f"{owner}: kl_weight must be a finite number >= 0; got {self.kl_weight!r}.")

    def settings(self) -> dict:
        return {**super().settings(), "kl_weight": self.kl_weight}


def probsurgery(
    merged: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    options: ProbSurgeryOptions = ProbSurgeryOptions(),
) -> TaskCalibrated:
    """ProbSurgery: per task, one probabilistic module on the final embedding, trained on
    ``L1(z - (mu + s eps), z^(i)) + beta KL`` and used at inference as ``z - mu`` (module
    docstring). Adds ``3 d_out h`` numbers per task."""
    opts = options

    def make(d, d_out, n_blocks, emb, o, gen, device):
        return {"embedding": ProbSurgeryAdapter(d_out, o.rank, gen, device=device)}

    noise = torch.Generator().manual_seed(opts.seed + 1)
    return run_tasks("probsurgery", merged, experts, calib_data, opts, make, sampled_output(opts.kl_weight, noise))

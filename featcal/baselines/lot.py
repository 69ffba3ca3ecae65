"""LOT Merging (Sun et al., NeurIPS 2025, arXiv 2505.23859): layer-wise optimal task vectors.

Every layer's merged task vector ``tau = theta - theta_0`` minimises the *feature drift* between
the merged layer and each expert's, on the inputs expert k's own layer receives on task k's data
(a few unlabeled examples per task), ``sum_k ||f(x; theta_0 + tau) - f(x; theta_0 + tau_k)||^2``
summed over x in task k, a convex quadratic with a closed form per layer kind:

- a Linear (``y = W x``): ``tau_W = (sum_k tau_k G_k) (sum_k G_k)^+`` with ``G_k = E_k[x x^T]``
  (:func:`lot_linear`), a pseudo-inverse: directions no task's inputs reach keep the base's
  weight (``tau = 0`` there), where RegMean's ridge would pull them to 0;
- a norm (``y = gamma * z + beta``, ``z`` the normalised input; an RMS norm's ``z = x / rms(x)``):
  per channel j, ``tau_gamma[j] = sum_k e_k[j] tau_k[j] / sum_k e_k[j]`` with ``e_k = E_k[z*z]``
  (:func:`lot_norm_scale`), each task's scale weighted by how much its normalised feature carries;
- everything else (Linear biases, norm shifts, embeddings, the stem and the heads outside the
  blocks): the mean of the task vectors, i.e. the experts' mean.

The layers are solved independently (each expert's features come from its own forward pass, not the
merged model's), every stack of an encoder-decoder in turn. Expectations are means over tokens,
padding excluded, per task (a task with longer sequences weighs no more). The statistics are
those RegMean collects (:func:`featcal.baselines.regmean.block_input_stats`). Nothing passed in is
modified; the result is a new model in eval mode.

Usage::

    merged = featcal.merge_with_data("lot", base=zoo.base, experts=zoo.experts, calib_data=zoo.calib_data(16))
"""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn

from featcal.baselines.merging import average
from featcal.baselines.regmean import block_input_stats, check_calib
from featcal.model.arch import LINEAR, block_targets, get_params, resolve_blocks, resolve_stacks, set_params
from featcal.model.capture import target_site
from featcal.model.modes import eval_mode
from featcal.model.streams import catch_block_inputs, device_of
from featcal.util.progress import bar

# Eigenvalues of sum_k G_k below RTOL times the largest count as zero in the pseudo-inverse.
# torch.linalg.pinv's own cut for a float32 d x d matrix is d * 1.2e-7 (9e-5 at d = 768): 1e-5
# keeps what float32 features resolve and drops the directions they do not.
RTOL = 1e-5

# ---------------------------------------------------------------------------- the maths


def gram_pinv(grams: list[torch.Tensor], rtol: float = RTOL) -> torch.Tensor:
    """``(sum_k G_k)^+`` (d x d), the Moore-Penrose pseudo-inverse of the summed Gram matrices
    (symmetric positive semi-definite), eigenvalues below ``rtol`` times the largest taken as 0."""
    return torch.linalg.pinv(sum(grams), rtol=rtol, hermitian=True)


def lot_linear(deltas: list[torch.Tensor], grams: list[torch.Tensor], pinv: torch.Tensor) -> torch.Tensor:
    """The merged Linear task vector ``tau = (sum_k tau_k G_k) (sum_k G_k)^+`` (out x in), the
    minimiser of ``sum_k E_k ||(tau - tau_k) x||^2`` of least norm: ``deltas`` the experts' task
    vectors ``tau_k = W_k - W_0`` (out x in), ``grams`` ``G_k = E_k[x x^T]`` over task k's
    inputs, ``pinv`` ``(sum_k G_k)^+`` (:func:`gram_pinv`, shared by the q/k/v that read one
    input). In the Grams' dtype."""
    B = sum(D.to(G.dtype) @ G for D, G in zip(deltas, grams))  # (o, d)
    return B @ pinv


def lot_norm_scale(deltas: list[torch.Tensor], energies: list[torch.Tensor]) -> torch.Tensor:
    """The merged norm-scale task vector, per channel j
    ``tau[j] = sum_k e_k[j] tau_k[j] / sum_k e_k[j]``: the minimiser of
    ``sum_k E_k ||(tau - tau_k) * z||^2`` for ``deltas`` ``tau_k = gamma_k - gamma_0`` and
    ``energies`` ``e_k = E_k[z * z]`` (``z`` the normalised input of task k). A channel no task's
    input reaches (``sum_k e_k[j] = 0``) takes the plain mean. In the energies' dtype."""
    E = torch.stack(energies)  # (K, d)
    D = torch.stack([d.to(E.dtype) for d in deltas])  # (K, d)
    total = E.sum(0)
    weighted = (E * D).sum(0) / total.clamp(min=torch.finfo(E.dtype).tiny)
    return torch.where(total > 0, weighted, D.mean(0))


# ---------------------------------------------------------------------------- the plumbing


def _check(experts: Mapping[str, nn.Module], calib_data: Mapping[str, list], rtol: float) -> None:
    check_calib(experts, calib_data, "LOT Merging")
    if not 0.0 < rtol < 1.0:
        raise ValueError(f"lot: rtol must be in (0, 1) (the pseudo-inverse's relative cut), got {rtol}.")


def _merge_block(blk, base_blk, exp_blks: dict, stats: dict, rtol: float, what: str) -> None:
    """Solve every Linear weight and norm scale of ``blk`` from the experts' statistics ``stats``
    (``{task: {site: G or e}}``) and write them into ``blk`` (biases and shifts stay as they are)."""
    tasks = list(exp_blks)
    pinvs: dict[int, torch.Tensor] = {}  # one pseudo-inverse per distinct input (q/k/v share one)
    new = []
    for tg in block_targets(blk):
        site = target_site(tg)
        S = [stats[t][site] for t in tasks]
        W0 = get_params(base_blk, tg)[0].to(S[0].device, torch.float64)
        D = [get_params(exp_blks[t], tg)[0].to(S[0].device, torch.float64) - W0 for t in tasks]
        if tg.kind == LINEAR:
            key = id(S[0])
            if key not in pinvs:
                pinvs[key] = gram_pinv(S, rtol)
            tau = lot_linear(D, S, pinvs[key])
        else:
            tau = lot_norm_scale(D, S)
        if not bool(torch.isfinite(tau).all()):
            raise FloatingPointError(f"lot: {what} {tg.name}: the solve gave non-finite values; check calib_data.")
        new.append((tg, W0 + tau))
    for tg, W in new:
        set_params(blk, tg, W.to(device_of(blk)), None)


@torch.no_grad()
def lot(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    rtol: float = RTOL,
    blocks: str | None = None,
    progress: bool = True,
) -> nn.Module:
    """LOT Merging: every Linear weight and norm scale in the blocks from the features each expert
    computes on its own task's ``calib_data`` batches (16 to 64 examples per task in the paper),
    every other entry the experts' mean. ``rtol``: eigenvalues of the summed input Gram below
    ``rtol`` times its largest count as zero in the pseudo-inverse. ``blocks``: the dotted path of
    the blocks when featcal does not find them (an encoder-decoder without it: both stacks)."""
    _check(experts, calib_data, rtol)
    tasks = list(experts)
    model = copy.deepcopy(base)
    model.load_state_dict(average(base.state_dict(), {t: m.state_dict() for t, m in experts.items()}))
    model.eval()
    with eval_mode(base, *experts.values()):
        for path, blks in resolve_stacks(model, blocks):
            base_blks = resolve_blocks(base, path)[1]
            exp_blks = {t: resolve_blocks(experts[t], path)[1] for t in tasks}
            # Each expert's own stream: its stem on its task's batches, then its own blocks.
            calls = {t: [catch_block_inputs(experts[t], exp_blks[t][0], b) for b in calib_data[t]] for t in tasks}
            for idx in bar(range(len(blks)), desc=f"lot {path}", unit="block", show=progress):
                stats = {
                    t: block_input_stats(
                        exp_blks[t][idx], block_targets(exp_blks[t][idx]), calls[t], device_of(experts[t]), True
                    )
                    for t in tasks
                }
                blk_exps = {t: exp_blks[t][idx] for t in tasks}
                _merge_block(blks[idx], base_blks[idx], blk_exps, stats, rtol, f"{path} block {idx}")
    return model

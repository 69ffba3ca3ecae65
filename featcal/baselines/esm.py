"""ESM, Essential Subspace Merging (CVPR 2026, arXiv 2602.20208): each task's update to a Linear
kept on the few output directions along which it actually moves that task's features.

For a Linear of the blocks with task vector ``D_i = W_i - W_0`` (out x in) and ``X_i`` the rows
(tokens) expert i's own Linear reads on task i's unlabeled examples (32 a task in the paper), the
*essential subspace decomposition* (ESD) is the PCA of the output displacement
``dO_i = X_i D_i^T``: the eigenvectors ``U_i`` of ``D_i G_i D_i^T`` (``G_i = E[x x^T]``, the
Gram of the inputs; :func:`essential_basis`), ordered by eigenvalue ``lam``. Each task keeps its
top ``k = out // T`` directions, ``U_i[:, :k]`` and ``V_i = U_i[:, :k]^T D_i``, both weighted by
``e = (lam / mean lam)^0.15`` normalised to mean 1 (:func:`task_components`). The T tasks'
factors are concatenated and each replaced by its polar factor times its mean singular value
(:func:`flat_polar`): ``D = flat_polar(U_cat) flat_polar(V_cat)`` (:func:`esm_task_vector`).
Every Linear of one kind (``mlp.fc1`` of every block, ...) is then rescaled by
``(||D_l|| / mean_l ||D_l||)^2`` (:func:`layer_balance`), and ``theta = theta_0 + scale * D``.

``recipe`` picks the authors' two scripts. ``"vit"`` (their CLIP ViT code) also
weights each task by ``(||D_i|| / mean_j ||D_j||)^2`` and each input column of ``V_cat`` by
``(c_j / mean c)^2`` (``c_j`` its norm), and doubles ``D``; ``"roberta"`` (their RoBERTa code)
does neither. ``"auto"`` (the default) is the ViT script except on a decoder-only language model
(a Llama, a GPT-2: :func:`is_decoder_lm`), where it is the RoBERTa script: on the LLM zoo
``smollm2`` (30 blocks, LoRA experts) the ViT script's doubling and squared inter-column scaling
make each Linear's update 2 to 8 times Task Arithmetic's, and its squared inter-layer scaling
widens that to up to 59 times in some blocks: at scale 1 (and 0.5, 0.25) the merged model is
broken, and only a scale near 0.1, which the authors' labelled validation search would have to
find, brings it back to TA's level; the RoBERTa script stays near TA's size there and, at scale
1, scores 29.5 against TA's 31.0 (the ViT script: 9.0, the base's level; docs/comparison.md, the
LLM zoo). Asked for explicitly on such a model, ``"vit"`` runs
and warns.

Every other entry is merged as the authors do: 2-D entries outside the blocks'
Linears (embeddings, projections, heads) by TSV (:func:`featcal.baselines.merging.tsv`), the rest
(biases, norms, convolutions) by the experts' mean; ``scale`` multiplies all of it (the authors
search it on labelled validation data: [0, 2] for ViT, [0, 5] for RoBERTa; 1.0 before it).

With the ViT recipe an ``nn.MultiheadAttention`` (open_clip, the authors' model) is merged as their
code does: its packed q/k/v decomposed as one matrix, its ``out_proj`` (whose input their hooks never
see) by TSV, balanced across the blocks like the rest. Differences from the authors' code
(docs/comparison.md): elsewhere every Linear of the blocks is decomposed on its own (HF's separate
q/k/v and output projections, as their RoBERTa code does); the basis is exact (their SVD pads with
identity columns when there are fewer token rows than outputs, which changes ``||V_i||``);
directions with a zero eigenvalue are never kept (theirs get weight 0, and the polar factor then
fills them arbitrarily). The statistics are those RegMean and LOT Merging collect
(:func:`featcal.baselines.regmean.block_input_stats`).

Usage::

    merged = featcal.merge_with_data("esm", base=zoo.base, experts=zoo.experts, calib_data=zoo.calib_data(32))
"""

from __future__ import annotations

import copy
import warnings
from typing import Mapping

import torch
from torch import nn

from featcal.baselines.merging import tsv
from featcal.baselines.regmean import block_input_stats, check_calib
from featcal.baselines.spectral import iso_c_task_vector, tsv_task_vector
from featcal.model.arch import block_targets, get_params, resolve_blocks, resolve_stacks, set_params
from featcal.model.capture import target_site
from featcal.model.modes import eval_mode
from featcal.model.streams import catch_block_inputs, device_of
from featcal.util.progress import bar

RECIPES = ("auto", "vit", "roberta")
# scale's slider spans the ViT script's search interval, [0, 2]; a run takes up to RoBERTa's 5.
SCALE_RANGE = (0.05, 2.0, 0.05, False, (0.0, 5.0), "the authors search [0, 2] (ViT), [0, 5] (RoBERTa)")
EIGEN_POWER = 0.15  # the exponent of the eigenvalue weights (both of the authors' scripts)
NORM_POWER = 2.0  # the exponent of the task, column and layer norm ratios (both scripts)
# Eigenvalues below RTOL times the largest count as zero: a direction dO_i never moves along.
RTOL = 1e-10

# ---------------------------------------------------------------------------- the maths


def essential_basis(delta: torch.Tensor, gram: torch.Tensor, rtol: float = RTOL) -> tuple[torch.Tensor, torch.Tensor]:
    """ESD of one task's Linear: ``(lam, U)``, the eigenvalues (descending) and eigenvectors (out x r)
    of ``D G D^T``, the second moment of the output displacement ``dO = X D^T`` (``G = E[x x^T]``):
    the principal directions of ``dO``, which the authors take from ``svd(dO)`` (``lam`` is their
    ``sigma^2 / (n - 1)`` up to a constant factor, which the weights never see). Only the ``r``
    directions with ``lam > rtol * lam_max`` are returned."""
    M = delta @ gram @ delta.T  # (out, out)
    lam, U = torch.linalg.eigh((M + M.T) / 2)  # ascending
    lam, U = lam.flip(0), U.flip(1)
    keep = lam > rtol * lam[0].clamp(min=0)
    return lam[keep], U[:, keep]


def eigen_weights(lam: torch.Tensor, power: float = EIGEN_POWER) -> torch.Tensor:
    """``e = w / mean(w)`` with ``w = (lam / mean lam)^power``: the weight of each kept direction,
    mean 1 (a gentle tilt towards the directions that move the features most)."""
    w = (lam / lam.mean()) ** power
    return w / w.mean()


def task_components(
    delta: torch.Tensor, lam: torch.Tensor, U: torch.Tensor, rank: int, power: float = EIGEN_POWER
) -> tuple[torch.Tensor, torch.Tensor]:
    """One task's essential components ``(U_k diag(e), diag(e) U_k^T D)`` (out x k, k x in): its
    task vector on its top ``k = min(rank, r)`` essential directions, both factors weighted by
    :func:`eigen_weights` of their eigenvalues."""
    k = min(rank, U.shape[1])
    Uk = U[:, :k]
    e = eigen_weights(lam[:k], power)
    return Uk * e, e.unsqueeze(1) * (Uk.T @ delta)


def flat_polar(A: torch.Tensor) -> torch.Tensor:
    """``mean(S) P Q^T`` for ``A = P S Q^T``: the orthogonal factor of ``A`` with every singular
    value set to their mean (Iso-C's flattening, here of one factor)."""
    return iso_c_task_vector(A.unsqueeze(0))


def column_balance(V: torch.Tensor, power: float = NORM_POWER) -> torch.Tensor:
    """``V diag((c / mean c)^power)``, ``c_j`` the norm of column j: input channels the tasks'
    components agree to use (large ``c_j``) weigh more ("inter-column scaling", ViT recipe)."""
    c = V.norm(dim=0)
    return V * (c / c.mean()) ** power if c.mean() > 0 else V


def esm_task_vector(
    deltas: list[torch.Tensor], grams: list[torch.Tensor], recipe: str = "vit", power: float = NORM_POWER
) -> torch.Tensor:
    """The merged task vector of one Linear from the experts' ``deltas`` ``D_i`` (out x in) and
    their input Grams ``G_i``: ``flat_polar(U_cat) flat_polar(V_cat)`` over the concatenated
    :func:`task_components` (``k = max(1, out // T)`` each). ``recipe="vit"``: task i's rows of
    ``V_cat`` times ``(||D_i|| / mean_j ||D_j||)^power``, then :func:`column_balance`, then
    the result doubled."""
    rank = max(1, deltas[0].shape[0] // len(deltas))
    norms = torch.stack([D.norm() for D in deltas])
    Us, Vs = [], []
    for i, (D, G) in enumerate(zip(deltas, grams)):
        lam, U = essential_basis(D, G)
        if U.shape[1] == 0:  # a task that does not move this Linear's features
            continue
        Ui, Vi = task_components(D, lam, U, rank)
        if recipe == "vit":
            Vi = Vi * (norms[i] / norms.mean()) ** power
        Us.append(Ui)
        Vs.append(Vi)
    if not Us:
        return torch.zeros_like(deltas[0])
    U_cat, V_cat = torch.cat(Us, 1), torch.cat(Vs, 0)
    if recipe == "vit":
        V_cat = column_balance(V_cat, power)
    merged = flat_polar(U_cat) @ flat_polar(V_cat)
    return 2.0 * merged if recipe == "vit" else merged


def layer_balance(deltas: list[torch.Tensor], power: float = NORM_POWER) -> list[torch.Tensor]:
    """``D_l (||D_l|| / mean_l ||D_l||)^power`` for the merged task vectors of one Linear kind
    across the blocks ("inter-layer scaling"): layers that change more change more still."""
    norms = torch.stack([D.norm() for D in deltas])
    if norms.mean() == 0:
        return list(deltas)
    return [D * (n / norms.mean()) ** power for D, n in zip(deltas, norms)]


# ---------------------------------------------------------------------------- the plumbing


def is_decoder_lm(model: nn.Module) -> bool:
    """Whether ``model`` is a decoder-only language model (HF ``...ForCausalLM``, GPT-2's
    ``LMHeadModel``: it generates and is not an encoder-decoder), the kind neither of the
    authors' scripts was written for."""
    can_generate = getattr(model, "can_generate", None)
    config = getattr(model, "config", None)
    return bool(callable(can_generate) and can_generate() and not getattr(config, "is_encoder_decoder", False))


def resolve_recipe(recipe: str, model: nn.Module) -> str:
    """The script ``recipe`` names on ``model``: ``"auto"`` is ``"roberta"`` on a decoder-only LM
    (:func:`is_decoder_lm`; the ViT script's scalings break it, module docstring) and ``"vit"``
    elsewhere; ``"vit"`` on a decoder-only LM warns and runs."""
    decoder = is_decoder_lm(model)
    if recipe == "auto":
        return "roberta" if decoder else "vit"
    if recipe == "vit" and decoder:
        warnings.warn(
            f"esm: recipe 'vit' (the authors' CLIP ViT script) on a decoder-only LM ({type(model).__name__}): "
            "its doubling and squared inter-column and inter-layer scalings made updates up to 59x Task "
            "Arithmetic's on the smollm2 zoo and broke the merge at scale 1 (only about 0.1 recovered; "
            "docs/comparison.md); recipe 'auto' or 'roberta' uses the authors' RoBERTa script.",
            stacklevel=3,
        )
    return recipe


def _check(experts: Mapping[str, nn.Module], calib_data: Mapping[str, list], scale: float, recipe: str) -> None:
    check_calib(experts, calib_data, "ESM")
    if recipe not in RECIPES:
        raise ValueError(
            f"esm: recipe must be one of {', '.join(RECIPES)} (auto or one of the authors' scripts), got {recipe!r}."
        )
    if not 0.0 <= scale:
        raise ValueError(f"esm: scale must be >= 0 (it multiplies the merged task vector), got {scale}.")


def _weight_name(path: str, idx: int, t) -> str:
    """The state-dict name of a Linear target's weight (open_clip's packed q/k/v: ``in_proj_weight``)."""
    return f"{path}.{idx}.{t.owner}.{'in_proj_weight' if t.rows else 'weight'}"


def _unit(tg, recipe: str) -> str:
    """The name a Linear target is merged under: with the ViT recipe, one ``nn.MultiheadAttention``'s
    packed q/k/v are one matrix (``attn.in_proj``), as the authors' ViT code decomposes them; else
    the target alone."""
    return f"{tg.owner}.in_proj" if recipe == "vit" and tg.rows else tg.name


def _unit_task_vector(deltas: list[torch.Tensor], grams: list[torch.Tensor], recipe: str, site: str) -> torch.Tensor:
    """One unit's merged task vector: :func:`esm_task_vector`, except, with the ViT recipe, an
    ``nn.MultiheadAttention``'s ``out_proj`` (site ``...#context``), which the authors' hooks never
    see and their code merges by TSV."""
    if recipe == "vit" and site.endswith("#context"):
        return tsv_task_vector(torch.stack(deltas))
    return esm_task_vector(deltas, grams, recipe)


def _decompose_stack(model, base, experts, calib_data, path, recipe, progress) -> dict:
    """``{unit: [(block, targets, W_0, D_l), ...]}``: the merged task vector of every Linear unit
    (:func:`_unit`; ``W_0`` and ``D_l`` its targets' rows stacked) of the stack at ``path``, each
    task's features from its own expert on its own batches."""
    blks = resolve_blocks(model, path)[1]
    base_blks = resolve_blocks(base, path)[1]
    exp_blks = {t: resolve_blocks(e, path)[1] for t, e in experts.items()}
    calls = {t: [catch_block_inputs(experts[t], exp_blks[t][0], b) for b in calib_data[t]] for t in experts}
    kinds: dict[str, list] = {}
    for idx in bar(range(len(blks)), desc=f"esm {path}", unit="block", show=progress):
        targets = {t: block_targets(exp_blks[t][idx], layernorm=False) for t in experts}
        stats = {
            t: block_input_stats(exp_blks[t][idx], targets[t], calls[t], device_of(experts[t]), True) for t in experts
        }
        units: dict[str, list] = {}
        for tg in block_targets(blks[idx], layernorm=False):
            units.setdefault(_unit(tg, recipe), []).append(tg)
        for name, tgs in units.items():
            grams = [stats[t][target_site(tgs[0])] for t in experts]  # one input for a packed unit
            W0 = torch.cat([get_params(base_blks[idx], tg)[0] for tg in tgs]).to(grams[0].device, torch.float64)
            rows = [torch.cat([get_params(exp_blks[t][idx], tg)[0] for tg in tgs]) for t in experts]
            deltas = [W.to(W0.device, torch.float64) - W0 for W in rows]
            tau = _unit_task_vector(deltas, grams, recipe, tgs[0].site)
            kinds.setdefault(name, []).append((idx, tgs, W0, tau))
    return kinds


@torch.no_grad()
def esm(
    *,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    scale: float = 1.0,
    recipe: str = "auto",
    blocks: str | None = None,
    progress: bool = True,
) -> nn.Module:
    """ESM: every Linear weight of the blocks from the essential subspaces of each expert's output
    displacement on its own task's ``calib_data`` batches (32 examples a task in the paper), then
    balanced across the blocks (module docstring); 2-D entries outside them by TSV, the rest the
    experts' mean; ``theta = theta_0 + scale * tau`` throughout. ``recipe``: ``"vit"`` or
    ``"roberta"``, the authors' two scripts, or ``"auto"`` (:func:`resolve_recipe`: the RoBERTa
    script on a decoder-only LM, the ViT script elsewhere). ``blocks``: the dotted path of the
    blocks when featcal does not find them (an encoder-decoder without it: both stacks)."""
    _check(experts, calib_data, scale, recipe)
    recipe = resolve_recipe(recipe, base)
    model = copy.deepcopy(base).eval()
    solved: dict[str, list] = {}  # weight name -> [(block, target, W_0 + scale * D)] (q/k/v: three)
    with eval_mode(base, *experts.values()):
        for path, blks in resolve_stacks(model, blocks):
            for kind in _decompose_stack(model, base, experts, calib_data, path, recipe, progress).values():
                balanced = layer_balance([D for *_, D in kind])
                for (idx, tgs, W0, _), D in zip(kind, balanced):
                    Ws = (W0 + scale * D).split([get_params(blks[idx], tg)[0].shape[0] for tg in tgs])
                    for tg, W in zip(tgs, Ws):
                        solved.setdefault(_weight_name(path, idx, tg), []).append((blks[idx], tg, W))
    base_sd = base.state_dict()
    rest = {k: v for k, v in base_sd.items() if k not in solved}
    expert_rest = {t: {k: e.state_dict()[k] for k in rest} for t, e in experts.items()}
    model.load_state_dict(tsv(rest, expert_rest, scale), strict=False)
    for entries in solved.values():
        for blk, tg, W in entries:
            set_params(blk, tg, W.to(device_of(blk)), None)
    return model

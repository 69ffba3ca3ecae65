"""ESM (featcal.merge_with_data("esm")) on tiny seeded models: equal to a float64 re-derivation of
the authors' update from an SVD of each task's stacked output displacements, its isotropic-input
property, every architecture through the registry, and bad parameters refused by name."""

import copy
import warnings

import pytest
import torch

import tiny
from featcal import merge, merge_with_data
from featcal.baselines.esm import esm_task_vector, is_decoder_lm
from featcal.baselines.registry import ParamError, get
from featcal.model.arch import block_targets, resolve_stacks

NAMES = ("proj", "fc1", "fc2")  # the toy blocks' Linears


def _orth(A):
    """``mean(S) P Q^T`` for ``A = P S Q^T`` (the authors' Procrustes step)."""
    P, S, Qh = torch.linalg.svd(A, full_matrices=False)
    return P @ Qh * S.mean()


def _reference_layer(base, experts, data, block, name, recipe):
    """One Linear's merged task vector as the authors' scripts compute it, in float64: PCA of the
    stacked ``dO_i = X_i D_i^T`` by an SVD, top ``out // T`` directions weighted by
    ``(lam / mean)^0.15`` (mean 1), concatenated, Procrustes on each factor (ViT: the task norms
    and column norms squared, and twice the result)."""
    W0 = getattr(base.blocks[block], name).weight.detach().double()
    T = len(experts)
    k = W0.shape[0] // T
    Us, Vs, norms = [], [], []
    for t, e in experts.items():
        e64 = copy.deepcopy(e).double()
        X = tiny.module_inputs(e64, getattr(e64.blocks[block], name), [b.double() for b in data[t]])
        D = getattr(e.blocks[block], name).weight.detach().double() - W0
        _, S, Vh = torch.linalg.svd(X @ D.T, full_matrices=False)
        lam = S[:k] ** 2 / (len(X) - 1)
        w = (lam / lam.mean()) ** 0.15
        w = w / w.mean()
        U = Vh[:k].T  # (out, k): the principal directions of dO
        V = U.T @ D
        if recipe == "vit":
            V = V * D.norm() ** 2
            norms.append(D.norm())
        Us.append(U * w)
        Vs.append(V * w.unsqueeze(1))
    U_cat, V_cat = torch.cat(Us, 1), torch.cat(Vs, 0)
    if recipe == "vit":
        V_cat = V_cat / torch.stack(norms).mean() ** 2
        c = V_cat.norm(dim=0)
        V_cat = V_cat * (c / c.mean()) ** 2
    out = _orth(U_cat) @ _orth(V_cat)
    return 2 * out if recipe == "vit" else out


@pytest.mark.parametrize("recipe", ["vit", "roberta"])
def test_equals_a_float64_rederivation_from_the_svd_of_the_displacements(recipe):
    base, experts, _, data = tiny.zoo("toy", n_tasks=3)
    scale = 0.7
    out = merge_with_data(
        "esm", base=base, experts=experts, calib_data=data, scale=scale, recipe=recipe, progress=False
    )
    for name in NAMES:
        taus = [_reference_layer(base, experts, data, b, name, recipe) for b in range(len(base.blocks))]
        norms = torch.stack([t.norm() for t in taus])
        for b, tau in enumerate(taus):
            want = getattr(base.blocks[b], name).weight.detach().double() + scale * tau * (norms[b] / norms.mean()) ** 2
            got = getattr(out.blocks[b], name).weight.double()
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (b, name, (got - want).abs().max())
            bias = torch.stack([getattr(e.blocks[b], name).bias for e in experts.values()]).mean(0)
            b0 = getattr(base.blocks[b], name).bias
            assert torch.allclose(getattr(out.blocks[b], name).bias, b0 + scale * (bias - b0), atol=1e-6)
    # Outside the blocks' Linears: TSV (2-D entries) and the mean (the rest), scaled as well.
    sds = {t: e.state_dict() for t, e in experts.items()}
    want = merge("tsv", base.state_dict(), sds, scale=scale)
    for key in ("stem.weight", "stem.bias", "head.weight", "blocks.0.ln1.weight"):
        assert torch.allclose(out.state_dict()[key], want[key], atol=1e-6), key


def test_isotropic_inputs_give_the_flattened_polar_factor_of_one_task():
    """One task whose inputs are white (``G = I``), RoBERTa recipe: the essential directions are
    ``D``'s left singular vectors, so ESM returns ``mean(e * s) U V^T`` for ``D = U diag(s) V^T``
    (``e`` the eigenvalue weights of ``lam = s^2``): D's polar factor, its spectrum flattened."""
    gen = torch.Generator().manual_seed(0)
    D = torch.randn(7, 7, generator=gen, dtype=torch.float64)
    U, s, Vh = torch.linalg.svd(D)
    e = (s**2 / (s**2).mean()) ** 0.15
    e = e / e.mean()
    got = esm_task_vector([D], [torch.eye(7, dtype=torch.float64)], recipe="roberta")
    assert torch.allclose(got, (e * s).mean() * U @ Vh, atol=1e-10)
    assert not torch.allclose(got, D, atol=1e-2)  # flattened: not the task vector itself


def test_the_order_of_the_tasks_does_not_matter():
    base, experts, _, data = tiny.zoo("toy", n_tasks=3)
    a = merge_with_data("esm", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    rev = dict(reversed(list(experts.items())))
    b = merge_with_data("esm", base=base, experts=rev, calib_data=data, progress=False).state_dict()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5), k


@pytest.mark.parametrize("kind", ["toy", "hf_clip", "open_clip", "bert", "t5", "llama"])
def test_runs_through_the_registry_on_every_architecture(kind):
    base, experts, _, data = tiny.any_zoo(kind)
    m = get("esm", "data_merger")
    assert (m.kind, m.label, m.defaults) == ("data_merger", "ESM", {"scale": 1.0, "recipe": "auto", "blocks": None})
    out = merge_with_data("esm", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    sds = [e.state_dict() for e in experts.values()]
    solved = {
        f"{path}.{i}.{t.owner}.{'in_proj_weight' if t.rows else 'weight'}"
        for path, blks in resolve_stacks(base)
        for i, blk in enumerate(blks)
        for t in block_targets(blk, layernorm=False)
    }
    assert solved
    for k, v in out.items():
        assert torch.isfinite(v.float()).all(), k
        mean = torch.stack([sd[k].float() for sd in sds]).mean(0).to(v.dtype)
        if k in solved:
            assert not torch.allclose(v, mean, atol=1e-6), k  # decomposed, not the mean
        elif v.is_floating_point() and v.dim() != 2:
            assert torch.allclose(v, mean, atol=1e-6), k  # biases, norms: the experts' mean
    if kind == "t5":  # both stacks, the decoder's cross-attention included
        assert "decoder.block.1.layer.1.EncDecAttention.k.weight" in solved


def test_bad_parameters_are_refused_by_name():
    base, experts, _, data = tiny.zoo("toy")
    with pytest.raises(ParamError, match=r"esm: parameter 'recipe' takes one of auto, vit, roberta, got 'bert'"):
        merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe="bert")
    with pytest.raises(ParamError, match=r"esm: parameter 'scale' takes a number in \[0, 5\]"):
        merge_with_data("esm", base=base, experts=experts, calib_data=data, scale=9.0)
    with pytest.raises(ParamError, match=r"esm takes no parameter 'rank'; it takes scale, recipe, blocks"):
        merge_with_data("esm", base=base, experts=experts, calib_data=data, rank=4)
    with pytest.raises(ValueError, match=r"calib_data has no batches for task\(s\) \['t1'\]; ESM"):
        merge_with_data("esm", base=base, experts=experts, calib_data={"t0": data["t0"]})
    from featcal.baselines.esm import esm

    with pytest.raises(ValueError, match=r"esm: recipe must be one of auto, vit, roberta"):
        esm(base=base, experts=experts, calib_data=data, recipe="vit2")
    with pytest.raises(ValueError, match=r"esm: scale must be >= 0"):
        esm(base=base, experts=experts, calib_data=data, scale=-1.0)
    assert get("esm").fn is esm


def test_vit_recipe_merges_open_clip_attention_as_the_authors_code():
    """open_clip's nn.MultiheadAttention under the ViT recipe: ``out_proj`` (whose input the authors'
    hooks never see) is TSV's merge, balanced across the blocks; the packed q/k/v are decomposed as
    one matrix (the RoBERTa recipe decomposes q, k and v apart: a different result)."""
    base, experts, _, data = tiny.zoo("open_clip", n_tasks=3)
    vit = merge_with_data("esm", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    rob = merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe="roberta", progress=False)
    sds = {t: e.state_dict() for t, e in experts.items()}
    tsv = merge("tsv", base.state_dict(), sds)
    keys = [f"transformer.resblocks.{i}.attn.out_proj.weight" for i in range(len(base.transformer.resblocks))]
    taus = [(tsv[k] - base.state_dict()[k]).double() for k in keys]
    norms = torch.stack([t.norm() for t in taus])
    for k, tau in zip(keys, taus):
        want = base.state_dict()[k].double() + tau * (tau.norm() / norms.mean()) ** 2
        assert torch.allclose(vit[k].double(), want, atol=1e-5), k
    k = "transformer.resblocks.0.attn.in_proj_weight"
    assert not torch.allclose(vit[k], rob.state_dict()[k], atol=1e-4)


@pytest.mark.parametrize("kind", ["toy", "hf_clip", "open_clip", "bert", "t5", "llama"])
def test_auto_recipe_is_roberta_on_a_decoder_lm_and_vit_elsewhere(kind):
    """The default recipe ``auto``: the authors' RoBERTa script on a decoder-only LM (the ViT
    script's doubling and squared column and layer scalings broke the merge of the smollm2 zoo),
    the ViT script on every other architecture (CLIP towers, encoders, T5), as before."""
    base, experts, _, data = tiny.any_zoo(kind)
    decoder = kind == "llama"
    assert is_decoder_lm(base) is decoder
    auto = merge_with_data("esm", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    same = "roberta" if decoder else "vit"
    want = merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe=same, progress=False)
    for k, v in want.state_dict().items():
        assert torch.equal(auto[k], v), k
    other = "vit" if decoder else "roberta"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ViT script's warning on a decoder LM (next test)
        not_want = merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe=other, progress=False)
    differ = [k for k, v in not_want.state_dict().items() if not torch.allclose(auto[k], v, atol=1e-6)]
    assert differ  # the two scripts merge these tiny models differently: the default picked one


def test_vit_recipe_on_a_decoder_lm_warns_and_runs_as_asked():
    """Asked for explicitly on a decoder-only LM, the ViT script is what runs (doubled, balanced:
    not the RoBERTa script's result), with a warning naming the recipe and the model; on an
    encoder (BERT) it runs without one."""
    base, experts, _, data = tiny.any_zoo("llama")
    with pytest.warns(UserWarning, match=r"esm: recipe 'vit' .* on a decoder-only LM \(LlamaForCausalLM\)"):
        vit = merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe="vit", progress=False)
    rob = merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe="roberta", progress=False)
    k = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(vit.state_dict()[k], rob.state_dict()[k], atol=1e-6)
    base, experts, _, data = tiny.any_zoo("bert")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe="vit", progress=False)

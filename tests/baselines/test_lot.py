"""LOT Merging (featcal.merge_with_data("lot")) on tiny seeded models: equal to a float64
re-derivation of the paper's layer-wise least squares, its one-expert property, every
architecture through the registry, and bad parameters refused by name."""

import copy

import pytest
import torch
import torch.nn.functional as F

import tiny
from featcal import merge_with_data
from featcal.baselines.registry import ParamError, get
from featcal.model.arch import LINEAR, block_targets, resolve_blocks, resolve_stacks


def _reference(base, experts, data, block, name):
    """The paper's update for one module, re-derived in float64 by a plain least-squares solve:
    ``tau = argmin sum_k mean_x |(tau - tau_k) f(x)|^2`` over the rows of expert k's own inputs on
    task k (a Linear: ``f(x) = x``, lstsq on the stacked rows, minimum norm; a LayerNorm's scale:
    ``f(x) = z``, its normalised input, channel by channel); returns ``W_0 + tau``."""
    W0 = getattr(base.blocks[block], name).weight.detach().double()
    A, Y = [], []
    for t, e in experts.items():
        e64 = copy.deepcopy(e).double()
        x = tiny.module_inputs(e64, getattr(e64.blocks[block], name), [b.double() for b in data[t]])
        tau_k = getattr(e.blocks[block], name).weight.detach().double() - W0
        if name.startswith("ln"):
            x = F.layer_norm(x, x.shape[-1:], eps=1e-5)
            A.append(x / len(x) ** 0.5)
            Y.append(x * tau_k / len(x) ** 0.5)
        else:
            A.append(x / len(x) ** 0.5)
            Y.append(x @ tau_k.T / len(x) ** 0.5)
    A, Y = torch.cat(A), torch.cat(Y)
    if name.startswith("ln"):  # one scalar per channel: a (rows, 1) least squares each
        tau = torch.stack([torch.linalg.lstsq(A[:, j : j + 1], Y[:, j : j + 1]).solution[0, 0] for j in range(len(W0))])
    else:
        tau = torch.linalg.lstsq(A, Y, driver="gelsd").solution.T
    return W0 + tau


def test_equals_a_float64_least_squares_rederivation():
    base, experts, _, data = tiny.zoo("toy", n_tasks=3)
    out = merge_with_data("lot", base=base, experts=experts, calib_data=data, progress=False)
    for block in range(len(base.blocks)):
        for name in ("proj", "fc1", "fc2", "ln1", "ln2"):
            want = _reference(base, experts, data, block, name)
            got = getattr(out.blocks[block], name).weight.double()
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (block, name, (got - want).abs().max())
            mean = torch.stack(
                [getattr(e.blocks[block], name).weight.detach().double() for e in experts.values()]
            ).mean(0)
            assert not torch.allclose(got, mean, atol=1e-3), (block, name)  # solved, not the mean
            bias = torch.stack([getattr(e.blocks[block], name).bias for e in experts.values()]).mean(0)
            assert torch.allclose(getattr(out.blocks[block], name).bias, bias, atol=1e-7)  # biases, shifts: the mean
    for key in ("stem.weight", "head.bias"):  # outside the blocks: the experts' mean
        mean = torch.stack([e.state_dict()[key] for e in experts.values()]).mean(0)
        assert torch.allclose(out.state_dict()[key], mean, atol=1e-7)


def test_rank_deficient_inputs_keep_the_base_off_their_span():
    """fc2 of the tiny HF CLIP reads 64 channels, here over 40 rows (4 images x 5 tokens a task):
    the pseudo-inverse leaves the base's weight on the directions no task's input reaches."""
    base, experts, _, data = tiny.zoo("hf_clip", n_tasks=2)
    data = {t: batches[:1] for t, batches in data.items()}
    out = merge_with_data("lot", base=base, experts=experts, calib_data=data, progress=False)
    path, blks = resolve_blocks(out)
    fc2 = lambda m: resolve_blocks(m, path)[1][0].mlp.fc2  # noqa: E731
    X = torch.cat([tiny.module_inputs(e, fc2(e), data[t]) for t, e in experts.items()]).double()  # (40, 64)
    _, S, Vh = torch.linalg.svd(X)
    null = Vh[(S > 1e-6 * S[0]).sum() :]  # directions orthogonal to every task's inputs
    assert len(null) > 0
    W, W0 = fc2(out).weight.double(), fc2(base).weight.detach().double()
    assert torch.allclose(W @ null.T, W0 @ null.T, atol=1e-6)


def test_one_expert_is_returned_on_its_own_features():
    """One expert: ``tau = tau_1 G (G)^+``, the expert's weights wherever its inputs reach (all of
    them at full rank: the toy zoo), the norm scales and every other entry exactly its own."""
    base, experts, _, data = tiny.zoo("toy")
    out = merge_with_data(
        "lot", base=base, experts={"t0": experts["t0"]}, calib_data={"t0": data["t0"]}, progress=False
    )
    want = experts["t0"].state_dict()
    for k, v in out.state_dict().items():
        assert torch.allclose(v, want[k], atol=1e-5), k
    # Rank-deficient (fc2 of the tiny HF CLIP): equal outputs on the expert's own inputs.
    base, experts, _, data = tiny.zoo("hf_clip")
    e = experts["t0"]
    out = merge_with_data("lot", base=base, experts={"t0": e}, calib_data={"t0": data["t0"]}, progress=False)
    path, _ = resolve_blocks(out)
    for m in (out, e):
        m.fc2 = resolve_blocks(m, path)[1][1].mlp.fc2
    x = tiny.module_inputs(e, e.fc2, data["t0"])
    assert torch.allclose(x @ out.fc2.weight.T, x @ e.fc2.weight.T, atol=1e-5)
    assert not torch.allclose(out.fc2.weight, e.fc2.weight, atol=1e-4)  # rank 60 < 64: not the weight itself


@pytest.mark.parametrize("kind", ["toy", "hf_clip", "open_clip", "bert", "t5", "llama"])
def test_runs_through_the_registry_on_every_architecture(kind):
    base, experts, _, data = tiny.any_zoo(kind)
    m = get("lot", "data_merger")
    assert (m.kind, m.label, m.defaults) == ("data_merger", "LOT Merging", {"rtol": 1e-5, "blocks": None})
    out = merge_with_data("lot", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    sds = [e.state_dict() for e in experts.values()]
    solved = set()
    for path, blks in resolve_stacks(base):
        for i, blk in enumerate(blks):
            for t in block_targets(blk):
                leaf = "in_proj_weight" if t.rows else "weight"
                solved.add(f"{path}.{i}.{t.owner}.{leaf}")
    assert solved
    off_mean = 0
    for k, v in out.items():
        mean = torch.stack([sd[k].float() for sd in sds]).mean(0).to(v.dtype)
        assert torch.isfinite(v.float()).all(), k
        if k in solved:
            off_mean += not torch.allclose(v, mean, atol=1e-6)
        elif v.is_floating_point():
            assert torch.allclose(v, mean, atol=1e-7), k  # everything else: the experts' mean
    assert off_mean >= len(solved) // 2, (off_mean, len(solved))
    if kind == "t5":  # both stacks solved, the decoder's cross-attention included
        k = "decoder.block.1.layer.1.EncDecAttention.k.weight"
        assert k in solved and not torch.allclose(out[k], torch.stack([sd[k] for sd in sds]).mean(0), atol=1e-6)


def test_bad_parameters_are_refused_by_name():
    base, experts, _, data = tiny.zoo("toy")
    with pytest.raises(ParamError, match=r"lot: parameter 'rtol' takes a number in"):
        merge_with_data("lot", base=base, experts=experts, calib_data=data, rtol=2.0)
    with pytest.raises(ParamError, match=r"lot takes no parameter 'reduce_nondiag'; it takes rtol, blocks"):
        merge_with_data("lot", base=base, experts=experts, calib_data=data, reduce_nondiag=0.5)
    with pytest.raises(ParamError, match=r"'rtol' takes a number"):
        merge_with_data("lot", base=base, experts=experts, calib_data=data, rtol="small")
    with pytest.raises(ValueError, match=r"calib_data has no batches for task\(s\) \['t1'\]; LOT Merging"):
        merge_with_data("lot", base=base, experts=experts, calib_data={"t0": data["t0"]})
    from featcal.baselines.lot import lot

    with pytest.raises(ValueError, match=r"rtol must be in \(0, 1\)"):
        lot(base=base, experts=experts, calib_data=data, rtol=0.0)
    assert get("lot").fn is lot and LINEAR == "linear"

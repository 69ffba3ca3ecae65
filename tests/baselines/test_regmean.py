"""RegMean and RegMean++ (featcal.merge_with_data) on tiny seeded models: their defining
closed forms, on every architecture the engine supports."""

import copy

import pytest
import torch

import tiny
from featcal import MERGERS_WITH_DATA, merge_with_data
from featcal.model.arch import block_targets, resolve_blocks

METHODS = tuple(m for m in MERGERS_WITH_DATA if m.startswith("regmean"))  # the Gram-matrix mergers


def _linear_keys(model):
    """State-dict names of the weights RegMean solves (the Linears inside the blocks)."""
    path, blks = resolve_blocks(model)
    keys = set()
    for i, blk in enumerate(blks):
        for t in block_targets(blk, layernorm=False):
            keys.add(f"{path}.{i}.{t.owner}.{'in_proj_weight' if t.rows else 'weight'}")
    return keys


@pytest.mark.parametrize("method", METHODS)
def test_one_task_returns_that_expert(tiny_kind, method):
    base, experts, _, data = tiny.zoo(tiny_kind)
    one = {"t0": experts["t0"]}
    out = merge_with_data(method, base=base, experts=one, calib_data={"t0": data["t0"]}, progress=False)
    want = experts["t0"].state_dict()
    solved = _linear_keys(base)
    assert solved
    for k, v in out.state_dict().items():
        if k in solved:
            assert torch.allclose(v, want[k], atol=1e-4), k
        else:
            assert torch.equal(v, want[k]), k  # every other entry: the mean of one expert


def _one_block_zoo(n_tasks=3):
    """One-block toy models whose experts differ from the base only inside the block, so
    that block 0's input is the same in every expert and in the merged model."""
    torch.manual_seed(0)
    base = tiny.ToyModel(n_blocks=1)
    experts = {}
    for i in range(n_tasks):
        e = copy.deepcopy(base)
        e.blocks[0] = tiny.perturbed(base.blocks[0], 0.3, 100 + i)
        experts[f"t{i}"] = e
    return base, experts, tiny.toy_data(experts)


def test_regmean_plusplus_equals_regmean_on_a_single_block_model():
    base, experts, data = _one_block_zoo()
    a = merge_with_data("regmean", base=base, experts=experts, calib_data=data, progress=False)
    b = merge_with_data("regmean_plusplus", base=base, experts=experts, calib_data=data, progress=False)
    for k, v in a.state_dict().items():
        assert torch.allclose(v, b.state_dict()[k], atol=1e-6), k


def test_regmean_plusplus_reads_the_merged_models_inputs():
    base, experts, _, data = tiny.zoo("toy", n_tasks=3)
    a = merge_with_data("regmean", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    b = merge_with_data("regmean_plusplus", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    # Block 0's Linears read the stem's output, which differs between the experts and the mean.
    assert not torch.allclose(a["blocks.0.fc1.weight"], b["blocks.0.fc1.weight"], atol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_no_off_diagonal_gives_the_per_feature_weighted_mean(method):
    base, experts, data = _one_block_zoo()
    out = merge_with_data(method, base=base, experts=experts, calib_data=data, reduce_nondiag=0.0, progress=False)
    # W[:, j] = sum_i E_i[x_j^2] W_i[:, j] / sum_i E_i[x_j^2], E_i the mean over expert i's tokens.
    for name in ("proj", "fc1", "fc2"):
        diag = [tiny.module_inputs(e, getattr(e.blocks[0], name), data[t]).square().mean(0) for t, e in experts.items()]
        Ws = [getattr(e.blocks[0], name).weight.detach() for e in experts.values()]
        want = sum(d * W for d, W in zip(diag, Ws)) / sum(diag)
        assert torch.allclose(getattr(out.blocks[0], name).weight, want, atol=1e-5), name
        bias = torch.stack([getattr(e.blocks[0], name).bias for e in experts.values()]).mean(0)
        assert torch.allclose(getattr(out.blocks[0], name).bias, bias, atol=1e-6)  # biases: the mean


def test_regmean_solves_the_least_squares_merge():
    """RegMean's weight (reduce_nondiag=1) minimises sum_i E_i|W x - W_i x|^2 (its gradient vanishes)."""
    base, experts, data = _one_block_zoo()
    out = merge_with_data("regmean", base=base, experts=experts, calib_data=data, reduce_nondiag=1.0, progress=False)
    grad = 0
    for t, e in experts.items():
        x = tiny.module_inputs(e, e.blocks[0].fc1, data[t]).double()
        grad = grad + (x @ (out.blocks[0].fc1.weight.double() - e.blocks[0].fc1.weight.double()).T).T @ x / len(x)
    assert grad.abs().max() < 1e-5


def _llama(pad: int):
    """A tiny Llama zoo, its batches right-padded by ``pad`` tokens of random ids (mask 0)."""
    base = tiny.tiny_llama()
    experts = {t: tiny.perturbed(base, 0.02, i) for i, t in enumerate("ab")}
    gen = torch.Generator().manual_seed(1)
    data = {}
    for t in experts:
        ids = torch.randint(0, 50, (4, 10), generator=gen)
        junk = torch.randint(0, 50, (4, pad), generator=torch.Generator().manual_seed(2))
        mask = torch.cat([torch.ones(4, 10), torch.zeros(4, pad)], 1).long()
        ids = torch.cat([ids, junk], 1)
        data[t] = [{"input_ids": ids[i : i + 2], "attention_mask": mask[i : i + 2]} for i in (0, 2)]
    return base, experts, data


@pytest.mark.parametrize("method", METHODS)
def test_llama_padding_is_left_out(method):
    base, experts, plain = _llama(0)
    _, _, padded = _llama(5)
    a = merge_with_data(method, base=base, experts=experts, calib_data=plain, progress=False).state_dict()
    b = merge_with_data(method, base=base, experts=experts, calib_data=padded, progress=False).state_dict()
    for k in _linear_keys(base):
        assert torch.allclose(a[k], b[k], atol=1e-5), k
    assert not torch.allclose(
        a["model.layers.0.mlp.up_proj.weight"], base.state_dict()["model.layers.0.mlp.up_proj.weight"]
    )


@pytest.mark.parametrize("method", METHODS)
def test_inputs_are_untouched(method):
    base, experts, _, data = tiny.zoo("open_clip")
    experts["t1"].train()
    before = tiny.state_snapshot(base), {t: tiny.state_snapshot(m) for t, m in experts.items()}
    out = merge_with_data(method, base=base, experts=experts, calib_data=data, progress=False)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in before[0].items())
    for t, snap in before[1].items():
        assert all(torch.equal(v, experts[t].state_dict()[k]) for k, v in snap.items())
    assert experts["t1"].training and not experts["t0"].training and not out.training
    # open_clip's packed q/k/v projection was solved, row block by row block: off the experts' mean.
    key = "transformer.resblocks.0.attn.in_proj_weight"
    mean = torch.stack([m.state_dict()[key] for m in experts.values()]).mean(0)
    assert not torch.allclose(out.state_dict()[key], mean, atol=1e-4)


def test_bad_input_errors_name_the_problem():
    base, experts, _, data = tiny.zoo("toy")
    with pytest.raises(ValueError, match="unknown data-using merge method 'nope'"):
        merge_with_data("nope", base=base, experts=experts, calib_data=data)
    with pytest.raises(ValueError, match=r"no batches for task\(s\) \['t1'\]"):
        merge_with_data("regmean", base=base, experts=experts, calib_data={"t0": data["t0"]})
    with pytest.raises(ValueError, match="reduce_nondiag must be in"):
        merge_with_data("regmean", base=base, experts=experts, calib_data=data, reduce_nondiag=2.0)
    with pytest.raises(TypeError):
        merge_with_data("regmean", base=base, experts=experts, calib_data=data, scale=0.3)

"""Bayesian Model Merging's inner level (featcal.merge_with_data("bmm"), featcal.merge("bmm_datafree"))
on tiny seeded models: equal to a float64 re-derivation of the MAP regression under the anchor's
prior, its limits (RegMean, the anchor, WUDI's objective), every architecture through the registry,
the models given left as they are, and bad input refused by name. The outer level: test_bmm_search.py."""

import copy

import pytest
import torch

import tiny
from featcal import merge, merge_with_data
from featcal.baselines.registry import ParamError, get
from featcal.baselines.spectral import wudi_objective
from featcal.model.arch import block_targets, resolve_stacks

LINEARS = ("proj", "fc1", "fc2")


def _map_reference(W0, Wa, xs, Ws, sigma):
    """The MAP weight re-derived as one augmented least squares, in float64: the rows
    ``X_i / sqrt(n_i)`` with targets ``X_i W_i^T / sqrt(n_i)``, then ``sqrt(s) I`` with target
    ``sqrt(s) W_a^T``, ``s = sigma * tr(sum_i X_i^T X_i / n_i) / d`` (lstsq, not the normal equations)."""
    d = W0.shape[1]
    A = [x / len(x) ** 0.5 for x in xs]
    Y = [x @ (W - W0).T / len(x) ** 0.5 for x, W in zip(xs, Ws)]
    s = sigma * sum(float(a.square().sum()) for a in A) / d
    A.append(s**0.5 * torch.eye(d, dtype=torch.float64))
    Y.append(s**0.5 * (Wa - W0).T)
    return W0 + torch.linalg.lstsq(torch.cat(A), torch.cat(Y)).solution.T


def _inputs(expert, block, name, batches):
    e64 = copy.deepcopy(expert).double()
    return tiny.module_inputs(e64, getattr(e64.blocks[block], name), [b.double() for b in batches])


@pytest.mark.parametrize("anchor", ["ta", "tsv"])
def test_bmm_equals_a_float64_map_rederivation(anchor):
    base, experts, _, data = tiny.zoo("toy", n_tasks=3)
    sds = {t: e.state_dict() for t, e in experts.items()}
    prior = merge({"ta": "task_arithmetic"}.get(anchor, anchor), base.state_dict(), sds)
    out = merge_with_data("bmm", base=base, experts=experts, calib_data=data, anchor=anchor, sigma=0.3, progress=False)
    for block in range(len(base.blocks)):
        for name in LINEARS:
            key = f"blocks.{block}.{name}.weight"
            xs = [_inputs(e, block, name, data[t]) for t, e in experts.items()]
            Ws = [sd[key].double() for sd in sds.values()]
            want = _map_reference(base.state_dict()[key].double(), prior[key].double(), xs, Ws, 0.3)
            got = out.state_dict()[key].double()
            assert torch.allclose(got, want, atol=2e-5, rtol=1e-4), (key, (got - want).abs().max())
            assert not torch.allclose(got, prior[key].double(), atol=1e-3), key  # solved, not the anchor
    solved = {f"blocks.{b}.{n}.weight" for b in range(len(base.blocks)) for n in LINEARS}
    for k, v in out.state_dict().items():  # every other entry: the anchor's (the prior's mean)
        if k not in solved:
            assert torch.allclose(v, prior[k], atol=1e-7), k


def test_its_limits_are_regmean_and_the_anchor():
    base, experts, _, data = tiny.zoo("toy", n_tasks=3)
    kw = dict(base=base, experts=experts, calib_data=data, progress=False)
    regmean = merge_with_data("regmean", reduce_nondiag=1.0, **kw).state_dict()
    ta = merge("task_arithmetic", base.state_dict(), {t: e.state_dict() for t, e in experts.items()})
    at_zero = merge_with_data("bmm", sigma=0.0, **kw).state_dict()
    at_inf = merge_with_data("bmm", sigma=1e6, **kw).state_dict()
    for b in range(len(base.blocks)):
        for n in LINEARS:
            k = f"blocks.{b}.{n}.weight"
            assert torch.allclose(at_zero[k], regmean[k], atol=1e-4), k  # sigma -> 0: RegMean
            assert torch.allclose(at_inf[k], ta[k], atol=1e-4), k  # sigma -> inf: the anchor
            assert not torch.allclose(regmean[k], ta[k], atol=1e-3), k


def test_datafree_equals_its_rederivation_and_solves_wudis_objective():
    """``G_i = tau_i^T tau_i / ||tau_i||^2``: the rows ``tau_i / ||tau_i||`` play the inputs'
    part in the same augmented least squares; sigma -> 0 minimises WUDI's objective."""
    base, experts, _ = tiny.toy_zoo(n_tasks=3)
    b, sds = base.state_dict(), {t: e.state_dict() for t, e in experts.items()}
    prior = merge("tsv", b, sds)
    out = merge("bmm_datafree", b, sds, anchor="tsv", sigma=0.5, progress=False)
    near_zero = merge("bmm_datafree", b, sds, sigma=0.0, progress=False)
    two_d = [k for k, v in b.items() if v.dim() == 2]
    for k in two_d:
        W0 = b[k].double()
        taus = torch.stack([sd[k].double() - W0 for sd in sds.values()])
        xs = [t / t.norm() for t in taus]
        want = _map_reference(W0, prior[k].double(), xs, [W0 + t for t in taus], 0.5)
        assert torch.allclose(out[k].double(), want, atol=1e-5), (k, (out[k].double() - want).abs().max())
        tau = (near_zero[k].double() - W0).requires_grad_(True)
        wudi_objective(tau, taus).backward()
        start = taus.sum(0).requires_grad_(True)  # WUDI's own starting point
        wudi_objective(start, taus).backward()
        assert tau.grad.norm() < 1e-4 * start.grad.norm(), k  # a stationary point of the convex objective
    for k, v in out.items():
        if k not in two_d:
            assert torch.equal(v, prior[k]), k  # not 2-D: the anchor's


def _solved_keys(model):
    keys = set()
    for path, blks in resolve_stacks(model):
        for i, blk in enumerate(blks):
            for t in block_targets(blk, layernorm=False):
                keys.add(f"{path}.{i}.{t.owner}.{'in_proj_weight' if t.rows else 'weight'}")
    return keys


@pytest.mark.parametrize("kind", ["toy", "hf_clip", "open_clip", "bert", "t5", "llama"])
def test_runs_through_the_registry_on_every_architecture(kind):
    base, experts, _, data = tiny.any_zoo(kind)
    m = get("bmm", "data_merger")
    assert (m.kind, m.label, m.defaults) == ("data_merger", "BMM", {"anchor": "ta", "sigma": 0.1, "blocks": None})
    assert get("bmm_datafree").kind == "merger" and get("bmm_datafree").param("anchor").choices == ("ta", "tsv", "wudi")
    sds = {t: e.state_dict() for t, e in experts.items()}
    prior = merge("task_arithmetic", base.state_dict(), sds)
    out = merge_with_data("bmm", base=base, experts=experts, calib_data=data, progress=False).state_dict()
    free = merge("bmm_datafree", base.state_dict(), sds, progress=False)
    solved = _solved_keys(base)
    assert solved
    for k, v in out.items():
        assert torch.isfinite(v.float()).all() and torch.isfinite(free[k].float()).all(), k
        if k in solved:
            assert not torch.allclose(v, prior[k], atol=1e-6), k
            assert not torch.allclose(free[k], prior[k], atol=1e-6), k
        else:
            assert torch.equal(v, prior[k]), k  # everything else: the anchor's
    if kind == "t5":  # both stacks solved, the decoder's cross-attention included
        assert "decoder.block.1.layer.1.EncDecAttention.k.weight" in solved


@pytest.mark.parametrize("method", ["bmm", "bmm_datafree"])
def test_the_models_given_are_not_modified(method):
    base, experts, _, data = tiny.zoo("open_clip")
    experts["t1"].train()
    before = tiny.state_snapshot(base), {t: tiny.state_snapshot(m) for t, m in experts.items()}
    if method == "bmm":
        out = merge_with_data(method, base=base, experts=experts, calib_data=data, progress=False)
        assert not out.training
    else:
        out = merge(method, base.state_dict(), {t: e.state_dict() for t, e in experts.items()}, progress=False)
        assert all(v.data_ptr() != base.state_dict()[k].data_ptr() for k, v in out.items())
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in before[0].items())
    for t, snap in before[1].items():
        assert all(torch.equal(v, experts[t].state_dict()[k]) for k, v in snap.items())
    assert experts["t1"].training and not experts["t0"].training


def test_bad_input_is_refused_by_name_before_any_work():
    base, experts, _, data = tiny.zoo("toy")
    kw = dict(base=base, experts=experts, calib_data=data)
    with pytest.raises(ParamError, match=r"bmm: parameter 'anchor' takes one of ta, tsv, wudi, got 'ties'"):
        merge_with_data("bmm", anchor="ties", **kw)
    with pytest.raises(ParamError, match=r"bmm_datafree: parameter 'anchor' takes one of ta, tsv, wudi"):
        merge("bmm_datafree", base.state_dict(), {t: e.state_dict() for t, e in experts.items()}, anchor="iso_c")
    with pytest.raises(ParamError, match=r"bmm: parameter 'sigma' takes a number in \[0, 1e\+06\]"):
        merge_with_data("bmm", sigma=-1.0, **kw)
    with pytest.raises(ValueError, match=r"calib_data has no batches for task\(s\) \['t1'\]; BMM reads"):
        merge_with_data("bmm", base=base, experts=experts, calib_data={"t0": data["t0"]})
    with pytest.raises(ValueError, match=r"calib_data has no batches for task\(s\) \['t0', 't1'\]"):
        merge_with_data("bmm", base=base, experts=experts, calib_data={})
    from featcal.baselines.bmm import bmm, bmm_datafree

    with pytest.raises(ValueError, match=r"bmm: anchor must be one of ta, tsv, wudi .*got 'TA'"):
        bmm(anchor="TA", **kw)
    with pytest.raises(ValueError, match=r"bmm_datafree: sigma must be >= 0"):
        bmm_datafree(base.state_dict(), {t: e.state_dict() for t, e in experts.items()}, sigma=float("nan"))

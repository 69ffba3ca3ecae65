"""Mergers: known closed forms on tiny state dicts."""

import pytest
import torch

from featcal import merge
from featcal.baselines.registry import MERGERS


def _sds(seed=0, n=3):
    gen = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(4, 5, generator=gen), "b": torch.randn(4, generator=gen), "steps": torch.tensor(7)}
    experts = {
        f"t{i}": {
            "w": base["w"] + torch.randn(4, 5, generator=gen),
            "b": base["b"] + torch.randn(4, generator=gen),
            "steps": torch.tensor(100 + i),
        }
        for i in range(n)
    }
    return base, experts


def test_registry_names():
    assert {"average", "task_arithmetic", "ties", "dare"} <= set(MERGERS)


def test_average_and_task_arithmetic_closed_forms():
    base, experts = _sds()
    avg = merge("average", base, experts)
    assert torch.allclose(avg["w"], torch.stack([e["w"] for e in experts.values()]).mean(0), atol=1e-6)
    ta = merge("task_arithmetic", base, experts, scale=0.3)
    want = base["w"] + 0.3 * sum(e["w"] - base["w"] for e in experts.values())
    assert torch.allclose(ta["w"], want, atol=1e-6)
    assert torch.equal(ta["steps"], base["steps"])  # integer entries come from the base


def test_ties_density_one_without_conflicts_equals_task_arithmetic():
    gen = torch.Generator().manual_seed(1)
    base = {"w": torch.randn(6, 3, generator=gen)}
    mag = torch.rand(6, 3, generator=gen) + 0.1
    sign = torch.sign(torch.randn(6, 3, generator=gen))
    experts = {f"t{i}": {"w": base["w"] + sign * mag * (i + 1)} for i in range(3)}  # same signs everywhere
    ta = merge("task_arithmetic", base, experts, scale=0.3)
    ties_sum = merge("ties", base, experts, density=1.0, scale=0.3, disjoint="sum")
    assert torch.allclose(ties_sum["w"], ta["w"], atol=1e-6)
    # With the disjoint mean, the agreeing entries are averaged: TA at scale/N.
    ties_mean = merge("ties", base, experts, density=1.0, scale=0.3)
    assert torch.allclose(ties_mean["w"], merge("task_arithmetic", base, experts, scale=0.1)["w"], atol=1e-6)


def test_ties_trims_and_elects_signs():
    base = {"w": torch.zeros(4)}
    experts = {"a": {"w": torch.tensor([3.0, -0.1, 2.0, 0.0])}, "b": {"w": torch.tensor([-1.0, 0.2, 2.0, 5.0])}}
    out = merge("ties", base, experts, density=0.5, scale=1.0)
    # a keeps [3, 2] (top 2), b keeps [2, 5]; entry 0: only a (3) -> 3; entry 2: mean(2, 2); entry 3: 5.
    assert torch.allclose(out["w"], torch.tensor([3.0, 0.0, 2.0, 5.0]))


def test_dare_is_seeded_and_unbiased_in_expectation():
    base, experts = _sds(n=2)
    a = merge("dare", base, experts, drop=0.5, scale=1.0, seed=3)
    b = merge("dare", base, experts, drop=0.5, scale=1.0, seed=3)
    assert torch.equal(a["w"], b["w"])
    assert torch.equal(
        merge("dare", base, experts, drop=0.0, scale=1.0)["w"], merge("task_arithmetic", base, experts, scale=1.0)["w"]
    )


def test_merge_returns_new_tensors_and_keeps_dtype():
    base, experts = _sds()
    base16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in base.items()}
    exp16 = {
        t: {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in e.items()} for t, e in experts.items()
    }
    out = merge("average", base16, exp16)
    assert out["w"].dtype == torch.bfloat16
    out["w"].add_(1.0)
    assert not torch.equal(out["w"], base16["w"])  # no aliasing of the inputs
    assert torch.equal(base["w"], _sds()[0]["w"])


def test_bad_input_errors_name_the_problem():
    base, experts = _sds()
    with pytest.raises(ValueError, match="unknown merge method 'nope'"):
        merge("nope", base, experts)
    bad = dict(experts)
    bad["t0"] = {**experts["t0"], "w": torch.zeros(5, 4)}
    with pytest.raises(ValueError, match="'w' has shape"):
        merge("average", base, bad)
    with pytest.raises(TypeError):
        merge("task_arithmetic", base, experts, density=0.2)


# ----------------------------------------------------------------------------- the matrix mergers

MATRIX_MERGERS = ("iso_c", "iso_cts", "tsv", "wudi")


def _matrix_sds(n=3, shape=(12, 6), seed=0):
    """A base with a 2-D, a 1-D and an integer entry, and ``n`` experts around it."""
    gen = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(*shape, generator=gen), "b": torch.randn(shape[0], generator=gen), "n": torch.tensor(3)}
    experts = {
        f"t{i}": {"w": base["w"] + torch.randn(*shape, generator=gen), "b": base["b"] + i + 1.0, "n": torch.tensor(9)}
        for i in range(n)
    }
    return base, experts


def _taus(base, experts, key="w"):
    return torch.stack([e[key] - base[key] for e in experts.values()])


def test_matrix_mergers_are_registered_with_the_issues_parameter_names():
    import inspect

    want = {"iso_c": ["scale"], "iso_cts": ["scale", "common_space_fraction"], "tsv": ["scale"]}
    want["wudi"] = ["iters", "lr", "seed"]
    for name, params in want.items():
        sig = inspect.signature(MERGERS[name]).parameters
        assert [p for p in sig if p in params] == params, name


def test_iso_c_flattens_the_spectrum_of_the_summed_task_vector():
    base, experts = _matrix_sds()
    out = merge("iso_c", base, experts, scale=1.5)
    tau = (out["w"] - base["w"]) / 1.5
    summed = _taus(base, experts).sum(0)
    sv = torch.linalg.svdvals(tau)
    assert torch.allclose(sv, torch.full_like(sv, float(torch.linalg.svdvals(summed).mean())), rtol=1e-5)
    # Same singular directions as the sum: tau = mean(S) U V^T, the polar factor of the sum.
    U, _, Vh = torch.linalg.svd(summed, full_matrices=False)
    assert torch.allclose(tau, sv[0] * U @ Vh, atol=1e-5)
    # The other entries: scale times the mean task vector; integers from the base.
    assert torch.allclose(out["b"], base["b"] + 1.5 * _taus(base, experts, "b").mean(0), atol=1e-6)
    assert torch.equal(out["n"], base["n"])


def test_iso_cts_split_gives_the_rest_evenly_to_the_tasks():
    from featcal.baselines.spectral import iso_cts_split

    for k, n_tasks, f in [(768, 8, 0.8), (6, 3, 0.5), (5, 3, 0.8), (4, 7, 0.1), (12, 5, 0.0)]:
        c, r = iso_cts_split(k, n_tasks, f)
        assert c + n_tasks * r == k and c >= 0 and r >= 0
    assert iso_cts_split(768, 8, 0.8) == (616, 19)  # int(614.4) = 614 -> round(154 / 8) = 19 per task


def test_iso_cts_is_flat_and_its_common_space_is_the_top_of_the_sum():
    base, experts = _matrix_sds(shape=(12, 6))  # k = 6, T = 3, f = 0.5: c = 3, one direction per task
    out = merge("iso_cts", base, experts, common_space_fraction=0.5)
    tau = out["w"] - base["w"]
    sv = torch.linalg.svdvals(tau)
    assert torch.allclose(sv, sv.mean().expand_as(sv), rtol=1e-5)
    # The top-3 left singular vectors of the sum lie in tau's column space (6 of 12 dimensions).
    U_top = torch.linalg.svd(_taus(base, experts).sum(0), full_matrices=False)[0][:, :3]
    Q = torch.linalg.svd(tau, full_matrices=False)[0]  # (12, 6): an orthonormal basis of the columns
    assert torch.allclose(Q @ (Q.T @ U_top), U_top, atol=1e-5)
    # Not Iso-C: the task-specific directions replace the sum's bottom ones.
    assert not torch.allclose(tau, merge("iso_c", base, experts)["w"] - base["w"], atol=1e-3)


def _orthogonal_tasks(n_tasks=3, r=4, extra=2, m=12, n=12, seed=0):
    """Task vectors whose top ``r`` singular directions are orthogonal across tasks (disjoint
    coordinates), plus ``extra`` weaker, random directions each."""
    gen = torch.Generator().manual_seed(seed)
    Qu, _ = torch.linalg.qr(torch.randn(m, m, generator=gen))
    Qv, _ = torch.linalg.qr(torch.randn(n, n, generator=gen))
    base = {"w": torch.randn(m, n, generator=gen)}
    experts, tops = {}, []
    for i in range(n_tasks):
        cols = slice(i * r, (i + 1) * r)
        top = Qu[:, cols] @ torch.diag(torch.linspace(5.0, 3.0, r) + i) @ Qv[:, cols].T
        weak = 0.1 * torch.randn(m, extra, generator=gen) @ torch.randn(extra, n, generator=gen) / n**0.5
        experts[f"t{i}"] = {"w": base["w"] + top + weak}
        tops.append(top)
    return base, experts, tops


def test_tsv_keeps_rank_k_over_t_per_task_and_orthogonalises():
    base, experts, _ = _orthogonal_tasks()
    taus = _taus(base, experts)
    out = merge("tsv", base, experts)
    tau = out["w"] - base["w"]
    # r = 12 // 3 = 4: the sum of every task's rank-4 truncation, orthogonalised; its singular
    # values are exactly the 12 kept ones (polar factors with orthonormal columns).
    kept = torch.cat([torch.linalg.svdvals(t)[:4] for t in taus]).sort(descending=True).values
    assert torch.allclose(torch.linalg.svdvals(tau), kept, rtol=1e-4)
    truncs = []
    for t in taus:
        U, S, Vh = torch.linalg.svd(t, full_matrices=False)
        truncs.append(U[:, :4] @ torch.diag(S[:4]) @ Vh[:4])
    # The truncations overlap a little (the weak directions tilt them), so orthogonalising
    # moves their sum, but only a little.
    assert torch.linalg.matrix_rank(tau) == 12
    assert (tau - sum(truncs)).norm() < 0.1 * tau.norm()


def test_tsv_on_orthogonal_truncations_is_their_sum():
    gen = torch.Generator().manual_seed(3)
    Q, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen))
    P, _ = torch.linalg.qr(torch.randn(8, 8, generator=gen))
    base = {"w": torch.zeros(8, 8)}
    # Task i: rank 4 on coordinates {4i..4i+3}; TSV with T = 2 keeps r = 4 each: exactly both.
    experts = {
        f"t{i}": {
            "w": Q[:, 4 * i : 4 * i + 4] @ torch.diag(torch.rand(4, generator=gen) + 1) @ P[:, 4 * i : 4 * i + 4].T
        }
        for i in range(2)
    }
    out = merge("tsv", base, experts)
    assert torch.allclose(out["w"], experts["t0"]["w"] + experts["t1"]["w"], atol=1e-5)


def test_wudi_lowers_its_objective_and_is_deterministic():
    from featcal.baselines.spectral import wudi_objective

    base, experts = _matrix_sds(shape=(6, 9))
    taus = _taus(base, experts)
    a = merge("wudi", base, experts, iters=50, lr=1e-2, seed=1, progress=False)
    b = merge("wudi", base, experts, iters=50, lr=1e-2, seed=1, progress=False)
    assert torch.equal(a["w"], b["w"])
    start = wudi_objective(taus.sum(0), taus)
    assert wudi_objective(a["w"] - base["w"], taus) < 0.8 * start
    # Zero steps: the summed task vector; other entries the mean task vector, unscaled.
    z = merge("wudi", base, experts, iters=0, progress=False)
    assert torch.allclose(z["w"], base["w"] + taus.sum(0), atol=1e-6)
    assert torch.allclose(z["b"], base["b"] + _taus(base, experts, "b").mean(0), atol=1e-6)


def test_wudi_objective_tall_and_wide_forms_agree():
    from featcal.baselines.spectral import wudi_objective

    gen = torch.Generator().manual_seed(2)
    taus = torch.randn(3, 7, 4, dtype=torch.float64, generator=gen)
    tau = torch.randn(7, 4, dtype=torch.float64, generator=gen)
    direct = sum(((tau - t) @ t.T).square().sum() / t.square().sum() for t in taus)
    assert torch.allclose(wudi_objective(tau, taus), direct)  # m > n: the n x n form
    assert torch.allclose(
        wudi_objective(tau.T, taus.mT), sum(((tau.T - t.T) @ t).square().sum() / t.square().sum() for t in taus)
    )


@pytest.mark.parametrize("method", MATRIX_MERGERS)
def test_matrix_mergers_leave_their_inputs_untouched(method):
    base, experts = _matrix_sds()
    before = (
        {k: v.clone() for k, v in base.items()},
        {t: {k: v.clone() for k, v in e.items()} for t, e in experts.items()},
    )
    out = merge(method, base, experts, **({"iters": 3, "progress": False} if method == "wudi" else {}))
    assert all(torch.equal(base[k], v) for k, v in before[0].items())
    assert all(torch.equal(experts[t][k], v) for t, e in before[1].items() for k, v in e.items())
    assert all(out[k].data_ptr() != base[k].data_ptr() for k in base)


def test_matrix_mergers_reject_bad_parameters():
    base, experts = _matrix_sds()
    with pytest.raises(ValueError, match="common_space_fraction"):
        merge("iso_cts", base, experts, common_space_fraction=1.5)
    with pytest.raises(ValueError, match="iters"):
        merge("wudi", base, experts, iters=-1)
    with pytest.raises(TypeError):
        merge("iso_c", base, experts, density=0.2)


def test_tsv_warns_when_a_matrix_has_fewer_singular_values_than_tasks():
    base, experts = _matrix_sds(n=3, shape=(2, 5))
    with pytest.warns(UserWarning, match="fewer singular values than there are tasks"):
        out = merge("tsv", base, experts)
    assert torch.equal(out["w"], base["w"])


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "dare"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_not_merged(method, bad):
    """``weights={t: nan | inf}`` returned an all-NaN / Inf state dict."""
    base = {"w": torch.zeros(4, 4)}
    experts = {"a": {"w": torch.ones(4, 4)}, "b": {"w": -torch.ones(4, 4)}}
    with pytest.raises(ValueError, match=r"weights: \{'a': (nan|inf)\} is not a finite number"):
        merge(method, base, experts, weights={"a": bad, "b": 1.0})


def test_per_task_weights_sit_on_the_task_vectors_device():
    """Task Arithmetic's weights column is made on the task vectors' device: made on the CPU it
    failed the first merge of a zoo held on a GPU (found on an H200). The meta device stands in."""
    from featcal.baselines.merging import _column

    taus = torch.empty(3, 4, 5, device="meta")
    w = _column([1.0, 0.5, 0.25], taus)
    assert w.device == taus.device and w.shape == (3, 1, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", sorted(MERGERS))
def test_each_merger_on_the_gpu_equals_its_cpu_result(method):
    base, experts = _sds()
    cpu = merge(method, base, experts)
    on = lambda sd: {k: v.cuda() for k, v in sd.items()}  # noqa: E731
    gpu = merge(method, on(base), {t: on(e) for t, e in experts.items()})
    for k, v in cpu.items():
        assert gpu[k].device.type == "cuda"
        torch.testing.assert_close(gpu[k].cpu(), v, rtol=1e-4, atol=1e-5)

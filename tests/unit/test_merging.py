"""Mergers: known closed forms on tiny state dicts."""

import pytest
import torch

from featcal import merge
from featcal.merging import MERGERS


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

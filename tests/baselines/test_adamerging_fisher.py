"""AdaMerging and Fisher merging (FusionBench's conventions) on a tiny CLIP tower with a linear
head per task: their defining properties."""

import copy

import pytest
import torch
from torch import nn

from featcal import adamerging, fisher_merging, merge, merge_with_data
from featcal.baselines.adamerging import entropy, learn_coefficients, model_from_coefficients
from featcal.baselines.fisher import diagonal_fisher, fisher_weighted_average
from tiny import perturbed, state_snapshot, tiny_hf_clip


def _setup(n_tasks=2, classes=4):
    base = tiny_hf_clip()
    experts = {f"t{i}": perturbed(base, 0.05, 10 + i) for i in range(n_tasks)}
    gen = torch.Generator().manual_seed(0)
    heads = {t: nn.Linear(32, classes).requires_grad_(False) for t in experts}
    for h in heads.values():
        nn.init.normal_(h.weight, std=1.0, generator=gen)
    data = {t: [torch.randn(8, 3, 16, 16, generator=gen) for _ in range(2)] for t in experts}

    def logits(model, task, batch):
        return heads[task](model(pixel_values=batch).pooler_output)

    return base, experts, data, logits


def test_entropy_is_shannons():
    p = torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]])
    want = torch.tensor([-(0.5 * torch.log(torch.tensor(0.5)) + 0.5 * torch.log(torch.tensor(0.25))), 0.0]).mean()
    assert float(entropy(torch.log(p + 1e-30))) == pytest.approx(float(want), abs=1e-6)


@pytest.mark.parametrize("granularity", ["task", "layer"])
def test_adamerging_lowers_the_entropy_seeded_and_deterministic(granularity):
    base, experts, data, logits = _setup()
    kw = dict(granularity=granularity, steps=25, lr=5e-2, batch=4, progress=False)
    a = learn_coefficients(base, experts, data, logits, seed=1, **kw)
    b = learn_coefficients(base, experts, data, logits, seed=1, **kw)
    P = len(list(base.parameters()))
    assert a.weights.shape == ((2,) if granularity == "task" else (2, P))
    assert a.losses == b.losses and torch.equal(a.weights, b.weights)
    k = 5  # the entropy over the last steps is below the first steps' (minibatches differ step to step)
    assert sum(a.losses[-k:]) / k < sum(a.losses[:k]) / k
    c = learn_coefficients(base, experts, data, logits, seed=2, **kw)
    assert c.losses != a.losses  # the seed draws the minibatches


def test_adamerging_starts_at_task_arithmetic_and_one_task_gives_that_expert():
    base, experts, data, logits = _setup()
    ta = merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
    start = model_from_coefficients(base, experts, torch.full((2,), 0.3))
    for k, v in start.state_dict().items():
        assert torch.allclose(v, ta[k], atol=1e-6), k
    one = {"t0": experts["t0"]}
    model = model_from_coefficients(base, one, torch.ones(1))
    for (k, v), w in zip(model.named_parameters(), experts["t0"].parameters()):
        assert torch.allclose(v, w, atol=1e-6), k


def test_adamerging_clamps_and_leaves_its_inputs_alone():
    base, experts, data, logits = _setup()
    before = {t: state_snapshot(m) for t, m in {"base": base, **experts}.items()}
    run = learn_coefficients(
        base, experts, data, logits, init=0.99, lr=0.5, steps=5, clamp_weights=True, progress=False
    )
    assert float(run.weights.min()) >= 0.0 and float(run.weights.max()) <= 1.0
    model = adamerging(base=base, experts=experts, calib_data=data, logits=logits, steps=2, progress=False)
    assert isinstance(model, type(base)) and not model.training
    for name, m in {"base": base, **experts}.items():
        assert all(torch.equal(v, before[name][k]) for k, v in m.state_dict().items()), name


def test_adamerging_without_a_head_is_refused_clearly():
    base, experts, data, _ = _setup()
    with pytest.raises(ValueError, match="logits=fn.*LLM"):
        merge_with_data("adamerging", base=base, experts=experts, calib_data=data)
    with pytest.raises(ValueError, match="granularity"):
        adamerging(base=base, experts=experts, calib_data=data, logits=lambda *a: None, granularity="block")


def test_a_zoo_without_heads_gets_the_refusal_not_a_key_error():
    """An LLM zoo has no class heads: ``featcal compare`` and ``featcal merge`` pass
    ``zoo_logits(zoo)``, which is then None, so each method says why it cannot run."""
    from types import SimpleNamespace

    from featcal.baselines.registry import zoo_logits

    base, experts, data, _ = _setup()
    llm_zoo = SimpleNamespace(heads={})
    assert zoo_logits(llm_zoo) is None
    for method in ("adamerging", "fisher_merging"):
        with pytest.raises(ValueError, match="LLM"):
            merge_with_data(method, base=base, experts=experts, calib_data=data, logits=zoo_logits(llm_zoo))


def test_fisher_weighted_average_one_expert_and_uniform_fisher():
    gen = torch.Generator().manual_seed(0)
    thetas = {
        "w": [torch.randn(3, 4, generator=gen) for _ in range(3)],
        "b": [torch.randn(4, generator=gen) for _ in range(3)],
    }
    one = fisher_weighted_average(
        {k: v[:1] for k, v in thetas.items()}, [{k: torch.rand(v[0].shape, generator=gen) for k, v in thetas.items()}]
    )
    assert all(torch.allclose(one[k], thetas[k][0]) for k in thetas)
    uniform = [{k: torch.full(v[0].shape, 0.7) for k, v in thetas.items()} for _ in range(3)]
    avg = fisher_weighted_average(thetas, uniform)
    assert all(torch.allclose(avg[k], torch.stack(thetas[k]).mean(0), atol=1e-6) for k in thetas)


def test_fisher_normalisation_makes_each_experts_scale_irrelevant():
    """normalize: c_i is 1/||F_i|| (over all parameters), so scaling one expert's Fisher by a
    constant changes nothing (up to the 1e-6 floor); without it the larger Fisher wins."""
    gen = torch.Generator().manual_seed(1)
    thetas = {"w": [torch.randn(5, generator=gen) for _ in range(2)]}
    F = [{"w": torch.rand(5, generator=gen) + 0.5} for _ in range(2)]
    scaled = [F[0], {"w": F[1]["w"] * 100.0}]
    assert torch.allclose(
        fisher_weighted_average(thetas, F)["w"], fisher_weighted_average(thetas, scaled)["w"], atol=1e-5
    )
    raw = fisher_weighted_average(thetas, scaled, normalize=False)
    assert (raw["w"] - thetas["w"][1]).abs().max() < (
        fisher_weighted_average(thetas, F)["w"] - thetas["w"][1]
    ).abs().max()


def test_diagonal_fisher_is_the_mean_squared_gradient_per_example_batch():
    base, experts, data, logits = _setup(n_tasks=1)
    F = diagonal_fisher(experts["t0"], "t0", data["t0"], logits, batch=16, n_examples=16)
    model = copy.deepcopy(experts["t0"])
    out = logits(model, "t0", torch.cat(data["t0"]))
    p = torch.softmax(out, -1).detach()
    (p.sqrt() * torch.log_softmax(out, -1)).sum().backward()
    for n, q in model.named_parameters():
        assert torch.allclose(F[n], q.grad**2 / 16, rtol=1e-4, atol=1e-12), n


def test_fisher_merging_of_one_task_gives_that_expert():
    base, experts, data, logits = _setup(n_tasks=1)
    model = fisher_merging(base=base, experts=experts, calib_data=data, logits=logits, progress=False)
    for k, v in model.state_dict().items():
        assert torch.allclose(v, experts["t0"].state_dict()[k], atol=1e-5), k
    with pytest.raises(ValueError, match="logits"):
        fisher_merging(base=base, experts=experts, calib_data=data)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_adamerging_and_fisher_equal_their_cpu_results():
    """Their coefficients and scalings are made on the weights' device (both were made on the CPU)."""
    base, experts, data, _ = _setup()
    heads = {t: nn.Linear(32, 4).requires_grad_(False) for t in experts}

    def logits_on(device):
        hs = {t: copy.deepcopy(h).to(device) for t, h in heads.items()}
        return lambda model, task, batch: hs[task](model(pixel_values=batch).pooler_output)

    kw = dict(granularity="task", steps=5, lr=5e-2, batch=4, progress=False, seed=1)
    cpu = learn_coefficients(base, experts, data, logits_on("cpu"), **kw)
    on = {t: copy.deepcopy(m).cuda() for t, m in experts.items()}
    gpu_data = {t: [b.cuda() for b in bs] for t, bs in data.items()}
    gpu = learn_coefficients(copy.deepcopy(base).cuda(), on, gpu_data, logits_on("cuda"), **kw)
    torch.testing.assert_close(gpu.weights.cpu(), cpu.weights, rtol=1e-3, atol=1e-5)
    params = {"w": [torch.randn(3, 2), torch.randn(3, 2)]}
    fishers = [{"w": torch.rand(3, 2)}, {"w": torch.rand(3, 2)}]
    want = fisher_weighted_average(params, fishers)["w"]
    got = fisher_weighted_average({"w": [v.cuda() for v in params["w"]]}, [{"w": f["w"].cuda()} for f in fishers])
    torch.testing.assert_close(got["w"].cpu(), want)

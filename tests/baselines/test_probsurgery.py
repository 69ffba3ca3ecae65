"""ProbSurgery (featcal.probsurgery) as its authors define it: two training steps equal a float64
re-derivation written here from the paper's equations (hand-written gradients, Adam by its
formula), inference reads the mean, it runs through the registry on the tiny CLIP zoo, and bad
options are refused by name."""

import math

import pytest
import torch

from diagnostics import compare as cmp
from featcal import ProbSurgeryOptions, probsurgery
from featcal.baselines import registry
from featcal.baselines.trained.probsurgery import ProbSurgeryAdapter
from featcal.zoo import load_any
from featcal.zoo.core import evaluate
from tiny import perturbed, tiny_hf_clip

BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


def _embeds(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=x).image_embeds.double()


def _grads(W_in, W_mu, W_s, z, t, eps, beta):
    """The loss ``L1(z - (mu + s eps), t) + beta mean_b KL_b`` and its gradients, by hand:
    ``a = ReLU(W_in z)``, ``mu = W_mu a``, ``lv = W_s a``, ``s = exp(lv / 2)``,
    ``KL_b = -1/2 sum_j (1 + lv - mu^2 - e^lv)``."""
    B, d = z.shape
    pre = z @ W_in.T
    a = pre.clamp_min(0)
    mu, lv = a @ W_mu.T, a @ W_s.T
    s = torch.exp(lv / 2)
    r = z - mu - s * eps - t
    kl = (-0.5 * (1 + lv - mu**2 - lv.exp()).sum(1)).mean()
    loss = r.abs().mean() + beta * kl
    dr = torch.sign(r) / (B * d)
    dmu = -dr + beta * mu / B
    dlv = -dr * eps * s / 2 - beta * 0.5 * (1 - lv.exp()) / B
    da = dmu @ W_mu + dlv @ W_s
    return float(loss), {"W_in": ((da * (pre > 0)).T @ z), "W_mu": dmu.T @ a, "W_s": dlv.T @ a}


def _adam(params, grads, state, step, lr):
    """torch.optim.Adam's update (no weight decay), in float64."""
    b1, b2 = BETAS
    for k, g in grads.items():
        m, v = state.get(k, (torch.zeros_like(g), torch.zeros_like(g)))
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        state[k] = (m, v)
        denom = v.sqrt() / math.sqrt(1 - b2**step) + ADAM_EPS
        params[k] = params[k] - lr / (1 - b1**step) * m / denom


def test_two_training_steps_equal_a_float64_rederivation_of_the_papers_equations():
    base = tiny_hf_clip(with_projection=True)
    expert, merged = perturbed(base, 0.05, 10), perturbed(base, 0.02, 3)
    x = torch.randn(6, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    seed, h, lr, beta, steps = 3, 8, 1e-2, 0.1, 2
    opts = ProbSurgeryOptions(steps=steps, batch=6, rank=h, lr=lr, kl_weight=beta, seed=seed, progress=False)
    cal = probsurgery(merged, {"t": expert}, {"t": [x]}, opts)

    z_all, t_all = _embeds(merged, x), _embeds(expert, x)
    n, d = z_all.shape
    # The start: W_in an nn.Linear weight (uniform in +-1/sqrt(d)) from the seeded generator, the rest zero.
    W_in = (torch.rand(h, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2 - 1) / d**0.5
    params = {
        "W_in": W_in,
        "W_mu": torch.zeros(d, h, dtype=torch.float64),
        "W_s": torch.zeros(d, h, dtype=torch.float64),
    }
    order = torch.Generator().manual_seed(seed)  # a new permutation of the examples per pass (one step here)
    noise = torch.Generator().manual_seed(seed + 1)  # eps ~ N(0, I), one row per example and step
    state, losses = {}, []
    for step in range(1, steps + 1):
        idx = torch.randperm(n, generator=order)
        eps = torch.randn(n, d, generator=noise, dtype=torch.float32).double()
        loss, grads = _grads(params["W_in"], params["W_mu"], params["W_s"], z_all[idx], t_all[idx], eps, beta)
        losses.append(loss)
        _adam(params, grads, state, step, lr)

    assert cal.runs["t"].losses == pytest.approx(losses, rel=1e-5)
    assert losses[0] > float((z_all - t_all).abs().mean()) + 0.1  # the noise (s = 1 at the start) is in the loss
    mod = cal.modules["t"]["embedding"]
    assert isinstance(mod, ProbSurgeryAdapter)
    for name, want in params.items():
        got = getattr(mod, name).detach().double()
        assert torch.allclose(got, want, atol=2e-6), (name, float((got - want).abs().max()))
    assert float(params["W_in"].sub(W_in).abs().max()) > 1e-4  # W_in moved at step 2: its gradient was checked


def test_inference_subtracts_the_mean_and_ignores_the_variance():
    base = tiny_hf_clip(with_projection=True)
    expert, merged = perturbed(base, 0.05, 10), perturbed(base, 0.02, 3)
    x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    cal = probsurgery(merged, {"t": expert}, {"t": [x]}, ProbSurgeryOptions(steps=30, batch=4, lr=1e-2, progress=False))
    mod = cal.modules["t"]["embedding"]
    assert mod.W_mu.abs().max() > 1e-3 and mod.W_s.abs().max() > 1e-3  # both heads trained
    model = cal.for_task("t")
    got = _embeds(model, x)
    z = _embeds(merged, x)
    W_in, W_mu = mod.W_in.detach().double(), mod.W_mu.detach().double()
    assert torch.allclose(got, z - (z @ W_in.T).clamp_min(0) @ W_mu.T, atol=1e-5)  # z - mu
    assert torch.equal(_embeds(model, x), got)  # no sampling at inference
    model.visual_projection.featcal_calibrator.W_s.fill_(5.0)  # any variance: the same output
    assert torch.equal(_embeds(model, x), got)
    with torch.no_grad():  # training samples: z - (mu + s eps), not the mean
        sampled, _ = mod.sampled(z.float(), torch.ones_like(z, dtype=torch.float32))
    assert not torch.allclose(sampled.double(), got, atol=1e-3)


@pytest.fixture(scope="module")
def zoo(tiny_zoo_dir):
    return load_any(tiny_zoo_dir)


def test_runs_through_the_registry_on_the_tiny_clip_zoo_with_modules_per_task(zoo):
    method = registry.get("ProbSurgery")
    assert (method.name, method.kind, method.label, method.task_specific) == (
        "probsurgery",
        "trained",
        "ProbSurgery",
        True,
    )
    assert method.options is ProbSurgeryOptions and method.length.name == "steps"
    assert {k: method.defaults[k] for k in ("rank", "steps", "lr", "batch", "kl_weight")} == dict(
        rank=128, steps=5000, lr=1e-3, batch=16, kl_weight=1e-4
    )  # the authors' (run.py, run_ProbSurgery.py)
    assert "probsurgery" in cmp.TRAINED and registry.get("probsurgery").fn is probsurgery
    params = registry.parse_param_items(["probsurgery.steps=3", "probsurgery.rank=4"])["probsurgery"]
    cal = method.fn(
        zoo.merged("task_arithmetic"), zoo.experts, zoo.calib_data(8), method.options(**params, progress=False)
    )
    assert cal.method == "probsurgery" and cal.tasks == list(zoo.tasks)
    assert all(list(mods) == ["embedding"] for mods in cal.modules.values())
    d_out = cal.modules[zoo.tasks[0]]["embedding"].W_mu.shape[0]
    assert cal.added_parameters["per_task"][zoo.tasks[0]]["trained"] == 3 * d_out * 4  # W_in, W_mu, W_s
    first, second = (cal.modules[t]["embedding"].W_mu for t in zoo.tasks[:2])
    assert not torch.allclose(first, second)  # task-specific modules
    assert all(r.steps == 3 for r in cal.runs.values())
    accuracy = evaluate(cal.for_task(zoo.tasks[0]), zoo, tasks=[zoo.tasks[0]])
    assert 0.0 <= accuracy[zoo.tasks[0]] <= 100.0


def test_the_comparison_runs_it_after_a_merger(zoo):
    result = cmp.compare(
        zoo,
        ["ta+probsurgery"],
        cmp.CompareOptions(n=8, calibrator_params={"probsurgery": {"steps": 2}}),
        progress=False,
    )
    row = result.summary.set_index("method").loc["ta+probsurgery"]
    assert row["label"] == "ta+probsurgery (2 steps)"  # shorter than the authors' 5000
    d_out = zoo.heads[zoo.tasks[0]].weight.shape[1]  # the heads read the final embedding
    assert row["added_trained"] == 3 * d_out * 128  # one task's W_in, W_mu, W_s at the authors' h
    assert 0.0 <= row["accuracy"] <= 100.0


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"kl_weight": -1e-4}, "kl_weight"),
        ({"kl_weight": float("nan")}, "kl_weight"),
        ({"rank": 0}, "rank"),
        ({"steps": 0}, "steps"),
        ({"pool": "max"}, "pool"),
    ],
)
def test_bad_options_are_refused_by_name(bad, name):
    with pytest.raises(ValueError, match=name):
        ProbSurgeryOptions(**bad)
    with pytest.raises(ValueError, match=name):
        registry.check_params("probsurgery", bad)


def test_unknown_or_mistyped_parameters_are_refused_by_name():
    with pytest.raises(ValueError, match="'hidden_layer'"):
        registry.check_params("probsurgery", {"hidden_layer": 64})
    with pytest.raises(ValueError, match="'kl_weight'"):
        registry.parse_param_items(["probsurgery.kl_weight=big"])

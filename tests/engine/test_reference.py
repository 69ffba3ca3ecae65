"""The fast engine against the plain float64 reference (featcal/method/reference.py), and the
reference's maths against closed-form truths (docs/maths.md)."""

import copy
import functools

import pytest
import torch

import tiny
from featcal import FastPaths, FeatCalConfig, calibrate, merge
from featcal.method.reference import (
    anchor,
    calibrate_reference,
    layernorm_affine,
    layernorm_moments,
    linear_bias,
    linear_weight,
    task_scale,
    task_statistics,
)
from featcal.model.arch import block_targets, get_params, resolve_stacks

# ---------------------------------------------------------------------------- engine == reference

KINDS = ["toy", "hf_clip", "open_clip", "toy_padded", "llama_padded", "llama_left_padded", "bert", "roberta", "t5"]
SETTINGS = {
    "default": FeatCalConfig(stats_dtype=torch.float64),
    "clip_token_weights": FeatCalConfig.clip(rho=2.2, alpha=0.25, stats_dtype=torch.float64),
    "no_bias_no_layernorm": FeatCalConfig(
        lam=0.5, rho=0.5, alpha=0.7, bias=False, layernorm=False, stats_dtype=torch.float64
    ),
}
BATCHING = ["several_batches", "one_batch"]


class DictToy(tiny.ToyModel):
    """The toy model called with a dict batch (``model(**batch)``) that carries a padding mask."""

    def forward(self, x, attention_mask=None):
        return super().forward(x)


def _task_arithmetic(base, experts):
    merged = copy.deepcopy(base)
    merged.load_state_dict(
        merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
    )
    return merged


def _padded_zoo():
    """Toy models on dict batches whose masks pad a different number of tokens per example."""
    torch.manual_seed(0)
    base = DictToy()
    experts = {f"t{i}": tiny.perturbed(base, 0.3, 20 + i) for i in range(2)}
    gen = torch.Generator().manual_seed(3)
    data = {}
    for t in experts:
        x = torch.randn(8, 5, 6, generator=gen)
        mask = torch.ones(8, 5)
        for r, pad in enumerate([0, 1, 2, 3, 0, 2, 1, 3]):
            mask[r, 5 - pad :] = 0
        data[t] = [{"x": x[i : i + 4], "attention_mask": mask[i : i + 4]} for i in (0, 4)]
    return base, experts, _task_arithmetic(base, experts), data


def _llama_zoo():
    """A tiny Llama: blocks called with position embeddings and masks as keyword arguments,
    token ids padded at the end of some sequences."""
    base = tiny.tiny_llama()
    experts = {t: tiny.perturbed(base, 0.02, i) for i, t in enumerate("ab")}
    gen = torch.Generator().manual_seed(1)
    data = {}
    for t in experts:
        ids = torch.randint(0, 50, (4, 16), generator=gen)
        mask = torch.ones(4, 16, dtype=torch.long)
        mask[0, 9:] = 0
        mask[3, 12:] = 0
        data[t] = [{"input_ids": ids[i : i + 2], "attention_mask": mask[i : i + 2]} for i in (0, 2)]
    return base, experts, _task_arithmetic(base, experts), data


def _one_batch(batches):
    """A task's batches as one batch (tensors, or dicts of tensors, concatenated)."""
    if isinstance(batches[0], dict):
        return [{k: torch.cat([b[k] for b in batches]) for k in batches[0]}]
    return [torch.cat(batches)]


@functools.cache
def _zoo(kind, batching):
    """``(base, experts, merged, data)``; built once per kind and batching (nothing mutates them)."""
    if kind == "toy_padded":
        base, experts, merged, data = _padded_zoo()
    elif kind == "llama_padded":
        base, experts, merged, data = _llama_zoo()
    elif kind == "llama_left_padded":
        base, experts, merged, data = tiny.text_zoo(
            tiny.tiny_llama, lambda seed: tiny.text_batches(vocab=50, left=True, seed=seed)
        )
    elif kind in ("bert", "roberta"):
        make = functools.partial(tiny.tiny_bert, roberta=kind == "roberta")
        base, experts, merged, data = tiny.text_zoo(make, lambda seed: tiny.text_batches(seed=seed))
    elif kind == "t5":  # both stacks in one call; encoder and decoder padded, of different lengths
        base, experts, merged, data = tiny.text_zoo(tiny.tiny_t5, lambda seed: tiny.t5_batches(seed=seed))
    else:
        base, experts, merged, data = tiny.zoo(kind, n_tasks=3 if kind == "toy" else 2)
    if batching == "one_batch":
        data = {t: _one_batch(bs) for t, bs in data.items()}
    return base, experts, merged, data


@functools.cache
def _reference(kind, setting, batching):
    base, experts, merged, data = _zoo(kind, batching)
    return calibrate_reference(merged, base=base, experts=experts, calib_data=data, config=SETTINGS[setting])


def _targets(model):
    """``{(stack, block, target name): (W, b)}`` of every Linear and LayerNorm in every block."""
    return {
        (path, i, t.name): get_params(blk, t)
        for path, blks in resolve_stacks(model)
        for i, blk in enumerate(blks)
        for t in block_targets(blk)
    }


def assert_matches_reference(model, ref, rel=1e-4):
    """Every calibrated parameter (weights, biases, LayerNorm affines) of ``model`` equals the
    reference's to ``rel`` of the parameter's largest entry."""
    want = _targets(ref)
    for key, params in _targets(model).items():
        for name, got, exp in zip(("weight", "bias"), params, want[key]):
            assert (got is None) == (exp is None), (key, name)
            if got is not None:
                err = float((got.double() - exp.double()).abs().max() / exp.double().abs().max())
                assert err <= rel, f"{key} {name}: relative error {err:.2e} > {rel:.0e}"


@pytest.mark.filterwarnings("ignore:task .* token rows")
@pytest.mark.parametrize("batching", BATCHING)
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_engine_matches_reference(kind, setting, batching):
    base, experts, merged, data = _zoo(kind, batching)
    got, _ = calibrate(merged, base=base, experts=experts, calib_data=data, config=SETTINGS[setting], progress=False)
    ref = _reference(kind, setting, batching)
    assert_matches_reference(got, ref)
    # Not a vacuous comparison: the reference moved weights away from the merged ones in every block.
    mer = _targets(merged)
    for block in {key[:2] for key in mer}:
        assert any(
            not torch.allclose(W, mer[key][0], rtol=1e-3, atol=1e-5)
            for key, (W, _) in _targets(ref).items()
            if key[:2] == block
        ), block


# Every fast path of the engine, forced on where the tiny models would not take it by default.
PATHS = {
    "plainest": FastPaths.plainest(),
    "form_PW": FastPaths(form="PW"),
    "form_PW+CW": FastPaths(form="PW+CW"),
    "all_forced": FastPaths(pool_rows=1 << 20, stack_max=1 << 40, direct_rows=1e9, lapack_min_d=1, gram_block=2),
}


@pytest.mark.filterwarnings("ignore:task .* token rows")
@pytest.mark.parametrize("batching", BATCHING)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_fast_path_matches_reference(kind, path, batching):
    base, experts, merged, data = _zoo(kind, batching)
    got, _ = calibrate(
        merged,
        base=base,
        experts=experts,
        calib_data=data,
        config=SETTINGS["clip_token_weights"],
        fast=PATHS[path],
        progress=False,
    )
    assert_matches_reference(got, _reference(kind, "clip_token_weights", batching))


def test_reference_drops_padding_rows():
    """Masked tokens are out of the statistics: junk in them changes nothing."""
    base, experts, merged, data = _zoo("toy_padded", "several_batches")
    junk = {
        t: [dict(b, x=torch.where(b["attention_mask"][..., None] > 0, b["x"], 1e3)) for b in bs]
        for t, bs in data.items()
    }
    cfg = SETTINGS["default"]
    a = calibrate_reference(merged, base=base, experts=experts, calib_data=data, config=cfg)
    b = calibrate_reference(merged, base=base, experts=experts, calib_data=junk, config=cfg)
    assert_matches_reference(a, b, rel=1e-6)


# ---------------------------------------------------------------------------- the maths, closed-form truths


def _tasks(n=3, rows=12, d=4, o=3, seed=0):
    """Per task: calibrating rows ``xs``, expert rows ``xe``, positive row weights, ``W_i``, ``b_i``."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    weights = [torch.rand(rows, generator=gen, dtype=torch.float64) + 0.1 for _ in range(n)]
    return [(randn(rows, d), randn(rows, d), w, randn(o, d), randn(o)) for w in weights]


def _solve_linear(tasks, W_anc, b_anc, lam, eps, alpha):
    stats = [task_statistics(xs, xe, w, alpha) for xs, xe, w, _, _ in tasks]
    Cs, Xs, mus_s, mus_t = zip(*stats)
    scales = [task_scale(C, eps) for C in Cs]
    W_i, b_i = [t[3] for t in tasks], [t[4] for t in tasks]
    W = linear_weight(Cs, Xs, scales, W_i, W_anc, lam, eps)
    return W, linear_bias(W, mus_s, mus_t, scales, W_i, b_i, b_anc, lam), scales


def _objective(W, b, tasks, scales, W_anc, b_anc, lam, eps, alpha):
    """``sum_i s_i E|W xs + b - W_i xt - b_i|^2 + lam (|W - W_anc|^2 + |b - b_anc|^2) + eps |W|^2``,
    straight from the rows; ``b`` None: the same without any bias (the weight's objective)."""
    total = lam * (W - W_anc).square().sum() + eps * W.square().sum()
    if b is not None:
        total = total + lam * (b - b_anc).square().sum()
    for s, (xs, xe, w, W_i, b_i) in zip(scales, tasks):
        xt = alpha * xe + (1 - alpha) * xs
        r = xs @ W.T - xt @ W_i.T  # (rows, o)
        if b is not None:
            r = r + b - b_i
        total = total + s * (w @ r.square().sum(1)) / w.sum()
    return total


def test_linear_solution_zeroes_the_objectives_gradient():
    """The weight minimises the bias-free objective of 'Linear weight'; the bias then minimises
    the objective with biases for that weight ('Linear bias')."""
    tasks = _tasks()
    gen = torch.Generator().manual_seed(1)
    W_anc = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    b_anc = torch.randn(3, generator=gen, dtype=torch.float64)
    lam, eps, alpha = 0.05, 1e-8, 0.3
    W, b, scales = _solve_linear(tasks, W_anc, b_anc, lam, eps, alpha)

    def grad(W, b):
        W, b = W.clone().requires_grad_(), None if b is None else b.clone().requires_grad_()
        wrt = (W,) if b is None else (b,)
        return torch.autograd.grad(_objective(W, b, tasks, scales, W_anc, b_anc, lam, eps, alpha), wrt)[0]

    # Relative to the gradient at the anchor, so the bound does not depend on the problem's scale.
    assert grad(W, None).norm() < 1e-9 * grad(W_anc, None).norm()
    assert grad(W, b).norm() < 1e-9 * grad(W, b_anc).norm()


def test_lambda_to_infinity_gives_the_anchor():
    tasks = _tasks()
    W_mer, W_0 = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    b_mer, b_0 = torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    W_anc, b_anc = anchor(W_mer, W_0, 2.2), anchor(b_mer, b_0, 2.2)
    W, b, _ = _solve_linear(tasks, W_anc, b_anc, lam=1e12, eps=1e-8, alpha=0.3)
    assert torch.allclose(W, 2.2 * W_mer - 1.2 * W_0, atol=1e-9)
    assert torch.allclose(b, b_anc, atol=1e-9)
    es, ms = zip(*(layernorm_moments(xs, w, 1e-5) for xs, _, w, _, _ in tasks))
    gammas, betas = [t[3][0] for t in tasks], [t[3][1] for t in tasks]  # any (d,) vectors
    gamma, beta = layernorm_affine(es, ms, gammas, betas, W_anc[0], W_anc[1], lam=1e12, eps=1e-8)
    assert torch.allclose(gamma, W_anc[0], atol=1e-9) and torch.allclose(beta, W_anc[1], atol=1e-9)


def test_task_scale_makes_a_tasks_weight_independent_of_its_feature_scale():
    """``s_i`` divides out the size of task i's features: scaling its rows by 10 (both streams)
    leaves the solution as it was, where without ``s_i`` it would dominate the solve."""
    tasks = _tasks()
    W_anc, b_anc = torch.zeros(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    W, _, _ = _solve_linear(tasks, W_anc, b_anc, 0.05, 1e-8, 0.3)
    xs, xe, w, W_i, b_i = tasks[0]
    louder = [(10 * xs, 10 * xe, w, W_i, b_i), *tasks[1:]]
    W10, _, _ = _solve_linear(louder, W_anc, b_anc, 0.05, 1e-8, 0.3)
    assert torch.allclose(W10, W, atol=1e-10)
    assert task_scale(torch.zeros(4, 4, dtype=torch.float64), 1e-8) == 1e8  # clamped at eps, not infinite


def test_task_statistics_weights_count_as_repeated_rows():
    xs, xe, w, _, _ = _tasks(n=1)[0]
    w = torch.ones(len(xs), dtype=torch.float64)
    w[0] = 3.0
    once = task_statistics(xs, xe, w, 0.4)
    rep = task_statistics(
        torch.cat([xs, xs[:1], xs[:1]]),
        torch.cat([xe, xe[:1], xe[:1]]),
        torch.ones(len(xs) + 2, dtype=torch.float64),
        0.4,
    )
    for a, b in zip(once, rep):
        assert torch.allclose(a, b, atol=1e-12)
    C, X, mu_s, mu_t = task_statistics(xs, xe, w, 0.0)  # alpha 0: the target is the input itself
    assert torch.allclose(X, C) and torch.allclose(mu_t, mu_s)


def test_layernorm_affine_is_the_least_squares_fit():
    """Per channel, the 2x2 system's solution is the ridge least-squares fit of
    ``gamma z + beta`` to every expert's ``gamma_i z + beta_i`` (rows weighted within a task)."""
    tasks = _tasks(d=5)
    lam, ln_eps = 0.3, 1e-5
    es, ms = zip(*(layernorm_moments(xs, w, ln_eps) for xs, _, w, _, _ in tasks))
    gammas, betas = [t[3][0] for t in tasks], [t[3][1] for t in tasks]  # any (d,) vectors
    g_anc, b_anc = torch.linspace(0.5, 1.5, 5, dtype=torch.float64), torch.linspace(-1, 1, 5, dtype=torch.float64)
    gamma, beta = layernorm_affine(es, ms, gammas, betas, g_anc, b_anc, lam, eps=1e-12)
    for c in range(5):
        A, y = [], []
        for (xs, _, w, _, _), g, b in zip(tasks, gammas, betas):
            z = torch.nn.functional.layer_norm(xs, (5,), eps=ln_eps)[:, c]
            sw = (w / w.sum()).sqrt()
            A.append(torch.stack([sw * z, sw], 1))
            y.append(sw * (g[c] * z + b[c]))
        A.append(lam**0.5 * torch.eye(2, dtype=torch.float64))  # the pull toward the anchor
        y.append(lam**0.5 * torch.stack([g_anc[c], b_anc[c]]))
        fit = torch.linalg.lstsq(torch.cat(A), torch.cat(y)[:, None]).solution[:, 0]
        assert torch.allclose(fit, torch.stack([gamma[c], beta[c]]), atol=1e-10), c

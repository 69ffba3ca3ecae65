"""ACE-Merging (featcal.merge("ace")) on tiny seeded state dicts and models: equal to a plain float64
re-derivation of its update (numpy, sample by sample), its limits (one task, the prior, the ridge,
the refinement), every architecture, the models given left as they are, bad parameters refused."""

import numpy as np
import pytest
import torch

import tiny
from featcal import merge
from featcal.baselines import ace
from featcal.baselines.registry import ParamError, get


def _reference(taus: np.ndarray, prior: float, ridge: float, refine: float) -> np.ndarray:
    """ACE-Merging of one entry written out with numpy, loops and an explicit inverse: each task's
    covariance the mean outer product of its rows, scaled to mean eigenvalue 1, shrunk toward the
    tasks' mean, plus the ridge; ``tau = (sum_t tau_t Sigma_t) inv(sum_t Sigma_t)``; the singular
    values moved toward their mean."""
    T, m, n = taus.shape
    N = []
    for tau in taus:
        S = sum(np.outer(row, row) for row in tau) / m
        N.append(S * n / np.trace(S))
    P = sum(N) / T
    Sig = [(1 - prior) * Nt + prior * P + ridge * np.eye(n) for Nt in N]
    merged = sum(tau @ S for tau, S in zip(taus, Sig)) @ np.linalg.inv(sum(Sig))
    U, s, Vt = np.linalg.svd(merged, full_matrices=False)
    return U @ np.diag((1 - refine) * s + refine * s.mean()) @ Vt


@pytest.mark.parametrize("prior, ridge, refine", [(0.1, 0.01, 0.5), (0.0, 1e-3, 0.0), (0.7, 0.3, 1.0)])
def test_equals_a_float64_rederivation(prior, ridge, refine):
    base, experts, _ = tiny.toy_zoo(n_tasks=3)
    b, sds = base.state_dict(), {t: e.state_dict() for t, e in experts.items()}
    out = merge("ace", b, sds, scale=0.8, prior=prior, ridge=ridge, refine=refine, progress=False)
    for k, v in b.items():
        taus = np.stack([sd[k].double().numpy() - v.double().numpy() for sd in sds.values()])
        if v.dim() == 2:
            want = v.double().numpy() + 0.8 * _reference(taus, prior, ridge, refine)
        else:  # every other entry: the mean task vector, scaled
            want = v.double().numpy() + 0.8 * taus.mean(0)
        assert np.allclose(out[k].double().numpy(), want, atol=2e-6), (k, np.abs(out[k].double().numpy() - want).max())


def test_its_limits():
    gen = torch.Generator().manual_seed(3)
    taus = torch.randn(3, 5, 7, dtype=torch.float64, generator=gen)
    one = ace.ace_task_vector(taus[:1], prior=0.4, ridge=0.2, refine=0.0)
    assert torch.allclose(one, taus[0])  # one task: its own update, whatever the prior and ridge
    mean = taus.mean(0)
    assert torch.allclose(ace.ace_task_vector(taus, prior=1.0, refine=0.0), mean)  # prior 1: averaging
    assert torch.allclose(ace.ace_task_vector(taus, ridge=1e9, refine=0.0), mean, atol=1e-7)  # huge ridge: too
    plain = ace.ace_task_vector(taus, prior=0.0, ridge=1e-12, refine=0.0)
    shrunk = ace.ace_task_vector(taus, prior=0.3, ridge=1e-12, refine=0.0)
    assert torch.allclose(shrunk, 0.7 * plain + 0.3 * mean, atol=1e-8)  # the prior blends toward the mean
    flat = torch.linalg.svdvals(ace.ace_task_vector(taus, refine=1.0))
    assert torch.allclose(flat, flat.mean().expand_as(flat))  # refine 1: Iso-C's flat spectrum
    s0, s1 = (
        torch.linalg.svdvals(ace.ace_task_vector(taus, refine=0.0)),
        torch.linalg.svdvals(ace.ace_task_vector(taus)),
    )
    assert torch.isclose(s0.sum(), s1.sum()) and not torch.allclose(s0, s1)  # the sum kept, the spread halved
    # A task's update scaled by 10 keeps its normalised covariance: the weights do not follow the scale.
    scaled = taus.clone()
    scaled[1] *= 10
    assert all(torch.allclose(a, b) for a, b in zip(ace.ace_covariances(taus), ace.ace_covariances(scaled)))


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip", "bert", "t5", "llama"])
def test_every_architecture_and_its_inputs_untouched(kind):
    base, experts, _, _ = tiny.any_zoo(kind)
    m = get("ace", "merger")
    assert (m.label, m.defaults) == ("ACE-Merging", {"scale": 1.0, "prior": 0.1, "ridge": 0.01, "refine": 0.5})
    b, sds = base.state_dict(), {t: e.state_dict() for t, e in experts.items()}
    before = {k: v.clone() for k, v in b.items()}, {t: {k: v.clone() for k, v in sd.items()} for t, sd in sds.items()}
    out = merge("ace", b, sds, progress=False)
    mean = merge("average", b, sds)
    assert all(torch.equal(b[k], v) for k, v in before[0].items())
    assert all(torch.equal(sds[t][k], v) for t, sd in before[1].items() for k, v in sd.items())
    moved = [k for k, v in b.items() if v.dim() == 2 and not torch.allclose(out[k], mean[k], atol=1e-6)]
    assert len(moved) >= sum(v.dim() == 2 for v in b.values()) // 2
    assert all(torch.isfinite(v.float()).all() and v.dtype == b[k].dtype for k, v in out.items())


def test_bad_parameters_are_refused_by_name():
    base, experts, _ = tiny.toy_zoo(n_tasks=2)
    b, sds = base.state_dict(), {t: e.state_dict() for t, e in experts.items()}
    with pytest.raises(ParamError, match=r"ace: parameter 'prior' takes a number in \[0, 1\]"):
        merge("ace", b, sds, prior=1.5)
    with pytest.raises(ParamError, match=r"ace: parameter 'ridge' takes a number in \[1e-12, 1e\+06\]"):
        merge("ace", b, sds, ridge=0.0)
    with pytest.raises(ParamError, match=r"ace takes no parameter 'anchor'"):
        merge("ace", b, sds, anchor="ta")
    from featcal.baselines.merging import ace as ace_merger

    with pytest.raises(ValueError, match=r"ace: prior and refine must be in \[0, 1\] and ridge > 0"):
        ace_merger(b, sds, refine=-0.1)

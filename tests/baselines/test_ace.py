"""ACE-Merging (featcal.merge("ace")) on tiny seeded state dicts and models: equal to a plain float64
re-derivation of the authors' update (numpy, loops, an explicit inverse), in both of its branches
(homogeneous and heterogeneous tasks); its limits (one task, identical experts, a huge ridge, no
refinement); CLIP's text projection averaged; every architecture, the models given left as they
are, bad parameters refused."""

import numpy as np
import pytest
import torch

import tiny
from featcal import merge
from featcal.baselines import ace
from featcal.baselines.registry import ParamError, get


def _reference(taus: np.ndarray, eps: float, k_frac: float, threshold: float) -> np.ndarray:
    """The authors' ACE update of one entry (github unravel-xu/ACE-Merging, src/merge/strategy.py,
    ``ace_merging``) written out with numpy, in float64.

    gamma = var(log ||tau_t||^2) / mean(log ||tau_t||^2)^2 (unbiased variance); heterogeneous
    above ``threshold``. Each task: rows centred, S_t = sum over rows of outer(row, row); divided
    by its trace (and the ridge eps with it) when heterogeneous. A = sum_t (S_t + ridge_t I) plus,
    in every row, the column means of sum_t S_t (divided by the mean ||tau_t||^2 when
    heterogeneous); W0 = sum_t C_t (S_t + ridge_t I) inv(A). Heterogeneous: plus the top
    k = int(k_frac min(m, n)) singular directions of W0 + sum_t tau_t (S_t - mean_s (S_s + ridge_s
    I)), each with their mean singular value."""
    T, m, n = taus.shape
    sq_norms = np.array([np.sum(tau * tau) for tau in taus])
    logs = np.log(sq_norms + 1e-12)
    gamma = np.var(logs, ddof=1) / (np.mean(logs) ** 2 + 1e-12) if T > 1 else np.nan
    het = gamma > threshold
    Cs, Ss, ridges = [], [], []
    for tau in taus:
        C = tau - tau.mean(axis=0)
        S = sum(np.outer(row, row) for row in C)
        tr = np.trace(S) + 1e-12
        Cs.append(C)
        Ss.append(S / tr if het else S)
        ridges.append(eps / tr if het else eps)
    prior = sum(Ss).mean(axis=0)
    if het:
        prior = prior / (sq_norms.mean() + 1e-12)
    A = sum(S + r * np.eye(n) for S, r in zip(Ss, ridges))
    A = A + np.outer(np.ones(n), prior)
    B = sum(C @ (S + r * np.eye(n)) for C, S, r in zip(Cs, Ss, ridges))
    W0 = B @ np.linalg.inv(A)
    if not het:
        return W0
    M = sum(S + r * np.eye(n) for S, r in zip(Ss, ridges)) / T
    fused = W0 + sum(tau @ (S - M) for tau, S in zip(taus, Ss))
    U, s, Vt = np.linalg.svd(fused, full_matrices=False)
    k = int(min(m, n) * k_frac)
    return W0 + s[:k].mean() * U[:, :k] @ Vt[:k]


def _spread(b: dict, sds: dict, factors) -> dict:
    """The experts with task i's update multiplied by ``factors[i]``: update sizes made unequal."""
    return {t: {k: b[k] + f * (sd[k] - b[k]) for k in b} for f, (t, sd) in zip(factors, sds.items())}


@pytest.mark.parametrize("factors, heterogeneous", [((1.0, 1.0, 1.0), False), ((1.0, 20.0, 400.0), True)])
@pytest.mark.parametrize("eps, k_frac", [(1e-2, 0.3), (0.5, 0.6)])
def test_equals_a_float64_rederivation(factors, heterogeneous, eps, k_frac):
    base, experts, _ = tiny.toy_zoo(n_tasks=3)
    b = base.state_dict()
    sds = _spread(b, {t: e.state_dict() for t, e in experts.items()}, factors)
    out = merge("ace", b, sds, scale=0.8, eps=eps, k_frac=k_frac, progress=False)
    matrices = 0
    for k, v in b.items():
        taus = np.stack([sd[k].double().numpy() - v.double().numpy() for sd in sds.values()])
        if v.dim() == 2:
            matrices += 1
            assert (ace.heterogeneity(torch.from_numpy(taus)) > 0.3) == heterogeneous, k  # the branch meant
            want = v.double().numpy() + 0.8 * _reference(taus, eps, k_frac, 0.3)
        else:  # every other entry: the mean task vector, scaled
            want = v.double().numpy() + 0.8 * taus.mean(0)
        got = out[k].double().numpy()
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max()), (k, np.abs(got - want).max())
    assert matrices >= 2


def test_the_threshold_picks_the_branch():
    gen = torch.Generator().manual_seed(5)
    taus = torch.randn(4, 9, 7, dtype=torch.float64, generator=gen) * torch.tensor([1.0, 2.0, 0.5, 3.0]).view(4, 1, 1)
    logs = np.log(taus.square().sum(dim=(1, 2)).numpy() + 1e-12)
    gamma = ace.heterogeneity(taus)
    assert np.isclose(gamma, np.var(logs, ddof=1) / (np.mean(logs) ** 2 + 1e-12))
    for threshold in (gamma - 1e-3, gamma + 1e-3):
        want = _reference(taus.numpy(), 1e-2, 0.3, threshold)
        assert np.allclose(ace.ace_task_vector(taus, threshold=threshold).numpy(), want)
    flat = ace.ace_task_vector(taus, threshold=gamma + 1e-3)
    lifted = ace.ace_task_vector(taus, threshold=gamma - 1e-3)
    assert not torch.allclose(flat, lifted)
    assert np.isnan(ace.heterogeneity(taus[:1]))  # one task: undefined, never heterogeneous


def test_its_limits():
    gen = torch.Generator().manual_seed(3)
    tau = torch.randn(1, 8, 6, dtype=torch.float64, generator=gen)
    centred = tau[0] - tau[0].mean(0)
    # Homogeneous tasks: the merge of the centred updates, so every column sums to zero over the rows.
    taus = torch.randn(3, 8, 6, dtype=torch.float64, generator=gen)
    assert ace.heterogeneity(taus) < 0.3
    assert torch.allclose(ace.ace_task_vector(taus).sum(0), torch.zeros(6, dtype=torch.float64), atol=1e-12)
    # A huge ridge: the mean centred update.
    big = ace.ace_task_vector(taus, eps=1e12)
    assert torch.allclose(big, (taus - taus.mean(1, keepdim=True)).mean(0), atol=1e-9)
    # Identical experts, any number of them (one included): the same merge; with a huge ridge the
    # expert's own centred update.
    one = ace.ace_task_vector(tau)
    for copies in (2, 5):
        assert torch.allclose(ace.ace_task_vector(tau.expand(copies, -1, -1)), one)
    assert torch.allclose(ace.ace_task_vector(tau, eps=1e12), centred, atol=1e-9)
    # Heterogeneous tasks: k_frac 0 adds nothing to the closed form; k_frac 0.5 adds k = 3 equal
    # singular values (rank 3).
    spread = taus * torch.tensor([1.0, 30.0, 900.0], dtype=torch.float64).view(3, 1, 1)
    assert ace.heterogeneity(spread) > 0.3
    closed = ace.ace_task_vector(spread, k_frac=0.0)
    added = torch.linalg.svdvals(ace.ace_task_vector(spread, k_frac=0.5) - closed)
    assert torch.allclose(added[:3], added[0].expand(3)) and added[0] > 0 and torch.all(added[3:] < 1e-9 * added[0])
    # Fewer than 4 rows or columns: k = int(0.3 * 3) = 0, no refinement (theirs: NaN).
    small = spread[:, :3, :]
    assert torch.isfinite(ace.ace_task_vector(small)).all()
    assert torch.allclose(ace.ace_task_vector(small), ace.ace_task_vector(small, k_frac=0.0))


def test_clips_text_projection_is_averaged():
    gen = torch.Generator().manual_seed(1)
    b = {
        "text_projection": torch.randn(6, 6, generator=gen),
        "visual_projection.weight": torch.randn(6, 6, generator=gen),
    }
    sds = {t: {k: v + torch.randn(v.shape, generator=gen) for k, v in b.items()} for t in "abc"}
    out = merge("ace", b, sds, progress=False)
    mean = merge("average", b, sds)
    assert torch.allclose(out["text_projection"], mean["text_projection"])
    assert not torch.allclose(out["visual_projection.weight"], mean["visual_projection.weight"], atol=1e-3)


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip", "bert", "t5", "llama"])
def test_every_architecture_and_its_inputs_untouched(kind):
    base, experts, _, _ = tiny.any_zoo(kind)
    m = get("ace", "merger")
    assert (m.label, m.defaults) == ("ACE-Merging", {"scale": 1.0, "eps": 0.01, "k_frac": 0.3, "threshold": 0.3})
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
    with pytest.raises(ParamError, match=r"ace: parameter 'k_frac' takes a number in \[0, 1\]"):
        merge("ace", b, sds, k_frac=1.5)
    with pytest.raises(ParamError, match=r"ace: parameter 'eps' takes a number in \[1e-12, 1e\+06\]"):
        merge("ace", b, sds, eps=0.0)
    with pytest.raises(ParamError, match=r"ace takes no parameter 'prior'"):
        merge("ace", b, sds, prior=0.1)
    from featcal.baselines.merging import ace as ace_merger

    with pytest.raises(ValueError, match=r"ace: eps must be > 0, k_frac in \[0, 1\] and threshold finite"):
        ace_merger(b, sds, k_frac=-0.1)

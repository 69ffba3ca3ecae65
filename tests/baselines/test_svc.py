"""featcal.svc against FusionBench 0.2.33's own SVC code (its singular_value_calibration utils,
loaded from the installed package's file: they need torch only) on seeded random weights, and
against the published formula written out as loops."""

import importlib.util
from pathlib import Path

import pytest
import torch

from featcal import svc
from featcal.baselines.svc import svc_matrix


def _fusion_bench_svc():
    spec = importlib.util.find_spec("fusion_bench")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fusion-bench is not installed (requirements-nodeps.txt)")
    path = Path(next(iter(spec.submodule_search_locations))) / "method" / "singular_value_calibration" / "utils.py"
    mod_spec = importlib.util.spec_from_file_location("fusion_bench_svc_utils", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def _weights(seed, shape=(7, 5), T=3, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(*shape, generator=gen, dtype=torch.float64)
    shared = 0.3 * torch.randn(*shape, generator=gen, dtype=torch.float64)  # a direction every task shares
    experts = [base + shared + 0.2 * torch.randn(*shape, generator=gen, dtype=torch.float64) for _ in range(T)]
    merged = base + 0.3 * sum(e - base for e in experts)  # Task Arithmetic 0.3
    return base.to(dtype), [e.to(dtype) for e in experts], merged.to(dtype)


@pytest.mark.parametrize("seed, shape, alpha", [(0, (7, 5), 1.0), (1, (4, 9), 0.1), (2, (6, 6), 0.2)])
def test_svc_matrix_equals_fusion_benchs(seed, shape, alpha):
    fb = _fusion_bench_svc()
    base, experts, merged = _weights(seed, shape)
    want = fb.subspace_consistency_spectral_calibration_accelerated(
        base, experts, merged, alpha=alpha, accelerator="cpu"
    )
    got = svc_matrix(base, experts, merged, alpha)
    assert got.dtype == merged.dtype
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    # FusionBench's original loop implementation too (in the inputs' dtype: float64 here)
    b64, e64, m64 = _weights(seed, shape, dtype=torch.float64)
    loop = fb.subspace_consistency_spectral_calibration(b64, e64, m64, alpha=alpha, accelerator="cpu")
    assert torch.allclose(svc_matrix(b64, e64, m64, alpha), loop, rtol=1e-9, atol=1e-10)


def _formula(W_0, W_i, W_m, alpha):
    """The paper's rule, direction by direction (float64)."""
    W_0, W_m = W_0.double(), W_m.double()
    D_m = W_m - W_0
    U, S, Vh = torch.linalg.svd(D_m, full_matrices=False)
    gammas = []
    for r in range(S.shape[0]):
        a_m = U[:, r] @ D_m
        s = []
        for W in W_i:
            a_i = U[:, r] @ (W.double() - W_0)
            s.append(max(alpha, float(a_m @ a_i / max(float(a_i @ a_i), 1e-12))))
        gammas.append(len(W_i) / sum(s))
    return W_0 + U @ torch.diag(torch.tensor(gammas, dtype=torch.float64) * S) @ Vh


def test_svc_matrix_is_the_published_formula():
    base, experts, merged = _weights(5, (5, 8), T=4, dtype=torch.float64)
    assert torch.allclose(svc_matrix(base, experts, merged, 0.1), _formula(base, experts, merged, 0.1), atol=1e-10)


def test_one_expert_merged_as_itself_is_left_alone():
    """With the expert itself as the merge, every s = 1 (alpha <= 1): gamma = 1, nothing changes."""
    base, experts, _ = _weights(3, T=1, dtype=torch.float64)
    assert torch.allclose(svc_matrix(base, experts, experts[0], 1.0), experts[0], atol=1e-10)


def test_svc_state_dict_calibrates_every_2d_entry_and_copies_the_rest():
    fb = _fusion_bench_svc()
    gen = torch.Generator().manual_seed(9)
    shapes = {"w": (6, 4), "pos": (5, 4), "b": (6,), "conv": (2, 3, 2, 2), "ids": (1, 5)}

    def sd(shift):
        out = {k: torch.randn(*s, generator=gen) + shift for k, s in shapes.items() if k != "ids"}
        out["ids"] = torch.arange(5).reshape(1, 5)
        return out

    base = sd(0.0)
    experts = {t: sd(0.1) for t in ("a", "b", "c")}
    merged = sd(0.2)
    before = {k: v.clone() for k, v in merged.items()}
    out = svc(merged, base, experts, alpha=0.1)
    for k in ("w", "pos"):  # every floating 2-D entry, the position-embedding-like one too
        want = fb.subspace_consistency_spectral_calibration_accelerated(
            base[k], [e[k] for e in experts.values()], merged[k], alpha=0.1, accelerator="cpu"
        )
        assert torch.allclose(out[k], want, atol=1e-6), k
        assert not torch.allclose(out[k], merged[k])
    for k in ("b", "conv", "ids"):
        assert torch.equal(out[k], merged[k]), k
    assert all(torch.equal(merged[k], before[k]) for k in merged)  # the input is not modified


def test_svc_names_bad_input():
    base, experts, merged = _weights(0)
    with pytest.raises(ValueError, match="alpha"):
        svc({"w": merged}, {"w": base}, [{"w": e} for e in experts], alpha=0)
    with pytest.raises(ValueError, match="'w'"):
        svc({"w": merged}, {"w": base[:3]}, [{"w": e} for e in experts])
    with pytest.raises(ValueError, match="at least one expert"):
        svc({"w": merged}, {"w": base}, {})


# Our registry names -> FusionBench's recipe files (config/method/singular_value_calibration/*.yaml).
RECIPES = {
    "task_arithmetic": "task_arithmetic",
    "ties": "ties_merging",
    "dare": "dare_task_arithmetic",
    "average": "simple_average",
    "iso_c": "iso_c",
    "iso_cts": "iso_cts",
    "tsv": "task_singular_vector",
    "wudi": "wudi",
}


def test_alpha_after_each_merger_is_fusion_benchs_recipes():
    """ALPHA_AFTER holds the alpha of each of FusionBench's SVC recipes (its installed configs)."""
    from featcal.baselines.svc import ALPHA_AFTER

    yaml = pytest.importorskip("yaml")
    spec = importlib.util.find_spec("fusion_bench_config")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fusion-bench is not installed (requirements-nodeps.txt)")
    folder = Path(next(iter(spec.submodule_search_locations))) / "method" / "singular_value_calibration"
    recipes = {p.stem: yaml.safe_load(p.read_text())["alpha"] for p in folder.glob("*.yaml")}
    assert set(recipes) == set(RECIPES.values())  # a new recipe upstream shows here
    assert ALPHA_AFTER == {ours: recipes[theirs] for ours, theirs in RECIPES.items()}
    assert ALPHA_AFTER["task_arithmetic"] == 0.1 and ALPHA_AFTER["iso_cts"] == 0.2 and ALPHA_AFTER["tsv"] == 1.0


def test_svc_alpha_defaults_to_fusion_benchs_after_the_merger():
    from featcal.baselines.svc import ALPHA_FALLBACK, default_alpha

    base, experts, merged = _weights(3)
    sds = [{"w": e} for e in experts]

    def run(**kw):
        return svc({"w": merged}, {"w": base}, sds, **kw)["w"]

    assert torch.equal(run(merger="task_arithmetic"), run(alpha=0.1))
    assert torch.equal(run(merger="iso_cts"), run(alpha=0.2))
    assert torch.equal(run(merger="TSV"), run(alpha=1.0))
    assert not torch.equal(run(merger="task_arithmetic"), run(merger="tsv"))  # the default changes the result
    assert torch.equal(run(), run(alpha=ALPHA_FALLBACK))  # no merger named: the documented fallback
    assert default_alpha("regmean_plusplus") == default_alpha("fisher_merging") == ALPHA_FALLBACK  # no recipe
    assert torch.equal(run(alpha=0.5, merger="task_arithmetic"), run(alpha=0.5))  # a given alpha wins

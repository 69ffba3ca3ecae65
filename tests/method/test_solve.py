"""The closed-form solves against direct computations on small random problems."""

import math
from operator import attrgetter

import pytest
import torch

from featcal import FastPaths, Setting
from featcal.method import linalg, solve, stats
from featcal.method.kernels import Kernels, Scratch


@pytest.fixture(autouse=True)
def _float64():
    """These checks compare against direct float64 computations; restore the default after."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# A system's terms that every way of building it must agree on (the residual's too).
TERMS = ("S", "U", "V", "m_s", "sb", "ub", "vb", "res.k_ee", "res.k_se", "res.k_ss", "res.c_s", "res.c_v", "res.bb")


def _task(gen, rows=40, d=3, o=2, shift=0.3):
    xs = torch.randn(rows, d, generator=gen, dtype=torch.float64)
    xe = xs + shift * torch.randn(rows, d, generator=gen, dtype=torch.float64)
    W = torch.randn(o, d, generator=gen, dtype=torch.float64)
    b = torch.randn(o, generator=gen, dtype=torch.float64)
    w = torch.rand(rows, generator=gen, dtype=torch.float64) + 0.1
    return xs, xe, W, b, w


def _system(tasks, eps=1e-8, batches=1, form="P"):
    d, o = tasks[0][2].shape[1], tasks[0][2].shape[0]
    sysm = solve.LinearSystem.zeros(d, o, torch.float64, "cpu")
    for xs, xe, W, b, w in tasks:
        acc = stats.LinearSums.zeros(d, torch.float64, "cpu", cross=form == "P")
        ms = stats.ModuleSums(torch.zeros(()))
        for part in torch.arange(len(xs)).tensor_split(batches):
            stats.accumulate_linear(acc, xs[part], xe[part], w[part])
            stats.accumulate_module(ms, form, xs[part], xe[part] @ W.T, w[part], W)
        solve.add_task(sysm, stats.linear_moments(acc, W, ms), W, b, eps)
    return sysm


def _anchors(gen, o=2, d=3):
    """Random merged and base parameters ``(W_mer, b_mer, W_0, b_0)``."""
    return (
        torch.randn(o, d, generator=gen),
        torch.randn(o, generator=gen),
        torch.randn(o, d, generator=gen),
        torch.randn(o, generator=gen),
    )


def _objective(tasks, Wn, bn, alpha, lam, W_anc, b_anc, eps=1e-8):
    """The spec's objective, evaluated directly on the rows."""
    total = lam * ((Wn - W_anc) ** 2).sum() + eps * (Wn**2).sum() + lam * ((bn - b_anc) ** 2).sum()
    for xs, xe, W, b, w in tasks:
        C = (xs * w[:, None]).T @ xs / w.sum()
        s = 1 / torch.linalg.matrix_norm(C)
        xt = alpha * xe + (1 - alpha) * xs
        r = xs @ Wn.T + bn - (xt @ W.T + b)
        total = total + s * (w * (r**2).sum(1)).sum() / w.sum()
    return total


def test_solution_is_the_minimiser_of_the_spec_objective():
    gen = torch.Generator().manual_seed(0)
    tasks = [_task(gen) for _ in range(3)]
    sysm = _system(tasks)
    W_mer, b_mer, W_0, b_0 = _anchors(gen)
    lam, rho, alpha = 0.7, 1.5, 0.4
    W, b, _ = solve.solve_linear(sysm, solve.Endpoints(W_mer, b_mer, W_0, b_0), Setting(lam, rho, alpha), eps=1e-8)
    W_anc, b_anc = rho * W_mer + (1 - rho) * W_0, rho * b_mer + (1 - rho) * b_0
    # The weight solve is the closed form for W; the gradient in W of the spec objective vanishes
    # at bias-free rows, so check it on the weight part with the bias taken as the spec's formula.
    Wv = W.clone().requires_grad_(True)
    f = _objective(
        [(xs, xe, Wi, torch.zeros(2), w) for xs, xe, Wi, _, w in tasks],
        Wv,
        torch.zeros(2),
        alpha,
        lam,
        W_anc,
        torch.zeros(2),
    )
    (g,) = torch.autograd.grad(f, Wv)
    assert g.abs().max() < 1e-9
    # The bias: with W fixed, it minimises the spec objective in b.
    bv = b.clone().requires_grad_(True)
    f = _objective(tasks, W, bv, alpha, lam, W_anc, b_anc)
    (gb,) = torch.autograd.grad(f, bv)
    assert gb.abs().max() < 1e-9


def test_residual_formula_matches_direct_computation():
    gen = torch.Generator().manual_seed(1)
    tasks = [_task(gen) for _ in range(2)]
    sysm = _system(tasks)
    Wn, bn, alpha = torch.randn(2, 3, generator=gen), torch.randn(2, generator=gen), 0.35
    num = den = 0.0
    for xs, xe, W, b, w in tasks:
        C = (xs * w[:, None]).T @ xs / w.sum()
        s = 1 / torch.linalg.matrix_norm(C)
        yt = (alpha * xe + (1 - alpha) * xs) @ W.T + b
        num += s * (w * ((xs @ Wn.T + bn - yt) ** 2).sum(1)).sum() / w.sum()
        den += s * (w * (yt**2).sum(1)).sum() / w.sum()
    assert abs(solve.linear_residual(sysm, Wn, bn, alpha) - float(num / den)) < 1e-10


@pytest.mark.parametrize("form", ["PW", "PW+CW"])
def test_every_form_of_the_statistics_gives_the_same_system(form):
    """P (shared cross moment), PW (per-module cross moment) and PW+CW (no d x d x o product
    left) are the same sums in another order."""
    gen = torch.Generator().manual_seed(5)
    tasks = [_task(gen, rows=30, d=4, o=3) for _ in range(3)]
    ref, other = _system(tasks, batches=3), _system(tasks, batches=3, form=form)
    for name in TERMS:
        assert torch.allclose(attrgetter(name)(ref), attrgetter(name)(other), atol=1e-12), name


@pytest.mark.parametrize("d", [5, 384 * 2 + 7, 384 * 9])
def test_triangular_gram_equals_the_full_product(d):
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(20, d, generator=gen), torch.rand(20, generator=gen)
    acc = stats.LinearSums.zeros(d, torch.float64, "cpu", cross=False)
    for part in torch.arange(20).tensor_split(3):
        stats.accumulate_linear(acc, x[part], x[part], w[part])
    full = (x * w[:, None]).T @ x
    norm = torch.linalg.matrix_norm(full).item()
    assert linalg.gram_norm(acc.C, acc.edges).item() == pytest.approx(norm, rel=1e-12)
    stats.finish_gram(acc)
    assert linalg.gram_norm(acc.C, acc.edges, finished=True).item() == pytest.approx(norm, rel=1e-12)
    assert len(acc.edges) == min(9, max(2, d // FastPaths().gram_block + 1))
    assert torch.allclose(acc.C, full, atol=1e-12)
    full_products = Kernels(gram_block=None)
    plain = stats.LinearSums.zeros(d, torch.float64, "cpu", cross=False, kernels=full_products)
    stats.accumulate_linear(plain, x, x, w)
    assert plain.edges == (0, d) and torch.allclose(plain.C, full, atol=1e-12)
    # Float32 sums: their norm is the float64 norm of the very same float32 matrix to float32
    # rounding (reduced in float64, whatever the CPU's BLAS kernel), and within float32
    # accumulation of 20 rows (below 4e-6) of the float64 sums'.
    C32 = torch.zeros(d, d, dtype=torch.float32)
    linalg.accumulate_gram(C32, x.float() * w.float()[:, None], x.float(), acc.edges)
    norm32 = torch.linalg.matrix_norm(linalg.symmetric(C32).double()).item()
    assert linalg.gram_norm(C32, acc.edges).item() == pytest.approx(norm32, rel=1e-6)
    assert norm32 == pytest.approx(norm, rel=1e-5)
    assert linalg.gram_norm(linalg.symmetric(C32), acc.edges, finished=True).item() == pytest.approx(norm32, rel=1e-6)


def test_cheapest_form_follows_rows_and_widths():
    assert stats.cheapest_form(3072, [768], rows=400) == "PW+CW"  # few rows, wide input
    assert stats.cheapest_form(768, [768] * 3, rows=100_000) == "P"  # many rows: shared P
    assert stats.cheapest_form(3072, [768], rows=100_000) == "PW"  # narrow output


def test_batched_statistics_equal_one_shot():
    gen = torch.Generator().manual_seed(2)
    tasks = [_task(gen, rows=37) for _ in range(2)]
    one, many = _system(tasks, batches=1), _system(tasks, batches=5)
    for name in TERMS:
        assert torch.allclose(attrgetter(name)(one), attrgetter(name)(many), atol=1e-12), name


def test_lambda_to_infinity_gives_the_anchor():
    gen = torch.Generator().manual_seed(3)
    tasks = [_task(gen) for _ in range(2)]
    sysm = _system(tasks)
    W_mer, b_mer, W_0, b_0 = _anchors(gen)
    W, b, _ = solve.solve_linear(sysm, solve.Endpoints(W_mer, b_mer, W_0, b_0), Setting(1e9, 2.2, 0.3), eps=1e-8)
    assert torch.allclose(W, 2.2 * W_mer - 1.2 * W_0, atol=1e-6)
    assert torch.allclose(b, 2.2 * b_mer - 1.2 * b_0, atol=1e-6)


def test_norm_solve_minimises_its_objective_and_limits():
    gen = torch.Generator().manual_seed(4)
    n, d = 3, 5
    zs = [torch.randn(50, d, generator=gen) * 1.3 + 0.2 for _ in range(n)]
    e = torch.stack([(z * z).mean(0) for z in zs])
    m = torch.stack([z.mean(0) for z in zs])
    g, bb = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    sysm = solve.NormSystem(e, m, g, bb)
    g_mer, b_mer, g_0, b_0 = (torch.randn(d, generator=gen) for _ in range(4))
    lam, rho = 0.3, 1.7
    gam, bet = solve.solve_norm(sysm, solve.Endpoints(g_mer, b_mer, g_0, b_0), Setting(lam, rho, 0.0), eps=1e-8)
    gv, bv = gam.clone().requires_grad_(True), bet.clone().requires_grad_(True)
    f = sum(((gv * z + bv - g[i] * z - bb[i]) ** 2).mean(0).sum() for i, z in enumerate(zs))
    g_anc, b_anc = rho * g_mer + (1 - rho) * g_0, rho * b_mer + (1 - rho) * b_0
    f = f + lam * (((gv - g_anc) ** 2).sum() + ((bv - b_anc) ** 2).sum())
    grads = torch.autograd.grad(f, (gv, bv))
    assert max(x.abs().max() for x in grads) < 1e-9
    gam, bet = solve.solve_norm(sysm, solve.Endpoints(g_mer, b_mer, g_0, b_0), Setting(1e10, rho, 0.0), eps=1e-8)
    assert torch.allclose(gam, rho * g_mer + (1 - rho) * g_0, atol=1e-6)
    assert torch.allclose(bet, rho * b_mer + (1 - rho) * b_0, atol=1e-6)
    # Residual formula against the rows.
    num = sum(((gam * z + bet - g[i] * z - bb[i]) ** 2).mean(0).sum() for i, z in enumerate(zs))
    den = sum(((g[i] * z + bb[i]) ** 2).mean(0).sum() for i, z in enumerate(zs))
    assert abs(solve.norm_residual(sysm, gam, bet) - float(num / den)) < 1e-10


def test_singular_system_fails_clearly():
    with pytest.raises(FloatingPointError, match="block 0 fc.*raise lam"):
        linalg.spd_solve(torch.zeros(2, 2), torch.ones(2, 1), "block 0 fc")


def test_indefinite_system_falls_back_to_an_eigen_solve():
    A = torch.tensor([[1.0, 0.0], [0.0, -2.0]])
    X = linalg.spd_solve(A, torch.ones(2, 1), "indefinite")
    assert torch.allclose(A @ X, torch.ones(2, 1))


@pytest.mark.parametrize("lapack_from", [None, 1], ids=["torch", "lapack"])
def test_systems_kept_on_their_upper_triangle_solve_like_full_ones(lapack_from):
    """Wide inputs keep only the upper block triangle of ``C`` and ``S`` (the PW+CW form never
    mirrors it): the solve (torch's Cholesky on the mirrored system, or LAPACK's in place),
    the residual and the preview's eigenvectors read no more."""
    gen = torch.Generator().manual_seed(7)
    d = FastPaths().gram_block * 2 + 5
    tasks = [_task(gen, rows=30, d=d, o=3) for _ in range(2)]
    full, upper = _system(tasks, form="P"), _system(tasks, form="PW+CW")
    assert not torch.equal(upper.S, upper.S.T)  # really one triangle only
    assert torch.allclose(linalg.symmetric(upper.S), linalg.symmetric(full.S), atol=1e-12)
    W_mer, b_mer, W_0, b_0 = _anchors(gen, o=3, d=d)
    ends, at = solve.Endpoints(W_mer, b_mer, W_0, b_0), Setting(0.2, 1.5, 0.3)
    (W1, b1, _), (W2, b2, _) = (
        solve.solve_linear(s, ends, at, eps=1e-8, kernels=Kernels(lapack_from)) for s in (full, upper)
    )
    assert torch.allclose(W1, W2, atol=1e-9) and torch.allclose(b1, b2, atol=1e-9)
    assert abs(solve.linear_residual(full, W1, b1, 0.3) - solve.linear_residual(upper, W1, b1, 0.3)) < 1e-10
    by_lapack = getattr(Kernels(lapack_from).solver(upper.S, 0.2), "lapack", False)
    assert by_lapack == (lapack_from is not None)
    ev1 = torch.linalg.eigvalsh(linalg.symmetric(full.S))
    assert torch.allclose(torch.linalg.eigvalsh(upper.S, UPLO="U"), ev1, atol=1e-10)


@pytest.mark.parametrize("lapack_from", [None, 1], ids=["torch", "lapack"])
def test_lu_fallback_reads_the_upper_triangle(lapack_from):
    S = torch.tensor([[1.0, 2.0], [0.0, -2.0]])  # the symmetric [[1, 2], [2, -2]]: indefinite
    X = linalg.spd_factor(S, 0.0, "indefinite", lapack_min_d=lapack_from)(torch.ones(2, 1))
    assert torch.allclose(linalg.symmetric(S) @ X, torch.ones(2, 1))


def test_kernels_share_one_factorisation_per_system_and_give_its_buffer_back():
    """Systems sharing one ``S`` (q/k/v) share its factorisation; LAPACK's copy of ``S`` comes
    from the kernels' scratch and goes back at the end of the block."""
    gen = torch.Generator().manual_seed(7)
    A, B = torch.randn(6, 6, generator=gen), torch.randn(6, 6, generator=gen)
    S1, S2 = A @ A.T, B @ B.T
    scratch = Scratch()
    kernels = Kernels(lapack_min_d=1, scratch=scratch)
    one = kernels.solver(S1, 0.1)
    assert kernels.solver(S1, 0.1) is one and kernels.solver(S2, 0.1) is not one
    X = one(torch.eye(6))
    assert torch.allclose((S1 + 0.1 * torch.eye(6)) @ X, torch.eye(6), atol=1e-9)
    kernels.end_block()
    assert len(scratch._free[((6, 6), S1.dtype, S1.device)]) == 2
    assert kernels.solver(S1, 0.1) is not one  # the block ended: factored anew


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_residual_is_not_finite_when_the_weights_are_not(bad):
    """The engine checks a solved module through its residual alone (no pass over W)."""
    gen = torch.Generator().manual_seed(8)
    sysm = _system([_task(gen) for _ in range(2)])
    W_mer, b_mer, W_0, b_0 = _anchors(gen)
    W, b, SWt = solve.solve_linear(sysm, solve.Endpoints(W_mer, b_mer, W_0, b_0), Setting(0.1, 1.0, 0.3), eps=1e-8)
    assert math.isfinite(solve.linear_residual(sysm, W, b, 0.3, SWt))
    W2 = W.clone()
    W2[1, 2] = bad
    assert not math.isfinite(solve.linear_residual(sysm, W2, b, 0.3, SWt))
    b2 = b.clone()
    b2[0] = bad
    assert not math.isfinite(solve.linear_residual(sysm, W, b2, 0.3, SWt))


def test_inner_of_stacks_is_one_sum_per_matrix():
    gen = torch.Generator().manual_seed(9)
    a, b = (
        torch.randn(3, 5, 7, generator=gen, dtype=torch.float64),
        torch.randn(3, 5, 7, generator=gen, dtype=torch.float64),
    )
    want = torch.stack([(x * y).sum() for x, y in zip(a, b)])
    for x, y in ((a, b), (a.mT.contiguous().mT, b.mT.contiguous().mT), (a[:, :, ::2], b[:, :, ::2])):
        ref = torch.stack([(p * q).sum() for p, q in zip(x, y)])
        assert torch.allclose(linalg.inner(x, y), ref)
    assert torch.allclose(linalg.inner(a, b), want)
    assert torch.allclose(linalg.inner(a[0], b[0]), want[0])  # one matrix: a scalar


def test_add_weighted_on_strided_tiles_equals_the_weighted_sum():
    gen = torch.Generator().manual_seed(9)
    x, f = torch.randn(3, 8, 10, generator=gen), torch.rand(3, generator=gen)
    out = torch.randn(8, 10, generator=gen)
    want = out + (f[:, None, None] * x).sum(0)
    tile = x[:, 2:5, 4:]  # a strided tile of the stack
    got = out.clone()
    linalg.add_weighted(got[2:5, 4:], tile, f)
    assert torch.allclose(got[2:5, 4:], want[2:5, 4:], atol=1e-6)
    assert torch.equal(got[:2], out[:2])
    assert torch.allclose(linalg.add_weighted(out.clone(), x, f), want, atol=1e-6)  # contiguous: one product


@pytest.fixture(params=[1, None], ids=["syrk", "torch"])
def threads(request):
    """One torch thread (CPU float Gram matrices by BLAS ``syrk``) or torch's own count
    (torch's products); restored after."""
    old = torch.get_num_threads()
    if request.param == 1:
        torch.set_num_threads(1)
    elif old == 1:
        torch.set_num_threads(2)
    yield request.param
    torch.set_num_threads(old)


@pytest.mark.parametrize("form", ["P", "PW", "PW+CW"])
def test_direct_sums_of_one_batch_equal_the_gram_sums(threads, form):
    """A task of one batch may keep its weighted rows instead of ``C`` (direct sums): the
    system (``S`` on its upper triangle, the right-hand sides, the scales) is the same."""
    gen = torch.Generator().manual_seed(7)
    d, o = 300, 5
    tasks = [_task(gen, rows=rows, d=d, o=o) for rows in (40, 70)]
    systems = []
    for direct in (False, True):
        sysm = solve.LinearSystem.zeros(d, o, torch.float64, "cpu")
        for xs, xe, W, b, w in tasks:
            acc = stats.LinearSums.zeros(d, torch.float64, "cpu", cross=form == "P", direct=direct)
            ms = stats.ModuleSums(torch.zeros(()))
            stats.accumulate_linear(acc, xs, xe, w)
            stats.accumulate_module(ms, form, xs, xe @ W.T, w, W)
            assert (acc.C is None) == direct
            solve.add_task(sysm, stats.linear_moments(acc, W, ms), W, b, 1e-8)
        systems.append(sysm)
    gram, direct = systems
    assert torch.allclose(direct.S.triu(), gram.S.triu(), rtol=1e-10, atol=1e-12)
    for name in ("U", "V", "s_sum", "m_s", "ub", "vb", "res.k_ee", "res.k_se", "res.k_ss", "res.c_s", "res.bb"):
        assert torch.allclose(attrgetter(name)(direct), attrgetter(name)(gram), rtol=1e-10, atol=1e-12), name


def test_direct_sums_take_one_batch_only():
    x = torch.randn(4, 10)
    acc = stats.LinearSums.zeros(10, torch.float64, "cpu", cross=False, direct=True)
    stats.accumulate_linear(acc, x, x, None)
    with pytest.raises(ValueError, match="one batch"):
        stats.accumulate_linear(acc, x, x, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_gram_norm_and_syrk_update(threads, dtype):
    """``||Z^T Z||_F`` from the rows' Gram matrix, and ``S += a Z^T Z`` on the upper triangle
    (below it, each entry left as it was or updated alike), against float64 products."""
    gen = torch.Generator().manual_seed(8)
    Z = torch.randn(30, 500, generator=gen).to(dtype)
    assert (linalg._blas("syrk", Z) is not None) == (threads == 1)
    C = Z.double().T @ Z.double()
    assert linalg.rows_gram_norm(Z).item() == pytest.approx(torch.linalg.matrix_norm(C).item(), rel=1e-6)
    S = torch.randn(500, 500, generator=gen).to(dtype)
    before = S.clone()
    linalg.add_rows_gram(S, Z, 0.25, linalg.gram_blocks(500, FastPaths.gram_block))
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(S.triu().double(), (before.double() + 0.25 * C).triu(), rtol=tol, atol=tol * 10)
    lower = torch.ones(500, 500, dtype=torch.bool).tril(-1)
    kept = S[lower] == before[lower]
    updated = torch.isclose(S[lower].double(), (before.double() + 0.25 * C)[lower], rtol=tol, atol=tol * 10)
    assert bool((kept | updated).all())


def test_scratch_hands_back_zeroed_buffers():
    sc = Scratch()
    a = sc.take((3, 4), torch.float32, "cpu")
    a.fill_(5.0)
    sc.give([a])
    b = sc.take((3, 4), torch.float32, "cpu")
    assert b.data_ptr() == a.data_ptr() and not b.any()
    c = sc.take((3, 4), torch.float32, "cpu")  # none left: a new one
    assert c.data_ptr() != a.data_ptr() and not c.any()
    assert sc.take((3, 4), torch.float64, "cpu").dtype == torch.float64
    big = torch.zeros(10, 10)
    sc.give([a, big])
    sc.trim(50)  # the 10 x 10 one goes, the 3 x 4 one stays
    assert sc.take((10, 10), torch.float32, "cpu").data_ptr() != big.data_ptr()
    assert sc.take((3, 4), torch.float32, "cpu").data_ptr() == a.data_ptr()

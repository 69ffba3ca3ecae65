"""Diagnostics: the drift identity e = m + p, its squared split, the zero cases, and the pure
maths (CKA, KL, task-vector cosines, row selection) (tiny seeded models, offline). The cost,
the cached streams, the tables' shapes and the command lines: test_drift_tables.py."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from torch import nn

from diagnostics import (
    WHOLE,
    drift_table,
    drift_tokens,
    expert_cosine,
    kl_rows,
    output_drift,
    task_vector_cosine,
    task_vector_matrix,
)
from diagnostics.decomposition import batch_first, select_rows
from diagnostics.similarity import CKASums, accumulate_cka, linear_cka
from featcal.model.arch import resolve_blocks
from featcal.model.streams import catch_block_inputs
from tiny import (
    ToyModel,
    model_expert_batches,
    perturbed,
    toy_data,
    toy_zoo,
    toy_zoo_object,
)

torch.set_num_threads(1)


def _wide(df: pd.DataFrame) -> pd.DataFrame:
    """``(task, block)`` x metric."""
    return df.pivot_table(index=["task", "block"], columns="metric", values="value")


def _walk(model, expert, batch):
    """Every block's DriftTokens on one batch, streams advanced block by block."""
    _, blks = resolve_blocks(model)
    _, eblks = resolve_blocks(expert)
    cm, ce = catch_block_inputs(model, blks[0], batch), catch_block_inputs(expert, eblks[0], batch)
    out = []
    for blk, eblk in zip(blks, eblks):
        dt = drift_tokens(blk, eblk, cm, ce)
        cm, ce = cm.with_hidden(dt.h_mod), ce.with_hidden(dt.h_exp)
        out.append(dt)
    return out


# ----------------------------------------------------------------------------- the identity


@pytest.mark.parametrize("kind", ["toy", "hf_clip", "open_clip"])
def test_drift_is_mismatch_plus_propagation_per_token(kind):
    model, expert, batches = model_expert_batches(kind)
    for dt in _walk(model, expert, batches[0]):
        assert dt.e.abs().max() > 1e-3  # a real drift, not a trivial zero
        torch.testing.assert_close(dt.m + dt.p, dt.e, rtol=0, atol=1e-12)  # float64 differences
        torch.testing.assert_close(dt.h_mod.double() - dt.h_exp.double(), dt.e, rtol=0, atol=0)


def test_identity_is_exact_for_bfloat16_models():
    model, expert, batches = model_expert_batches("toy")
    model, expert = model.to(torch.bfloat16), expert.to(torch.bfloat16)
    for dt in _walk(model, expert, batches[0].to(torch.bfloat16)):
        assert dt.e.dtype == torch.float64
        assert torch.equal(dt.m + dt.p, dt.e)  # differences of bf16 values are exact in float64


def test_block_outputs_without_token_axis():
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    model = MLP()
    expert = perturbed(model, 0.3, 2)
    x = torch.randn(5, 4)
    w = _wide(drift_table(model, {"a": expert}, {"a": [x]}))
    dts = _walk(model, expert, x)
    for l, dt in enumerate(dts):
        assert dt.e.shape == (5, 4)  # one row per example
        assert w.loc[("a", l), "drift"] == pytest.approx(float(dt.e.norm(dim=-1).mean()), rel=1e-9)


def test_streams_match_the_full_forward():
    model, expert, batches = model_expert_batches("hf_clip")
    walked = _walk(model, expert, batches[0])
    with torch.no_grad():
        full = model(batches[0], output_hidden_states=True).hidden_states  # (L + 1) x (B, T, d)
    for l, dt in enumerate(walked):
        torch.testing.assert_close(dt.h_mod, full[l + 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", ["all", "cls"])
def test_squared_drift_splits_exactly(tokens):
    model, expert, batches = model_expert_batches("hf_clip")
    w = _wide(drift_table(model, {"a": expert}, {"a": batches}, tokens=tokens))
    split = torch.tensor((w.drift_sq_mismatch + w.drift_sq_propagation).values)
    torch.testing.assert_close(torch.tensor(w.drift_sq.values), split, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(
        torch.tensor((w.drift_sq_mismatch_share + w.drift_sq_propagation_share).values),
        torch.ones(len(w), dtype=torch.float64),
    )
    assert (w.drift <= w.mismatch + w.propagation + 1e-9).all()  # norms do not add, they bound
    torch.testing.assert_close(torch.tensor(w.drift_rel.values), torch.tensor((w.drift / w.expert_norm).values))


def test_table_means_match_the_tokens():
    model, expert, batches = model_expert_batches("toy")
    w = _wide(drift_table(model, {"a": expert}, {"a": batches[:1]}, tokens="cls"))
    dts = _walk(model, expert, batches[0])
    for l, dt in enumerate(dts):
        e, m = select_rows(dt.e, "cls"), select_rows(dt.m, "cls")  # (B, d)
        assert w.loc[("a", l), "drift"] == pytest.approx(float(e.norm(dim=-1).mean()), rel=1e-5)
        assert w.loc[("a", l), "drift_sq_mismatch"] == pytest.approx(float((e * m).sum(-1).mean()), rel=1e-5)


# ----------------------------------------------------------------------------- zero cases


def test_model_equal_to_expert_has_no_drift():
    base, experts, _ = toy_zoo(n_tasks=1)
    expert = experts["t0"]
    data = toy_data(["t0"], n=6, batch=3)
    w = _wide(drift_table(copy.deepcopy(expert), experts, data))
    for k in ("drift", "mismatch", "propagation", "drift_sq"):
        assert w[k].abs().max() < 1e-6, k
    assert (w.expert_cosine - 1).abs().max() < 1e-6
    assert (w.cka - 1).abs().max() < 1e-6
    cos = expert_cosine(copy.deepcopy(expert), experts, data)
    assert (cos.value - 1).abs().max() < 1e-6
    zoo = toy_zoo_object(model_for_experts=expert)
    out = _wide(output_drift(copy.deepcopy(expert), zoo))
    assert out.kl.abs().max() < 1e-9
    assert (out.agreement == 100.0).all()
    assert (out.accuracy == out.expert_accuracy).all()
    tv = task_vector_cosine(expert, base, experts)
    assert (tv[tv.metric == "task_vector_cosine"].value - 1).abs().max() < 1e-9


@pytest.mark.parametrize("k", [0, 1, 2])
def test_expert_differing_in_one_block(k):
    torch.manual_seed(0)
    base = ToyModel(n_blocks=3)
    expert = copy.deepcopy(base)
    expert.blocks[k] = perturbed(base.blocks[k], 0.3, 7)
    w = _wide(drift_table(base, {"a": expert}, toy_data(["a"], n=6, batch=3)))
    for l in range(3):
        row = w.loc[("a", l)]
        if l != k:
            assert row.mismatch < 1e-6, f"block {l}: local mismatch outside block {k}"
        else:
            assert row.mismatch > 1e-2
        if l <= k:
            assert row.propagation < 1e-6, f"block {l}: propagation up to block {k}"
        else:
            assert row.propagation > 1e-2
    tv = task_vector_cosine(base, base, {"a": expert})
    assert tv[tv.metric == "task_vector_norm"].value.abs().max() == 0.0
    norms = tv[tv.metric == "expert_task_vector_norm"].set_index("block").value
    assert norms[k] > 0 and all(norms[l] == 0 for l in range(3) if l != k)


# ----------------------------------------------------------------------------- pure maths


def test_streaming_cka_equals_one_shot_and_is_invariant():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(20, 3, generator=gen, dtype=torch.float64)
    acc = CKASums.zeros(4, 3)
    for xb, yb in zip(x.split(7), y.split(7)):
        accumulate_cka(acc, xb, yb)
    xc, yc = x - x.mean(0), y - y.mean(0)
    want = (xc.T @ yc).pow(2).sum() / ((xc.T @ xc).norm() * (yc.T @ yc).norm())
    assert linear_cka(acc) == pytest.approx(float(want), rel=1e-10)
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=torch.float64))
    same = accumulate_cka(CKASums.zeros(4, 4), x, 3.0 * x @ q + 1.0)  # rotate, scale, shift
    assert linear_cka(same) == pytest.approx(1.0, abs=1e-10)


def test_kl_rows_matches_torch():
    gen = torch.Generator().manual_seed(0)
    le, lm = torch.randn(5, 4, generator=gen), torch.randn(5, 4, generator=gen)
    want = torch.nn.functional.kl_div(lm.log_softmax(-1), le.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(kl_rows(le, lm).float(), want)
    assert (kl_rows(le, lm) >= 0).all() and kl_rows(le, le).abs().max() < 1e-12


def test_task_vector_cosine_whole_model_matches_flat_vectors():
    base, experts, merged = toy_zoo(n_tasks=2)
    tv = task_vector_cosine(merged, base, experts)

    def flat(m):
        return torch.cat([v.double().reshape(-1) for v in m.state_dict().values()])

    tau = flat(merged) - flat(base)
    for t, e in experts.items():
        tau_i = flat(e) - flat(base)
        want = float(tau @ tau_i / (tau.norm() * tau_i.norm()))
        got = tv[(tv.task == t) & (tv.block == WHOLE) & (tv.metric == "task_vector_cosine")].value.item()
        assert got == pytest.approx(want, rel=1e-10)
    assert set(tv.block) == {WHOLE, 0, 1, 2}


def test_task_vector_cosine_per_block_matches_the_blocks_own_vectors():
    """Block ``l`` reads only ``blocks.l.*``."""
    base, experts, merged = toy_zoo(n_tasks=3)
    tv = task_vector_cosine(merged, base, experts)

    def flat(m):
        return torch.cat([v.double().reshape(-1) for k, v in m.state_dict().items() if k.startswith("blocks.1.")])

    tau = flat(merged) - flat(base)
    for t, e in experts.items():
        tau_i = flat(e) - flat(base)
        sel = tv[(tv.task == t) & (tv.block == 1)].set_index("metric").value
        assert sel["task_vector_cosine"] == pytest.approx(float(tau @ tau_i / (tau.norm() * tau_i.norm())), rel=1e-10)
        assert sel["expert_task_vector_norm"] == pytest.approx(float(tau_i.norm()), rel=1e-12)


def test_task_vector_matrix_is_task_vector_cosine_of_each_expert_against_the_others():
    """cos(tau_i, tau_j) per block and whole model: expert j diagnosed as the model gives
    column j; the matrix is symmetric with a unit diagonal."""
    base, experts, _ = toy_zoo(n_tasks=3)
    mat = task_vector_matrix(base, experts)
    assert set(mat.block) == {WHOLE, 0, 1, 2}
    for other, model in experts.items():
        tv = task_vector_cosine(model, base, experts)
        tv = tv[tv.metric == "task_vector_cosine"].set_index(["task", "block"]).value
        col = mat[mat.other == other].set_index(["task", "block"]).value
        pd.testing.assert_series_equal(col.sort_index(), tv.sort_index(), check_names=False, rtol=1e-10)
    wide = mat[mat.block == 1].pivot(index="task", columns="other", values="value")
    torch.testing.assert_close(torch.tensor(wide.values), torch.tensor(wide.values.T))
    assert wide.values.diagonal() == pytest.approx([1.0] * 3)
    assert (wide.values < 1 - 1e-6).sum() == 6  # distinct experts: off-diagonal cosines below 1


def test_row_selection_and_layout():
    h = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)  # (B, T, d)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    assert select_rows(h, "all", mask).shape == (4, 2)
    torch.testing.assert_close(select_rows(h, "cls", mask), h[:1, 0])  # example 1's first token is padding
    assert select_rows(h[:, 0], "all").shape == (2, 2)  # no token axis: one row per example
    torch.testing.assert_close(batch_first(h.transpose(0, 1), 2), h)

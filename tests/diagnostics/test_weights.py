"""The weight-space views (diagnostics.weights): TIES's sign count, the spectral overlap and
the cosines on hand-made task vectors, and the per-block tables on a tiny seeded zoo against
sums taken here from the state dicts."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from diagnostics import task_vector_matrix
from diagnostics.weights import (
    ALL,  # noqa: F401 (used in the query strings as @ALL)
    beside_drift,
    block_table,
    correlations,
    pairwise_cosines,
    sign_conflicts,
    spectral_overlap,
    weight_table,
)
from tiny import toy_zoo


def test_sign_conflicts_count_as_ties_does():
    taus = torch.tensor([[1.0, -1.0, 2.0], [1.0, 1.0, -3.0]])
    # elected sign of the sums (2, 0, -1): (+, 0, -); entries 1 and 2 hold both signs
    both, against, kept = sign_conflicts(taus, density=1.0)
    assert both == pytest.approx(2 / 3)
    assert against.tolist() == pytest.approx([2 / 3, 1 / 3]) and kept.tolist() == [3, 3]
    # density 1/3 keeps each task's largest entry only: 2.0 and -3.0, both at entry 2
    both, against, kept = sign_conflicts(taus, density=1 / 3)
    assert both == pytest.approx(1 / 3) and kept.tolist() == [1, 1]
    assert against.tolist() == pytest.approx([1.0, 0.0])  # elected: sign(2 - 3) = -


def test_spectral_overlap_is_one_for_one_subspace_and_zero_for_orthogonal_ones():
    gen = torch.Generator().manual_seed(0)
    a = torch.zeros(6, 5)
    a[:3] = torch.randn(3, 5, generator=gen)  # column space: the first 3 coordinates
    b = torch.zeros(6, 5)
    b[3:] = torch.randn(3, 5, generator=gen)  # the last 3: orthogonal
    mat = spectral_overlap(torch.stack([a, 2 * a, b]), k=3)
    assert mat[0, 1] == pytest.approx(1.0) and mat[0, 0] == pytest.approx(1.0)
    assert mat[0, 2] == pytest.approx(0.0, abs=1e-12) and mat[2, 1] == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(spectral_overlap(torch.stack([a, torch.zeros(6, 5)]), k=3)[0, 1])


def test_pairwise_cosines():
    taus = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0], [0.0, 0.0]])
    cos = pairwise_cosines(taus)
    assert cos[0, 1] == pytest.approx(1.0) and cos[0, 2] == pytest.approx(0.0) and math.isnan(cos[0, 3])


def test_block_tables_match_sums_over_the_state_dicts():
    base, experts, _ = toy_zoo(n_tasks=3)
    table = weight_table(base, experts, density=0.5, k=2)
    blocks = block_table(table, task_vector_matrix(base, experts))
    sd0 = base.state_dict()
    for task, expert in experts.items():
        sd = expert.state_dict()
        for b in range(3):
            names = [n for n in sd0 if n.startswith(f"blocks.{b}.")]
            want = math.sqrt(sum(float((sd[n].double() - sd0[n].double()).square().sum()) for n in names))
            got = blocks.query("task == @task and block == @b and metric == 'tau_norm'").value.item()
            assert got == pytest.approx(want, rel=1e-9)
    # per-tensor sign shares: recomputed for one tensor by hand
    name = "blocks.1.fc1.weight"
    taus = torch.stack([e.state_dict()[name].double() - sd0[name].double() for e in experts.values()])
    both, against, _ = sign_conflicts(taus, 0.5)
    rows = table[(table.block == 1) & (table.layer == "fc1.weight")]
    assert rows.query("task == @ALL and metric == 'sign_conflict'").value.item() == pytest.approx(both)
    assert rows.query("task == 't2' and metric == 'sign_against'").value.item() == pytest.approx(float(against[2]))
    # every view of every task and block, the spectral overlap only from matrices (not biases)
    assert set(blocks.metric) == {"tau_norm", "cosine_others", "sign_against", "spectral_overlap", "sign_conflict"}
    assert not table.query("metric == 'spectral_overlap' and layer.str.endswith('bias')", engine="python").size
    assert blocks.value.notna().all() and (blocks.query("metric == 'sign_against'").value.between(0, 1)).all()


def test_the_views_sit_beside_the_drift_of_the_same_block_and_task():
    base, experts, _ = toy_zoo(n_tasks=3)
    blocks = block_table(weight_table(base, experts), task_vector_matrix(base, experts))
    drift = pd.DataFrame(
        [(t, b, "drift_rel", 0.1 * b + i) for i, t in enumerate(experts) for b in range(3)],
        columns=["task", "block", "metric", "value"],
    )
    wide = beside_drift(blocks, drift)
    assert len(wide) == 9 and wide.drift_rel.tolist() == sorted(wide.drift_rel.tolist(), key=lambda v: v)
    row = wide[(wide.task == "t1") & (wide.block == 2)].iloc[0]
    assert row.drift_rel == pytest.approx(1.2)
    assert row.sign_conflict == blocks.query("task == @ALL and block == 2").value.item()
    corr = correlations(wide)
    assert set(corr.view) >= {"tau_norm", "sign_against", "spectral_overlap"} and (corr.rows == 9).all()
    assert corr.spearman.between(-1, 1).all()

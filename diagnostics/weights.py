"""Weight-space views of a merge, per block and task, from parameters only (no data).

The views researchers look at before merging, each a pure function of the experts' task
vectors ``tau_i = theta_i - theta_0`` on one weight tensor (``taus``: ``(n_tasks, *shape)``):

- :func:`pairwise_cosines`: ``cos(tau_i, tau_j)``;
- :func:`sign_conflicts`: TIES's count (Yadav et al. 2023): trim each ``tau_i`` to its
  top-``density`` entries by magnitude, elect the sign of their sum per entry; the share of
  entries whose kept values take both signs, and per task the share of its kept entries
  against the elected sign (those TIES's disjoint merge drops);
- :func:`spectral_overlap`: of two tasks' top-``k`` left singular directions ``U_i``,
  ``||U_i^T U_j||_F^2 / k`` (1: the same subspace, ~k/d for random ones).

:func:`weight_table` applies them to every tensor of every block; :func:`block_table` sums
them up per block (norms from sums of squares, cosines of the whole block's task vectors, shares weighted
by entries, overlaps as the mean over the block's matrices); :func:`beside_drift` puts them
next to a :func:`diagnostics.drift_table`'s drift of the same block and task. Tables are tidy.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np
import pandas as pd
import torch
from torch import nn

from diagnostics.similarity import EPS, block_numbers, block_of
from featcal.baselines.merging import _trim_top  # TIES's trim step, as the merger does it

ALL = "all tasks"  # ``task`` of a measurement over every task at once
DENSITY = 0.2  # TIES's default trim density (featcal.baselines.merging.ties)
TOP_K = 8  # singular directions compared per task vector


# ----------------------------------------------------------------------------- pure maths


def pairwise_cosines(taus: torch.Tensor) -> torch.Tensor:
    """``(n, *shape)`` task vectors -> ``(n, n)`` cosines in float64 (NaN for a zero vector)."""
    flat = taus.reshape(len(taus), -1).double()
    gram = flat @ flat.T
    norms = gram.diagonal().clamp_min(0).sqrt()
    den = norms[:, None] * norms[None, :]
    return torch.where(den > EPS, gram / den.clamp_min(EPS), torch.full_like(gram, float("nan")))


def sign_conflicts(taus: torch.Tensor, density: float = DENSITY) -> tuple[float, torch.Tensor, torch.Tensor]:
    """TIES's sign conflicts on one tensor: ``(share of entries whose kept values take both
    signs, per task the share of its kept entries against the elected sign (n,), per task
    the number of kept entries (n,))``."""
    trimmed = _trim_top(taus.double(), density).reshape(len(taus), -1)  # (n, m)
    elected = torch.sign(trimmed.sum(0))  # (m,)
    kept = trimmed != 0
    pos, neg = ((trimmed > 0) & kept).any(0), ((trimmed < 0) & kept).any(0)
    both = float((pos & neg).double().mean())
    against = (torch.sign(trimmed) != elected) & kept  # (n, m)
    n_kept = kept.sum(1)
    share = against.sum(1).double() / n_kept.clamp_min(1)
    return both, share, n_kept


def top_directions(tau: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """The top-``k`` left singular vectors of a matrix ``(out, in)`` -> ``(out, k)`` (fewer
    when its rank is lower; float64)."""
    u, s, _ = torch.linalg.svd(tau.double(), full_matrices=False)
    rank = int((s > s[0] * 1e-10).sum()) if len(s) and s[0] > 0 else 0
    return u[:, : min(k, rank)]


def spectral_overlap(taus: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """``(n, out, in)`` task vectors -> ``(n, n)``: ``||U_i^T U_j||_F^2 / k`` of their top-``k``
    left singular directions (k: the smaller of the two subspaces; NaN for a zero matrix)."""
    us = [top_directions(t, k) for t in taus]
    n = len(us)
    out = torch.full((n, n), float("nan"), dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            kk = min(us[i].shape[1], us[j].shape[1])
            if kk:
                out[i, j] = float((us[i][:, :kk].T @ us[j][:, :kk]).square().sum()) / kk
    return out


# ----------------------------------------------------------------------------- per tensor


def block_tensors(
    base: nn.Module, experts: Mapping[str, nn.Module], blocks: str | None = None
) -> Iterator[tuple[int, str, torch.Tensor]]:
    """``(block, name within the block, taus (n_tasks, *shape))`` for every floating tensor
    inside the blocks, in the base's order (experts in ``experts``' order); blocks numbered in
    forward order over every stack (:func:`diagnostics.similarity.block_numbers`)."""
    first = next(iter(experts.values()))
    numbers = block_numbers(first, blocks)
    names = list(numbers)
    thetas = [m.state_dict() for m in experts.values()]
    for name, w0 in base.state_dict().items():
        b = block_of(name, numbers)
        if b is None or not torch.is_floating_point(w0):
            continue
        missing = [t for t, th in zip(experts, thetas) if name not in th]
        if missing:
            raise ValueError(f"parameter {name!r} of the base is missing from expert {missing[0]!r}.")
        w0 = w0.double()
        taus = torch.stack([th[name].to(w0.device).double() - w0 for th in thetas])
        yield b, name[len(names[b]) + 1 :], taus


def _other_mean(mat: torch.Tensor, i: int) -> float:
    """Mean of row ``i`` of a pairwise matrix over the other tasks (NaN for none)."""
    vals = [float(mat[i, j]) for j in range(len(mat)) if j != i and not torch.isnan(mat[i, j])]
    return float(np.mean(vals)) if vals else float("nan")


@torch.no_grad()
def weight_table(
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    blocks: str | None = None,
    density: float = DENSITY,
    k: int = TOP_K,
) -> pd.DataFrame:
    """Per block, tensor (``layer``) and task, tidy ``task, block, layer, metric, value``:

    - ``tau_norm`` ``|tau_i|``, ``tau_sq`` ``|tau_i|^2``, ``entries`` (the tensor's size);
    - ``cosine_others``: the mean ``cos(tau_i, tau_j)`` over the other tasks;
    - ``sign_against``: share of the task's kept entries against TIES's elected sign,
      ``kept`` their count; task :data:`ALL`: ``sign_conflict``, the share of entries
      whose kept values take both signs;
    - ``spectral_overlap`` (matrices only): the mean overlap of its top-``k`` singular
      directions with the other tasks'.
    """
    tasks = list(experts)
    rows = []
    for block, layer, taus in block_tensors(base, experts, blocks):
        cos = pairwise_cosines(taus)
        both, against, kept = sign_conflicts(taus, density)
        overlap = spectral_overlap(taus, k) if taus.dim() == 3 and min(taus.shape[1:]) > 1 else None
        sq = taus.reshape(len(tasks), -1).square().sum(1)
        for i, task in enumerate(tasks):
            rows += [
                (task, block, layer, "tau_norm", float(sq[i].sqrt())),
                (task, block, layer, "tau_sq", float(sq[i])),
                (task, block, layer, "entries", float(taus[i].numel())),
                (task, block, layer, "cosine_others", _other_mean(cos, i)),
                (task, block, layer, "sign_against", float(against[i])),
                (task, block, layer, "kept", float(kept[i])),
            ]
            if overlap is not None:
                rows.append((task, block, layer, "spectral_overlap", _other_mean(overlap, i)))
        rows += [(ALL, block, layer, "sign_conflict", both), (ALL, block, layer, "entries", float(taus[0].numel()))]
    return pd.DataFrame(rows, columns=["task", "block", "layer", "metric", "value"])


# ----------------------------------------------------------------------------- per block


def _weighted(df: pd.DataFrame, metric: str, weight: str) -> pd.Series:
    """Per (task, block): the mean of ``metric`` over the block's tensors weighted by ``weight``."""
    wide = df[df.metric.isin([metric, weight])].pivot_table(
        index=["task", "block", "layer"], columns="metric", values="value"
    )
    wide = wide.dropna()
    num = (wide[metric] * wide[weight]).groupby(level=["task", "block"]).sum()
    den = wide[weight].groupby(level=["task", "block"]).sum()
    return num / den.where(den > 0)


def block_table(table: pd.DataFrame, matrix: pd.DataFrame) -> pd.DataFrame:
    """:func:`weight_table` summed up per block, tidy ``task, block, metric, value``:
    ``tau_norm`` (over the block's tensors), ``cosine_others`` the mean over the other tasks
    of the block's task-vector cosine (``matrix``: :func:`diagnostics.task_vector_matrix` of
    the same experts), ``sign_against`` weighted by the tensors' kept entries,
    ``sign_conflict`` (task :data:`ALL`) by their entries, ``spectral_overlap`` the mean over
    the block's matrices."""
    per_task = table[table.task != ALL]
    pairs = matrix[(matrix.task != matrix.other) & (matrix.block >= 0)]
    series = {
        "tau_norm": per_task[per_task.metric == "tau_sq"].groupby(["task", "block"])["value"].sum() ** 0.5,
        "cosine_others": pairs.groupby(["task", "block"])["value"].mean(),
        "sign_against": _weighted(per_task, "sign_against", "kept"),
        "spectral_overlap": per_task[per_task.metric == "spectral_overlap"].groupby(["task", "block"])["value"].mean(),
        "sign_conflict": _weighted(table[table.task == ALL], "sign_conflict", "entries"),
    }
    frames = [s.rename("value").reset_index().assign(metric=m) for m, s in series.items() if len(s)]
    out = pd.concat(frames, ignore_index=True)[["task", "block", "metric", "value"]]
    out["block"] = out.block.astype(int)
    order = {t: i for i, t in enumerate(dict.fromkeys(table.task))}  # the experts' order, not alphabetical
    out = out.assign(_order=out.task.map(order)).sort_values(["metric", "_order", "block"], kind="stable")
    return out.drop(columns="_order").reset_index(drop=True)


def beside_drift(blocks: pd.DataFrame, drift: pd.DataFrame, metric: str = "drift_rel") -> pd.DataFrame:
    """One row per task and block: the per-task weight views of :func:`block_table` and the
    block-level ``sign_conflict``, beside ``drift``'s ``metric`` (a drift table's, e.g. the
    merged model's relative drift) of the same block and task."""
    per_task = blocks[blocks.task != ALL].pivot_table(index=["task", "block"], columns="metric", values="value")
    shared = blocks[blocks.task == ALL].set_index("block")["value"].rename("sign_conflict")
    feat = drift[(drift.metric == metric) & (drift.block >= 0)].groupby(["task", "block"])["value"].mean()
    out = per_task.join(feat.rename(metric), how="left").reset_index()
    out = out.join(shared, on="block")
    out.columns.name = None
    return out


def correlations(wide: pd.DataFrame, target: str = "drift_rel") -> pd.DataFrame:
    """Spearman rank correlation of every weight view in :func:`beside_drift`'s table with
    ``target`` over its (task, block) rows: ``view``, ``spearman``, ``rows``."""
    rows = []
    for col in wide.columns:
        if col in ("task", "block", target):
            continue
        pair = wide[[col, target]].dropna()
        rho = pair[col].rank().corr(pair[target].rank()) if len(pair) > 2 else float("nan")
        rows.append({"view": col, "spearman": rho, "rows": len(pair)})
    return pd.DataFrame(rows, columns=["view", "spearman", "rows"])

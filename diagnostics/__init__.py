"""Feature-drift diagnostics of merged (or calibrated) models against their experts
(FeatCal paper, section 3). Every function returns tidy pandas tables.

    from diagnostics import diagnose, drift_table
    df = drift_table(merged, experts, data)            # task, block, metric, value
    tables, summary = diagnose(merged, zoo)            # every table + a short text

Tables and their ``block`` column (``-1`` = the whole model):

- ``drift`` (:func:`drift_table`): per task and block, ``e = m + p`` statistics,
  block-output cosine and CKA;
- ``expert_cosine`` (:func:`expert_cosine`): per example, cosine of final features;
- ``task_vector`` (:func:`task_vector_cosine`): ``cos(theta - theta_0, theta_i - theta_0)``,
  whole model and per block;
- ``task_vector_matrix`` (:func:`task_vector_matrix`): ``cos(tau_i, tau_j)`` between the
  experts' task vectors, whole model and per block;
- ``output`` (:func:`output_drift`): KL(expert || model), top-1 agreement, accuracy.
"""

from __future__ import annotations

import pandas as pd
from torch import nn

from diagnostics.decomposition import DriftTokens, drift_metrics, drift_tokens
from diagnostics.drift import ExpertStreams, drift_table, drift_tables, expert_streams, streams_while
from diagnostics.output import default_features, expert_cosine, output_drift
from diagnostics.similarity import WHOLE, linear_cka, task_vector_cosine, task_vector_matrix
from featcal.util.metrics import kl_rows

__all__ = [
    "diagnose",
    "summarize",
    "drift_table",
    "drift_tables",
    "drift_tokens",
    "drift_metrics",
    "DriftTokens",
    "ExpertStreams",
    "expert_streams",
    "streams_while",
    "expert_cosine",
    "default_features",
    "task_vector_cosine",
    "task_vector_matrix",
    "output_drift",
    "kl_rows",
    "linear_cka",
    "WHOLE",
]


def diagnose(
    model: nn.Module,
    zoo,
    n_per_task: int = 32,
    seed: int = 42,
    batch_size: int = 16,
    split: str = "test",
    max_per_task: int | None = None,
    blocks: str | None = None,
    tokens: str = "all",
    cka: bool = True,
    progress: bool = False,
    name: str = "model",
) -> tuple[dict[str, pd.DataFrame], str]:
    """Every diagnostic of ``model`` against the experts of ``zoo``.

    Steps:

    1. D_i = ``zoo.calib_data(n_per_task, seed, batch_size)`` (the calibration split);
    2. ``drift``: :func:`drift_table` on D_i;
    3. ``expert_cosine``: :func:`expert_cosine` on D_i with ``zoo.features`` (what the heads read);
    4. ``task_vector``: :func:`task_vector_cosine` against ``zoo.base``;
    5. ``output``: :func:`output_drift` on ``split`` (``max_per_task`` examples per task).

    Returns ``(tables, summary)``: ``{"drift", "expert_cosine", "task_vector", "output"}`` ->
    DataFrame, and :func:`summarize`'s text.
    """
    data = zoo.calib_data(n_per_task, seed=seed, batch_size=batch_size)
    tables = {
        "drift": drift_table(model, zoo.experts, data, blocks=blocks, tokens=tokens, cka=cka, progress=progress),
        "expert_cosine": expert_cosine(model, zoo.experts, data, features_fn=zoo.features),
        "task_vector": task_vector_cosine(model, zoo.base, zoo.experts, blocks=blocks),
        "output": output_drift(model, zoo, split=split, max_per_task=max_per_task),
    }
    return tables, summarize(tables, name=name)


def _per_task(df: pd.DataFrame, metric: str, block: int | None = None) -> pd.Series:
    sel = df[df.metric == metric]
    if block is not None:
        sel = sel[sel.block == block]
    return sel.groupby("task", sort=False)["value"].mean()


def summarize(tables: dict[str, pd.DataFrame], name: str = "model") -> str:
    """A few lines a person reads first: output drift, final-feature cosine, where the
    drift comes from in the last block, and task-vector alignment (means over tasks)."""
    lines = [f"diagnostics of {name}"]
    out = tables.get("output")
    if out is not None and len(out):
        kl, agree = _per_task(out, "kl"), _per_task(out, "agreement")
        line = f"outputs: KL(expert || {name}) {kl.mean():.4f} nats, top-1 agreement {agree.mean():.1f}%"
        if (out.metric == "accuracy").any():
            line += (
                f", accuracy {_per_task(out, 'accuracy').mean():.1f}%"
                f" (experts {_per_task(out, 'expert_accuracy').mean():.1f}%)"
            )
        lines.append(line)
    cos = tables.get("expert_cosine")
    if cos is not None and len(cos):
        per = _per_task(cos, "expert_cosine")
        lines.append(
            f"final-feature cosine to the expert: mean {per.mean():.4f} (lowest: task {per.idxmin()!r} {per.min():.4f})"
        )
    drift = tables.get("drift")
    if drift is not None and len(drift):
        first, last = int(drift.block.min()), int(drift.block.max())
        rel0, rel = _per_task(drift, "drift_rel", first).mean(), _per_task(drift, "drift_rel", last).mean()
        share = _per_task(drift, "drift_sq_mismatch_share", last).mean()
        lines.append(f"relative drift |e|/|h_exp|: {rel0:.4f} after block {first}, {rel:.4f} after block {last}")
        lines.append(
            f"block {last}: {100 * share:.0f}% of the squared drift is local mismatch, "
            f"{100 * (1 - share):.0f}% upstream propagation"
        )
    tv = tables.get("task_vector")
    if tv is not None and len(tv):
        cos_tv = _per_task(tv, "task_vector_cosine", WHOLE).mean()
        text = "undefined (the model's task vector is zero)" if pd.isna(cos_tv) else f"mean {cos_tv:.4f}"
        lines.append(f"task-vector cosine (whole model): {text}")
    return "\n".join(lines)

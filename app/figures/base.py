"""What every figure of the app shares: one colour per quantity, the metrics' human names,
the shaping of tidy drift tables into wide ones, and the construction of a figure from plain
dicts (see :mod:`app.figures`)."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

# One layout (and one axis of blocks) for the app's and the command line's figures.
from featcal.sweep.figures import LAYOUT, block_axis, block_label, title_layout

# One colour per quantity, the same in every figure.
COLORS = {
    "drift": "#111827",
    "mismatch": "#1e3a8a",  # lines: darker than the bars they cross
    "propagation": "#9a3412",
    "drift_sq_mismatch": "#60a5fa",
    "drift_sq_propagation": "#fdba74",
    "base": "#9ca3af",
    "expert": "#16a34a",
    "merged": "#dc2626",
    "calibrated": "#2563eb",
    "preview": "#93c5fd",
}
SQUARED = {"drift_sq_mismatch": "local mismatch <e, m>", "drift_sq_propagation": "upstream propagation <e, p>"}
NORMS = {"drift": "|e| drift", "mismatch": "|m| mismatch", "propagation": "|p| propagation"}
# Human names of the diagnostics' metrics (diagnostics.drift_metrics and friends), for axes and hovers.
LABELS = {
    "drift_rel": "relative drift |e| / |h_exp|",
    "drift": "drift |e|",
    "drift_sq_mismatch_share": "share of |e|² from local mismatch",
    "mismatch_rel": "relative local mismatch |m| / |h_exp|",
    "propagation_rel": "relative propagation |p| / |h_exp|",
    "expert_cosine": "expert cosine",
    "task_vector_cosine": "task-vector cosine",
    "cka": "linear CKA",
}
TICKS = ".3~r"  # axis ticks: three significant digits, no trailing zeros, no exponent


def label(metric: str) -> str:
    """The human name of a diagnostics metric (the metric's own name when it has none)."""
    return LABELS.get(metric, metric)


# ----------------------------------------------------------------------------- shaping


def per_block(df: pd.DataFrame, metrics: Iterable[str], task: str | None = None) -> pd.DataFrame:
    """Wide frame indexed by block, one column per metric (sorted by name): task ``task``'s
    values, or the mean over tasks when ``task`` is None. In numpy, not a pandas groupby: it
    runs eight times per slider change on the Calibrate page."""
    metric, block = df.metric.to_numpy(), df.block.to_numpy()
    keep = np.isin(metric, list(metrics)) & (block >= 0)
    if task is not None:
        keep &= df.task.to_numpy() == task
    names, col = np.unique(metric[keep], return_inverse=True)
    blocks, row = np.unique(block[keep], return_inverse=True)
    total = np.zeros((len(blocks), len(names)))
    count = np.zeros((len(blocks), len(names)))
    np.add.at(total, (row, col), df.value.to_numpy(dtype=float)[keep])
    np.add.at(count, (row, col), 1.0)
    with np.errstate(invalid="ignore"):
        mean = total / count  # NaN where a block has no value of a metric
    return pd.DataFrame(mean, index=pd.Index(blocks, name="block"), columns=pd.Index(names, name="metric"))


def block_task_grid(df: pd.DataFrame, metric: str) -> pd.DataFrame:
    """Wide frame ``block x task`` of one metric (tasks in their first-seen order)."""
    sel = df[(df.metric == metric) & (df.block >= 0)]
    tasks = list(dict.fromkeys(sel.task))
    return sel.groupby(["block", "task"])["value"].mean().unstack("task")[tasks].sort_index()


def value_range(
    frames: Iterable[pd.DataFrame | None], metrics: Iterable[str], task: str | None = None, stacked: bool = False
) -> tuple[float, float] | None:
    """A y range that fits every frame (for side-by-side charts on one scale); stacked
    bars count their positive and negative parts separately."""
    lo, hi = 0.0, 0.0
    seen = False
    for df in frames:
        if df is None or df.empty:
            continue
        wide = per_block(df, metrics, task)
        if wide.empty:
            continue
        seen = True
        if stacked:
            hi = max(hi, float(wide.clip(lower=0).sum(axis=1).max()))
            lo = min(lo, float(wide.clip(upper=0).sum(axis=1).min()))
        else:
            hi, lo = max(hi, float(wide.max().max())), min(lo, float(wide.min().min()))
    if not seen or not math.isfinite(hi - lo):
        return None
    pad = 0.05 * (hi - lo or 1.0)
    return (lo - pad if lo < 0 else 0.0, hi + pad)


def heatmap_range(frames: Iterable[pd.DataFrame | None], metric: str) -> tuple[float, float] | None:
    """``(0, max)`` of one metric over every frame (one colour scale for side-by-side heatmaps)."""
    vals = [df[(df.metric == metric) & (df.block >= 0)].value for df in frames if df is not None and not df.empty]
    vals = [v for v in vals if len(v)]
    if not vals:
        return None
    return (0.0, float(pd.concat(vals).max()))


def _figure(data: list[dict], layout: dict) -> go.Figure:
    """One validated construction from plain dicts (much faster than incremental updates)."""
    return go.Figure({"data": data, "layout": {**LAYOUT, **layout}})


def _title(text: str) -> dict:
    return title_layout(text)


def _axis(text: str, **kw) -> dict:
    """A numeric axis with a title and rounded ticks."""
    return {"title": {"text": text}, "tickformat": TICKS, **kw}


TASK_COLORS = ("#2563eb", "#16a34a", "#f97316", "#0891b2", "#db2777", "#7c3aed", "#a16207", "#4b5563", "#dc2626")


def _heatmap(
    grid: pd.DataFrame, title: str, name: str, trace: dict, fmt: str = ".4f", names: Sequence[str] | None = None
) -> go.Figure:
    """``grid`` (block x task) as a heatmap whose every cell is clickable over its whole area:
    plotly reports no clicks (selections) on heatmap cells, so near-invisible bars, one per
    cell and exactly its size, lie over them and carry the hover and the click (the click's
    ``customdata`` is ``[block, value, the block's label]``, its ``x`` the task). ``names``:
    the blocks' names (:func:`~featcal.sweep.figures.block_axis`), else their numbers."""
    heat = {
        "type": "heatmap",
        "z": grid.values.tolist(),
        "x": list(grid.columns),
        "y": [int(b) for b in grid.index],
        "hoverinfo": "skip",
        **trace,
    }
    tasks = [t for _ in grid.index for t in grid.columns]
    cells = {
        "type": "bar",
        "x": tasks,
        "y": [1.0] * len(tasks),
        "base": [int(b) - 0.5 for b in grid.index for _ in grid.columns],
        "width": 1.0,
        "customdata": [
            [int(b), v, block_label(int(b), names)] for b, row in zip(grid.index, grid.values.tolist()) for v in row
        ],
        "showlegend": False,
        "name": "cells",
        "marker": {"color": "#000", "opacity": 0.01, "line": {"width": 0}},
        "selected": {"marker": {"opacity": 0.01}},
        "unselected": {"marker": {"opacity": 0.01}},
        "hovertemplate": "task %{x}<br>%{customdata[2]}<br>" + name + " %{customdata[1]:" + fmt + "}<extra></extra>",
    }
    return _figure(
        [heat, cells],
        {
            "title": _title(title),
            "clickmode": "event+select",
            "barmode": "overlay",
            "yaxis": block_axis(names, autorange="reversed", zeroline=False),
            "xaxis": {"title": {"text": "task"}},
            "height": max(450, 18 * len(grid.index) + 150),  # a 30-block LLM: a readable row per block
        },
    )


def _task_bars(frames: dict[str, pd.DataFrame], metric: str, block: int, hover: str) -> list[dict]:
    """One bar trace per model: its ``metric`` per task at ``block`` (tidy tables)."""
    data = []
    for name, df in frames.items():
        sel = df[(df.metric == metric) & (df.block == block)]
        data.append(
            {
                "type": "bar",
                "x": sel.task.tolist(),
                "y": sel.value.tolist(),
                "name": name,
                "marker": {"color": COLORS.get(name)},
                "hovertemplate": "%{x}<br>" + hover + " %{y:.4f}<extra>" + name + "</extra>",
            }
        )
    return data

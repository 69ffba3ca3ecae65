"""Figures of the Weights page: the weight-space views of :mod:`diagnostics.weights` per
block and task, next to the feature drift of the same block. Pure functions of tidy
DataFrames (no Streamlit, no model), built from plain dicts as in :mod:`app.figures`.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import plotly.graph_objects as go

from app.figures.base import (
    TASK_COLORS,
    TICKS,
    _figure,
    _heatmap,
    _title,
    block_axis,
    block_label,
    block_task_grid,
    label,
)

# The views (diagnostics.weights.block_table's metrics): short name (colour bar, axis), what
# it is (title), colour scale, fixed range or None.
VIEWS = {
    "sign_against": (
        "against elected sign",
        "kept entries against TIES's elected sign",
        "Oranges",
        (0.0, 1.0),
    ),
    "spectral_overlap": (
        "spectral overlap",
        "top singular directions shared with other tasks",
        "Purples",
        (0.0, 1.0),
    ),
    "cosine_others": ("cos(τ_i, τ_j), mean", "task-vector cosine with other tasks", "RdBu_r", None),
    "tau_norm": ("|τ_i|", "task-vector norm per block", "Greens", None),
}


def block_mark(block: int, names: Sequence[str] | None = None) -> str:
    """A point's short mark for its block: ``b3``; on a model of several stacks the stack's
    initial and the block's number in it (``encoder.block.1`` -> ``e1``, ``decoder.block.0`` ->
    ``d0``): ``b2`` did not tell the first decoder block from an encoder's."""
    if names is None:
        return f"b{block}"
    name = names[block]
    return f"{name[0]}{name.rsplit('.', 1)[-1]}"


def view_label(metric: str) -> str:
    """The short name of a weight view (of a drift metric otherwise)."""
    return VIEWS[metric][0] if metric in VIEWS else label(metric)


def view_title(metric: str) -> str:
    return VIEWS[metric][1] if metric in VIEWS else label(metric)


def view_heatmap(blocks: pd.DataFrame, metric: str, title: str, names: Sequence[str] | None = None) -> go.Figure:
    """``block x task`` heatmap of one weight view. Shares and overlaps use their whole range
    [0, 1] (never saturating); the cosine is centred at 0 on its largest magnitude. ``names``:
    the blocks' names (:func:`~featcal.sweep.figures.block_axis`), else their numbers."""
    grid = block_task_grid(blocks, metric)
    name, _, scale, fixed = VIEWS[metric]
    trace = {"colorscale": scale, "colorbar": {"title": {"text": name, "side": "right"}, "thickness": 12}}
    trace["colorbar"]["tickformat"] = TICKS
    if fixed is not None:
        trace.update(zmin=fixed[0], zmax=fixed[1])
    elif metric == "cosine_others":
        top = float(grid.abs().max().max()) if grid.size else 1.0
        trace.update(zmid=0.0, zmin=-top, zmax=top)
    return _heatmap(grid, title, name, trace, names=names)


def conflict_and_drift(
    blocks: pd.DataFrame, drift: pd.DataFrame, metric: str = "drift_rel", names: Sequence[str] | None = None
) -> go.Figure:
    """Per block: TIES's sign-conflict share over every task (bars, left axis from 0) and the
    mean over tasks of the drift ``metric`` (line, right axis from 0); ``names``: the blocks'
    names on the axis (:func:`~featcal.sweep.figures.block_axis`)."""
    conflict = blocks[(blocks.metric == "sign_conflict")].groupby("block")["value"].mean()
    feat = drift[(drift.metric == metric) & (drift.block >= 0)].groupby("block")["value"].mean()
    data = [
        {
            "type": "bar",
            "x": [int(b) for b in conflict.index],
            "y": conflict.tolist(),
            "name": "sign conflicts (share of entries, TIES trim)",
            "marker": {"color": "#f97316"},
            "customdata": [block_label(int(b), names) for b in conflict.index],
            "hovertemplate": "%{customdata}<br>sign conflicts %{y:.3f}<extra></extra>",
        },
        {
            "type": "scatter",
            "mode": "lines+markers",
            "x": [int(b) for b in feat.index],
            "y": feat.tolist(),
            "yaxis": "y2",
            "name": f"merged model: {label(metric)} (mean over tasks)",
            "line": {"color": "#111827"},
            "customdata": [block_label(int(b), names) for b in feat.index],
            "hovertemplate": "%{customdata}<br>drift %{y:.4f}<extra></extra>",
        },
    ]
    return _figure(
        data,
        {
            "title": _title("sign conflicts vs drift, per block"),
            "xaxis": block_axis(names),
            "yaxis": {"title": {"text": "sign-conflict share"}, "rangemode": "tozero", "tickformat": TICKS},
            "yaxis2": {
                "title": {"text": label(metric)},
                "overlaying": "y",
                "side": "right",
                "rangemode": "tozero",
                "tickformat": ".2~f",
                "showgrid": False,
            },
        },
    )


def view_vs_drift(
    wide: pd.DataFrame, metric: str, target: str = "drift_rel", names: Sequence[str] | None = None
) -> go.Figure:
    """One point per (task, block) of :func:`diagnostics.weights.beside_drift`'s table: the
    weight view ``metric`` across, the drift ``target`` up; one colour per task, each point
    marked with its block's short mark (:func:`block_mark`; hovered: its name in ``names``)."""
    data = []
    for i, (task, sel) in enumerate(wide.groupby("task", sort=False)):
        data.append(
            {
                "type": "scatter",
                "mode": "markers+text",
                "x": sel[metric].tolist(),
                "y": sel[target].tolist(),
                "text": [block_mark(int(b), names) for b in sel.block],
                "textposition": "top center",
                "textfont": {"size": 9},
                "name": task,
                "marker": {"color": TASK_COLORS[i % len(TASK_COLORS)], "size": 8},
                "customdata": [block_label(int(b), names) for b in sel.block],
                "hovertemplate": f"{task}" + ", %{customdata}<br>%{x:.4f} → drift %{y:.4f}<extra></extra>",
            }
        )
    return _figure(
        data,
        {
            "title": _title(f"drift vs {view_label(metric)}"),
            "xaxis": {"title": {"text": view_label(metric)}, "tickformat": TICKS},
            "yaxis": {"title": {"text": label(target)}, "rangemode": "tozero", "tickformat": TICKS},
        },
    )

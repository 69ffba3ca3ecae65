"""The similarity figures: each model's cosine with the experts' features per block, and the
task vectors' cosines (between experts, and with each model's displacement)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.figures.base import (
    TASK_COLORS,
    TICKS,
    _axis,
    _figure,
    _task_bars,
    _title,
    block_axis,
    block_task_grid,
)


def expert_cosine_per_block(
    frames: dict[str, pd.DataFrame], title: str, names: Sequence[str] | None = None
) -> go.Figure:
    """Per block and task, the cosine of the model's pooled block output with the expert's
    (the drift tables' ``expert_cosine``): one colour per task, one dash per model
    (``frames``: ``{model name: drift table}``, the first drawn dashed); ``names``: the blocks'
    names on the axis (:func:`~featcal.sweep.figures.block_axis`)."""
    data = []
    for k, (name, df) in enumerate(frames.items()):
        grid = block_task_grid(df, "expert_cosine")
        for i, task in enumerate(grid.columns):
            data.append(
                {
                    "type": "scatter",
                    "x": [int(b) for b in grid.index],
                    "y": grid[task].tolist(),
                    "name": task,
                    "legendgroup": task,
                    "showlegend": k == len(frames) - 1,  # one legend entry per task (the dash tells the model)
                    "mode": "lines+markers",
                    "line": {"color": TASK_COLORS[i % len(TASK_COLORS)], "dash": "dot" if k == 0 else "solid"},
                    "marker": {"size": 5},
                    "hovertemplate": f"{task} ({name})" + " %{y:.4f}<extra></extra>",
                }
            )
    return _figure(
        data,
        {
            "title": _title(title),
            "hovermode": "x unified",
            "xaxis": block_axis(names),
            "yaxis": _axis("expert cosine of the block output"),
        },
    )


def task_vector_matrix_heatmap(mat: pd.DataFrame, block: int, title: str) -> go.Figure:
    """``task x task`` cosines of the experts' task vectors at ``block`` (-1: whole model),
    from :func:`diagnostics.task_vector_matrix`'s table; diverging colours centred at 0 on the
    largest off-diagonal magnitude, which the colour bar states; the diagonal (1) is blank."""
    sel = mat[mat.block == block]
    tasks = list(dict.fromkeys(sel.task))
    grid = sel.pivot(index="task", columns="other", values="value").loc[tasks, tasks]
    diagonal = np.eye(len(tasks), dtype=bool)
    off = grid.values[~diagonal]
    top = float(np.nanmax(np.abs(off))) if off.size and np.isfinite(off).any() else 1.0
    z = np.where(diagonal, np.nan, grid.values)  # the diagonal (1, a task with itself) left blank: no saturation
    trace = {
        "type": "heatmap",
        "z": [[None if v != v else float(v) for v in row] for row in z],
        "x": tasks,
        "y": tasks,
        "colorscale": "RdBu_r",
        "zmid": 0.0,
        "zmin": -top,
        "zmax": top,
        "xgap": 1,
        "ygap": 1,
        "colorbar": {
            "title": {"text": f"cos(τ_i, τ_j); scale ±{top:.2g}, off-diagonal", "side": "right"},
            "thickness": 12,
            "tickformat": TICKS,
        },
        "hovertemplate": "%{y} · %{x}<br>cos %{z:.4f}<extra></extra>",
    }
    return _figure(
        [trace],
        {
            "title": _title(title),
            "height": 460,
            "yaxis": {"autorange": "reversed", "automargin": True},
            "xaxis": {"tickangle": -45, "automargin": True},
        },
    )


def task_vector_bars(tables: dict[str, pd.DataFrame], block: int, title: str) -> go.Figure:
    """Per task, the cosine of each model's displacement ``theta - theta_0`` with the expert's
    task vector at ``block`` (-1: whole model), one bar group per model (``tables``:
    ``{model name: diagnostics.task_vector_cosine table}``)."""
    data = _task_bars(tables, "task_vector_cosine", block, "task-vector cosine")
    return _figure(
        data,
        {"title": _title(title), "barmode": "group", "yaxis": _axis("cos(θ − θ₀, τ_task)", rangemode="tozero")},
    )

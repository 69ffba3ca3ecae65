"""The score figures: accuracy per task (a markdown table of the change, grouped bars) and
the calibration's residual per block."""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import plotly.graph_objects as go

from app.figures.base import COLORS, _axis, _figure, _title, block_axis


def task_accuracy_table(before: pd.DataFrame, after: pd.DataFrame, name: str) -> str:
    """Accuracy per task (rows of ``task_summary`` frames, column ``accuracy``) of the merged
    model and of ``name``, with the change in points, as one markdown table: one element for
    the browser to draw on every slider change, where an ``st.metric`` per task is one per
    task plus their column containers)."""
    tasks = list(after.index)

    def color(d):
        return "green" if d > 0.05 else "red" if d < -0.05 else "gray"

    cells = [
        f"{after.accuracy[t]:.1f}% :{color(d)}[{d:+.1f}]"
        for t, d in ((t, after.accuracy[t] - before.accuracy[t]) for t in tasks)
    ]
    return "\n".join(
        [
            f"| accuracy per task | {' | '.join(tasks)} |",
            "|:--|" + "--:|" * len(tasks),
            f"| merged | {' | '.join(f'{before.accuracy[t]:.1f}%' for t in tasks)} |",
            f"| {name} (Δ pp) | {' | '.join(cells)} |",
        ]
    )


def accuracy_bars(acc: pd.DataFrame, title: str = "accuracy per task (%)") -> go.Figure:
    """Grouped bars from a tidy ``task``, ``model``, ``accuracy`` frame (models in first-seen order)."""
    data = []
    for name in dict.fromkeys(acc.model):
        sel = acc[acc.model == name]
        data.append(
            {
                "type": "bar",
                "x": sel.task.tolist(),
                "y": sel.accuracy.tolist(),
                "name": name,
                "marker": {"color": COLORS.get(name.split(" ")[0])},
                "hovertemplate": "%{x}<br>%{y:.1f}%<extra>" + name + "</extra>",
            }
        )
    return _figure(
        data,
        {
            "title": _title(title),
            "barmode": "group",
            "yaxis": {"title": {"text": "top-1 accuracy (%)"}, "range": [0, 100]},
        },
    )


def residuals(
    modules: pd.DataFrame, title: str = "relative residual per module", names: Sequence[str] | None = None
) -> go.Figure:
    """``report.to_frame()``: mean relative residual per block, before vs after calibration
    (``names``: the blocks' names on the axis, :func:`~featcal.sweep.figures.block_axis`)."""
    g = modules.groupby("block")[["residual_before", "residual_after"]].mean()
    blocks = [int(b) for b in g.index]
    data = [
        {
            "type": "bar",
            "x": blocks,
            "y": g.residual_before.tolist(),
            "name": "merged",
            "marker": {"color": COLORS["merged"]},
        },
        {
            "type": "bar",
            "x": blocks,
            "y": g.residual_after.tolist(),
            "name": "calibrated",
            "marker": {"color": COLORS["calibrated"]},
        },
    ]
    return _figure(
        data,
        {
            "title": _title(title),
            "barmode": "group",
            "xaxis": block_axis(names),
            "yaxis": _axis("mean relative residual", rangemode="tozero"),
        },
    )

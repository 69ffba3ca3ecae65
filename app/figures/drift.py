"""The drift figures: the decomposition ``e = m + p`` per block, heatmaps of one metric
``block x task`` (and of its change), and the drill-downs at one block or one task."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.figures.base import (
    COLORS,
    NORMS,
    SQUARED,
    TICKS,
    _axis,
    _figure,
    _heatmap,
    _task_bars,
    _title,
    block_axis,
    block_label,
    block_task_grid,
    label,
    per_block,
)


def drift_decomposition(
    df: pd.DataFrame,
    title: str,
    task: str | None = None,
    sq_range: tuple[float, float] | None = None,
    norm_range: tuple[float, float] | None = None,
    selected_block: int | None = None,
    reference: tuple[str, pd.DataFrame] | None = None,
    names: Sequence[str] | None = None,
) -> go.Figure:
    """Per block: the squared drift split additively, ``|e|^2 = <e, m> + <e, p>``, as stacked
    bars (left axis), and the norms ``|e|``, ``|m|``, ``|p|`` as lines (right axis; norms do
    not add). Means over rows, and over tasks unless ``task`` is given. ``reference``:
    ``(name, drift frame)`` of another model (the merged one) whose ``|e|^2`` is drawn as a
    short red dash over each bar and whose ``|e|`` as a grey dashed line. ``names``: the
    blocks' names on the axis (:func:`~featcal.sweep.figures.block_axis`), else their numbers."""
    data = _squared_bars(per_block(df, SQUARED, task), selected_block) + _norm_lines(per_block(df, NORMS, task))
    if reference is not None:
        data += _reference_marks(*reference, task)
    return _figure(data, _bars_and_norms_layout(title, sq_range, norm_range, names))


def _squared_bars(sq: pd.DataFrame, selected_block: int | None) -> list[dict]:
    """The stacked parts of ``|e|^2``, ``<e, m>`` and ``<e, p>``, one bar per block; every block
    but ``selected_block`` faded when one is chosen."""
    blocks = [int(b) for b in sq.index]
    return [
        {
            "type": "bar",
            "x": blocks,
            "y": sq[metric].tolist(),
            "name": name,
            "marker": {
                "color": COLORS[metric],
                "opacity": [1.0 if selected_block in (None, b) else 0.35 for b in blocks],
            },
            # Plotly's own selection fades nothing: the chosen block is shown by the opacities.
            "selected": {"marker": {"opacity": 1.0}},
            "unselected": {"marker": {"opacity": 1.0}},
            "hovertemplate": name + " %{y:.4g}<extra></extra>",
        }
        for metric, name in SQUARED.items()
        if metric in sq
    ]


def _norm_lines(nm: pd.DataFrame) -> list[dict]:
    """The norms ``|e|`` (solid), ``|m|`` and ``|p|`` (dotted) per block, on the right axis."""
    return [
        {
            "type": "scatter",
            "x": [int(b) for b in nm.index],
            "y": nm[metric].tolist(),
            "name": name,
            "mode": "lines+markers",
            "yaxis": "y2",
            "line": {"color": COLORS[metric], "dash": "solid" if metric == "drift" else "dot"},
            "hovertemplate": name + " %{y:.4g}<extra></extra>",
        }
        for metric, name in NORMS.items()
        if metric in nm
    ]


def _reference_marks(name: str, ref: pd.DataFrame, task: str | None) -> list[dict]:
    """Model ``name``'s drift (table ``ref``) for comparison: its ``|e|^2`` as a short red dash
    per block (the top of its bar), its ``|e|`` as a grey dashed line on the right axis."""
    sq_ref, nm_ref = per_block(ref, SQUARED, task).sum(axis=1, min_count=1), per_block(ref, ["drift"], task)
    marks = [
        {
            "type": "scatter",
            "x": [int(b) for b in sq_ref.index],
            "y": sq_ref.tolist(),
            "name": f"{name}: |e|²",
            "mode": "markers",
            "marker": {
                "symbol": "line-ew-open",
                "size": 28,
                "color": COLORS["merged"],
                "line": {"width": 3, "color": COLORS["merged"]},
            },
            "hovertemplate": name + " |e|² %{y:.4g}<extra></extra>",
        }
    ]
    if "drift" in nm_ref:
        marks.append(
            {
                "type": "scatter",
                "x": [int(b) for b in nm_ref.index],
                "y": nm_ref["drift"].tolist(),
                "name": f"{name}: |e|",
                "mode": "lines",
                "yaxis": "y2",
                "line": {"color": COLORS["base"], "dash": "dash"},
                "hovertemplate": name + " |e| %{y:.4g}<extra></extra>",
            }
        )
    return marks


def _bars_and_norms_layout(
    title: str,
    sq_range: tuple[float, float] | None,
    norm_range: tuple[float, float] | None,
    names: Sequence[str] | None = None,
) -> dict:
    """Squared drift on the left axis (stacked bars, clickable blocks), norms on the right."""
    return {
        "title": _title(title),
        "barmode": "relative",
        "clickmode": "event+select",
        "hovermode": "x unified",  # one box: every series of the block under the pointer
        "xaxis": block_axis(names, hoverformat="d"),
        "yaxis": _axis("squared drift |e|² (mean over tokens)", range=sq_range),
        "yaxis2": {
            "title": {"text": "norm (mean over tokens)"},
            "tickformat": TICKS,
            "tickmode": "auto",  # its own round ticks, not the left axis' grid lines
            "nticks": 6,
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "range": norm_range,
            "rangemode": "tozero",
        },
    }


def drift_heatmap(
    df: pd.DataFrame,
    title: str,
    metric: str = "drift_rel",
    z_range: tuple[float, float] | None = None,
    names: Sequence[str] | None = None,
) -> go.Figure:
    """``block x task`` heatmap of one drift metric (default: relative drift ``|e| / |h_exp|``);
    ``names``: the blocks' names (:func:`~featcal.sweep.figures.block_axis`)."""
    trace = {
        "colorscale": "Reds",
        "colorbar": {"title": {"text": label(metric), "side": "right"}, "thickness": 12, "tickformat": TICKS},
    }
    if z_range is not None:
        trace.update(zmin=z_range[0], zmax=z_range[1])
    return _heatmap(block_task_grid(df, metric), title, label(metric), trace, names=names)


def drift_difference(after: pd.DataFrame, before: pd.DataFrame, metric: str = "drift_rel") -> pd.DataFrame:
    """``block x task`` of ``after``'s metric minus ``before``'s (e.g. calibrated minus merged)."""
    a, b = block_task_grid(after, metric), block_task_grid(before, metric)
    return a - b.reindex(index=a.index, columns=a.columns)


def drift_difference_heatmap(
    after: pd.DataFrame,
    before: pd.DataFrame,
    title: str,
    metric: str = "drift_rel",
    names: Sequence[str] | None = None,
) -> go.Figure:
    """``block x task`` heatmap of ``after`` minus ``before`` (:func:`drift_difference`) in
    diverging colours centred at 0: blue where the drift fell (calibration helps), red where
    it rose (it hurts)."""
    diff = drift_difference(after, before, metric)
    top = float(np.nanmax(np.abs(diff.values))) if diff.size and np.isfinite(diff.values).any() else 1.0
    trace = {
        "colorscale": "RdBu_r",
        "zmid": 0.0,
        "zmin": -top,
        "zmax": top,
        "colorbar": {"title": {"text": f"Δ {label(metric)}", "side": "right"}, "thickness": 12, "tickformat": TICKS},
    }
    return _heatmap(diff, title, f"Δ {label(metric)}", trace, fmt="+.4f", names=names)


def block_by_task(
    frames: dict[str, pd.DataFrame], block: int, metric: str = "drift_rel", names: Sequence[str] | None = None
) -> go.Figure:
    """Drill-down at one block: ``metric`` per task, one bar group per model; the block named as
    in ``names`` (:func:`~featcal.sweep.figures.block_label`)."""
    data = _task_bars(frames, metric, block, label(metric))
    return _figure(
        data,
        {
            "title": _title(f"{block_label(block, names)}: {label(metric)} per task"),
            "barmode": "group",
            "yaxis": _axis(label(metric), rangemode="tozero"),
        },
    )


def task_by_block(
    frames: dict[str, pd.DataFrame], task: str, metric: str = "drift_rel", names: Sequence[str] | None = None
) -> go.Figure:
    """Drill-down for one task: ``metric`` per block, one line per model (``names``: the
    blocks' names on the axis)."""
    data = []
    for name, df in frames.items():
        sel = df[(df.metric == metric) & (df.task == task) & (df.block >= 0)].sort_values("block")
        data.append(
            {
                "type": "scatter",
                "x": sel.block.tolist(),
                "y": sel.value.tolist(),
                "name": name,
                "mode": "lines+markers",
                "line": {"color": COLORS.get(name)},
            }
        )
    return _figure(
        data,
        {
            "title": _title(f"task {task}: {label(metric)} per block"),
            "hovermode": "x unified",
            "xaxis": block_axis(names),
            "yaxis": _axis(label(metric), rangemode="tozero"),
        },
    )

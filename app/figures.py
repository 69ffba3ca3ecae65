"""Plotly figures of the app: pure functions from tidy DataFrames to figures.

Each figure is built in one ``go.Figure({"data": [...], "layout": {...}})`` call from
plain dicts: plotly validates a figure once that way, where ``make_subplots`` and
``update_*`` calls validate again and again (tens of times slower, which a slider's
one-second budget cannot afford).

No Streamlit and no model here. The drift tables are :func:`diagnostics.drift_table`'s
tidy frames (``task``, ``block``, ``metric``, ``value``); accuracy tables are tidy
``task``, ``model``, ``accuracy``. Every function returns a new ``go.Figure``, except
:func:`task_accuracy_table`, a markdown table.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from featcal.sweep.figures import LAYOUT, title_layout  # one layout for the app's and the command line's figures

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


# ----------------------------------------------------------------------------- tables


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


# ----------------------------------------------------------------------------- drift


def drift_decomposition(
    df: pd.DataFrame,
    title: str,
    task: str | None = None,
    sq_range: tuple[float, float] | None = None,
    norm_range: tuple[float, float] | None = None,
    selected_block: int | None = None,
    reference: tuple[str, pd.DataFrame] | None = None,
) -> go.Figure:
    """Per block: the squared drift split additively, ``|e|^2 = <e, m> + <e, p>``, as stacked
    bars (left axis), and the norms ``|e|``, ``|m|``, ``|p|`` as lines (right axis; norms do
    not add). Means over rows, and over tasks unless ``task`` is given. ``reference``:
    ``(name, drift frame)`` of another model (the merged one) whose ``|e|^2`` is drawn as a
    short red dash over each bar and whose ``|e|`` as a grey dashed line."""
    sq = per_block(df, SQUARED, task)
    nm = per_block(df, NORMS, task)
    blocks = [int(b) for b in sq.index]
    data = []
    for metric, label in SQUARED.items():
        if metric in sq:
            data.append(
                {
                    "type": "bar",
                    "x": blocks,
                    "y": sq[metric].tolist(),
                    "name": label,
                    "marker": {
                        "color": COLORS[metric],
                        "opacity": [1.0 if selected_block in (None, b) else 0.35 for b in blocks],
                    },
                    # Plotly's own selection fades nothing: the chosen block is shown by the opacities.
                    "selected": {"marker": {"opacity": 1.0}},
                    "unselected": {"marker": {"opacity": 1.0}},
                    "hovertemplate": label + " %{y:.4g}<extra></extra>",
                }
            )
    for metric, label in NORMS.items():
        if metric in nm:
            data.append(
                {
                    "type": "scatter",
                    "x": [int(b) for b in nm.index],
                    "y": nm[metric].tolist(),
                    "name": label,
                    "mode": "lines+markers",
                    "yaxis": "y2",
                    "line": {"color": COLORS[metric], "dash": "solid" if metric == "drift" else "dot"},
                    "hovertemplate": label + " %{y:.4g}<extra></extra>",
                }
            )
    if reference is not None:
        name, ref = reference
        sq_ref, nm_ref = per_block(ref, SQUARED, task).sum(axis=1, min_count=1), per_block(ref, ["drift"], task)
        data.append(
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
        )
        if "drift" in nm_ref:
            data.append(
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
    return _figure(
        data,
        {
            "title": _title(title),
            "barmode": "relative",
            "clickmode": "event+select",
            "hovermode": "x unified",  # one box: every series of the block under the pointer
            "xaxis": {"title": {"text": "block"}, "dtick": 1, "hoverformat": "d"},
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
        },
    )


def _heatmap(grid: pd.DataFrame, title: str, name: str, trace: dict, fmt: str = ".4f") -> go.Figure:
    """``grid`` (block x task) as a heatmap whose every cell is clickable over its whole area:
    plotly reports no clicks (selections) on heatmap cells, so near-invisible bars, one per
    cell and exactly its size, lie over them and carry the hover and the click (the click's
    ``customdata`` is ``[block, value]``, its ``x`` the task)."""
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
        "customdata": [[int(b), v] for b, row in zip(grid.index, grid.values.tolist()) for v in row],
        "showlegend": False,
        "name": "cells",
        "marker": {"color": "#000", "opacity": 0.01, "line": {"width": 0}},
        "selected": {"marker": {"opacity": 0.01}},
        "unselected": {"marker": {"opacity": 0.01}},
        "hovertemplate": "task %{x}<br>block %{customdata[0]}<br>"
        + name
        + " %{customdata[1]:"
        + fmt
        + "}<extra></extra>",
    }
    return _figure(
        [heat, cells],
        {
            "title": _title(title),
            "clickmode": "event+select",
            "barmode": "overlay",
            "yaxis": {"title": {"text": "block"}, "dtick": 1, "autorange": "reversed", "zeroline": False},
            "xaxis": {"title": {"text": "task"}},
            "height": max(450, 18 * len(grid.index) + 150),  # a 30-block LLM: a readable row per block
        },
    )


def drift_heatmap(
    df: pd.DataFrame, title: str, metric: str = "drift_rel", z_range: tuple[float, float] | None = None
) -> go.Figure:
    """``block x task`` heatmap of one drift metric (default: relative drift ``|e| / |h_exp|``)."""
    trace = {
        "colorscale": "Reds",
        "colorbar": {"title": {"text": label(metric), "side": "right"}, "thickness": 12, "tickformat": TICKS},
    }
    if z_range is not None:
        trace.update(zmin=z_range[0], zmax=z_range[1])
    return _heatmap(block_task_grid(df, metric), title, label(metric), trace)


def drift_difference(after: pd.DataFrame, before: pd.DataFrame, metric: str = "drift_rel") -> pd.DataFrame:
    """``block x task`` of ``after``'s metric minus ``before``'s (e.g. calibrated minus merged)."""
    a, b = block_task_grid(after, metric), block_task_grid(before, metric)
    return a - b.reindex(index=a.index, columns=a.columns)


def drift_difference_heatmap(
    after: pd.DataFrame, before: pd.DataFrame, title: str, metric: str = "drift_rel"
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
    return _heatmap(diff, title, f"Δ {label(metric)}", trace, fmt="+.4f")


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


def block_by_task(frames: dict[str, pd.DataFrame], block: int, metric: str = "drift_rel") -> go.Figure:
    """Drill-down at one block: ``metric`` per task, one bar group per model."""
    data = _task_bars(frames, metric, block, label(metric))
    return _figure(
        data,
        {
            "title": _title(f"block {block}: {label(metric)} per task"),
            "barmode": "group",
            "yaxis": _axis(label(metric), rangemode="tozero"),
        },
    )


def task_by_block(frames: dict[str, pd.DataFrame], task: str, metric: str = "drift_rel") -> go.Figure:
    """Drill-down for one task: ``metric`` per block, one line per model."""
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
            "xaxis": {"title": {"text": "block"}, "dtick": 1},
            "yaxis": _axis(label(metric), rangemode="tozero"),
        },
    )


# ----------------------------------------------------------------------------- cosines

TASK_COLORS = ("#2563eb", "#16a34a", "#f97316", "#0891b2", "#db2777", "#7c3aed", "#a16207", "#4b5563", "#dc2626")


def expert_cosine_per_block(frames: dict[str, pd.DataFrame], title: str) -> go.Figure:
    """Per block and task, the cosine of the model's pooled block output with the expert's
    (the drift tables' ``expert_cosine``): one colour per task, one dash per model
    (``frames``: ``{model name: drift table}``, the first drawn dashed)."""
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
            "xaxis": {"title": {"text": "block"}, "dtick": 1},
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


# ----------------------------------------------------------------------------- accuracy


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


def residuals(modules: pd.DataFrame, title: str = "relative residual per module") -> go.Figure:
    """``report.to_frame()``: mean relative residual per block, before vs after calibration."""
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
            "xaxis": {"title": {"text": "block"}, "dtick": 1},
            "yaxis": _axis("mean relative residual", rangemode="tozero"),
        },
    )


# ----------------------------------------------------------------------------- export


def for_export(fig: go.Figure) -> go.Figure:
    """A copy styled for a file (the app's theme does not travel with it)."""
    return go.Figure(fig).update_layout(template="plotly_white")


def to_html(fig: go.Figure) -> str:
    """A standalone HTML page of the figure (plotly.js inlined: opens offline)."""
    return for_export(fig).to_html(include_plotlyjs=True, full_html=True)


def to_png(fig: go.Figure, scale: float = 2.0) -> bytes:
    """PNG bytes via kaleido (needs Chrome or Chromium; raises when none is found)."""
    return for_export(fig).to_image(format="png", scale=scale, width=900, height=440)

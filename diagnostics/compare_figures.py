"""Figures of a method comparison (:mod:`diagnostics.compare`), pure functions of its tidy
tables: no Streamlit and no model here; each returns a new ``go.Figure`` (the app's Compare
page shows them, ``featcal compare --out`` writes them as HTML). Needs plotly."""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import plotly.graph_objects as go

from featcal.sweep.figures import CYCLE, LAYOUT, block_axis

REFERENCE_STYLE = {"experts": ("#111827", "dash"), "base": ("#9ca3af", "dot")}


def _colors(methods: list[str]) -> dict[str, str]:
    return {m: CYCLE[i % len(CYCLE)] for i, m in enumerate(methods)}


def _methods(df: pd.DataFrame) -> list[str]:
    return [m for m in dict.fromkeys(df["method"]) if m not in REFERENCE_STYLE]


def accuracy_bars(accuracy: pd.DataFrame) -> go.Figure:
    """Per-task test accuracy, one bar group per task and one bar per method; the experts'
    and the base's accuracies as short reference lines across each task's group."""
    tasks = list(dict.fromkeys(accuracy["task"]))
    methods = _methods(accuracy)
    colors = _colors(methods)
    data = []
    for m in methods:
        rows = accuracy[accuracy["method"] == m].set_index("task")["accuracy"]
        data.append(
            {"type": "bar", "name": m, "x": tasks, "y": [rows.get(t) for t in tasks], "marker": {"color": colors[m]}}
        )
    for ref, (color, dash) in REFERENCE_STYLE.items():
        rows = accuracy[accuracy["method"] == ref].set_index("task")["accuracy"]
        if rows.empty:
            continue
        xs, ys = [], []
        for i, t in enumerate(tasks):  # a segment across task i's bar group (categories sit at i)
            xs += [i - 0.45, i + 0.45, None]
            ys += [rows.get(t), rows.get(t), None]
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "name": ref,
                "x": xs,
                "y": ys,
                "xaxis": "x2",
                "line": {"color": color, "dash": dash, "width": 2},
            }
        )
    layout = {
        **LAYOUT,
        "title": {"text": "Test accuracy per task", "font": {"size": 15}},
        "barmode": "group",
        "yaxis": {"title": "accuracy (%)", "range": [0, 100]},
        "xaxis2": {"overlaying": "x", "range": [-0.5, len(tasks) - 0.5], "visible": False},
    }
    return go.Figure({"data": data, "layout": layout})


def drift_lines(drift: pd.DataFrame, task: str, names: Sequence[str] | None = None) -> go.Figure:
    """For one task, per block, each method's relative drift from the expert (solid) and its
    local-mismatch part (dotted): where each method's features leave the expert's. ``names``:
    the blocks' names on the axis (an encoder-decoder's: :func:`featcal.model.arch.block_names`)."""
    df = drift[drift["task"] == task]
    methods = [m for m in dict.fromkeys(df["method"]) if m != "experts"]
    colors = {**_colors([m for m in methods if m != "base"]), "base": REFERENCE_STYLE["base"][0]}
    data = []
    for m in methods:
        rows = df[df["method"] == m].pivot_table(index="block", columns="metric", values="value")
        for metric, dash, legend in (("drift_rel", "solid", True), ("mismatch_rel", "dot", False)):
            data.append(
                {
                    "type": "scatter",
                    "mode": "lines+markers",
                    "name": m if legend else f"{m} (mismatch)",
                    "legendgroup": m,
                    "showlegend": legend,
                    "x": rows.index.tolist(),
                    "y": rows[metric].tolist(),
                    "line": {"color": colors[m], "dash": dash},
                }
            )
    layout = {
        **LAYOUT,
        "title": {
            "text": f"Drift from the expert per block, task {task} (dotted: local mismatch)",
            "font": {"size": 15},
        },
        "xaxis": block_axis(names),
        "yaxis": {"title": "|e| / |h_expert|", "rangemode": "tozero"},
    }
    return go.Figure({"data": data, "layout": layout})


def output_scatter(summary: pd.DataFrame) -> go.Figure:
    """Each method's mean KL to the experts against its top-1 agreement with them."""
    df = summary[summary["method"] != "experts"]
    colors = {**_colors(_methods(df)), "base": REFERENCE_STYLE["base"][0]}
    data = [
        {
            "type": "scatter",
            "mode": "markers+text",
            "name": r.method,
            "x": [r.kl],
            "y": [r.agreement],
            "text": [r.method],
            "textposition": "top center",
            "marker": {"size": 11, "color": colors[r.method]},
            "showlegend": False,
        }
        for r in df.itertuples()
    ]
    layout = {
        **LAYOUT,
        "title": {"text": "Output drift: KL to the experts and top-1 agreement (test)", "font": {"size": 15}},
        "xaxis": {"title": "KL(expert || model), nats", "rangemode": "tozero"},
        "yaxis": {"title": "top-1 agreement (%)"},
    }
    return go.Figure({"data": data, "layout": layout})

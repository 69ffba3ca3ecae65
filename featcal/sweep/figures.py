"""Plotly figures of the sweep and the studies: pure functions from DataFrames to figures.

``featcal tune`` and ``featcal study`` write them as HTML; the app's Tune and Studies
pages show them. :data:`LAYOUT` is the layout every featcal figure shares (the app's
drift figures too). Needs plotly (``pip install 'featcal[app]'``).

Inputs are :func:`featcal.sweep.search.tune`'s table (one row per point: ``lam``, ``rho``,
``alpha``, ``preview``, ``exact``, ``confirmed``, ...) and the tidy study tables of
:mod:`featcal.sweep.studies` (``method``, ``n``, ``seed``, ``corruption``, ``severity``,
``task``, ``accuracy``). No Streamlit and no model here; every function returns a
new ``go.Figure``.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from featcal.sweep.studies import summarize

# No template here: in the app Streamlit's theme styles the charts; exports add plotly_white.
LAYOUT = {
    "margin": {"l": 10, "r": 10, "t": 70, "b": 10},  # the title sits below the chart's toolbar (modebar)
    "height": 400,
    "legend": {"orientation": "h", "yanchor": "top", "y": -0.22, "x": 0.0, "font": {"size": 11}},
}
SCORE_LABEL = {"accuracy": "val accuracy (%)", "kl": "-KL(expert || model), val"}
# Mergers in the app's colours where they have one, then a fixed cycle.
METHOD_COLORS = {"task_arithmetic": "#dc2626", "average": "#9ca3af", "ties": "#a16207", "dare": "#7c3aed"}
CYCLE = ("#2563eb", "#16a34a", "#f97316", "#0891b2", "#db2777", "#4b5563")
SEVERITY_COLORS = ("#bfdbfe", "#93c5fd", "#60a5fa", "#3b82f6", "#2563eb", "#1d4ed8", "#1e3a8a")


def title_layout(text: str, size: int = 15) -> dict:
    """A figure title, left-aligned and 30 px below the top edge: the chart's toolbar (plotly's
    modebar, top right) then never covers it, however narrow the chart."""
    return {
        "text": text,
        "font": {"size": size},
        "x": 0.0,
        "xanchor": "left",
        "xref": "paper",
        "yref": "container",
        "y": 1.0,
        "yanchor": "top",
        "pad": {"t": 30},
    }


def block_axis(names: Sequence[str] | None = None, **kw) -> dict:
    """An axis of blocks, one tick each: their numbers, or ``names`` at them (a model of several
    stacks: :func:`featcal.model.arch.block_names`, ``encoder.block.3`` ... ``decoder.block.0``,
    which tell an encoder's blocks from a decoder's). ``kw``: more of the axis' settings.

    Named, the axis spans half a block past the first and the last (unless ``kw`` sets its
    range): a line chart's own range ends at its first and last points, and plotly hides a tick
    label that would run past the figure, so a long last name (``decoder.block.1``) went missing."""
    axis = {"title": {"text": "block"}, "dtick": 1, **kw}
    if names is not None:
        axis.update(tickmode="array", tickvals=list(range(len(names))), ticktext=list(names))
        if "range" not in kw and "autorange" not in kw:
            axis["range"] = [-0.5, len(names) - 0.5]
    return axis


def block_label(block: int, names: Sequence[str] | None = None) -> str:
    """``block`` as a figure's title or hover names it: ``block 3``, or its name in ``names``
    (:func:`block_axis`)."""
    return f"block {block}" if names is None else names[block]


def tick(value: float) -> str:
    """An axis label for a grid value: three significant digits (a refined grid's values are
    not round)."""
    return f"{value:.3g}"


def _color(method: str, i: int) -> str:
    return METHOD_COLORS.get(method, CYCLE[i % len(CYCLE)])


def _rgba(hex_color: str, alpha: float) -> str:
    r, g, b = (int(hex_color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgba({r},{g},{b},{alpha})"


def _reference_line(fig: go.Figure, y: float, label: str, color: str, dash: str) -> None:
    """A full-width horizontal line named in the legend (labels on the plot would collide)."""
    fig.add_hline(y=y, line=dict(color=color, dash=dash, width=1.5))
    fig.add_trace(
        go.Scatter(x=[None], y=[None], mode="lines", name=label, line=dict(color=color, dash=dash, width=1.5))
    )


# ----------------------------------------------------------------------------- the sweep


def sweep_parallel(
    table: pd.DataFrame, score: str = "accuracy", title: str = "sweep: every point previewed"
) -> go.Figure:
    """Parallel coordinates: log10 lambda, rho, alpha and the preview score, coloured by the
    score; a last axis marks the points re-run exactly."""
    t = table.sort_values("point")
    lams = sorted(t["lam"].astype(float).unique())
    dims = [
        # λ on a log axis, its ticks at the values tried (labelled in λ, not log10 λ)
        dict(
            label="λ (log scale)",
            values=np.log10(t["lam"].astype(float)),
            tickvals=np.log10(lams).tolist(),
            ticktext=[tick(v) for v in lams],
        ),
        # ticks at the values tried (a few per axis), never plotly's dense defaults that overlap
        _ticks("ρ", t["rho"].astype(float)),
        _ticks("α", t["alpha"].astype(float)),
        _ticks("preview score", t["preview"].astype(float), spread=True),
        dict(label="exact run", values=t["confirmed"].astype(int), tickvals=[0, 1], ticktext=["no", "yes"]),
    ]
    fig = go.Figure(
        go.Parcoords(
            line=dict(
                color=t["preview"],
                colorscale="Viridis",
                showscale=True,
                colorbar=dict(title=dict(text=SCORE_LABEL.get(score, score), side="right"), x=1.06, thickness=12),
            ),
            dimensions=dims,
        )
    )
    fig.update_layout(**{**LAYOUT, "margin": dict(l=60, r=90, t=110, b=30)}, title=title_layout(title))
    return fig


def _ticks(label: str, values: pd.Series, spread: bool = False, most: int = 6) -> dict:
    """A parallel-coordinates axis whose ticks are the distinct values (at most ``most``, else
    ``most`` evenly spread ones; ``spread``: always spread, for a continuous score)."""
    distinct = sorted(values.dropna().unique())
    if spread or len(distinct) > most:
        lo, hi = (distinct[0], distinct[-1]) if distinct else (0.0, 1.0)
        distinct = list(np.linspace(lo, hi, min(most, max(len(distinct), 2))))
    return dict(label=label, values=values, tickvals=distinct, ticktext=[tick(v) for v in distinct])


def best_lam(table: pd.DataFrame) -> float:
    """The lambda of the best exact run (the best preview when none was confirmed)."""
    col = "exact" if table["exact"].notna().any() else "preview"
    return float(table.loc[table[col].idxmax(), "lam"])


def sweep_heatmap(
    table: pd.DataFrame, lam: float | None = None, value: str = "preview", score: str = "accuracy"
) -> go.Figure:
    """The ``value`` score over (rho, alpha) at one lambda (default :func:`best_lam`): the
    previews colour the cells; the exactly confirmed points are circled and the best of them,
    the chosen one, starred (the exact runs choose, not the previews)."""
    lam = best_lam(table) if lam is None else lam
    at = table[np.isclose(table["lam"].astype(float), lam, rtol=1e-6)]
    grid = at.pivot_table(index="rho", columns="alpha", values=value, aggfunc="mean").sort_index()
    fig = go.Figure(
        go.Heatmap(
            z=grid.values,
            x=[tick(a) for a in grid.columns],
            y=[tick(r) for r in grid.index],
            colorscale="Viridis",
            colorbar=dict(title=dict(text=SCORE_LABEL.get(score, score), side="right"), tickformat=".3~g"),
            hovertemplate="ρ=%{y}, α=%{x}<br>" + value + " %{z:.4g}<extra></extra>",
        )
    )
    conf = at[at["confirmed"]]
    if len(conf):
        fig.add_trace(
            go.Scatter(
                x=[tick(a) for a in conf["alpha"]],
                y=[tick(r) for r in conf["rho"]],
                mode="markers",
                name="exact run",
                showlegend=False,
                marker=dict(symbol="circle-open", size=16, color="white", line=dict(width=2)),
                text=[f"exact run: {e:.4g}" for e in conf["exact"]],
                hoverinfo="text",
            )
        )
        top = conf.loc[conf["exact"].idxmax()]
        fig.add_trace(
            go.Scatter(
                x=[tick(top["alpha"])],
                y=[tick(top["rho"])],
                mode="markers",
                name="best exact",
                showlegend=False,
                marker=dict(symbol="star", size=14, color="#f97316"),
                hovertemplate=f"chosen: best exact run, {top['exact']:.4g}<extra></extra>",
            )
        )
    # Short enough for a half-width chart; the marks are named in their hover texts (and the app's caption).
    fig.update_layout(**LAYOUT, title=title_layout(f"{value} score over (ρ, α), λ = {lam:.3g}"))
    fig.update_xaxes(title="α (target interpolation)", type="category")
    fig.update_yaxes(title="ρ (anchor blend)", type="category")
    return fig


def grid_edges(point: dict, axes: dict[str, Sequence[float]]) -> dict[str, str]:
    """Where ``point`` (``{axis: value}``) lies on the edge of a grid (``{axis: values}``):
    ``{axis: "low" | "high"}`` for every axis with more than one value on which it takes the
    smallest or the largest value (the optimum may lie beyond it)."""
    out = {}
    for name, values in axes.items():
        values = sorted(float(v) for v in values)
        if len(values) < 2:
            continue
        v = float(point[name])
        if math.isclose(v, values[0], rel_tol=1e-6, abs_tol=1e-12):
            out[name] = "low"
        elif math.isclose(v, values[-1], rel_tol=1e-6, abs_tol=1e-12):
            out[name] = "high"
    return out


def widen(
    values: Sequence[float], side: str, log: bool = False, bounds: tuple[float, float] | None = None
) -> tuple[float, ...]:
    """``values`` with one more value past their ``side`` (``low`` / ``high``) end, one step
    beyond it (the end step; a ratio on a ``log`` axis such as lambda), kept within ``bounds``
    (alpha's [0, 1]): unchanged when the end already is the bound."""
    v = sorted(float(x) for x in values)
    if len(v) < 2:
        raise ValueError("a grid axis needs two values to be widened by its end step.")
    if side not in ("low", "high"):
        raise ValueError(f"side must be 'low' or 'high', not {side!r}.")
    if log:
        new = v[0] * v[0] / v[1] if side == "low" else v[-1] * v[-1] / v[-2]
    else:
        new = v[0] - (v[1] - v[0]) if side == "low" else v[-1] + (v[-1] - v[-2])
    if bounds is not None:
        new = min(max(new, bounds[0]), bounds[1])
    new = float(f"{new:.3g}")
    return tuple(sorted({*v, new}))


# ----------------------------------------------------------------------------- studies


def sample_efficiency_curve(
    df: pd.DataFrame, title: str = "test accuracy vs calibration examples per task"
) -> go.Figure:
    """Mean +- std over seeds of the task-average accuracy against n (log x) for every
    calibrated method; the plain mergers as horizontal lines."""
    s = summarize(df, by=("method", "featcal", "n"))
    fig = go.Figure()
    for i, (method, g) in enumerate(s[s["featcal"]].groupby("method", sort=False)):
        g = g.sort_values("n")
        c = _color(method, i)
        x = list(g["n"]) + list(g["n"])[::-1]
        band = list(g["mean"] + g["std"]) + list(g["mean"] - g["std"])[::-1]
        fig.add_trace(
            go.Scatter(
                x=x,
                y=band,
                mode="lines",
                fill="toself",
                fillcolor=_rgba(c, 0.18),
                line=dict(width=0),
                hoverinfo="skip",
                showlegend=False,
                name=f"{method} ± std",
            )
        )
        fig.add_trace(
            go.Scatter(
                x=g["n"],
                y=g["mean"],
                mode="lines+markers",
                name=method,
                line=dict(color=c, width=2),
                error_y=dict(type="data", array=g["std"], visible=False),
                hovertemplate="n=%{x}<br>%{y:.2f}% ± %{customdata:.2f}<extra>" + method + "</extra>",
                customdata=g["std"],
            )
        )
    base = s[~s["featcal"]].groupby("method", sort=False)["mean"].mean()
    for i, (method, acc) in enumerate(base.items()):
        _reference_line(fig, acc, f"{method} (no calibration data) {acc:.1f}%", _color(method, i), "dash")
    ns = sorted(df["n"].dropna().unique())
    cal = s[s["featcal"]]
    ys = [*(cal["mean"] - cal["std"]), *(cal["mean"] + cal["std"]), *base]
    pad = 0.05 * ((max(ys) - min(ys)) or 1.0)
    fig.update_layout(**{**LAYOUT, "margin": dict(l=10, r=10, t=100, b=10)}, title=title_layout(title))
    fig.update_yaxes(range=[min(ys) - pad, max(ys) + pad])
    fig.update_xaxes(
        type="log", title="calibration examples per task (n)", tickvals=ns, ticktext=[str(int(n)) for n in ns]
    )
    fig.update_yaxes(title="test accuracy, task average (%)")
    return fig


def robustness_bars(df: pd.DataFrame, title: str = "FeatCal with corrupted calibration data (clean test)") -> go.Figure:
    """Task-average test accuracy (mean +- std over seeds) per corruption, one bar per
    severity; FeatCal on clean data and the plain merger as horizontal lines."""
    s = summarize(df, by=("method", "featcal", "corruption", "severity"))
    cal = s[s["featcal"] & (s["corruption"] != "none")]
    fig = go.Figure()
    sevs = sorted(cal["severity"].unique())
    for i, sev in enumerate(sevs):
        g = cal[cal["severity"] == sev]
        fig.add_trace(
            go.Bar(
                x=g["corruption"],
                y=g["mean"],
                name=f"severity {sev:g}",
                marker_color=SEVERITY_COLORS[round(i * (len(SEVERITY_COLORS) - 1) / max(1, len(sevs) - 1))],
                error_y=dict(type="data", array=g["std"], visible=bool((g["std"] > 0).any())),
            )
        )
    clean = s[s["featcal"] & (s["corruption"] == "none")]["mean"]
    plain = s[~s["featcal"]].groupby("method", sort=False)["mean"].mean()
    if len(clean):
        _reference_line(fig, float(clean.mean()), f"FeatCal, clean data {float(clean.mean()):.1f}%", "#16a34a", "dash")
    for i, (method, acc) in enumerate(plain.items()):
        _reference_line(fig, acc, f"{method} {acc:.1f}%", _color(method, i), "dot")
    fig.update_layout(**LAYOUT, title=title_layout(title), barmode="group")
    fig.update_yaxes(title="test accuracy, task average (%)", range=[0, 100])  # bars compare: from zero
    fig.update_xaxes(title="corruption of the calibration images")
    return fig

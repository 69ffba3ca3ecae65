"""A figure as a file: standalone HTML or PNG, in a theme of its own."""

from __future__ import annotations

import plotly.graph_objects as go


def for_export(fig: go.Figure) -> go.Figure:
    """A copy styled for a file (the app's theme does not travel with it)."""
    return go.Figure(fig).update_layout(template="plotly_white")


def to_html(fig: go.Figure) -> str:
    """A standalone HTML page of the figure (plotly.js inlined: opens offline)."""
    return for_export(fig).to_html(include_plotlyjs=True, full_html=True)


def to_png(fig: go.Figure, scale: float = 2.0) -> bytes:
    """PNG bytes via kaleido (needs Chrome or Chromium; raises when none is found)."""
    return for_export(fig).to_image(format="png", scale=scale, width=900, height=440)

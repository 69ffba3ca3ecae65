"""Plotly figures of the app: pure functions from tidy DataFrames to figures, one module per
topic (:mod:`~app.figures.drift`, :mod:`~app.figures.similarity`, :mod:`~app.figures.scores`,
:mod:`~app.figures.export`) over what they share (:mod:`~app.figures.base`); the pages call
them as ``figures.NAME``.

Each figure is built in one ``go.Figure({"data": [...], "layout": {...}})`` call from
plain dicts: plotly validates a figure once that way, where ``make_subplots`` and
``update_*`` calls validate again and again (tens of times slower, which a slider's
one-second budget cannot afford).

No Streamlit and no model here. The drift tables are :func:`diagnostics.drift_table`'s
tidy frames (``task``, ``block``, ``metric``, ``value``); accuracy tables are tidy
``task``, ``model``, ``accuracy``. Every function returns a new ``go.Figure``, except
:func:`task_accuracy_table`, a markdown table.
"""

from app.figures.base import (
    COLORS,
    LABELS,
    NORMS,
    SQUARED,
    TASK_COLORS,
    TICKS,
    block_label,
    block_task_grid,
    heatmap_range,
    label,
    per_block,
    value_range,
)
from app.figures.drift import (
    block_by_task,
    drift_decomposition,
    drift_difference,
    drift_difference_heatmap,
    drift_heatmap,
    task_by_block,
)
from app.figures.export import for_export, to_html, to_png
from app.figures.scores import accuracy_bars, residuals, task_accuracy_table
from app.figures.similarity import expert_cosine_per_block, task_vector_bars, task_vector_matrix_heatmap

__all__ = [
    "COLORS",
    "LABELS",
    "NORMS",
    "SQUARED",
    "TASK_COLORS",
    "TICKS",
    "accuracy_bars",
    "block_by_task",
    "block_label",
    "block_task_grid",
    "drift_decomposition",
    "drift_difference",
    "drift_difference_heatmap",
    "drift_heatmap",
    "expert_cosine_per_block",
    "for_export",
    "heatmap_range",
    "label",
    "per_block",
    "residuals",
    "task_accuracy_table",
    "task_by_block",
    "task_vector_bars",
    "task_vector_matrix_heatmap",
    "to_html",
    "to_png",
    "value_range",
]

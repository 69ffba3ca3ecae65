"""The app's figures without Streamlit's AppTest: each drawn from a tidy frame (or a zoo's block
names), checked for what a reader sees (traces, axes, labels, hovers). The rest of the app's parts:
tests/app/test_app_parts.py; the pages themselves: tests/app/test_app.py."""

from __future__ import annotations

import pandas as pd
import pytest

pytest.importorskip("streamlit")


# ----------------------------------------------------------------------------- figures (pure)


def _drift_frame() -> pd.DataFrame:
    rows = []
    for task in ("a", "b"):
        for block in range(3):
            e, m = 1.0 + block, 0.5
            for metric, value in [
                ("drift", e),
                ("mismatch", m),
                ("propagation", e - m),
                ("drift_sq", e * e),
                ("drift_sq_mismatch", 0.4 * e * e),
                ("drift_sq_propagation", 0.6 * e * e),
                ("drift_rel", e / 10),
            ]:
                rows.append((task, block, metric, value))
    return pd.DataFrame(rows, columns=["task", "block", "metric", "value"])


def test_drift_figures_from_a_tidy_frame():
    from app import figures

    df = _drift_frame()
    fig = figures.drift_decomposition(df, "t")
    bars = [t for t in fig.data if t.type == "bar"]
    assert len(bars) == 2 and list(bars[0].y) == pytest.approx([0.4, 1.6, 3.6])
    assert sum(t.type == "scatter" for t in fig.data) == 3
    hm = figures.drift_heatmap(df, "t")
    assert len(hm.data[0].z) == 3 and len(hm.data[0].z[0]) == 2
    cells = hm.data[1]  # the clickable cells: one bar per cell, exactly its size
    assert cells.type == "bar" and len(cells.x) == 6 and cells.width == 1.0
    spans = sorted(zip(cells.x, cells.base))
    assert spans == [(t, b - 0.5) for t in ("a", "b") for b in range(3)]
    assert [c[1] for c in cells.customdata] == pytest.approx([v for row in hm.data[0].z for v in row])
    assert hm.layout.yaxis.title.text == "block" and "relative drift" in hm.data[0].colorbar.title.text
    lo, hi = figures.value_range([df, df.assign(value=df.value * 2)], figures.SQUARED, stacked=True)
    assert hi >= 18.0 and lo == 0.0
    assert "<html" in figures.to_html(fig)[:200].lower()


def test_named_blocks_label_the_axes_the_hovers_and_the_titles():
    """An encoder-decoder's block names (app.zoos.block_names) at the blocks' numbers: the axes'
    ticks, the heatmap's hover, the drill-down's title; the clicks still give the number."""
    from app import figures

    df = _drift_frame()  # blocks 0-2
    names = ["encoder.block.0", "encoder.block.1", "decoder.block.0"]
    hm = figures.drift_heatmap(df, "t", names=names)
    assert list(hm.layout.yaxis.tickvals) == [0, 1, 2] and list(hm.layout.yaxis.ticktext) == names
    assert [c[0] for c in hm.data[1].customdata] == [0, 0, 1, 1, 2, 2]  # what a click reads
    assert [c[2] for c in hm.data[1].customdata] == [n for n in names for _ in range(2)]
    assert list(figures.drift_decomposition(df, "t", names=names).layout.xaxis.ticktext) == names
    frames = {"merged": df}
    assert figures.block_by_task(frames, 2, names=names).layout.title.text.startswith("decoder.block.0:")
    assert list(figures.task_by_block(frames, "a", names=names).layout.xaxis.ticktext) == names
    plain = figures.drift_heatmap(df, "t")  # one stack: the numbers, as before
    assert plain.layout.yaxis.ticktext is None and plain.data[1].customdata[0][2] == "block 0"


def test_line_charts_over_named_blocks_leave_room_for_the_first_and_last_names():
    """A line chart's axis ended at its first and last points, where plotly hid the last long
    name (``decoder.block.1`` was missing under the Drift page's per-block line and the Calibrate
    page's expert cosines): a named axis spans half a block past both ends; a heatmap's reversed
    axis, and a numbered one, keep plotly's own range."""
    from app import figures

    df = _drift_frame().assign(metric=lambda d: d.metric.replace("drift_rel", "expert_cosine"))
    names = ["encoder.block.0", "encoder.block.1", "decoder.block.0"]
    frames = {"merged": _drift_frame(), "calibrated": _drift_frame()}
    charts = {
        "drift per block": figures.task_by_block(frames, "a", names=names),
        "expert cosine": figures.expert_cosine_per_block({"merged": df}, "t", names=names),
    }
    for title, fig in charts.items():
        assert tuple(fig.layout.xaxis.range) == (-0.5, len(names) - 0.5), title
        assert list(fig.layout.xaxis.ticktext) == names, title
    heatmap = figures.drift_heatmap(_drift_frame(), "t", names=names).layout.yaxis
    assert heatmap.range is None and heatmap.autorange == "reversed"
    assert figures.task_by_block(frames, "a").layout.xaxis.range is None


def test_the_block_names_of_a_zoo_tell_its_stacks_apart():
    """None for a model of one stack (numbered blocks); an encoder-decoder's names in forward order."""
    from app.zoos import block_names
    from tiny import ToyModel, tiny_t5

    class Zoo:
        def __init__(self, base):
            self.base = base

    assert block_names(Zoo(ToyModel())) is None
    assert block_names(Zoo(tiny_t5(0, layers=2))) == [
        "encoder.block.0",
        "encoder.block.1",
        "decoder.block.0",
        "decoder.block.1",
    ]


def test_the_difference_heatmap_is_calibrated_minus_merged_centred_at_zero():
    from app import figures

    merged = _drift_frame()
    rel = merged.metric == "drift_rel"
    factor = merged.task.map({"a": 0.5, "b": 1.5}).where(rel, 1.0)
    calibrated = merged.assign(value=merged.value * factor)
    fig = figures.drift_difference_heatmap(calibrated, merged, "d")
    diff = figures.drift_difference(calibrated, merged)
    want = figures.block_task_grid(calibrated, "drift_rel") - figures.block_task_grid(merged, "drift_rel")
    pd.testing.assert_frame_equal(diff, want)
    assert (diff["a"] < 0).all() and (diff["b"] > 0).all()  # a helped, b hurt
    heat = fig.data[0]
    assert heat.zmid == 0.0 and heat.zmin == -heat.zmax == pytest.approx(-float(diff.abs().max().max()))
    assert heat.colorscale[0][1] != heat.colorscale[-1][1]  # diverging: two ends, two colours


def test_cosine_figures_show_every_task_and_model():
    from app import figures

    df = _drift_frame()
    cos = pd.concat([df, df.assign(metric="expert_cosine", value=0.9)])
    fig = figures.expert_cosine_per_block({"merged": cos, "calibrated": cos.assign(value=0.95)}, "c")
    assert len(fig.data) == 4  # 2 tasks x 2 models
    assert {t.line.dash for t in fig.data} == {"dot", "solid"} and fig.layout.hovermode == "x unified"
    mat = pd.DataFrame(
        [(a, b, blk, 1.0 if a == b else 0.2) for blk in (-1, 0) for a in "xy" for b in "xy"],
        columns=["task", "other", "block", "value"],
    )
    hm = figures.task_vector_matrix_heatmap(mat, 0, "m")
    assert [list(r) for r in hm.data[0].z] == [[None, 0.2], [0.2, None]]  # the diagonal blank, not saturating
    assert hm.data[0].zmax == pytest.approx(0.2)  # the scale from the off-diagonal cells
    assert "±0.2" in hm.data[0].colorbar.title.text  # ... and the colour bar says so


def test_a_reference_models_drift_is_drawn_over_the_bars():
    from app import figures

    df = _drift_frame()
    ref = df.assign(value=df.value * 2)
    fig = figures.drift_decomposition(df, "t", reference=("merged", ref))
    marks = next(t for t in fig.data if t.name == "merged: |e|²")
    assert list(marks.y) == pytest.approx([2.0, 8.0, 18.0])  # 2 x (0.4 + 0.6) e^2, e = 1, 2, 3
    line = next(t for t in fig.data if t.name == "merged: |e|")
    assert list(line.y) == pytest.approx([2.0, 4.0, 6.0]) and line.yaxis == "y2"
    assert len(fig.data) == len(figures.drift_decomposition(df, "t").data) + 2


def test_task_accuracy_table_has_every_task_and_signed_changes():
    from app import figures

    before = pd.DataFrame({"accuracy": [50.0, 80.0, 70.0]}, index=["a", "b", "c"])
    after = pd.DataFrame({"accuracy": [62.5, 75.0, 70.0]}, index=["a", "b", "c"])
    lines = figures.task_accuracy_table(before, after, "calibrated").splitlines()
    assert lines[0] == "| accuracy per task | a | b | c |" and lines[1] == "|:--|--:|--:|--:|"
    assert lines[2] == "| merged | 50.0% | 80.0% | 70.0% |"
    assert lines[3] == "| calibrated (Δ pp) | 62.5% :green[+12.5] | 75.0% :red[-5.0] | 70.0% :gray[+0.0] |"


def test_per_block_is_the_mean_over_tasks_per_block_and_metric():
    """The wide frame the drift charts read: what a pandas groupby-mean gives, block -1 left
    out, NaN where a block lacks a metric, one task's values when one is named."""
    from app import figures

    df = _drift_frame()
    df.loc[len(df)] = ("a", -1, "drift", 99.0)  # whole-model rows are not blocks
    df = df[~((df.task == "b") & (df.block == 2) & (df.metric == "mismatch"))]
    df = df[~((df.block == 1) & (df.metric == "propagation"))]
    for metrics, task in ((figures.NORMS, None), (figures.SQUARED, "b"), (["drift_rel", "nothing"], None)):
        sel = df[df.metric.isin(list(metrics)) & (df.block >= 0)]
        sel = sel if task is None else sel[sel.task == task]
        want = sel.groupby(["block", "metric"])["value"].mean().unstack("metric").sort_index()
        pd.testing.assert_frame_equal(
            figures.per_block(df, metrics, task),
            want,
            check_dtype=False,
            check_index_type=False,
            check_column_type=False,
        )
    wide = figures.per_block(df, figures.NORMS)
    assert wide.loc[2, "mismatch"] == 0.5 and pd.isna(wide.loc[1, "propagation"])
    assert figures.per_block(df, ["nothing"]).empty


@pytest.mark.slow
def test_png_export_with_chromium():
    import shutil

    from app import figures

    if shutil.which("chromium") is None:
        pytest.skip("Debian chromium is not installed (apt-get install chromium)")
    png = figures.to_png(figures.drift_decomposition(_drift_frame(), "t"), scale=1.0)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_weights_scatter_marks_tell_an_encoders_blocks_from_a_decoders():
    """Each point of the Weights page's scatter is marked with its block: ``e1`` / ``d0`` on an
    encoder-decoder (its ``b2`` was the first decoder block), ``b2`` on a model of one stack."""
    from app import weight_figures as wf

    wide = pd.DataFrame(
        {"task": ["a"] * 3, "block": [0, 1, 2], "sign_against": [0.1, 0.2, 0.3], "drift_rel": [0.2, 0.1, 0.3]}
    )
    names = ["encoder.block.0", "encoder.block.1", "decoder.block.0"]
    named = wf.view_vs_drift(wide, "sign_against", names=names).data[0]
    assert list(named.text) == ["e0", "e1", "d0"] and list(named.customdata) == names
    assert list(wf.view_vs_drift(wide, "sign_against").data[0].text) == ["b0", "b1", "b2"]

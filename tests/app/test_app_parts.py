"""The app's parts without Streamlit's AppTest: the settings as frozen values and model
references, the figures from tidy frames, and the library calls of :mod:`app.compute` and
:mod:`app.zoos` against diagnostics' own tables. The pages themselves: tests/app/test_app.py."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytest.importorskip("streamlit")


# ----------------------------------------------------------------------------- settings (pure)


def test_widget_values_become_the_featcal_config():
    from app.settings import AppCal
    from featcal import FeatCalConfig

    cal = AppCal.from_widgets(log_lam=-1.3, rho=1.5, alpha=0.45, n=16, bias=False, layernorm=True)
    assert cal.config.lam == 0.05 and cal.n == 16  # the paper's λ exactly (10^-1.3 = 0.0501...)
    assert cal.config == FeatCalConfig.clip(lam=0.05, rho=1.5, alpha=0.45, bias=False, layernorm=True)
    assert cal.config.token_weights is not None  # the CLIP preset's, as before
    assert AppCal.from_widgets(-1.2999999999999998, 1.5, 0.45, 16, False, True) == cal  # one cache entry
    assert "λ=0.05," in cal.label and "n=16/task" in cal.label and "bias" not in cal.label
    with pytest.raises(ValueError, match="lam"):
        AppCal.from_widgets(float("nan"), 1.5, 0.45, 16, False, True)


def test_llm_zoos_take_their_architectures_preset_and_every_other_zoo_clips():
    """The widgets' defaults and config follow the zoo's preset: the CLIP one (token weights) as
    before on every zoo but language models, whose Llama-family setting has none."""
    from app.settings import AppCal, cal_defaults
    from featcal import FeatCalConfig

    assert cal_defaults("clip") == dict(log_lam=-1.3, rho=2.0, alpha=0.3, n_cal=16, bias=True, layernorm=True)
    llama = cal_defaults("llama-3b")
    assert llama == dict(log_lam=-5.0, rho=0.5, alpha=0.15, n_cal=16, bias=True, layernorm=False)
    cal = AppCal.from_widgets(**{k: v for k, v in llama.items() if k != "n_cal"}, n=16, preset="llama-3b")
    # in float64, as the table: at lam 1e-5 float32 statistics fall back to slower, inexact solves
    assert cal.config == FeatCalConfig.llama("3b", stats_dtype=torch.float64) and cal.config.token_weights is None
    assert AppCal.from_widgets(-1.3, 2.0, 0.3, 16, True, True).config.stats_dtype == torch.float32  # CLIP


def test_the_zoos_preset_is_clip_unless_it_is_a_language_model(tiny_zoo_dir):
    from transformers import LlamaConfig, LlamaForCausalLM

    from app import zoos
    from featcal.config import preset_for_zoo

    assert preset_for_zoo(zoos.load_zoo(tiny_zoo_dir, "cpu")) == "clip"
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    assert preset_for_zoo(type("Zoo", (), {"base": LlamaForCausalLM(cfg)})()) == "llama-3b"


def _cal(log_lam=-1.3, rho=2.0, alpha=0.3, n=8, bias=True):
    from app.settings import AppCal

    return AppCal.from_widgets(log_lam, rho, alpha, n, bias, layernorm=True)


def _refs() -> list:
    """One reference per model the app can show, each differing from another in one setting."""
    from app.settings import Merger, ModelRef

    ta, ta4 = Merger("task_arithmetic", (("scale", 0.3),)), Merger("task_arithmetic", (("scale", 0.4),))
    ties = Merger("ties", (("density", 0.5), ("scale", 0.3)))
    cal, others = _cal(), [_cal(log_lam=-1.2), _cal(rho=1.5), _cal(alpha=0.35), _cal(n=16), _cal(bias=False)]
    return [
        ModelRef.base_model(),
        ModelRef.merged(ta),
        ModelRef.merged(ta4),
        ModelRef.merged(ties),
        ModelRef.calibrated(ta, cal),
        ModelRef.calibrated(ties, cal),
        *(ModelRef.calibrated(ta, c) for c in others),
        ModelRef.preview(ta, cal, others[0]),
        ModelRef.preview(ta, others[0], cal),
        ModelRef.preview(ta, cal, others[1]),
        ModelRef.preview(ta4, cal, others[1]),
    ]


@pytest.mark.parametrize("by_repr", [True, False])
def test_model_refs_are_distinct_cache_keys_for_distinct_settings(by_repr):
    """Python's hash (dict keys) and Streamlit's, the app's (HASH_FUNCS) and its default."""
    import streamlit as st

    from app.settings import HASH_FUNCS

    refs, again = _refs(), _refs()
    assert len(set(refs)) == len(refs) and again == refs and [hash(r) for r in again] == [hash(r) for r in refs]
    calls = []

    @st.cache_data(show_spinner=False, hash_funcs=HASH_FUNCS if by_repr else None)
    def table(ref):
        calls.append(ref)
        return ref.kind

    table.clear()  # the other parametrization's entries
    assert [table(r) for r in refs + again] == [r.kind for r in refs + again]
    assert calls == refs  # one cache entry per setting


def test_model_refs_reject_what_does_not_name_a_model():
    from app.settings import Merger, ModelRef

    ta, cal = Merger("task_arithmetic", (("scale", 0.3),)), _cal()
    assert cal.structure == _cal(log_lam=0.5, rho=1.0, alpha=0.9).structure != _cal(n=16).structure
    with pytest.raises(ValueError, match="needs 'cal'"):
        ModelRef("calibrated", ta)
    with pytest.raises(ValueError, match=r"takes no 'merger'.*ModelRef\.base_model"):
        ModelRef("base", ta)
    with pytest.raises(ValueError, match="kind"):
        ModelRef("expert")
    with pytest.raises(ValueError, match="structure"):
        ModelRef.preview(ta, cal, _cal(n=16))


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


# ----------------------------------------------------------------------------- compute and zoos (pure)


def test_cached_expert_outputs_give_diagnostics_own_tables(tiny_zoo_dir):
    """The app's fast path (experts run once per zoo) equals diagnostics' tables."""
    from app import compute, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    model = zoo.merged("ties", density=0.5, scale=0.7)
    data = zoo.calib_data(8, seed=0, split="val")
    ref = compute.scores(model, zoo, data, 20)
    fast = compute.scores(model, zoo, data, 20, compute.expert_side(zoo, data, 20))
    for key in ("output", "expert_cosine", "task_vector"):
        pd.testing.assert_frame_equal(
            fast[key].reset_index(drop=True), ref[key].reset_index(drop=True), check_dtype=False, atol=1e-6
        )


def test_cached_expert_streams_give_the_same_drift_and_respect_the_budget(tiny_zoo_dir):
    from app import compute, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    model = zoo.merged("task_arithmetic", scale=0.3)
    data = zoo.calib_data(8, seed=0, split="val")
    cache = compute.expert_streams(zoo, data)
    assert cache is not None and set(cache.calls) == set(zoo.tasks)
    pd.testing.assert_frame_equal(compute.drift(model, zoo, data, cache), compute.drift(model, zoo, data))
    assert compute.expert_streams(zoo, data, budget=cache.nbytes - 1) is None  # the estimate is exact here


def test_the_expert_trace_keeps_what_the_memory_allows():
    from app import compute

    assert 0 < compute.keep_budget() <= compute.KEEP_CAP
    assert compute.keep_budget(cap=1000) == 1000  # a machine has more than 1000 bytes available
    assert 0 < compute.expert_trace().max_bytes <= compute.KEEP_CAP
    assert compute.expert_trace(budget=123).max_bytes == 123


def test_streams_kept_while_scoring_cosines_give_the_same_drift(tiny_zoo_dir):
    """The worker's path: the cosine pass keeps the model's streams, the drift reuses them."""
    from app import compute, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    model = zoo.merged("ties", density=0.5, scale=0.7)
    data = zoo.calib_data(8, seed=0, split="val")
    side = compute.expert_side(zoo, data, 20)
    frame, own = compute.cosine_scores_and_streams(model, zoo, data, side)
    pd.testing.assert_frame_equal(frame, compute.cosine_scores(model, zoo, data, side))
    cache = compute.expert_streams(zoo, data)
    pd.testing.assert_frame_equal(compute.drift(model, zoo, data, cache, own), compute.drift(model, zoo, data))


def test_small_models_pair_work_on_one_thread_each_and_run_alone_on_every_core(tiny_zoo_dir, monkeypatch):
    from app import zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    from featcal.util import threads

    monkeypatch.delenv("FEATCAL_APP_THREADS", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 6)
    monkeypatch.setattr(threads, "load_average", lambda: 0.0)
    monkeypatch.setattr(threads, "own_load", lambda *_: 0.0)  # the load is other processes' here
    assert zoos.cpu_threads(zoo, "cpu") == 1
    assert zoos.cpu_threads(zoo, "cpu", alone=True) == 6
    monkeypatch.setattr(zoos, "SMALL_MODEL", 0)  # a big model: every core either way
    assert zoos.cpu_threads(zoo, "cpu") == 6
    monkeypatch.setattr(threads, "load_average", lambda: 4.2)  # a busy machine: the free cores only
    assert zoos.cpu_threads(zoo, "cpu") == zoos.cpu_threads(zoo, "cpu", alone=True) == 2
    monkeypatch.setenv("FEATCAL_APP_THREADS", "3")  # the user's choice wins for both
    assert zoos.cpu_threads(zoo, "cpu") == zoos.cpu_threads(zoo, "cpu", alone=True) == 3


def test_the_live_note_says_how_many_test_examples_and_why_fewer_on_an_llm(tiny_zoo_dir, monkeypatch):
    from app import compute, state, zoos

    zoo = zoos.load_zoo(tiny_zoo_dir, "cpu")
    n = min(compute.LIVE_TEST, zoos.split_size(zoo, "test"))
    assert compute.live_test(zoo) == compute.LIVE_TEST
    note = state.live_note(zoo)
    assert f"first {n} test examples per task;" in note and "language model" not in note
    monkeypatch.setattr(compute, "live_test", lambda _zoo: 3)  # as on an LLM zoo
    assert "first 3 test examples per task (fewer on a language model" in state.live_note(zoo)
    assert "first token" not in note


def test_the_live_note_of_a_language_model_zoo_says_its_accuracy_is_the_replys_first_token(monkeypatch):
    """On an encoder-decoder (or decoder) zoo the live accuracy is the reply's first token, the
    Compare page's the whole generated reply: on the FLAN-T5 stand-in 22% against 0%, so the note says which."""
    from app import state, zoos
    from featcal.zoo.score.seq2seq import Seq2SeqZoo

    monkeypatch.setattr(zoos, "split_size", lambda zoo, split: 4)
    note = state.live_note(object.__new__(Seq2SeqZoo))  # (live_note reads only the zoo's kind and test size)
    assert "first 4 test examples per task" in note
    assert "the reply's first token is the reference's" in note and "Compare page" in note


def test_a_long_exact_run_shows_its_blocks_and_the_time_left():
    """``ui.wait_with_progress`` writes the blocks done (from the run's ``on_block``) and an
    estimate of the time left while the job runs; without them, the seconds spent."""
    import threading
    from concurrent.futures import Future

    from app import ui

    class Line:
        def __init__(self):
            self.labels = []

        def update(self, label=None, state=None):
            self.labels.append(label)

    job, line, blocks = Future(), Line(), [None]
    threading.Timer(0.6, lambda: blocks.__setitem__(0, (3, 12))).start()
    threading.Timer(1.6, lambda: job.set_result("done")).start()
    ui.wait_with_progress(job, line, "Running", expected=None, after=0.1, blocks=lambda: blocks[0])
    assert any(lab.startswith("Running · ") and lab.endswith(" s") for lab in line.labels), line.labels
    with_blocks = [lab for lab in line.labels if "block 3 of 12" in lab]
    assert with_blocks and all("25%" in lab and "s left" in lab for lab in with_blocks), line.labels


def test_a_zoo_that_does_not_load_is_explained_in_wrapping_text():
    """The library's message is shown whole as text that wraps (a code block was cut off at
    1280 px), its Markdown characters escaped, with the one fix for that failure."""
    from app.zoos import explain_load_error

    msg = "spec my_zoo.yaml: experts.svhn: '/data/__models__/svhn' does not exist\nfix: download it ($5 of disk)"
    md = explain_load_error("my_zoo.yaml", FileNotFoundError(msg))
    assert "```" not in md and "Could not load zoo `my_zoo.yaml`" in md
    assert r"/data/\_\_models\_\_/svhn" in md and r"\(\$5 of disk\)" in md  # escaped, not emphasis or maths
    assert md.count("  \n") == 1 and "Fix: see the `fix:` lines above" in md


def test_two_zoo_loads_at_once_run_one_after_the_other(monkeypatch):
    """A zoo picked while another still loads waits for it: two loads side by side imported
    transformers' lazy submodules from two threads, and the second failed on a cold start
    ("cannot import name 'AutoTokenizer' from 'transformers'")."""
    import threading

    import featcal.zoo
    from app import zoos

    entered, active, most = threading.Event(), [0], [0]
    guard = threading.Lock()

    def fake_load(source, progress, device):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
        if source == "first":
            entered.set()
            threading.Event().wait(1.0)  # room for the second load to start beside this one
        with guard:
            active[0] -= 1
        return source

    monkeypatch.setattr(featcal.zoo, "load_any", fake_load)
    first = threading.Thread(target=zoos.load_zoo, args=("first", "cpu"))
    first.start()
    assert entered.wait(60)
    assert zoos.load_zoo("second", "cpu") == "second"
    first.join(60)
    assert most[0] == 1


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

"""The app on the generative zoos' shipped specs, on stand-ins under the real hub ids: every page runs on
the MergeBench (decoder LLM) zoo and on the FLAN-T5 (encoder-decoder) zoo, whose pages show the blocks
of both stacks in forward order, named (``encoder.block.1``, ``decoder.block.0``), and calibrate both."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))
import generative_hub as gh  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
APP = str(ROOT / "app" / "streamlit_app.py")
pytestmark = pytest.mark.slow
PAGES = ("drift", "calibrate", "weights", "tune", "studies", "export", "compare", "generate")


@pytest.fixture
def hub(tmp_path, monkeypatch):
    return gh.offline_cache(tmp_path, monkeypatch)


def _open(spec: str, out: Path) -> AppTest:
    doc = yaml.safe_load((ROOT / "assets" / "zoos" / spec).read_text())
    doc["splits"] = {"calib": 8, "val": 4, "test": 4}  # a small stand-in: fewer examples than the paper's
    out.write_text(yaml.safe_dump(doc))
    at = AppTest.from_file(APP, default_timeout=1800)
    at.query_params["zoo"] = "other (path)…"
    at.query_params["zoo_path"] = str(out)
    return at.run()


def test_every_page_runs_on_the_mergebench_zoo(hub, tmp_path):
    model = "Llama-3.2-3B-Instruct"
    domains = ("instruction", "math", "coding", "multilingual", "safety")
    gh.llama_standin(hub, f"meta-llama/{model}", {d: f"MergeBench/{model}_{d}" for d in domains})
    gh.mergebench_data(hub, tmp_path / "data")
    at = _open("mergebench-llama-3.2-3b-instruct.yaml", tmp_path / "mb.yaml")
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    for page in PAGES:
        got = at.switch_page(f"pages/{page}.py").run()
        assert not got.exception and not got.error, (page, [e.value for e in [*got.exception, *got.error]])


# ----------------------------------------------------------------------------- an encoder-decoder

T5_BLOCKS = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]  # the stand-in's


def _ok(at: AppTest) -> AppTest:
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    return at


@pytest.fixture
def flan_t5(hub, tmp_path) -> AppTest:
    """The app open on the FLAN-T5 GLUE zoo (a 2 + 2 block stand-in), on its first page."""
    gh.t5_standin(hub, "google/flan-t5-base", {t: f"tanganke/flan-t5-base_glue-{t}" for t in gh.GLUE_ROWS})
    gh.glue_standin(hub)
    return _ok(_open("flan-t5-base-glue.yaml", tmp_path / "t5.yaml"))


def _block_axes(at: AppTest) -> dict[str, list]:
    """Each chart's title -> the names on its block axis (charts without one left out)."""
    out = {}
    for chart in at.get("plotly_chart"):
        layout = json.loads(chart.proto.spec)["layout"]
        for axis in ("xaxis", "yaxis"):
            if "ticktext" in layout.get(axis, {}):
                out[layout["title"]["text"]] = layout[axis]["ticktext"]
    return out


def _finite_numbers(texts) -> list[float]:
    """The numbers in ``texts`` (metric values: ``12.50%``, ``0.9745``), each checked finite."""
    values = [float(m) for t in texts for m in re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?|nan|inf", t)]
    assert values and all(math.isfinite(v) for v in values), texts
    return values


def test_every_page_runs_on_the_flan_t5_zoo(flan_t5):
    for page in ("zoo", *PAGES):
        at = _ok(flan_t5.switch_page(f"pages/{page}.py").run())
        assert at.title and at.title[0].value, page


def test_the_zoo_page_names_each_tasks_scorer_not_its_classes(flan_t5):
    """A generative zoo's tasks have no classes: the Tasks table says how each is scored instead."""
    at = _ok(flan_t5.switch_page("pages/zoo.py").run())
    doc = yaml.safe_load((ROOT / "assets" / "zoos" / "flan-t5-base-glue.yaml").read_text())
    tasks = next(d.value for d in at.dataframe if "test" in d.value.columns)  # the Tasks table: split sizes
    assert "classes" not in tasks.columns
    assert dict(zip(tasks.task, tasks.scorer)) == {t: e["scorer"] for t, e in doc["tasks"].items()}
    assert (tasks["reply tokens"] > 0).all()
    at = _ok(at.toggle(key="zoo_full_eval").set_value(True).run())  # the full split's caption says it too
    assert any(c.value.startswith("Full test split") and "reply's first token" in c.value for c in at.caption)


def test_the_drift_page_shows_the_encoder_blocks_then_the_decoder_blocks(flan_t5):
    """Both stacks, in forward order and named, in every chart and picker; a decoder block's
    table holds finite drift of both models, nonzero for the merged one."""
    at = _ok(flan_t5.switch_page("pages/drift.py").run())
    assert at.selectbox(key="drill_block").options == T5_BLOCKS
    axes = _block_axes(at)
    assert len(axes) >= 5 and all(names == T5_BLOCKS for names in axes.values()), axes
    _ok(at.selectbox(key="drill_block").set_value(2).run())  # decoder.block.0
    table = at.dataframe[0].value
    assert set(table.block) == {2} and set(table.model) == {"merged", "calibrated"}
    assert table.value.notna().all() and np.isfinite(table.value).all()
    merged = table[(table.model == "merged") & (table.metric == "drift_rel")]
    assert len(merged) == len(gh.GLUE_ROWS) and (merged.value > 0).all()


def test_a_calibration_on_the_page_calibrates_both_stacks_and_moves_the_scores(flan_t5):
    at = _ok(flan_t5.switch_page("pages/calibrate.py").run())
    assert any("in 4 blocks" in c.value for c in at.caption), [c.value for c in at.caption]  # 2 + 2
    before = [(m.label, m.value, m.delta) for m in at.metric]
    _finite_numbers(m.value for m in at.metric)
    _ok(at.slider(key="alpha").set_value(0.9).run())
    after = [(m.label, m.value, m.delta) for m in at.metric]
    assert after != before
    _finite_numbers(m.value for m in at.metric)
    at.session_state["cal_residuals_open"] = True
    _ok(at.run())
    axes = _block_axes(at)
    assert "relative residual per module" in axes and all(n == T5_BLOCKS for n in axes.values()), axes
    assert at.selectbox(key="cal_tv_block").options == ["the whole model", *T5_BLOCKS]


def test_the_weights_page_reads_the_task_vectors_of_both_stacks(flan_t5):
    at = _ok(flan_t5.switch_page("pages/weights.py").run())
    assert at.selectbox(key="w_block").options == T5_BLOCKS
    axes = _block_axes(at)
    assert len(axes) == 3 and all(names == T5_BLOCKS for names in axes.values()), axes
    _ok(at.selectbox(key="w_block").set_value(3).run())  # decoder.block.1: its cross-attention among its tensors
    layers = at.dataframe[0].value.index
    assert any("EncDecAttention" in str(layer) for layer in layers), list(layers)


def test_tune_and_compare_run_on_the_flan_t5_zoo(flan_t5):
    """A per-block sweep's schedule names the blocks of both stacks; compare's drift lines too."""
    at = _ok(flan_t5.switch_page("pages/tune.py").run())
    at.selectbox(key="tune_search").set_value("per_block")
    _ok(at.run())
    _ok(at.button[0].click().run())  # Run sweep
    assert any(m.label.startswith("val") for m in at.metric)
    _finite_numbers(m.value for m in at.metric if m.label.startswith("val"))
    schedules = [t.value for t in at.dataframe if "block" in t.value.columns]
    if schedules:  # (a schedule only when one beat the paper's setting on val: one row per block)
        assert list(schedules[0].block) == T5_BLOCKS
    at = _ok(at.switch_page("pages/compare.py").run())
    _ok(at.button(key="cmp_run").click().run())
    axes = _block_axes(at)
    assert any(t.startswith("Drift from the expert per block") for t in axes), axes
    assert all(names == T5_BLOCKS for names in axes.values()), axes

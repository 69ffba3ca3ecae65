"""The app on the generative zoos' shipped specs, on stand-ins under the real hub ids: every page runs on
the MergeBench (decoder LLM) zoo; an encoder-decoder (FLAN-T5) zoo is refused with the way forward
(the command line), never a traceback."""

from __future__ import annotations

import sys
from pathlib import Path

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


def test_an_encoder_decoder_zoo_is_refused_with_the_way_forward(hub, tmp_path):
    gh.t5_standin(hub, "google/flan-t5-base", {t: f"tanganke/flan-t5-base_glue-{t}" for t in gh.GLUE_ROWS})
    gh.glue_standin(hub)
    at = _open("flan-t5-base-glue.yaml", tmp_path / "t5.yaml")
    assert not at.exception
    text = " ".join(e.value for e in at.error)
    assert "encoder-decoder" in text and "featcal reproduce" in text, text

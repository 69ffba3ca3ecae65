"""The app on an LLM zoo (the SmolLM2 micro build) under AppTest: every page runs without an
exception or an error, the zoo is in the picker, and the generate box answers a prompt with
the merged model, the calibrated one and each expert."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest

APP = str(Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py")
# The module opens the app on the LLM zoo once (its fixture: the micro build and a first run, 20-40 s).
pytestmark = pytest.mark.slow
PAGES = ("zoo", "drift", "calibrate", "weights", "tune", "studies", "export", "compare", "generate")


def _ok(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


@pytest.fixture(scope="module")
def app(smollm2_micro_dir):
    at = AppTest.from_file(APP, default_timeout=1800)
    at.query_params["zoo"] = "other (path)…"
    at.query_params["zoo_path"] = str(smollm2_micro_dir)
    return _ok(at.run())


def test_the_llm_zoo_is_in_the_picker(app):
    assert "smollm2" in app.sidebar.selectbox(key="zoo").options


@pytest.mark.parametrize("page", PAGES)
def test_every_page_runs_on_the_llm_zoo(app, page):
    at = _ok(app.switch_page(f"pages/{page}.py").run())
    assert at.title and at.title[0].value


def test_tune_and_studies_start_from_the_llm_preset(app):
    """Not CLIP's setting (its λ 0.05 on a Llama, and its class-token weights): the Llama one,
    with a grid around its λ offered first."""
    at = _ok(app.switch_page("pages/tune.py").run())
    assert any("llama-3b setting (λ=1e-05, ρ=0.5, α=0.15)" in c.value for c in at.caption), at.caption
    assert at.selectbox(key="tune_grid").options[0].startswith("LLM")
    at = _ok(app.switch_page("pages/studies.py").run())
    assert any("llama-3b setting (λ=1e-05, ρ=0.5, α=0.15)" in c.value for c in at.caption), at.caption


def test_generate_answers_with_every_model_side_by_side(app):
    at = _ok(app.switch_page("pages/generate.py").run())
    at.text_area(key="gen_prompt_(my own)").set_value("What is 2 + 3?")
    at.slider(key="gen_tokens").set_value(8)
    _ok(at.button(key="gen_go").click().run())
    names = [m.value for m in at.markdown]
    for want in ("merged", "calibrated", "expert python", "expert wordnet"):
        assert any(want in n for n in names), names
    assert len(at.text) >= 4

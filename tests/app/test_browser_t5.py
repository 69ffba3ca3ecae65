"""The Drift page of an encoder-decoder zoo in Debian's chromium (the server and browser of
test_browser.py): the FLAN-T5 GLUE spec on its stand-in (tests/zoo/generative_hub.py: a tiny
random T5 under the real hub ids in a Hugging Face cache of the test's own), opened from a
shared link. Every block-axis chart shows the blocks of both stacks, each name drawn (plotly
hid a line chart's last name, ``decoder.block.1``, that ran past the figure); no exception box.
The screenshot goes to artifacts/screenshots/drift-t5.png (docs/img/drift-t5.png is one such, resized)."""

from __future__ import annotations

import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml
from browser_kit import LOAD_MS, REPO, SHOTS, VIEW, _idle, _no_exception, launch_browser, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "zoo"))
import generative_hub as gh  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.demo_zoo, pytest.mark.slow]  # (the server checks the demo zoo)

T5_BLOCKS = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]  # the stand-in's
# The tick labels each chart draws: plotly keeps a label it hides in the page, with display none.
DRAWN_TICKS = """() => [...document.querySelectorAll('.js-plotly-plot')].map(plot =>
    [...plot.querySelectorAll('g.xtick text, g.ytick text')]
        .filter(t => getComputedStyle(t).display !== 'none' && t.getBoundingClientRect().width > 0)
        .map(t => t.textContent))"""


@pytest.fixture(scope="module")
def t5_server(tmp_path_factory):
    """``(url, spec path)``: the app on a Hugging Face cache holding the FLAN-T5 stand-in and
    tiny GLUE data, offline, and the zoo spec (the shipped one, with small splits)."""
    root = tmp_path_factory.mktemp("t5")
    hub = root / "hf" / "hub"
    env = {
        "HF_HOME": str(root / "hf"),
        "HF_HUB_CACHE": str(hub),
        "HF_HUB_OFFLINE": "1",
        "FEATCAL_DATA": str(root / "data"),
        "FEATCAL_PREVIEW_AFTER_S": "0",
        "FEATCAL_LOOK_AHEAD": "0",
    }
    server = start_server(tmp_path_factory, env)  # skips here without chromium
    url, _ = next(server)
    try:
        pytest.importorskip("transformers")
        gh.t5_standin(hub, "google/flan-t5-base", {t: f"tanganke/flan-t5-base_glue-{t}" for t in gh.GLUE_ROWS})
        gh.glue_standin(hub)
        doc = yaml.safe_load((REPO / "assets" / "zoos" / "flan-t5-base-glue.yaml").read_text())
        doc["splits"] = {"calib": 8, "val": 4, "test": 4}  # a small stand-in: fewer examples than the paper's
        spec = root / "flan-t5-base-glue.yaml"
        spec.write_text(yaml.safe_dump(doc))
        yield url, spec
    finally:
        next(server, None)  # stops the server


@pytest.fixture(scope="module")
def t5_browser(t5_server):
    yield from launch_browser()


def test_the_drift_page_of_a_t5_draws_the_encoder_and_the_decoder_blocks(t5_server, t5_browser):
    url, spec = t5_server
    context = t5_browser.new_context(viewport=VIEW)
    page = context.new_page()
    query = urllib.parse.urlencode({"zoo": "other (path)…", "zoo_path": str(spec)})  # a shared link to the page
    page.goto(f"{url}/drift?{query}")
    page.wait_for_selector(".js-plotly-plot", timeout=LOAD_MS)
    _idle(page, LOAD_MS)
    _no_exception(page)
    page.wait_for_timeout(1000)  # plotly draws after the run
    assert page.get_by_text("Feature drift").first.is_visible()
    body = page.inner_text("body")
    assert "encoder.block" in body and "decoder.block" in body, body[:2000]
    charts = [ticks for ticks in page.evaluate(DRAWN_TICKS) if any(t in T5_BLOCKS for t in ticks)]
    assert len(charts) >= 5, charts  # the two decompositions, three heatmaps, the per-block line
    for ticks in charts:
        assert [t for t in ticks if t in T5_BLOCKS] == T5_BLOCKS, ticks  # every name drawn, in forward order
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "drift-t5.png"))
    context.close()

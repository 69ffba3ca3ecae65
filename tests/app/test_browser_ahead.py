"""The Calibrate page's look-ahead in Debian's chromium (app/ahead.py): once a result is drawn
and the page has been idle a moment, a one-step slider change draws the exact result directly
(no preview chart ever appears), while a jump of several steps goes the usual way (the preview's
charts first). A server of its own, with the look-ahead on and the preview at every change."""

from __future__ import annotations

import pytest
from browser_kit import RUN_MS, _idle, _open, launch_browser, start_server
from test_browser_steady import SAMPLER, _press

pytestmark = [pytest.mark.browser, pytest.mark.demo_zoo, pytest.mark.slow]

LOOK_MS = 3000  # the page idle this long before a change: the first settings ahead are ready or under way
EXACT = "[...document.querySelectorAll('.gtitle')].some(e => e.textContent.startsWith('calibrated (exact)'))"


@pytest.fixture(scope="module")
def ahead_server(tmp_path_factory):
    # Look ahead whatever this machine's exact run takes (the threshold is a unit test's); without
    # the look-ahead every change would show the preview first.
    env = {"FEATCAL_LOOK_AHEAD": "1", "FEATCAL_LOOK_AHEAD_MAX_S": "60", "FEATCAL_PREVIEW_AFTER_S": "0"}
    yield from start_server(tmp_path_factory, env)


@pytest.fixture(scope="module")
def ahead_browser(ahead_server):
    yield from launch_browser()


def _change(page, label: str, presses: int) -> list[str]:
    """The drift chart's titles seen every animation frame through one slider change."""
    page.evaluate(SAMPLER)
    _press(page, label, presses)
    page.wait_for_timeout(500)
    page.wait_for_function(f"{EXACT} && !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=RUN_MS)
    _idle(page)
    return [s["title"] for s in page.evaluate("window.samples")]


def test_one_step_draws_the_exact_result_computed_ahead_a_jump_previews_first(ahead_server, ahead_browser):
    url, _ = ahead_server
    context = ahead_browser.new_context(viewport={"width": 1280, "height": 1000})
    page = _open(context, f"{url}/calibrate")
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 4", timeout=RUN_MS)
    _idle(page)
    page.wait_for_timeout(LOOK_MS)
    titles = _change(page, "ridge strength", 1)  # λ one step up: the first setting looked ahead at
    assert any(t.startswith("calibrated (exact)") for t in titles), titles[-3:]
    assert not any(t.startswith("preview") for t in titles), "a preview was drawn for a setting computed ahead"
    captions = page.locator('[data-testid="stCaptionContainer"]').all_inner_texts()
    assert any("Exact FeatCal done: λ=0.063" in c for c in captions), captions  # 10^-1.2
    page.wait_for_timeout(LOOK_MS)
    titles = _change(page, "anchor blend", -3)  # three steps at once: nothing computed there
    first_preview = next((i for i, t in enumerate(titles) if t.startswith("preview")), None)
    assert first_preview is not None, "a jump of three steps drew no preview"
    assert titles[-1].startswith("calibrated (exact)")
    assert page.locator('[data-testid="stException"]').count() == 0
    context.close()

"""The Compare page in Debian's chromium (the server and browser of test_browser.py): run two
fast methods on the demo zoo and find the charts; the screenshot goes to
artifacts/screenshots/compare.png (docs/img/compare.png is a copy)."""

from __future__ import annotations

import pytest
from browser_kit import LOAD_MS, SHOTS, _idle, _no_exception
from test_browser import browser, server  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.demo_zoo, pytest.mark.slow]


def test_compare_page_runs_two_methods_and_draws_the_charts(server, browser):  # noqa: F811
    url, _ = server
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1500})
    page = context.new_page()
    page.goto(f"{url}/compare")
    page.wait_for_selector('[data-testid="stMultiSelect"]', timeout=LOAD_MS)
    _idle(page, LOAD_MS)
    mergers = page.locator('[data-testid="stMultiSelect"]').first
    mergers.locator("input").click()
    for _ in range(2):  # drop iso_c and ties, leave ta; with ta+featcal: two fast methods
        page.keyboard.press("Backspace")
    page.keyboard.press("Escape")
    _idle(page)
    chosen = mergers.inner_text()
    assert "ta" in chosen and "ties" not in chosen and "iso_c" not in chosen, chosen
    assert page.locator(".js-plotly-plot").count() == 0  # nothing runs before Run
    page.get_by_role("button", name="Run").click()
    page.wait_for_selector(".js-plotly-plot", timeout=LOAD_MS)
    _idle(page, LOAD_MS)
    _no_exception(page)
    page.wait_for_timeout(1000)  # plotly draws after the run
    legend = page.locator(".js-plotly-plot .legendtext").all_text_contents()  # the accuracy chart's
    assert "ta" in legend and "ta+featcal" in legend and "experts" in legend, legend
    page.screenshot(path=str(SHOTS / "compare.png"))
    context.close()

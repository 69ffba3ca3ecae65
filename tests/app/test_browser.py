"""The app in a real browser: ``streamlit run`` on 127.0.0.1 and Debian's chromium
driven by Playwright (never ``playwright install``; tests/app/browser_kit.py). Pages render (screenshots in
artifacts/screenshots/), a slider moved with the keyboard updates the numbers and
the URL, and a second tab shares the server's cached models (its memory does not double).

Skipped when chromium is not installed (``apt-get install chromium``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from browser_kit import (
    LOAD_MS,
    METRIC,
    REPO,
    RUN_MS,
    SHOTS,
    VIEW,
    _free_port,
    _goto,
    _idle,
    _no_exception,
    _open,
    _rss_kib,
    launch_browser,
    start_server,
    wait_healthy,
)

pytestmark = [pytest.mark.browser, pytest.mark.demo_zoo, pytest.mark.slow]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The preview path, every time; no look-ahead (tests/app/test_browser_ahead.py has it).
    yield from start_server(tmp_path_factory, {"FEATCAL_PREVIEW_AFTER_S": "0", "FEATCAL_LOOK_AHEAD": "0"})


@pytest.fixture(scope="module")
def browser(server):
    yield from launch_browser()


def _metrics(page) -> list[str]:
    return page.locator(METRIC).all_inner_texts()


def _nudge(page, label: str, key: str, presses: int) -> float:
    """Focus slider ``label``'s thumb, press an arrow key ``presses`` times (left if negative);
    returns the seconds from the last key press to changed metric values."""
    before = _metrics(page)
    thumb = page.locator('[data-testid="stSlider"]', has_text=label).locator('input[type="range"]')
    thumb.focus()
    for _ in range(abs(presses)):
        page.keyboard.press("ArrowRight" if presses > 0 else "ArrowLeft")
    t0 = time.perf_counter()
    page.wait_for_function(
        """([sel, before]) => { const now = [...document.querySelectorAll(sel)].map(e => e.innerText);
             return now.length > 0 && JSON.stringify(now) !== JSON.stringify(before); }""",
        arg=[METRIC, before],
        timeout=RUN_MS,
    )
    seconds = time.perf_counter() - t0
    _idle(page)
    assert _metrics(page) != before
    return seconds


def test_pages_render(server, browser):
    url, _ = server
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport=VIEW)
    page = _open(context, url, ".js-plotly-plot")
    _no_exception(page)
    assert page.get_by_text("Zoo · demo").first.is_visible()
    page.wait_for_timeout(1000)  # plotly draws after the run
    page.screenshot(path=str(SHOTS / "zoo.png"))
    for name in ("drift", "calibrate", "export"):
        page.goto(f"{url}/{name}")
        page.wait_for_selector(".js-plotly-plot", timeout=LOAD_MS)
        _idle(page, LOAD_MS)
        _no_exception(page)
        page.wait_for_timeout(1000)
        page.screenshot(path=str(SHOTS / f"{name}.png"))
    context.close()


def _drill_titles(page) -> list[str]:
    return [t for t in page.locator(".gtitle").all_text_contents() if t and t.startswith(("block ", "task "))]


def _click_at(page, box: dict, fx: float = 0.5, fy: float = 0.5) -> None:
    page.mouse.click(box["x"] + fx * box["width"], box["y"] + fy * box["height"])
    _idle(page)
    page.wait_for_timeout(500)
    _idle(page)


def test_clicks_on_the_drift_charts_drill_down(server, browser):
    url, _ = server
    context = browser.new_context(viewport=VIEW)
    page = _open(context, f"{url}/drift", ".js-plotly-plot")
    assert _drill_titles(page)[0].startswith("block 0:")
    bars = page.locator(".js-plotly-plot").first.locator("g.trace.bars g.point path")
    _click_at(page, bars.nth(2).bounding_box())  # block 2's bar
    assert _drill_titles(page)[0].startswith("block 2:")
    grid = page.locator(".js-plotly-plot").nth(1).locator("rect.nsewdrag").first.bounding_box()
    _click_at(page, grid, 3.5 / 7, 1.5 / 4)  # 4th task, block 1
    titles = _drill_titles(page)
    assert titles[0].startswith("block 1:") and titles[1].startswith("task colour:"), titles
    page.screenshot(path=str(SHOTS / "drift-drilled.png"))
    context.close()


def test_slider_updates_numbers_and_url(server, browser):
    url, _ = server
    context = browser.new_context(viewport=VIEW)
    page = _open(context, f"{url}/calibrate")
    _nudge(page, "anchor blend", "rho", -4)  # 2.00 -> 1.80 (no earlier run: exact only)
    assert "rho=1.8" in page.url
    assert page.get_by_text("Exact FeatCal").first.is_visible()
    # The next change shows the preview (from the kept statistics of the rho=1.8 run) first.
    page.evaluate("""() => { window.sawPreview = false;
        new MutationObserver(() => { if ([...document.querySelectorAll('[data-testid="stAlertContentInfo"]')]
            .some(e => e.innerText.includes('Preview'))) window.sawPreview = true; })
          .observe(document.body, {childList: true, subtree: true, characterData: true}); }""")
    _nudge(page, "target interpolation", "alpha", 2)  # 0.30 -> 0.40
    assert page.evaluate("window.sawPreview"), "no preview was shown before the exact result"
    assert page.get_by_text("Exact FeatCal").first.is_visible()
    assert "alpha=0.4" in page.url
    page.screenshot(path=str(SHOTS / "calibrate-after-slider.png"))
    # The URL restores the view in a fresh tab.
    other = _open(context, page.url)
    for label, value in (("anchor blend", 1.8), ("target interpolation", 0.4)):
        thumb = other.locator('[data-testid="stSlider"]', has_text=label).locator('input[type="range"]')
        assert float(thumb.get_attribute("value")) == pytest.approx(value)
    context.close()


def test_two_tabs_share_the_server_memory(server, browser):
    url, proc = server
    first = browser.new_context(viewport=VIEW)
    tab1 = _open(first, f"{url}/calibrate")
    _nudge(tab1, "target interpolation", "alpha", 2)
    rss_one = _rss_kib(proc.pid)
    second = browser.new_context(viewport=VIEW)
    tab2 = _open(second, f"{url}/calibrate")
    _no_exception(tab2)
    _nudge(tab2, "target interpolation", "alpha", -2)
    _nudge(tab1, "anchor blend", "rho", 2)
    _no_exception(tab1)
    _no_exception(tab2)
    rss_two = _rss_kib(proc.pid)
    print(f"server RSS: {rss_one / 1024:.0f} MiB with one tab, {rss_two / 1024:.0f} MiB with two")
    assert rss_two < 1.5 * rss_one, f"server RSS {rss_one} KiB with one tab, {rss_two} KiB with two"
    first.close()
    second.close()


# ----------------------------------------------------------------------------- issue 19: every page, plots, downloads

PAGES = ("zoo", "drift", "calibrate", "export", "tune", "studies")
DOCS_IMG = REPO / "docs" / "img"


def _titles(page) -> list[str]:
    return page.locator(".gtitle").all_text_contents()


@pytest.mark.parametrize("width", [1280, 1920])
def test_every_page_renders_without_exception(server, browser, width):
    """Every page at 1280 and 1920 px wide: no exception, and no chart title under its toolbar
    (the title's box lies below the modebar's). Screenshots in artifacts/screenshots/."""
    url, _ = server
    SHOTS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": width, "height": 2000})
    page = context.new_page()
    for name in PAGES:
        _goto(page, f"{url}/" if name == "zoo" else f"{url}/{name}")  # the Zoo page is the app's root
        _no_exception(page)
        assert not page.get_by_text("Page not found").count(), name
        for plot in page.locator(".js-plotly-plot").all():
            title, bar = plot.locator(".gtitle").first, plot.locator(".modebar-container").first
            if title.count() and bar.count() and bar.bounding_box() and title.bounding_box():
                tb, mb = title.bounding_box(), bar.bounding_box()
                assert tb["y"] >= mb["y"] + mb["height"] - 1 or tb["x"] + tb["width"] <= mb["x"], (name, tb, mb)
        page.screenshot(path=str(SHOTS / f"{name}-{width}.png"))
    context.close()


def test_difference_heatmap_and_cosine_plots_are_drawn(server, browser):
    url, _ = server
    context = browser.new_context(viewport={"width": 1280, "height": 2600})
    page = context.new_page()
    _goto(page, f"{url}/drift", ".js-plotly-plot")
    assert any(t.startswith("calibrated minus merged") for t in _titles(page)), _titles(page)
    _goto(page, f"{url}/calibrate", ".js-plotly-plot")
    page.wait_for_function(
        "[...document.querySelectorAll('.gtitle')].some(e => e.textContent.startsWith('cos(τ_i, τ_j)'))",
        timeout=RUN_MS,
    )
    titles = _titles(page)
    for want in ("expert cosine per block", "task-vector cosine with each expert", "cos(τ_i, τ_j)"):
        assert any(t.startswith(want) for t in titles), (want, titles)
    context.close()


def test_a_downloaded_csv_parses(server, browser):
    import pandas as pd

    url, _ = server
    context = browser.new_context(viewport={"width": 1280, "height": 2600}, accept_downloads=True)
    page = context.new_page()
    _goto(page, f"{url}/drift", ".js-plotly-plot")
    with page.expect_download(timeout=RUN_MS) as info:
        page.get_by_role("button", name="drift.csv").click()
    df = pd.read_csv(info.value.path())
    assert list(df.columns) == ["task", "block", "metric", "value", "model"]
    assert set(df.model) == {"merged", "calibrated"} and df.value.notna().any()
    assert {"drift_rel", "expert_cosine"} <= set(df.metric)
    context.close()


def _slider_text(page, label: str) -> str:
    """The value a (select) slider shows on its thumb."""
    thumb = page.locator('[data-testid="stSlider"]', has_text=label).locator('[data-testid="stSliderThumbValue"]')
    return thumb.first.inner_text()


def test_apply_to_calibrate_moves_the_sliders(server, browser):
    import math
    import re

    from app.controls import on_slider

    url, proc = server
    context = browser.new_context(viewport={"width": 1280, "height": 2600})
    page = context.new_page()
    _goto(page, f"{url}/tune")
    tuned_n = _slider_text(page, "calibration examples per task")
    page.get_by_role("button", name="Run sweep").click()
    page.wait_for_selector("text=chosen setting", timeout=LOAD_MS)
    _idle(page, LOAD_MS)
    page.wait_for_function("document.querySelectorAll('.js-plotly-plot .main-svg').length >= 2", timeout=RUN_MS)
    page.wait_for_timeout(1500)  # plotly draws after the run
    page.screenshot(path=str(SHOTS / "tune-swept-1280.png"))
    chosen = page.locator('[data-testid="stMetric"]', has_text="chosen setting").locator(METRIC).inner_text()
    lam, rho, alpha = (float(v) for v in re.findall(r"=\s*([-0-9.e]+)", chosen))
    page.get_by_role("button", name="Apply to Calibrate").click()
    page.wait_for_url(re.compile(r".*/calibrate.*"), timeout=RUN_MS)
    page.wait_for_selector(METRIC, timeout=LOAD_MS)
    _idle(page, LOAD_MS)
    _no_exception(page)
    for label, key, value in (
        ("ridge strength", "log_lam", math.log10(lam)),
        ("anchor blend", "rho", rho),
        ("target interpolation", "alpha", alpha),
    ):
        thumb = page.locator('[data-testid="stSlider"]', has_text=label).locator('input[type="range"]')
        assert float(thumb.get_attribute("value")) == pytest.approx(on_slider(key, value), abs=1e-6), label
    assert _slider_text(page, "calibration examples per task") == tuned_n  # the calibration size too
    log = Path(os.readlink(f"/proc/{proc.pid}/fd/1")).read_text()  # the server's log
    assert "Session State API" not in log and "Traceback" not in log, log[-2000:]
    context.close()


def test_first_page_on_an_empty_cache_comes_from_the_shipped_zoo(browser, tmp_path):
    """A new user's first run: the shipped demo zoo, nothing cached: the Zoo page's numbers drawn
    from the shipped copy, nothing built (a build takes minutes). How long it takes is measured by
    benchmarks/first_run.py (benchmarks/README.md, 'First run'), not asserted here: a busy machine
    may take any time."""
    from featcal.zoo.builtin.demo import shipped_path

    assert shipped_path() is not None, "the shipped demo zoo (assets/zoos/demo/) is missing or stale"
    budget = LOAD_MS / 1000  # stops a hang only
    port, cache = _free_port(), tmp_path / "empty-cache"
    cmd = [sys.executable, "-m", "streamlit", "run", str(REPO / "app" / "streamlit_app.py")]
    cmd += ["--server.address", "127.0.0.1", "--server.port", str(port), "--server.headless", "true"]
    cmd += ["--browser.gatherUsageStats", "false"]
    env = {**os.environ, "FEATCAL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "streamlit.log"
    with open(log, "w") as out:
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log, timeout=budget)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url)
        page.wait_for_selector(METRIC, timeout=max(1, budget - (time.time() - t0)) * 1000)
        nav = page.locator('[data-testid="stSidebarNav"]').inner_text()
        page.close()
    finally:
        proc.terminate()
        proc.wait(600)
    assert "Zoo" in nav and "Drift" in nav and ".py" not in nav  # page titles, not file names
    assert not any(cache.rglob("meta.json")), "the demo zoo was built instead of loaded from the shipped copy"

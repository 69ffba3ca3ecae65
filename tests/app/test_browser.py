"""The app in a real browser: ``streamlit run`` on 127.0.0.1 and Debian's chromium
driven by Playwright (never ``playwright install``). Pages render (screenshots in
artifacts/screenshots/), a slider moved with the keyboard updates the numbers and
the URL, and a second tab shares the server's cached models (its memory does not double).

Skipped when chromium is not installed (``apt-get install chromium``)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.demo_zoo, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
SHOTS = REPO / "artifacts" / "screenshots"
CHROMIUM = shutil.which("chromium")
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
LOAD_MS = 1_800_000  # stops a hang only: the first page may build the demo zoo (minutes, once per machine)
RUN_MS = 1_800_000  # stops a hang only
METRIC = '[data-testid="stMetricValue"]'
EXCEPTION = '[data-testid="stException"]'
RUNNING = '[data-testid="stStatusWidget"]'
VIEW = {"width": 1500, "height": 2600}  # tall: Streamlit scrolls inside the page, screenshots show the viewport


# ``streamlit run`` with every thread's stack dumped to the server's log on SIGUSR1 (what a test that
# waited in vain shows: :func:`explain_wait`).
SERVE = (
    "import faulthandler, signal, sys; faulthandler.register(signal.SIGUSR1, all_threads=True); "
    "from streamlit.web.cli import main; sys.argv[0] = 'streamlit'; main()"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 1800) -> None:
    """Wait until the Streamlit server at ``url`` answers its health check; fail with the
    server's log (and kill it) when it exits or does not answer within ``timeout`` seconds."""
    deadline = time.time() + timeout
    while True:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"streamlit did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(tmp_path_factory, env: dict):
    """``streamlit run`` of the app on a free port of 127.0.0.1 with ``env`` added to the
    environment, on the demo zoo (built or checked first); yields ``(url, process)``."""
    if CHROMIUM is None:
        if os.environ.get("FEATCAL_REQUIRE_BROWSER"):  # CI: the browser tests must run
            pytest.fail("Debian chromium is not installed but FEATCAL_REQUIRE_BROWSER is set")
        pytest.skip("Debian chromium is not installed (apt-get install chromium); browser tests skipped")
    pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    from featcal.zoo.builtin.demo import load_demo

    load_demo(progress=False)  # build (or check) the cache here, not inside the first request
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "streamlit.log"
    cmd = [
        sys.executable,
        "-c",
        SERVE,
        "run",
        str(REPO / "app" / "streamlit_app.py"),
        "--server.address",
        "127.0.0.1",
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1", **env}
        )
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, log)
    yield url, proc
    proc.terminate()
    try:
        proc.wait(600)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The preview path, every time; no look-ahead (tests/app/test_browser_ahead.py has it).
    yield from start_server(tmp_path_factory, {"FEATCAL_PREVIEW_AFTER_S": "0", "FEATCAL_LOOK_AHEAD": "0"})


def launch_browser():
    """Debian's chromium under Playwright, with the flags that keep it off the network."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


@pytest.fixture(scope="module")
def browser(server):
    yield from launch_browser()


def _idle(page, timeout: int = RUN_MS, proc=None) -> None:
    """Wait until the script run is over: the 'running' widget gone and no stale element (a wait in
    vain shows the page, and the server's threads when ``proc`` is given: :func:`explain_wait`)."""
    page.wait_for_timeout(300)
    explain_wait(page, proc, f"!document.querySelector('{RUNNING}')", timeout)
    explain_wait(page, proc, "!document.querySelector('[data-stale=\"true\"]')", timeout)


def _open(context, url: str, ready: str = METRIC, proc=None):
    """A new page at ``url``, once ``ready`` is on it and the run is over; an exception on the
    page instead fails at once with its text (a wait in vain, with the server's threads when
    ``proc`` is given: :func:`explain_wait`)."""
    page = context.new_page()
    page.goto(url)
    explain_wait(page, proc, f"document.querySelector('{ready}') || document.querySelector('{EXCEPTION}')", LOAD_MS)
    _no_exception(page)
    _idle(page, LOAD_MS, proc)
    return page


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


def server_log(proc, stacks: bool = True) -> str:
    """The end of the server's log (its stdout), after it dumped every thread's stack when
    ``stacks``, it still runs and it was started to (:data:`SERVE`; to another, SIGUSR1 is fatal)."""
    log = Path(os.readlink(f"/proc/{proc.pid}/fd/1")) if proc.poll() is None else None
    if log is None:
        return f"(the server exited with code {proc.returncode})"
    if stacks and SERVE in proc.args:
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(2)
    return log.read_text()[-15000:]


def explain_wait(page, proc, condition: str, timeout: int, arg=None) -> None:
    """``page.wait_for_function(condition)``; on a timeout, a failure that shows what the page
    showed (its text and any exception, and a screenshot in SHOTS) and what the server's threads
    were doing (``proc``: the server, when the test has it), rather than the bare timeout."""
    from playwright.sync_api import TimeoutError as WaitedInVain

    try:
        page.wait_for_function(condition, arg=arg, timeout=timeout)
    except WaitedInVain:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "waited-in-vain.png"), full_page=True)
        text = page.locator("body").inner_text()[-5000:]
        server = "" if proc is None else f"\n--- the server's log and threads:\n{server_log(proc)}"
        pytest.fail(f"waited {timeout // 1000} s in vain for {condition}\n--- the page showed:\n{text}{server}")


def _no_exception(page) -> None:
    assert page.locator(EXCEPTION).count() == 0, page.locator(EXCEPTION).first.inner_text()


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


PLOTS = {"zoo": 1, "drift": 7, "calibrate": 4, "export": 1}  # charts each page draws on opening


def _goto(page, url: str, ready: str = '[data-testid="stMainBlockContainer"] h1') -> None:
    page.goto(url)
    page.wait_for_selector(ready, timeout=LOAD_MS)
    _idle(page, LOAD_MS)
    name = urllib.parse.urlparse(url).path.strip("/") or "zoo"
    if name in PLOTS:  # every chart drawn (on a busy machine the run can outlast the first idle)
        page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {PLOTS[name]}", timeout=LOAD_MS)
        _idle(page, LOAD_MS)
    page.wait_for_timeout(800)  # plotly draws after the run


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
        while True:
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                pass
            assert proc.poll() is None and time.time() - t0 < budget, f"no server:\n{log.read_text()[-2000:]}"
            time.sleep(0.1)
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

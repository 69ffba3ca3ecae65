"""The browser part of ``benchmarks/app_latency.py`` (``--browser``): ``streamlit run`` plus
Playwright on Debian's chromium, slider release (mouse) or arrow key -> first new numbers, first
plots redrawn, and the exact result drawn (the measures are described in app_latency.py)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common


def bench_browser(
    source: str, n: int, repeats: int, steps: int = 1, pause: float = 0.0, look_ahead: bool | None = None
) -> list[dict]:
    """Each change moves a slider ``steps`` steps, ``pause`` seconds after the page went idle
    (a person looking at the result); ``look_ahead``: the server's ``FEATCAL_LOOK_AHEAD``
    (None: as in this environment, on by default)."""
    env = dict(os.environ)
    if look_ahead is not None:
        env["FEATCAL_LOOK_AHEAD"] = "1" if look_ahead else "0"
    how_far = "" if steps == 1 and not pause else f", {steps} step{'s' if steps > 1 else ''}, {pause:g} s pause"
    chromium = shutil.which("chromium")
    if chromium is None:
        return [{"measure": "browser: skipped (no chromium; apt-get install chromium)"}]
    from playwright.sync_api import sync_playwright

    from featcal.util.memory import rss_mb, vmhwm_mb

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "streamlit",
            "run",
            str(_common.APP_SCRIPT),
            "--server.port",
            str(port),
            "--server.address",
            "127.0.0.1",
            "--server.headless",
            "true",
        ],
        cwd=_common.REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        path = Path(source).expanduser()
        query = {"zoo": source, "n_cal": n} if not path.exists() else {"zoo": "other (path)…", "zoo_path": source}
        query["n_cal"] = n  # a built-in zoo (demo, real-text, ...) by name, else a path
        rows = []
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=_common.CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1500, "height": 1200})
            page.goto(f"{url}/calibrate?{urllib.parse.urlencode(query)}")
            page.wait_for_selector('[data-testid="stMetricValue"]', timeout=900_000)
            for label, key in (
                ("ridge strength", "log_lam"),
                ("anchor blend", "rho"),
                ("target interpolation", "alpha"),
            ):
                for how, what in (("mouse", "mouse release"), ("key", "arrow key")):
                    xs, first, plots, settled = [], [], [], []
                    for _ in range(repeats):  # one way: every value is new (no cache hit)
                        page.wait_for_timeout(1000 * pause)
                        total, shown, plot, last = _browser_move(page, label, +1, how, steps)
                        print(
                            f"{key} {how}: exact result drawn after {total:.1f} s; server resident "
                            f"{rss_mb(proc.pid) or float('nan'):.0f} MB",
                            file=sys.stderr,
                            flush=True,
                        )
                        xs.append(total)
                        first.append(shown)
                        plots += [] if plot is None else [plot]
                        settled += [] if last is None else [last]
                    rows.append(
                        {
                            "measure": f"browser: {what} -> first new numbers ({key}{how_far})",
                            **_common.latency_stats(first),
                        }
                    )
                    if plots:
                        rows.append(
                            {
                                "measure": f"browser: {what} -> first plots redrawn ({key}{how_far})",
                                **_common.latency_stats(plots),
                            }
                        )
                    rows.append(
                        {
                            "measure": f"browser: {what} -> exact result, plots drawn ({key}{how_far})",
                            **_common.latency_stats(xs),
                        }
                    )
                    if settled:
                        rows.append(
                            {
                                "measure": f"browser: {what} -> every chart settled ({key}{how_far})",
                                **_common.latency_stats(settled),
                            }
                        )
            browser.close()
        peak = vmhwm_mb(proc.pid)
        rows.append({"measure": f"browser: the server's peak resident memory (VmHWM) {peak or float('nan'):.0f} MB"})
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(60)  # a loaded machine can take a while to stop the server
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _browser_idle(page) -> None:
    page.wait_for_timeout(200)
    page.wait_for_function("!document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=300_000)


# Records when a chart is first redrawn after the change (the preview's, else the exact one's:
# nodes added or removed in a chart) and when any chart last changed (nodes or attributes).
PLOT_WATCH = """() => { window.firstPlot = null; window.lastPlot = null; window.watchStart = performance.now();
  if (window.plotWatch) window.plotWatch.disconnect();
  window.plotWatch = new MutationObserver(ms => {
    const inPlot = ms.filter(m => m.target.closest && m.target.closest('.js-plotly-plot'));
    if (inPlot.length === 0) return;
    const now = performance.now();
    window.lastPlot = now;
    if (window.firstPlot === null && inPlot.some(m => m.type === 'childList')) window.firstPlot = now; });
  window.plotWatch.observe(document.body, {subtree: true, childList: true, attributes: true}); }"""
SETTLED_MS = 400  # the charts count as drawn once none has changed for this long
DONE_LINE = """() => [...document.querySelectorAll('[data-testid="stCaptionContainer"]')]
                        .map(e => e.innerText).filter(t => t.includes('Exact FeatCal done')).join('|')"""


def _drag_and_release(page, thumb, direction: int, steps: int = 1) -> None:
    """Press the mouse on the slider's thumb, move it pixel by pixel until the value is
    ``steps`` steps further (the app hears nothing while the button is down), and release."""
    box = thumb.locator("..").bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    last, moved = thumb.input_value(), 0
    page.mouse.move(x, y)
    page.mouse.down()
    for px in range(1, 800):
        page.mouse.move(x + direction * px, y)
        if (value := thumb.input_value()) != last:
            last, moved = value, moved + 1
            if moved >= steps:
                break
    page.mouse.up()


def _browser_move(
    page, label: str, direction: int, how: str = "mouse", steps: int = 1
) -> tuple[float, float, float | None, float | None]:
    """One slider change from an idle page, one step in ``direction``: dragged and released
    with the mouse (``how="mouse"``; the clock starts at the release, which the browser
    sends at once) or with an arrow key on the focused thumb (``"key"``; the browser sends
    that change to the server only ~0.24 s after the key press). Returns the seconds to the
    exact result's plots, to the first new numbers, to the first chart redrawn (the
    preview's when one is drawn; None if none was seen) and to the last change of any chart
    once none has changed for ``SETTLED_MS`` (None if none changed)."""
    _browser_idle(page)
    sel = '[data-testid="stMetricValue"]'
    before = page.locator(sel).all_inner_texts()
    done_before = page.evaluate(DONE_LINE)
    page.evaluate(PLOT_WATCH)
    thumb = page.locator('[data-testid="stSlider"]', has_text=label).locator('input[type="range"]')
    lo, hi, step = (float(thumb.get_attribute(a)) for a in ("min", "max", "step"))
    if not lo <= float(thumb.input_value()) + direction * steps * step <= hi:
        raise SystemExit(f"the {label!r} slider would pass its end: ask for fewer --repeats or --steps")
    if how == "mouse":
        _drag_and_release(page, thumb, direction, steps)
    else:
        thumb.focus()
        for _ in range(steps):
            page.keyboard.press("ArrowRight" if direction > 0 else "ArrowLeft")
    t0 = time.perf_counter()
    t0_js = page.evaluate("() => performance.now()")
    page.wait_for_function(
        """([sel, before]) => { const now = [...document.querySelectorAll(sel)].map(e => e.innerText);
             return now.length > 0 && JSON.stringify(now) !== JSON.stringify(before); }""",
        arg=[sel, before],
        timeout=300_000,
        polling=10,
    )
    shown = time.perf_counter() - t0
    page.wait_for_function(
        f"([before]) => {{ const now = ({DONE_LINE})(); return now !== '' && now !== before; }}",
        arg=[done_before],
        timeout=300_000,
        polling=10,
    )
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
    total = time.perf_counter() - t0
    page.wait_for_function(
        f"() => performance.now() - (window.lastPlot ?? window.watchStart) > {SETTLED_MS}",
        timeout=60_000,
        polling=50,
    )
    first_plot, last_plot = page.evaluate("() => [window.firstPlot, window.lastPlot]")
    plots = None if first_plot is None else max(0.0, (first_plot - t0_js) / 1000)
    settled = None if last_plot is None else max(0.0, (last_plot - t0_js) / 1000)
    return total, shown, plots, settled

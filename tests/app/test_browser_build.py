"""Issue 28 in Debian's chromium: a zoo build shows its progress on the page (stage, step and
time left, updated as it goes) and the page title follows the zoo being loaded; the server's
terminal shows the build too. The server runs the app with a micro demo recipe
(tests/app/micro_demo_server.py) and an empty cache, so its first page builds that zoo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from browser_kit import (
    ARGS,
    CHROMIUM,
    EXCEPTION,
    LOAD_MS,
    METRIC,
    REPO,
    _free_port,
    _idle,
    _no_exception,
    explain_wait,
    wait_healthy,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

# Every animation frame: the progress bar's text, if one is on the page.
SAMPLER = """() => { window.progress = [];
  const tick = () => { const p = document.querySelector('[data-testid="stProgress"]');
      if (p) window.progress.push({t: performance.now(), text: p.innerText});
      if (window.progress.length < 100000) requestAnimationFrame(tick); };
  requestAnimationFrame(tick); }"""
STEP = re.compile(r"^(?P<stage>[^:]+): step (?P<step>\d+)/(?P<total>\d+) \((?P<pct>\d+)% done, (?P<left>.+)\)$")


def test_a_zoo_build_shows_its_stage_step_and_time_left(tmp_path):
    if CHROMIUM is None:
        pytest.skip("Debian chromium is not installed (apt-get install chromium); browser tests skipped")
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright Python package is not installed")
    port, log = _free_port(), tmp_path / "streamlit.log"
    cmd = [sys.executable, str(Path(__file__).with_name("micro_demo_server.py")), "run"]
    cmd += [str(REPO / "app" / "streamlit_app.py"), "--server.address", "127.0.0.1", "--server.port", str(port)]
    cmd += ["--server.headless", "true", "--browser.gatherUsageStats", "false"]
    env = {**os.environ, "FEATCAL_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.add_init_script(f"({SAMPLER})()")
            page.goto(url)
            explain_wait(
                page, proc, f"document.querySelector('{METRIC}') || document.querySelector('{EXCEPTION}')", LOAD_MS
            )
            _no_exception(page)
            _idle(page, LOAD_MS)
            texts = [s["text"] for s in page.evaluate("window.progress")]
            title = page.title()
            browser.close()
    finally:
        proc.terminate()
        proc.wait(600)
    steps = [m for m in (STEP.match(t.strip()) for t in texts) if m]
    assert steps, f"no progress text of the form 'stage: step i/n (p% done, ...)' on the page: {set(texts)}"
    stages = {m["stage"] for m in steps}
    assert {"pretrain the base", "fine-tune the colour expert"} <= stages, stages
    assert len({m.group(0) for m in steps}) >= 3  # updated as the build goes, not drawn once
    assert any(re.fullmatch(r"about .+ left", m["left"]) for m in steps), {m["left"] for m in steps}
    pct = [int(m["pct"]) for m in steps]
    assert pct == sorted(pct) and pct[-1] >= 50, pct  # it moves forward
    assert "demo" in title, title  # the tab names the zoo being loaded
    assert "pretrain the base" in log.read_text()  # and the terminal shows the build's bars
    assert any((tmp_path / "cache").rglob("meta.json")), "the micro demo zoo was not built into the cache"

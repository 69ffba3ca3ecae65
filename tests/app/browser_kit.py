"""What the browser tests share: ``streamlit run`` of the app on a free port of 127.0.0.1 (its
threads' stacks on SIGUSR1), Debian's chromium under Playwright with the flags that keep it off the
network (never ``playwright install``), and waits that explain themselves when they come to nothing
(the page's text, a screenshot, the server's threads). The fixtures that use them are in
test_browser.py."""

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

from featcal.cli.app import command

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
PLOTS = {"zoo": 1, "drift": 7, "calibrate": 4, "export": 1}  # charts each page draws on opening
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
    # featcal app's own command line (featcal.cli.app.command), run through SERVE instead of ``-m streamlit``
    cmd = [sys.executable, "-c", SERVE, *command("127.0.0.1", port)[3:]]
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


def launch_browser():
    """Debian's chromium under Playwright, with the flags that keep it off the network."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield b
        b.close()


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


def _goto(page, url: str, ready: str = '[data-testid="stMainBlockContainer"] h1') -> None:
    page.goto(url)
    page.wait_for_selector(ready, timeout=LOAD_MS)
    _idle(page, LOAD_MS)
    name = urllib.parse.urlparse(url).path.strip("/") or "zoo"
    if name in PLOTS:  # every chart drawn (on a busy machine the run can outlast the first idle)
        page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {PLOTS[name]}", timeout=LOAD_MS)
        _idle(page, LOAD_MS)
    page.wait_for_timeout(800)  # plotly draws after the run

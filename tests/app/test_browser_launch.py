"""`featcal app` as a user starts it, in the real browser: from a directory outside the repository,
the first request straight to a page URL."""

import os
import subprocess
import sys

import pytest
from browser_kit import VIEW, _free_port, _goto, _no_exception, wait_healthy
from test_browser import browser, server  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.browser, pytest.mark.demo_zoo, pytest.mark.slow]


def test_featcal_app_from_another_directory_serves_a_page_url_on_a_first_request(tmp_path, browser):  # noqa: F811
    """`featcal app` started outside the repository, the first request straight to /calibrate (no visit to
    the app's root first): the page runs (it failed with "No module named 'app'": Streamlit puts only
    the script's folder on sys.path, the launcher now adds the repository)."""
    port = _free_port()  # (the browser fixture has checked for Chromium and the demo zoo)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FEATCAL_LOOK_AHEAD": "0"}
    env.pop("PYTHONPATH", None)
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "featcal", "app", "--port", str(port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        context = browser.new_context(viewport=VIEW)
        page = context.new_page()
        _goto(page, f"{url}/calibrate")
        _no_exception(page)
        assert "No module named" not in page.inner_text("body")
        assert page.get_by_text("Calibrate").first.is_visible()
        context.close()
    finally:
        proc.terminate()  # the launcher is the server (exec): this stops it
        try:
            proc.wait(600)
        except subprocess.TimeoutExpired:
            proc.kill()

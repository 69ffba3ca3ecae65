"""Re-take the README's screenshots of every app page (docs/img/, 1280 px wide, palette PNGs).

Starts ``streamlit run`` on a free 127.0.0.1 port with the shipped demo zoo and drives Debian's
chromium with Playwright: each page is opened, its long jobs started where a page waits for a
button (Tune's sweep, Studies' sample-efficiency study, Compare's run), and shot once every
chart is drawn and nothing runs.

    python scripts/screenshots.py                 # every page into docs/img/
    python scripts/screenshots.py --pages weights --out /tmp/shots
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _common import CHROMIUM_ARGS  # noqa: E402

# page -> (path, button to press first or None, charts to wait for)
PAGES = {
    "zoo": ("", None, 1),
    "drift": ("drift", None, 7),
    "calibrate": ("calibrate", None, 4),
    "weights": ("weights", None, 4),
    "export": ("export", None, 1),
    "tune": ("tune", "Run sweep", 2),
    "studies": ("studies", "Run", 1),
    "compare": ("compare", "Run", 3),
    "compare-rivals": ("compare", "Run", 3),  # the closed-form rivals too (CHOICES below)
}
# multiselects set before the button is pressed: {shot: {label: names to add}}
CHOICES = {"compare-rivals": {"mergers alone": ["lot", "esm", "bmm", "ace"], "calibrators": ["svc"]}}
LOAD_MS = 900_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _idle(page) -> None:
    page.wait_for_timeout(400)
    page.wait_for_function("!document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=LOAD_MS)


def _shoot(page, url: str, name: str, out: Path, height: int) -> Path:
    path, button, charts = PAGES[name]
    page.goto(f"{url}/{path}")
    page.wait_for_selector('[data-testid="stMainBlockContainer"] h1', timeout=LOAD_MS)
    _idle(page)
    for label, names in CHOICES.get(name, {}).items():
        box = page.locator('[data-testid="stMultiSelect"]').filter(has_text=label).locator("input")
        for n in names:
            box.click()
            box.fill(n)
            box.press("Enter")
            _idle(page)
        page.keyboard.press("Escape")
    if button:
        page.get_by_role("button", name=button, exact=True).first.click()
        _idle(page)
    page.wait_for_function(f"document.querySelectorAll('.js-plotly-plot').length >= {charts}", timeout=LOAD_MS)
    _idle(page)
    page.wait_for_timeout(1500)  # plotly draws after the run
    from PIL import Image

    png = page.screenshot(clip={"x": 0, "y": 0, "width": 1280, "height": height})
    target = out / f"{name}.png"
    Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256).save(target, optimize=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--pages", default=",".join(p for p in PAGES if p not in CHOICES), help=f"comma list of {', '.join(PAGES)}"
    )
    ap.add_argument("--out", default=str(REPO / "docs" / "img"))
    ap.add_argument("--height", type=int, default=2000)
    args = ap.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("needs Debian's chromium (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    cmd = [sys.executable, "-m", "streamlit", "run", str(REPO / "app" / "streamlit_app.py")]
    cmd += ["--server.address", "127.0.0.1", "--server.port", str(port), "--server.headless", "true"]
    cmd += ["--browser.gatherUsageStats", "false"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(480):
            try:
                if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                    break
            except OSError:
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": args.height})
            for name in args.pages.split(","):
                print(f"{name}: {_shoot(page, url, name, out, args.height)}", flush=True)
            browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()

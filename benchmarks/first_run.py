"""First run of the app: server start -> first page rendered in Chromium, on an empty cache.

A new user's `make app` on a fresh clone: the demo zoo must come from the copy shipped in
`assets/zoos/demo/`, not from a build. Each run starts `streamlit run` with
`$FEATCAL_CACHE` pointing at a new, empty directory and opens the app in Debian's
chromium (Playwright, never `playwright install`), timing

- `server up`: the process start -> `/_stcore/health` answers;
- `first page`: the process start -> the Zoo page's first number drawn
  (`stMetricValue`), the zoo loaded;
- `page idle`: the process start -> the first script run over.

Two ways to start it:

- `streamlit`: `python -m streamlit run app/streamlit_app.py` in this checkout;
- `make app`: `git clone` of this checkout's HEAD (what is committed) into a temporary
  directory, then `make -o venv app` there with this environment as `VENV` (an existing
  venv, left untouched: a fresh one's pip install takes minutes and is not what this
  measures). The clone's time is reported apart;
- `make app, fresh venv` (``--fresh-venv``, one run): a fresh clone and a plain `make app`, which
  creates `.venv` and installs `requirements.txt` first: install -> first page.

    python benchmarks/first_run.py                  # 3 runs of each
    python benchmarks/first_run.py --runs 1 --no-make
    python benchmarks/first_run.py --runs 1 --no-make --fresh-venv   # install -> first page, once

Target (issue 19): the first page within 30 s of the server starting.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common

REPO = _common.REPO_ROOT
CHROMIUM = shutil.which("chromium")
METRIC = '[data-testid="stMetricValue"]'
RUNNING = '[data-testid="stStatusWidget"]'
TARGET_S = 30.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.time() < deadline:
        try:
            if urllib.request.urlopen(f"{url}/_stcore/health", timeout=2).read() == b"ok":
                return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError("the server exited before answering")
        time.sleep(0.1)
    raise TimeoutError("the server did not answer its health check")


def one_run(browser, how: str, workdir: Path, timeout_s: float = 600) -> dict[str, float]:
    """Start the server (``how``: ``streamlit`` or ``make``) on an empty cache and time it."""
    port = _free_port()
    cache = Path(tempfile.mkdtemp(prefix="featcal-empty-cache-"))
    env = {**os.environ, "FEATCAL_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
    if how == "make":
        venv = Path(sys.executable).parents[1]
        cmd = ["make", "-o", "venv", "app", f"VENV={venv}", f"PORT={port}"]
    elif how == "make-fresh":  # the clone's own new .venv: pip install first
        cmd = ["make", "app", f"PORT={port}"]
    else:
        cmd = [sys.executable, "-m", "streamlit", "run", "app/streamlit_app.py"]
        cmd += ["--server.address", "127.0.0.1", "--server.port", str(port)]
    cmd_env = {**env, "STREAMLIT_SERVER_HEADLESS": "true", "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false"}
    log = open(cache.parent / f"{cache.name}.log", "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=workdir, env=cmd_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc, t0 + timeout_s)
        t_up = time.time() - t0
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(url)
        page.wait_for_selector(METRIC, timeout=timeout_s * 1000)
        t_first = time.time() - t0
        page.wait_for_timeout(300)
        page.wait_for_function(f"!document.querySelector('{RUNNING}')", timeout=timeout_s * 1000)
        t_idle = time.time() - t0
        page.close()
        built = any(cache.rglob("meta.json"))  # a build would have written the zoo into the cache
    finally:
        os.killpg(proc.pid, 15)  # the server and, under make, its child
        proc.wait(15)
        log.close()
        shutil.rmtree(cache, ignore_errors=True)
    return {"server up": t_up, "first page": t_first, "page idle": t_idle, "built": float(built)}


def fresh_clone() -> tuple[Path, float]:
    """``git clone`` of HEAD into a temporary directory and the seconds it took."""
    dest = Path(tempfile.mkdtemp(prefix="featcal-clone-")) / "featcal"
    t0 = time.time()
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dest)], check=True)
    seconds = time.time() - t0
    return dest, seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-make", action="store_true", help="skip the `make app` from a fresh clone")
    ap.add_argument(
        "--fresh-venv", action="store_true", help="also one `make app` creating its own venv (install -> page)"
    )
    args = ap.parse_args(argv)
    if CHROMIUM is None:
        sys.exit("Debian chromium is not installed (apt-get install -y chromium).")
    from playwright.sync_api import sync_playwright

    ways = [("streamlit run (this checkout)", "streamlit", REPO)]
    clone_s = None
    if not args.no_make:
        clone, clone_s = fresh_clone()
        ways.append(("make app (fresh clone, existing venv)", "make", clone))
    if args.fresh_venv:
        clone_fresh, _ = fresh_clone()
        ways.append(("make app (fresh clone, fresh venv: install included)", "make-fresh", clone_fresh))
    rows = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=_common.CHROMIUM_ARGS)
        for label, how, workdir in ways:
            runs = [one_run(browser, how, workdir) for _ in range(1 if how == "make-fresh" else args.runs)]
            row = {"start": label, "runs": len(runs)}
            for key in ("server up", "first page", "page idle"):
                xs = [r[key] for r in runs]
                row[f"{key} (median / max)"] = f"{statistics.median(xs):.1f} / {max(xs):.1f} s"
            row["zoo built"] = "yes" if any(r["built"] for r in runs) else "no (shipped copy)"
            rows.append(row)
        browser.close()
    print(_common.markdown_table(rows))
    print()
    load = os.getloadavg()
    print(f"- empty $FEATCAL_CACHE each run; target: first page within {TARGET_S:.0f} s of the server starting")
    if clone_s is not None:
        print(f"- git clone (not counted above): {clone_s:.1f} s")
    print(f"- load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()

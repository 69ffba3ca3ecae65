"""``featcal app [--port N] [--host H]``: the Streamlit app, bound to the address given here.

The app's settings live beside its script (``app/.streamlit/config.toml``, which Streamlit
reads from any directory), but an option given on the command line wins over them, and a bare
``streamlit run`` listens on every interface. This launcher passes ``--server.address``
itself (127.0.0.1 unless ``--host`` says otherwise) and tells the app, through
:data:`HOST_ENV`, which address the user asked for: served on any other non-loopback
address, the app shows a refusal instead of loading anything (``app/binding.py``).

The launcher becomes the server (``exec``): a SIGTERM or SIGINT sent to the pid ``featcal app`` started
stops the server itself, and no second process holds memory for the app's life.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HOST_ENV = "FEATCAL_APP_HOST"  # the address the user asked for with --host
APP = Path(__file__).resolve().parents[2] / "app" / "streamlit_app.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=_port, default=8501, help="port to listen on (default 8501)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1, this machine only); the app has no login, so any "
        "other address lets everyone who can reach it load zoos and write files as you",
    )


def _port(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if not 0 < n < 65536:
        raise argparse.ArgumentTypeError(f"expected a port number 1-65535, got {text!r}")
    return n


def command(host: str, port: int) -> list[str]:
    """The ``streamlit run`` command line, the address and port passed explicitly."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true",
        "--browser.gatherUsageStats",
        "false",
        "--browser.serverAddress",
        host,
    ]


def run(args: argparse.Namespace) -> int:
    if not APP.is_file():
        raise FileNotFoundError(
            f"the app's files are not there ({APP}); `featcal app` runs from a checkout of the repository "
            "(pip install -e .)."
        )
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"featcal: the app will listen on {args.host}:{args.port} and has no login: everyone who can reach "
            "that address can load zoos and export files as you.",
            file=sys.stderr,
        )
    os.execve(sys.executable, command(args.host, args.port), server_env(args.host))  # never returns


def server_env(host: str) -> dict:
    """The server's environment: the address asked for (:data:`HOST_ENV`), and the repository on
    ``PYTHONPATH``, so that a page's ``import app...`` works whichever page a first request opens and
    whatever the working directory (Streamlit puts only the script's own folder on ``sys.path``)."""
    repo = str(APP.parents[1])
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, HOST_ENV: host, "PYTHONPATH": os.pathsep.join([repo, *[p for p in path if p != repo]])}

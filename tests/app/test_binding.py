"""The app listens on 127.0.0.1 whatever the working directory (issue 24, item 5):
`featcal app` passes the address to Streamlit itself, and the app, served on a non-loopback
address nobody asked for, shows a refusal and loads nothing."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app import binding

REPO = Path(__file__).resolve().parents[2]
APP = str(REPO / "app" / "streamlit_app.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> set[str]:
    """The local addresses with a TCP socket listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state != "0A" or int(hexport, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            if v6:
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                found.add(socket.inet_ntop(socket.AF_INET6, words))
            else:
                found.add(socket.inet_ntoa(raw[::-1]))
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").is_file(), reason="reads the listening sockets from /proc/net/tcp")
def test_featcal_app_listens_on_loopback_only_from_another_directory(tmp_path):
    """... and stops when the pid `featcal app` started gets SIGTERM (the launcher left the server running,
    listening, with parent pid 1)."""
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # featcal as installed; the launcher adds the repository
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "featcal", "app", "--port", str(port)],
        cwd=tmp_path,  # no .streamlit/config.toml here: Streamlit's own default is every interface
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 1800
        while not _listening(port):
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.time() < deadline, "the server did not start listening in 1800 s"
            time.sleep(0.3)
        time.sleep(0.5)  # every socket it opens is open by now
        assert _listening(port) == {"127.0.0.1"}
        os.kill(proc.pid, signal.SIGTERM)  # the pid the user started, not its process group
        assert proc.wait(timeout=1800) is not None
        assert not _listening(port), "the server still listens after SIGTERM to featcal app"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=600)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_the_apps_settings_apply_from_any_directory(tmp_path):
    """The app's config file sits beside its script, so a server started elsewhere still gets
    its settings (no per-run garbage collection, no file watcher, loopback)."""
    probe = (
        "import json, streamlit.config as c; c._main_script_path = %r; "
        "c.get_config_options(force_reparse=True); "
        "print(json.dumps({k: c.get_option(k) for k in "
        "('runner.postScriptGC', 'server.fileWatcherType', 'server.address')}))"
    ) % APP
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMLIT_")}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800
    )
    assert out.returncode == 0, out.stderr
    options = json.loads(out.stdout.strip().splitlines()[-1])
    assert options == {"runner.postScriptGC": False, "server.fileWatcherType": "none", "server.address": "127.0.0.1"}


def test_launcher_passes_the_address_and_tells_the_app():
    from featcal.cli.app import command

    cmd = command("127.0.0.1", 8765)
    assert cmd[cmd.index("--server.address") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--server.port") + 1] == "8765"


@pytest.mark.parametrize(
    ("address", "asked", "refused"),
    [
        ("127.0.0.1", None, False),
        ("localhost", None, False),
        ("::1", None, False),
        (None, None, True),  # no address: every interface
        ("", None, True),
        ("0.0.0.0", None, True),
        ("192.168.1.7", None, True),
        ("192.168.1.7", "192.168.1.7", False),  # featcal app --host 192.168.1.7
        ("0.0.0.0", "192.168.1.7", True),
    ],
)
def test_refusal_rule(address, asked, refused):
    assert (binding.refusal(address, asked) is not None) == refused


def test_app_served_where_not_asked_shows_a_refusal_and_loads_nothing(monkeypatch):
    monkeypatch.setattr(binding, "check", lambda st: binding.refusal("0.0.0.0", None))
    at = AppTest.from_file(APP, default_timeout=1800).run()
    assert not at.exception
    assert at.error and "was not asked for" in at.error[0].value and "featcal app" in at.error[0].value
    assert not at.selectbox and not at.button  # no zoo picker, no page

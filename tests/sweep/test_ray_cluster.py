"""``tune(..., ray="HOST:PORT")`` / ``featcal tune --ray-address``: the jobs go to an existing Ray
cluster (a local ``ray start --head`` bound to 127.0.0.1 on free ports, with its own auth token,
stopped afterwards by the process ids it started) and give the one-process table. The drivers run
in subprocesses: a Ray driver keeps process-wide state (its config, the token) that would leak into
the other tests' local Ray."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import distrib
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stop(proc: subprocess.Popen, temp: str) -> None:
    """Stop the head: the processes of its session (it started them), then any process still
    naming its own temporary directory; nothing else."""
    import psutil

    mine = [p for p in psutil.process_iter(["pid", "cmdline"]) if temp in " ".join(p.info["cmdline"] or [])]
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    for p in mine:
        try:
            p.kill()
        except psutil.Error:
            pass
    shutil.rmtree(temp, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def ray_head():
    """``(address, env)``: the head's address, and the environment a driver of it needs."""
    pytest.importorskip("ray")
    temp = tempfile.mkdtemp(prefix="fcray", dir="/tmp")  # short: Ray's sockets live under it
    port = distrib.free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), OMP_NUM_THREADS="1")
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # not ~/.ray's token
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [ray_cli, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port)]
    cmd += ["--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp]
    cmd += ["--object-store-memory", str(200 << 20)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the Ray head did not come up (exit code {proc.poll()})")
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", env
    finally:
        _stop(proc, temp)


DRIVER = """
import sys
import pandas as pd
import tiny
from test_tune import _val
from featcal.sweep.search import Grid, tune

base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=2)
data, val = tiny.toy_data(experts, n=16), _val(experts)
grid = Grid(lam=(0.01, 0.5), rho=(2.0,), alpha=(0.0, 0.6))
local = tune(merged, base, experts, data, val, grid=grid, n_confirm=2)
remote = tune(merged, base, experts, data, val, grid=grid, n_confirm=2, ray=sys.argv[1])
cols = [c for c in local.table.columns if c != "seconds"]
pd.testing.assert_frame_equal(local.table[cols], remote.table[cols], check_exact=True)
try:
    tune(merged, base, experts, data, val, grid=grid, n_confirm=2, ray=sys.argv[1], num_cpus=2)
except ValueError as err:
    assert "num_cpus" in str(err)
    print("same table; num_cpus refused")
"""


@pytest.mark.slow
def test_tune_on_an_existing_cluster_gives_the_local_table(ray_head, tmp_path):
    address, env = ray_head
    env = dict(env, PYTHONPATH=env["PYTHONPATH"] + os.pathsep + os.path.join(ROOT, "tests", "sweep"))
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    run = subprocess.run([sys.executable, str(script), address], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "same table; num_cpus refused" in run.stdout, run.stderr[-3000:]


@pytest.mark.slow
def test_cli_tune_ray_address(ray_head, tiny_zoo_dir, tmp_path):
    import json

    address, env = ray_head
    args = [sys.executable, "-m", "featcal", "tune", "--zoo", tiny_zoo_dir, "--n-calib", "8"]
    args += ["--grid", "lam=0.05,0.5;rho=2;alpha=0.3", "--n-confirm", "1", "-q"]
    for name, extra in (("local", []), ("cluster", ["--ray-address", address])):
        run = subprocess.run(
            args + extra + ["--out", str(tmp_path / name)], env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-3000:]
    assert "(Ray)" in run.stdout
    local, cluster = (json.loads((tmp_path / n / "best.json").read_text()) for n in ("local", "cluster"))
    assert local["best"] == cluster["best"]

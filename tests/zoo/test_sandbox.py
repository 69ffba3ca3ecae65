"""The code sandbox (featcal.zoo.score.sandbox): right answers pass, wrong ones fail, and hostile
programs (sockets, writes outside the folder, endless loops, memory and fork bombs, subprocesses)
end with the right status while the machine stays untouched and nothing is left behind.

Each hostile program runs twice where it matters: with the audit hook (the clear ``refused``
status), and without it, to check that the kernel's layers alone (namespaces, Landlock, the
unprivileged user, the limits) stop it too; those checks skip, naming the missing layer, on a
machine that lacks it.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from featcal.zoo.score import sandbox
from featcal.zoo.score.sandbox import Limits, run

QUICK = Limits(timeout_s=10)


@pytest.fixture
def root():
    """A folder for the sandbox's temporary folders that the child's user can enter (pytest's
    tmp_path is private to this user); it must be empty after every run."""
    folder = tempfile.mkdtemp(prefix="featcal-sandbox-test-")
    os.chmod(folder, 0o711)
    yield folder
    left = os.listdir(folder)
    shutil.rmtree(folder)
    assert not left, f"the sandbox left {left} behind"


def _survivors(folder: str) -> list[int]:
    """Processes whose working directory is (or was) under ``folder``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd").startswith(folder):
                found.append(int(pid))
        except OSError:
            pass
    return found


def _needs(layer: str) -> None:
    iso = sandbox.isolation()
    present = {
        "netns": "--net" in iso.namespaces,
        "landlock": iso.landlock > 0,
        "other user": iso.user is not None,
    }
    if not present[layer]:
        pytest.skip(f"this machine's sandbox has no {layer} layer ({iso.describe()})")


def test_a_correct_solution_passes(root):
    code = "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\nprint('checked')\n"
    out = run(code, QUICK, tmp_root=root)
    assert out.passed and out.status == "passed" and "checked" in out.detail


def test_a_wrong_solution_fails_with_its_traceback(root):
    out = run("def add(a, b):\n    return a - b\n\nassert add(2, 3) == 5\n", QUICK, tmp_root=root)
    assert not out.passed and out.status == "failed"
    assert "AssertionError" in out.detail and "<program>" in out.detail


@pytest.mark.parametrize("ending", ["import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_leaving_before_the_tests_does_not_pass(root, ending):
    out = run(f"def f():\n    return 1\n{ending}\nassert f() == 2\n", QUICK, tmp_root=root)
    assert out.status == "failed" and not out.passed


def test_code_that_does_not_compile_is_an_error(root):
    out = run("def f(:\n    pass\n", QUICK, tmp_root=root)
    assert out.status == "error" and "compile" in out.detail


def test_writing_its_own_folder_is_allowed(root):
    code = "import tempfile\nopen('notes.txt', 'w').write('x')\ntempfile.mkstemp()\n"
    code += "assert open('notes.txt').read() == 'x'\n"
    assert run(code, QUICK, tmp_root=root).status == "passed"


@pytest.fixture
def listener():
    """A TCP server on this machine's loopback that counts the connections it gets."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.setblocking(False)
    yield server
    server.close()


def _accepted(server) -> int:
    count = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


@pytest.mark.parametrize("audit", [True, False])
def test_a_socket_reaches_nothing(root, listener, audit):
    if not audit and sandbox.isolation().landlock < 4:
        _needs("netns")  # Landlock stops TCP from its ABI 4 on
    port = listener.getsockname()[1]
    code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
    out = run(code, QUICK, audit=audit, tmp_root=root)
    assert out.status == ("refused" if audit else "failed"), out
    assert _accepted(listener) == 0


def test_udp_needs_the_network_namespace(root):
    """Landlock does not cover UDP: only the network namespace stops a datagram (audit hook off)."""
    _needs("netns")
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.1", 0))
    receiver.setblocking(False)
    port = receiver.getsockname()[1]
    code = f"import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'hi', ('127.0.0.1', {port}))\n"
    out = run(code, QUICK, audit=False, tmp_root=root)
    with pytest.raises(BlockingIOError):
        receiver.recv(16)
    receiver.close()
    assert out.status == "failed" and "unreachable" in out.detail.lower()


@pytest.mark.parametrize("audit", [True, False])
def test_writing_outside_its_folder_is_stopped(root, tmp_path, audit):
    if not audit:
        _needs("landlock")
    targets = [tmp_path / "outside.txt", Path(tempfile.gettempdir()) / f"featcal-sandbox-escape-{os.getpid()}"]
    for target in targets:
        out = run(f"open({str(target)!r}, 'w').write('escaped')\n", QUICK, audit=audit, tmp_root=root)
        assert out.status == ("refused" if audit else "failed"), out
        assert not target.exists()


@pytest.mark.parametrize("audit", [True, False])
def test_a_subprocess_is_stopped(root, tmp_path, audit):
    if not audit:
        _needs("landlock")
    target = Path(tempfile.gettempdir()) / f"featcal-sandbox-touched-{os.getpid()}"
    out = run(f"import subprocess\nsubprocess.run(['touch', {str(target)!r}])\n", QUICK, audit=audit, tmp_root=root)
    assert out.status == ("refused" if audit else "failed"), out
    assert not target.exists()


def test_an_endless_loop_times_out(root):
    out = run("while True:\n    pass\n", Limits(timeout_s=5), tmp_root=root)
    assert out.status == "timeout" and not out.passed
    assert not _survivors(root)


def test_a_memory_bomb_hits_the_memory_limit(root):
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))\n"
    out = run(code, Limits(timeout_s=30, memory_mb=512), tmp_root=root)
    assert out.status == "memory" and not out.passed


FORK_BOMB = """
import os, time
forks = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forks += 1
finally:
    print("forks:", forks)
"""


def test_a_fork_bomb_is_refused(root):
    out = run(FORK_BOMB, QUICK, tmp_root=root)
    assert out.status == "refused" and "os.fork" in out.detail


def test_without_the_audit_hook_a_fork_bomb_stops_at_the_process_limit(root):
    """RLIMIT_NPROC alone: the bomb gets a few processes (the interpreter and the launcher count
    among them), then an error; the sleeping children are killed with the run."""
    out = run(FORK_BOMB, Limits(timeout_s=10, processes=6), audit=False, tmp_root=root)
    assert out.status == "failed", out
    forks = int(out.detail.split("forks:")[1].split()[0])
    assert 0 <= forks <= 6
    assert "Resource temporarily unavailable" in out.detail
    assert not _survivors(root)


def test_other_refusals(root):
    for code, event in [
        ("import os\nos.system('true')\n", "os.system"),
        ("import os\nos.kill(1, 0)\n", "os.kill"),
        ("import os\nos.remove('/etc/hostname')\n", "os.remove"),
        ("import resource\nresource.setrlimit(resource.RLIMIT_CPU, (100, 100))\n", "resource.setrlimit"),
    ]:
        out = run(code, QUICK, tmp_root=root)
        assert out.status == "refused" and event in out.detail, (code, out)


def test_ctypes_cannot_be_imported(root):
    out = run("try:\n    import ctypes\nexcept ImportError:\n    print('no ctypes')\n", QUICK, tmp_root=root)
    assert out.status == "passed" and "no ctypes" in out.detail
    out = run("import ctypes\nctypes.CDLL(None).getpid()\n", QUICK, tmp_root=root)
    assert out.status == "failed" and "not available" in out.detail


def test_missing_modules_are_named():
    assert sandbox.missing_modules(("json", "featcal_no_such_module")) == ("featcal_no_such_module",)


def test_output_is_capped(root):
    out = run("import sys\nfor _ in range(10**6):\n    sys.stdout.write('x' * 100)\n", Limits(file_mb=1), tmp_root=root)
    assert out.status == "failed" and len(out.detail) <= Limits().detail_chars


def test_nothing_is_left_in_the_system_temporary_folder():
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("featcal-sandbox-*"))
    assert run("open('x', 'w').write('y')\n", QUICK).status == "passed"
    assert set(tmp.glob("featcal-sandbox-*")) <= before


def test_bad_limits_and_folders_are_refused_before_running(tmp_path):
    with pytest.raises(ValueError, match="timeout_s"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=8)
    with pytest.raises(TypeError, match="str"):
        run(b"print(1)")
    if sandbox.isolation().user is not None:
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        with pytest.raises(ValueError, match="cannot enter"):
            run("pass\n", tmp_root=str(private))

"""Run untrusted generated Python (a model's reply plus a task's tests) in a confined child process.

featcal never runs a reply with ``exec`` in its own process: :func:`run` makes an empty folder,
starts a fresh interpreter there and reads back an :class:`Outcome`. The layers, and what each one stops
(:func:`isolation` says which of the optional ones this machine has):

1. **Namespaces** (``unshare``, where the kernel lets this user make them): a new *network*
   namespace with no interface up, so no socket reaches another machine or a service on this one,
   even from native code; a new *pid* namespace whose first process is the interpreter, so every
   process the code starts dies with it (one that left the process group included).
2. **Landlock** (Linux >= 5.13 with the Landlock LSM on; kernel-enforced, unprivileged, for the
   process and all its children): files are created, written, truncated, renamed or removed only
   beneath the folder (and ``/dev/null``); no program can be executed at all; from Landlock ABI 4 no
   TCP bind or connect; from ABI 6 no signal to a process outside the sandbox.
3. **An unprivileged user.** Run as root, the child drops to ``nobody``: the kernel ignores
   ``RLIMIT_NPROC`` for root (even inside a user namespace), and ``nobody`` cannot write root's
   files. When ``nobody`` cannot run this interpreter (one under ``/root``), the system's ``python3``
   runs the code instead; :func:`missing_modules` tells what it lacks.
4. **Resource limits** (``setrlimit`` in the child, before the code is compiled): address space,
   CPU seconds, the size of any file written (the captured output included), processes and threads
   (a fork bomb stops at a few), open files, no core dumps. A wall-clock timeout kills the whole
   process group whatever the code does.
5. **A fresh folder and environment**: an empty temporary folder as cwd, ``HOME`` and ``TMPDIR``,
   removed afterwards; an empty environment but a minimal ``PATH`` (and one thread for BLAS
   libraries); the interpreter isolated (``-I -S -B``: no user site, no ``PYTHON*`` variables, no
   .pyc written, and no site-packages unless ``site_packages=True``: tests that import numpy).
6. **An audit hook** (``sys.addaudithook``, installed after compiling, before the code runs) refuses
   sockets, starting or signalling processes (``subprocess``, ``os.system``, ``os.exec*``,
   ``os.fork``, ``os.spawn*``, ``os.kill``), ``resource.setrlimit``, and writing, creating,
   removing, renaming or changing files outside the folder. A refusal ends the process at once
   (``os._exit``), so the code cannot catch it, with the clear ``refused`` status. Importing
   ``ctypes`` fails with an ImportError instead (numpy tries it and goes on without).

What it does **not** guarantee:

- The audit hook is not a security boundary: it sees only what CPython reports, and native code
  (an extension module, memory corruption through crafted bytecode) passes beside it. Against native
  code only layers 1-4 hold, and only those this machine has: where neither namespaces nor Landlock
  apply, native code run by an ordinary user may write that user's files and open sockets, and
  without a pid namespace a process that leaves its process group (``setsid``) may outlive the run.
- Reading is allowed (the interpreter reads its standard library): the code may read whatever the
  child's user may read. UDP is stopped by the network namespace only.
- Disk use is capped per file (``RLIMIT_FSIZE``), not in total; memory per process, so at most
  ``processes`` times ``memory_mb`` in all.
- A *pass* means the program ran to its end without an exception (an early ``sys.exit(0)`` or
  ``os._exit(0)`` does not pass), but code that looks for the run's token in the interpreter's
  memory could fake one: confinement makes a hostile program harmless, not its verdict trustworthy.
"""

from __future__ import annotations

import functools
import inspect
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from featcal.zoo.score import sandbox_child as child
from featcal.zoo.score.sandbox_child import EXIT_CPU, EXIT_MEMORY, EXIT_REFUSED, EXIT_SETUP, EXIT_SYNTAX, MARK

STATUSES = ("passed", "failed", "timeout", "memory", "refused", "error")
NAMESPACES = (  # the first that runs here wins (probed once per process)
    ("unshare", "--user", "--map-current-user", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--user", "--map-root-user", "--net", "--pid", "--fork", "--kill-child"),
    ("unshare", "--user", "--map-root-user", "--net"),
    (),
)
PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass(frozen=True)
class Outcome:
    """What became of one program: ``passed`` only when it ran to its end; ``status`` one of
    :data:`STATUSES`; ``detail`` the end of its output or why it stopped (a few lines)."""

    passed: bool
    status: str
    detail: str


@dataclass(frozen=True)
class Limits:
    """The child's limits (see the module docstring for who enforces each)."""

    timeout_s: float = 10.0  # wall clock from start to end; the process group is killed after it
    cpu_s: int | None = None  # CPU seconds (RLIMIT_CPU); None: the timeout rounded up
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    file_mb: int = 16  # largest file the child may write, its captured output included (RLIMIT_FSIZE)
    processes: int = 8  # processes and threads (RLIMIT_NPROC), the launcher and the interpreter among them
    open_files: int = 64  # file descriptors per process (RLIMIT_NOFILE)
    detail_chars: int = 2000  # how much of the output's end Outcome.detail keeps

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "file_mb", "processes", "open_files", "detail_chars"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox Limits.{name} must be positive, got {getattr(self, name)!r}.")
        if self.cpu_s is not None and self.cpu_s < 1:
            raise ValueError(f"sandbox Limits.cpu_s must be at least 1 second (or None), got {self.cpu_s!r}.")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox Limits.memory_mb={self.memory_mb} is too small for an interpreter; use >= 64.")


@dataclass(frozen=True)
class Isolation:
    """How this machine confines a child: the interpreter, the user it runs as (None: this one),
    the ``unshare`` prefix (empty where no namespace could be made) and the Landlock ABI."""

    interpreter: str
    user: tuple[int, int] | None
    namespaces: tuple[str, ...]
    landlock: int  # the kernel's Landlock ABI, 0: none

    def describe(self) -> str:
        net = "--net" in self.namespaces
        pid = "--pid" in self.namespaces
        who = f"uid {self.user[0]}" if self.user else f"this user (uid {os.geteuid()})"
        return (
            f"interpreter {self.interpreter}; runs as {who}; network namespace: {'yes' if net else 'NO'}; "
            f"pid namespace: {'yes' if pid else 'no'}; Landlock: {f'ABI {self.landlock}' if self.landlock else 'NO'}; "
            "rlimits and audit hook: yes"
        )


def _child_source(call: str = "main()") -> str:
    """What the child runs: :mod:`featcal.zoo.score.sandbox_child`'s source, then ``call``."""
    return inspect.getsource(child) + f"\n{call}\n"


# ----------------------------------------------------------------------------- this machine


def _launch(argv: list[str], user, cwd: str, **kwargs) -> subprocess.Popen:
    """Start ``argv`` in a new session (its own process group), as ``user`` when given."""
    extra = {"user": user[0], "group": user[1], "extra_groups": []} if user else {}
    env = {"PATH": PATH, "HOME": cwd, "TMPDIR": cwd, "LC_ALL": "C.UTF-8"}
    env |= {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    return subprocess.Popen(argv, cwd=cwd, env=env, start_new_session=True, close_fds=True, **extra, **kwargs)


def _probe(argv: list[str], user) -> str | None:
    """What ``argv`` prints when it succeeds (run as the child would be), None when it fails."""
    with tempfile.TemporaryDirectory(prefix="featcal-sandbox-probe-") as d:
        if user:
            os.chown(d, *user)
        try:
            proc = _launch(argv, user, d, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            out, _ = proc.communicate(timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.decode(errors="replace").strip() if proc.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def isolation() -> Isolation:
    """Find, once per process, how this machine can confine a child: drop to ``nobody`` when root;
    the first interpreter that user can run (this one, else the system's ``python3``); the first
    ``unshare`` prefix of :data:`NAMESPACES` that works; the Landlock ABI. Raises RuntimeError when
    no interpreter runs the child's code."""
    user = None
    if os.geteuid() == 0:
        try:
            entry = pwd.getpwnam("nobody")
            user = (entry.pw_uid, entry.pw_gid)
        except KeyError:
            user = (65534, 65534)
    check = ["-I", "-S", "-B", "-c", _child_source("print('ok')")]
    candidates = [sys.executable, shutil.which("python3", path=PATH)]
    interpreter = next((p for p in candidates if p and _probe([p, *check], user) == "ok"), None)
    if interpreter is None:
        who = f"uid {user[0]} (as root, the code runs as nobody)" if user else "this user"
        raise RuntimeError(
            f"the code sandbox found no Python >= 3.9 interpreter that {who} can run: tried {candidates}. "
            "Install python3 where every user can read it (e.g. /usr/bin/python3)."
        )
    prefix = next(p for p in NAMESPACES if not p or _probe([*p, interpreter, *check], user) == "ok")
    abi = _probe([*prefix, interpreter, "-I", "-S", "-B", "-c", _child_source("print(landlock_abi())")], user)
    return Isolation(interpreter, user, prefix, int(abi) if abi and abi.isdigit() else 0)


@functools.lru_cache(maxsize=64)
def missing_modules(names: tuple[str, ...], site_packages: bool = True) -> tuple[str, ...]:
    """Those of the top-level modules ``names`` that the sandbox's interpreter cannot find (as the
    child's user, with or without its site-packages): check them before scoring, so that tests
    importing numpy fail loudly up front rather than every reply failing its import."""
    iso = isolation()
    look = "import importlib.util as u\nprint(' '.join(n for n in %r if u.find_spec(n) is None) or '-')" % (names,)
    flags = ["-I", "-B"] if site_packages else ["-I", "-S", "-B"]
    out = _probe([*iso.namespaces, iso.interpreter, *flags, "-c", look], iso.user)
    if out is None:
        raise RuntimeError(f"the code sandbox's interpreter {iso.interpreter} could not look up modules {names}.")
    return tuple(n for n in out.split() if n != "-")


def _reachable(folder: str, user) -> None:
    """Raise ValueError when ``user`` could not enter ``folder`` (each parent needs o+x)."""
    if not user:
        return
    path = os.path.realpath(folder)
    while True:
        st = os.stat(path)
        if not (st.st_mode & stat.S_IXOTH or (st.st_uid == user[0] and st.st_mode & stat.S_IXUSR)):
            raise ValueError(
                f"the code sandbox runs as uid {user[0]}, which cannot enter {path} (not searchable by others); "
                "pass tmp_root= a folder every user can enter, such as /tmp."
            )
        if path == os.path.dirname(path):
            return
        path = os.path.dirname(path)


def _process_count(uid: int) -> int:
    """How many processes ``uid`` runs now (RLIMIT_NPROC counts them all, not only the child's)."""
    count = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                pass
    return count


def _remove(folder: str) -> None:
    """Remove the child's folder, even where it took away its own permissions."""

    def grant(func, path, _exc):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        func(path)

    shutil.rmtree(folder, onerror=grant)


# ----------------------------------------------------------------------------- running a program


def run(
    code: str,
    limits: Limits = Limits(),
    *,
    site_packages: bool = False,
    audit: bool = True,
    tmp_root: str | None = None,
) -> Outcome:
    """Run the program ``code`` (a reply plus its tests, asserts failing on a wrong answer) in a fresh
    confined interpreter and say how it ended. ``site_packages`` makes the interpreter's installed
    packages importable (see :func:`missing_modules`); ``audit=False`` leaves out the audit hook
    (layer 6), to check what the other layers stop alone; ``tmp_root`` is where the temporary folder
    goes (default: the system's). Nothing is left behind: the folder is removed, the processes killed."""
    if not isinstance(code, str):
        raise TypeError(f"the sandbox runs Python source given as str, got {type(code).__name__}.")
    iso = isolation()
    tmp_root = tmp_root or tempfile.gettempdir()
    _reachable(tmp_root, iso.user)
    uid = iso.user[0] if iso.user else os.getuid()
    cpu = limits.cpu_s or max(1, int(-(-limits.timeout_s // 1)))
    mb = 1 << 20
    numbers = [limits.memory_mb * mb, cpu, limits.file_mb * mb, limits.processes + _process_count(uid)]
    numbers += [limits.open_files, int(audit), iso.landlock]
    flags = ["-I", "-B"] if site_packages else ["-I", "-S", "-B"]
    argv = [*iso.namespaces, iso.interpreter, *flags, "-c", _child_source(), *map(str, numbers)]
    token = secrets.token_hex(16)
    folder = tempfile.mkdtemp(prefix="featcal-sandbox-", dir=tmp_root)
    try:
        if iso.user:
            os.chown(folder, *iso.user)
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as output:
            stdin.write(token.encode() + b"\n" + code.encode("utf-8", errors="surrogatepass"))
            stdin.seek(0)
            proc = _launch(argv, iso.user, folder, stdin=stdin, stdout=output, stderr=subprocess.STDOUT)
            timed_out = _wait(proc, limits.timeout_s)
            tail = _tail(output, limits.detail_chars * 4)
    finally:
        _remove(folder)
    return _verdict(proc.returncode, timed_out, tail, token, limits)


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``proc``; kill its whole process group after ``timeout_s`` and in any case once it
    ended (children it left behind). True when the timeout struck."""
    try:
        proc.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    _until_gone(proc.pid)
    return timed_out


def _until_gone(group: int, patience_s: float = 30.0) -> None:
    """Wait (at most ``patience_s``) until no process of the killed group is left: a killed child takes
    a moment to be torn down and reaped, longer on a loaded machine, and the caller then removes its folder."""
    end = time.monotonic() + patience_s
    while time.monotonic() < end:
        try:
            os.killpg(group, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)


def _tail(output, size: int) -> str:
    output.seek(0, os.SEEK_END)
    output.seek(max(0, output.tell() - size))
    return output.read().decode("utf-8", errors="replace")


def _signal_name(rc: int) -> str | None:
    """The signal that ended the child: a negative code, or 128 + n as ``unshare`` reports it."""
    number = -rc if rc < 0 else rc - 128 if 128 < rc < 128 + 65 else None
    if number is None:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _verdict(rc: int, timed_out: bool, tail: str, token: str, limits: Limits) -> Outcome:
    """The :class:`Outcome` from the child's exit code and the end of its output."""
    finished = tail.rstrip().endswith(token)
    text = tail.replace(token, "").strip()[-limits.detail_chars :]
    if timed_out:
        return Outcome(False, "timeout", f"still running after {limits.timeout_s:g} s (killed). {text}".strip())
    if rc == 0:
        if finished:
            return Outcome(True, "passed", text)
        return Outcome(False, "failed", f"the program ended before its tests did (os._exit?). {text}".strip())
    if rc == EXIT_REFUSED and MARK + " refused" in tail:
        return Outcome(False, "refused", text)
    if rc == EXIT_MEMORY and MARK + " MemoryError" in tail:
        return Outcome(False, "memory", f"over the {limits.memory_mb} MB memory limit. {text}".strip())
    if rc == EXIT_CPU:
        return Outcome(False, "timeout", f"over the CPU-time limit. {text}".strip())
    if rc in (EXIT_SYNTAX, EXIT_SETUP) and MARK in tail:
        return Outcome(False, "error", text)
    name = _signal_name(rc)
    if name:
        return Outcome(False, "error", f"killed by {name}. {text}".strip())
    return Outcome(False, "failed", text)

"""The code that runs inside the sandbox's interpreter, never in featcal's process.

:func:`featcal.zoo.score.sandbox.run` sends this file's source to a fresh ``python -I -S -B -c``
(followed by ``main()``), so it imports nothing but the standard library. :func:`main` reads the
run's token and the program from stdin, sets the limits, applies Landlock where the kernel has it,
compiles the program, installs the audit hook, runs the program and reports how it ended through
its exit code (the ``EXIT_*`` numbers below, read back by the parent) and, on success, the token.
"""

from __future__ import annotations

import os
import signal
import struct
import sys
import traceback

MARK = "featcal-sandbox:"  # the prefix of the child's own messages
EXIT_FAILED, EXIT_REFUSED, EXIT_MEMORY, EXIT_CPU, EXIT_SYNTAX, EXIT_SETUP = 1, 73, 74, 75, 76, 77
# Landlock's system calls (one number on every architecture) and access rights (linux/landlock.h)
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
FS_EXECUTE, FS_WRITE_FILE = 1 << 0, 1 << 1
FS_CHANGES = FS_WRITE_FILE | sum(1 << bit for bit in range(4, 13))  # remove_dir ... make_sym
FS_REFER, FS_TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
NET_TCP = 1 | 2  # bind, connect (ABI 4)
SCOPE_ALL = 1 | 2  # abstract unix sockets, signals (ABI 6)
PR_SET_NO_NEW_PRIVS = 38


def set_limits(memory: int, cpu: int, fsize: int, nproc: int, nofile: int) -> None:
    """Lower this process's limits (never above a hard limit already set); SIGXCPU ends it."""
    import resource  # POSIX only: imported here so that featcal can import this module anywhere

    def lower(which, value):
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))

    for which, value in (
        (resource.RLIMIT_AS, memory),
        (resource.RLIMIT_FSIZE, fsize),
        (resource.RLIMIT_NPROC, nproc),
        (resource.RLIMIT_NOFILE, nofile),
        (resource.RLIMIT_CORE, 0),
    ):
        lower(which, value)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1 if hard == resource.RLIM_INFINITY else min(cpu + 1, hard)))
    # as a pid namespace's first process the child would ignore SIGXCPU without a handler
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(EXIT_CPU))


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where Landlock is missing or off."""
    import ctypes

    abi = ctypes.CDLL(None, use_errno=True).syscall(SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    return max(abi, 0)


def apply_landlock(workdir: str, abi: int) -> None:
    """Restrict this process and its future children for good: write, create, remove and truncate
    files only beneath ``workdir`` (and write ``/dev/null``), execute no program; from ABI 4 no TCP
    bind or connect; from ABI 6 no signal or abstract unix socket beyond the sandbox."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    changes = FS_CHANGES | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0)
    fields = [changes | FS_EXECUTE] + ([NET_TCP] if abi >= 4 else []) + ([SCOPE_ALL] if abi >= 6 else [])
    attr = struct.pack(f"={len(fields)}Q", *fields)  # struct landlock_ruleset_attr
    ruleset = libc.syscall(SYS_CREATE_RULESET, ctypes.c_char_p(attr), ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    for path, access in ((workdir, changes), (os.devnull, FS_WRITE_FILE)):
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = struct.pack("=Qi", access, fd)  # struct landlock_path_beneath_attr (packed)
        added = libc.syscall(SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(1), ctypes.c_char_p(rule), 0)
        os.close(fd)
        if added != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule({path})")
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    if libc.syscall(SYS_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    os.close(ruleset)


BLOCKED = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen"}
BLOCKED |= {"os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit"}
BLOCKED_PREFIXES = ("socket.", "ctypes.")
BLOCKED_IMPORTS = {"_posixsubprocess"}  # the module behind subprocess: importing it ends the program
UNAVAILABLE_IMPORTS = {"_ctypes"}  # behind ctypes: its import fails (numpy and others try it and go on)
# audit events that change the file system: (indices of their paths, indices of their dir_fd arguments)
CHANGES = {"os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.mkdir": ((0,), (2,))}
CHANGES |= {"os.rename": ((0, 1), (2, 3)), "os.link": ((0, 1), (2, 3)), "os.symlink": ((0, 1), (2,))}
CHANGES |= {"os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,))}
CHANGES |= {"os.truncate": ((0,), ()), "os.mkfifo": ((0,), (2,)), "os.mknod": ((0,), (3,))}
CHANGES |= {"os.setxattr": ((0,), ()), "os.removexattr": ((0,), ())}
WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def audit_hook(workdir: str):
    """The hook that ends the process (uncatchable ``os._exit``) on any audited event reaching
    beyond ``workdir``: the blocked events, and file changes or writes outside it. Importing
    ``ctypes`` fails with an ImportError instead (libraries such as numpy try it and go on)."""

    def inside(path) -> bool:
        if isinstance(path, int):
            return False  # a descriptor: where it points is unknown here
        real = os.path.realpath(os.fsdecode(os.fspath(path)))
        return real == workdir or real.startswith(workdir + os.sep)

    def refuse(event, args):
        os.write(2, f"\n{MARK} refused {event}{tuple(args)!r}"[:400].encode(errors="replace") + b"\n")
        os._exit(EXIT_REFUSED)

    def hook(event, args):
        if event in BLOCKED or event.startswith(BLOCKED_PREFIXES):
            refuse(event, args[:2])
        elif event == "import" and args[0] in BLOCKED_IMPORTS:
            refuse(event, args[:1])
        elif event == "import" and args[0] in UNAVAILABLE_IMPORTS:
            raise ImportError(f"{args[0]} is not available in featcal's code sandbox")
        elif event == "open":
            path, mode, flags = args
            if isinstance(path, int):
                return  # wraps a descriptor already open
            # os.open (mode None) may be relative to a dir_fd the event does not show: only inside
            writes = mode is None or any(c in mode for c in "wax+") or (flags or 0) & WRITING
            if writes and path != os.devnull and not inside(path):
                refuse(event, args)
        elif event in CHANGES:
            paths, dir_fds = CHANGES[event]
            if any(args[i] not in (None, -1) for i in dir_fds) or not all(inside(args[i]) for i in paths):
                refuse(event, args)

    return hook


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, MemoryError):
            pass  # output over the file-size limit, or a stream the program closed


def _say(message: str, code: int) -> None:
    """End the process with ``code`` after the program's output and one line of ours."""
    _flush()
    os.write(2, f"\n{MARK} {message}\n".encode(errors="replace"))
    os._exit(code)


def main() -> None:
    """Run the program on stdin (after the token's line) confined by the limits in ``sys.argv``."""
    data = sys.stdin.buffer.read()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the program cannot read its token back
    token, _, source = data.partition(b"\n")
    memory, cpu, fsize, nproc, nofile, audit, landlock = map(int, sys.argv[1:8])
    set_limits(memory, cpu, fsize, nproc, nofile)
    workdir = os.path.realpath(os.getcwd())
    if landlock:
        try:
            apply_landlock(workdir, landlock)
        except OSError as exc:
            _say(f"could not apply Landlock: {exc!r}", EXIT_SETUP)
        for name in [m for m in sys.modules if m.partition(".")[0] in ("ctypes", "_ctypes")]:
            del sys.modules[name]  # so that the program's own import of ctypes meets the audit hook
    try:
        code = compile(source, "<program>", "exec")
    except (SyntaxError, ValueError) as exc:
        _say(f"the program does not compile: {exc!r}", EXIT_SYNTAX)
    if audit:
        sys.addaudithook(audit_hook(workdir))
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
        sys.stdout.flush()
    except MemoryError:
        _say("MemoryError", EXIT_MEMORY)
    except SystemExit as exc:
        _say(f"the program called sys.exit({exc.code!r}) before its end", EXIT_FAILED)
    except BaseException as exc:
        _flush()
        traceback.print_exception(exc.with_traceback(exc.__traceback__.tb_next))  # from the program's frame on
        _flush()
        os._exit(EXIT_FAILED)
    _flush()
    os.write(1, b"\n" + token + b"\n")
    os._exit(0)

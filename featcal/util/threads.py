"""How many torch CPU threads a long run should use, chosen from the model and the machine.

Torch's default is one thread per core. That is right for a big model on an idle machine
and badly wrong for a small model or a busy machine: the threads of a small matrix product
spend their time waiting for each other, and a thread whose core is taken by another
process stalls every other thread at each synchronisation (benchmarks/README.md, 'Threads', has
the measurements behind the rule).

:func:`choose_threads` is the rule, a pure function; :func:`default_threads` applies it to
a model and this machine; ``$FEATCAL_THREADS`` overrides both.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from torch import nn

SMALL_MODEL = 20_000_000  # parameters: below this, one thread is fastest (ops too small to split)
ENV = "FEATCAL_THREADS"
_IMPORTED = time.monotonic()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, else the core count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average (0 where the system does not report one)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


LOAD_WINDOW = 60.0  # seconds: the load average's (1-minute) window


def own_load(cpu_seconds: float, age: float, window: float = LOAD_WINDOW) -> float:
    """This process's part of the load average, roughly: its CPU seconds (every thread's) over
    the window, or over its whole life when it is older than the window (a single reading
    cannot tell when in its life it worked). Without it, a process choosing threads after
    work of its own (loading models, a previous run) would count itself as another's load."""
    return max(0.0, cpu_seconds) / max(age, window)


def process_age() -> float:
    """Seconds since this process started (Linux's /proc; elsewhere since this module was imported)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


def others_load() -> float:
    """The 1-minute load average less this process's own part (:func:`own_load`), at least 0."""
    return max(0.0, load_average() - own_load(time.process_time(), process_age()))


def free_cores(cores: int, load: float) -> int:
    """Cores not taken by other work: ``cores - load``, rounded to the nearest, at least 1."""
    return max(1, min(cores, int(cores - load + 0.5)))


def choose_threads(params: int | None, cores: int, load: float, small: int = SMALL_MODEL) -> int:
    """Threads for a model of ``params`` parameters (None: unknown) on ``cores`` cores under
    ``load``: 1 for a model below ``small`` parameters, else the free cores (:func:`free_cores`),
    so a busy machine is not oversubscribed."""
    if params is not None and params < small:
        return 1
    return free_cores(cores, load)


def default_threads(model: nn.Module | None = None, device: str = "cpu") -> int:
    """Torch CPU threads for long work on ``model`` (``$FEATCAL_THREADS`` when set); on a GPU
    ``device`` the CPU only feeds it, so one thread."""
    env = os.environ.get(ENV, "").strip()
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"${ENV}={env!r} is not a whole number of threads; unset it or give e.g. 1.") from None
    if not str(device).startswith("cpu"):
        return 1
    params = None if model is None else sum(p.numel() for p in model.parameters())
    return choose_threads(params, usable_cores(), others_load())

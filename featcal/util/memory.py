"""The process's memory: handing freed heap back to the OS, and reading the peak.

Why :func:`trim_heap` is needed: once glibc frees a block it had mapped on its own (over
``M_MMAP_THRESHOLD``), it raises that threshold (up to 32 MB on 64-bit). From then on
tensors of a few MB (an LLM's per-module statistics) come from the heap, and freeing them
does not shrink the process unless they sat at the heap's top. ``malloc_trim(0)`` returns
every free page of every arena. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import resource
import sys
from pathlib import Path


def trim_heap() -> bool:
    """Hand freed heap pages back to the OS (glibc's ``malloc_trim(0)``). Returns whether
    glibc was there to ask (not whether any memory was returned)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (any POSIX system). On Linux it is the
    ``VmHWM`` of ``/proc/self/status``: ``getrusage``'s ``ru_maxrss`` survives ``exec``, so in a
    process started by a large one (a test runner, a notebook) it reports the parent's size."""
    own = vmhwm_mb(os.getpid())
    if own is not None:
        return own
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return peak / (2**20 if sys.platform == "darwin" else 1024)


def vmhwm_mb(pid: int) -> float | None:
    """Peak resident memory (``VmHWM``) of another process in MB (:func:`peak_rss_mb` is this
    one's), or None where ``/proc`` does not tell (not Linux, or the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    return next((float(line.split()[1]) / 1024 for line in text.splitlines() if line.startswith("VmHWM:")), None)


def rss_mb(pid: int | None = None) -> float | None:
    """Resident memory of process ``pid`` (default: this one) in MB, or None where ``/proc``
    does not tell (``statm``: cheap enough to sample every millisecond)."""
    try:
        text = Path(f"/proc/{'self' if pid is None else pid}/statm").read_text()
        return int(text.split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


class PeakMemory:
    """``with PeakMemory() as peak: ...``: the most memory the block took above what was in use
    when it began, in MB: ``peak.mb`` (this process's resident memory, sampled every
    ``interval`` seconds by a thread, freed heap handed back first so that reusing it counts;
    NaN where ``/proc`` does not tell) and ``peak.gpu_mb`` (CUDA's allocator peak above its
    start, when CUDA is in use; None otherwise). Both are read when the block ends."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.mb = float("nan")
        self.gpu_mb: float | None = None

    def __enter__(self) -> "PeakMemory":
        import threading

        import torch

        trim_heap()
        self._cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        if self._cuda:
            torch.cuda.reset_peak_memory_stats()
            self._gpu_start = torch.cuda.memory_allocated()
        self._start = rss_mb()
        self._peak = self._start or 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            self._peak = max(self._peak, rss_mb() or 0.0)

    def __exit__(self, *exc) -> None:
        import torch

        self._stop.set()
        self._thread.join()
        if self._start is not None:
            self.mb = max(self._peak, rss_mb() or 0.0) - self._start
        if self._cuda:
            self.gpu_mb = (torch.cuda.max_memory_allocated() - self._gpu_start) / 2**20

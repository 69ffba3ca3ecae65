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
    """This process's peak resident memory so far, in MB (any POSIX system)."""
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

"""featcal.util.memory: the heap handed back to the OS, and the peak read from /proc."""

import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

from featcal.util import memory

GLIBC = sys.platform.startswith("linux") and (ctypes.util.find_library("c") or "").startswith("libc.so")


def test_this_processs_memory_is_read_and_a_gone_process_gives_none():
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc here")
    rss, peak = memory.rss_mb(), memory.vmhwm_mb(os.getpid())
    assert 10 < rss <= peak, (rss, peak)
    assert abs(memory.rss_mb(os.getpid()) - rss) < 0.05 * rss
    assert abs(memory.peak_rss_mb() - memory.vmhwm_mb(os.getpid())) < 0.05 * peak  # getrusage's account of the same
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert memory.vmhwm_mb(child.pid) is None and memory.rss_mb(child.pid) is None


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_freed_tensors_stay_resident_until_the_heap_is_trimmed():
    """The app's case: after one big tensor is freed, glibc serves tensors of a few MB from the
    heap, and freeing most of them leaves the process as large; trim_heap returns them. Run in
    a fresh interpreter, so that no earlier test's heap is in the way."""
    code = textwrap.dedent(
        """
        import torch
        from featcal.util import memory
        big = torch.ones(16 << 20, dtype=torch.uint8); del big   # raises glibc's mmap threshold to 16 MB
        parts = [torch.ones(4 << 20, dtype=torch.uint8) for _ in range(100)]   # 400 MB from the heap
        last = parts[-1]
        del parts   # all freed but the last, which pins the heap's top
        before = memory.rss_mb()
        assert memory.trim_heap()
        print(before, memory.rss_mb())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800, check=True)
    before, after = map(float, out.stdout.split())
    assert before - after > 200, (before, after)  # of the 396 MB freed


def test_peak_memory_is_what_the_block_took_above_its_start():
    import torch

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc here")
    with memory.PeakMemory() as peak:
        x = torch.ones(25_000_000)  # 100 MB, resident when the block ends (read then, no race)
    assert 90 <= peak.mb < 1000, peak.mb
    assert peak.gpu_mb is None or peak.gpu_mb >= 0
    del x
    with memory.PeakMemory() as quiet:
        pass
    assert quiet.mb < 50  # nothing allocated (another thread of this process could, hence the margin)


def test_a_child_process_peak_is_its_own_not_its_large_parents(tmp_path):
    """getrusage's ru_maxrss survives exec: a process a large one starts reports the parent's size
    there. peak_rss_mb reads the child's own high-water mark (CI once saw 3.3 GB for a small run)."""
    import torch

    big = torch.ones(300 * 2**20 // 4)  # 300 MB resident in this process
    big.add_(1)
    code = "from featcal.util.memory import peak_rss_mb; print(peak_rss_mb())"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert float(out.stdout) < 250, out.stdout  # a bare interpreter and featcal's import: tens of MB
    del big

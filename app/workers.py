"""Where the app's torch work runs: the locks on shared models, the CPU threads, one worker thread.

Torch work on shared models runs under one process-wide lock (hooks on a shared expert
must not interleave between tabs); previews are written into a scratch model under a
lock of their own. The work a slider change triggers runs in pairs on two cores: the
exact calibration or the held-out diagnostics on the worker thread (:func:`submit`),
the scores on the script's thread; what prepares the next preview runs in the background
(:func:`in_background`). :mod:`app.state` decides what runs where.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterator

import streamlit as st
import torch

# Torch CPU threads per (zoo source, alone), set when :mod:`app.state` loads a zoo
# (:func:`app.zoos.cpu_threads`); read by every :func:`torch_lock`.
THREADS: dict[tuple[str, bool], int] = {}


@st.cache_resource(show_spinner=False)
def model_lock() -> threading.RLock:
    """The lock every hook-setting or shared-model computation takes (shared by all tabs)."""
    return threading.RLock()


@st.cache_resource(show_spinner=False)
def scratch_lock() -> threading.RLock:
    """The lock of the scratch models that previews are written into."""
    return threading.RLock()


def _set_threads(source: str | None, alone: bool = False) -> None:
    if source is None:
        try:
            source = st.session_state.get("_zoo_source")
        except Exception:  # a worker thread has no session
            source = None
    threads = THREADS.get((source or "", alone)) or (min(THREADS.values()) if THREADS else None)
    if threads:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def torch_lock(source: str | None = None, lock=None, alone: bool = False) -> Iterator[None]:
    """Run torch work on the shared models: one at a time (``lock``, by default
    :func:`model_lock`; a ``nullcontext`` for none), without autograd, with the zoo's CPU
    thread count (set on every call: it is per thread; ``alone``: for work that has the
    machine to itself, :func:`app.zoos.cpu_threads`)."""
    with lock or model_lock(), torch.no_grad():
        _set_threads(source, alone)
        yield


@st.cache_resource(show_spinner=False)
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="featcal-exact")


def submit(fn, *args) -> Future:
    """Run ``fn(*args)`` on the app's one worker thread (shared by all tabs, so jobs queue)."""
    return _pool().submit(fn, *args)


@st.cache_resource(show_spinner=False)
def _idle_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="featcal-prepare")


def in_background(fn, *args) -> Future:
    """Run ``fn(*args)`` on a thread of its own, for work nobody waits for yet (what makes the
    next preview quick, the look-ahead of :mod:`app.ahead`), so that it never queues in front
    of the worker's exact runs (the look-ahead may hold the model lock for one of its steps)."""
    return _idle_pool().submit(fn, *args)


def done_within(job: Future, seconds: float) -> bool:
    """Whether ``job`` finishes within ``seconds`` (waits at most that long)."""
    wait([job], timeout=seconds)
    return job.done()

"""Library warnings in the app: collected for the sidebar's expander, not printed raw between
the server's log lines. One hook for the server process (``warnings.showwarning``), installed
once; thread-safe (the worker thread warns too). Each distinct message is kept once, counted."""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict

_LOCK = threading.Lock()
_SEEN: OrderedDict[str, int] = OrderedDict()  # "Category: message" -> times seen
KEEP = 200
log = logging.getLogger("featcal.app")


def _record(message, category, filename, lineno, file=None, line=None) -> None:
    text = f"{category.__name__}: {message}"
    with _LOCK:
        first = text not in _SEEN
        _SEEN[text] = _SEEN.get(text, 0) + 1
        _SEEN.move_to_end(text)
        while len(_SEEN) > KEEP:
            _SEEN.popitem(last=False)
    if first:  # one short line in the server's log, the rest on the page
        log.info("library warning (listed in the app's sidebar): %s", text[:200])


def install() -> None:
    """Route every warning of this process to the collection (idempotent)."""
    if warnings.showwarning is not _record:
        warnings.showwarning = _record


def recent() -> list[tuple[str, int]]:
    """``[(warning, times seen)]``, the most recent last."""
    with _LOCK:
        return list(_SEEN.items())

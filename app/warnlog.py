"""Library warnings in the app: collected for the sidebar's badge (:func:`app.ui.library_warnings`),
not printed raw between the server's log lines. One hook for the server process
(``warnings.showwarning``), installed once; thread-safe (the worker threads warn too). Each
distinct message is kept once, counted."""

from __future__ import annotations

import logging
import threading
import warnings
from collections import OrderedDict

KEEP = 200
log = logging.getLogger("featcal.app")


class WarningLog:
    """The warnings of this process, once :meth:`install` routed them here (the server's one
    is :attr:`app.calibrations.Calibrations.warnings`)."""

    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self._lock = threading.Lock()
        self._seen: OrderedDict[str, int] = OrderedDict()  # "Category: message" -> times seen

    def record(self, message, category, filename, lineno, file=None, line=None) -> None:
        """``warnings.showwarning``'s signature: keep the warning, count it."""
        text = f"{category.__name__}: {message}"
        with self._lock:
            first = text not in self._seen
            self._seen[text] = self._seen.get(text, 0) + 1
            self._seen.move_to_end(text)
            while len(self._seen) > self.keep:
                self._seen.popitem(last=False)
        if first:  # one short line in the server's log, the rest on the page
            log.info("library warning (listed in the app's sidebar): %s", text[:200])

    def install(self) -> None:
        """Route every warning of this process here (idempotent)."""
        if warnings.showwarning != self.record:
            warnings.showwarning = self.record

    def recent(self) -> list[tuple[str, int]]:
        """``[(warning, times seen)]``, the most recent last."""
        with self._lock:
            return list(self._seen.items())

"""Warnings collected instead of printed: a long command shows its progress bars, then one
list of what the libraries warned about (each distinct message once, with its count)."""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from typing import Iterator


@contextlib.contextmanager
def collected_warnings() -> Iterator[list[str]]:
    """Within the block, warnings are recorded, not printed; the list it yields is filled on
    exit with one line per distinct message (``Category: message`` and ``(N times)``), in
    first-seen order. Not for multi-threaded code (:func:`warnings.catch_warnings` is global)."""
    lines: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield lines
        finally:
            counts = Counter(f"{w.category.__name__}: {w.message}" for w in caught)
            lines.extend(f"{msg} ({n} times)" if n > 1 else msg for msg, n in counts.items())

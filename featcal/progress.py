"""Progress bars: the one place featcal and diagnostics make one (tqdm underneath).

Usage::

    for task in bar(tasks, desc="experts", show=progress):
        ...
    with bar(total=len(jobs), desc="preview", unit="job", show=progress) as b:
        b.update()
"""

from __future__ import annotations

import sys
from typing import Iterable

from tqdm.auto import tqdm


def bar(
    iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it", show: bool = True
) -> tqdm:
    """A tqdm bar over ``iterable`` (or counting to ``total``, advanced with ``update``) that
    disappears when done; with ``show=False`` it draws nothing and only passes the items on."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not show, leave=False)


def note(message: str) -> None:
    """One line on stderr that does not break a progress bar being drawn (it goes above it)."""
    tqdm.write(message, file=sys.stderr)

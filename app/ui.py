"""Drawing helpers: a status line for work the user waits on (without ``st.status``'s pauses),
elements redrawn in place (:class:`Slots`), table downloads.

``st.status`` (Streamlit 1.67) sleeps 50 ms when it opens and 50 ms when it closes still
running, so that quick updates reach the browser in order; the Calibrate page opened three
per slider change, 0.2 s of its 1 s budget. Here a status is one caption in a slot,
replaced in place (each replacement is one delta to the same element: nothing to reorder).
"""

from __future__ import annotations

import contextlib
import io
import time
from concurrent.futures import Future, wait
from typing import Iterator

import pandas as pd
import streamlit as st

ICONS = {"running": ":material/hourglass_top:", "complete": ":material/check_circle:", "error": ":material/error:"}


class StatusLine:
    """What is running (or was done) in one slot; ``update`` mirrors ``st.status``'s."""

    def __init__(self, slot, label: str):
        self.slot = slot
        self.label = label
        self.state = "running"
        self._draw()

    def update(self, label: str | None = None, state: str | None = None) -> "StatusLine":
        if state is not None and state not in ICONS:
            raise ValueError(f"state must be one of {sorted(ICONS)}, not {state!r}")
        self.label = self.label if label is None else label
        self.state = self.state if state is None else state
        self._draw()
        return self

    def _draw(self) -> None:
        self.slot.caption(f"{ICONS[self.state]} {self.label}")


@contextlib.contextmanager
def status(label: str, slot=None) -> Iterator[StatusLine]:
    """``with status("Scoring…") as s: ...; s.update(label=..., state="complete")``, in
    ``slot`` (an ``st.empty()``; a new one by default). Left running, it reads complete on exit;
    an exception (not Streamlit's own rerun or stop) marks it as an error and propagates."""
    line = StatusLine(st.empty() if slot is None else slot, label)
    try:
        yield line
    except Exception:
        line.update(state="error")
        raise
    if line.state == "running":
        line.update(state="complete")


class Slots:
    """Elements drawn in place, so that a page keeps its layout while results are replaced.

    The first ``draw`` of a name writes the element where ``where`` (a container, ``st``) is
    in this run, at the position the same element had in the previous run: the browser keeps
    the previous run's element there, greyed as stale, until this one replaces it (no empty
    placeholder first, which would drop it and make the page jump). A later ``draw`` of the
    name in the same run replaces that element (the exact result over its preview).
    """

    def __init__(self):
        self.handles: dict[str, object] = {}

    def draw(self, name: str, where, method: str, *args, **kwargs):
        """``where.<method>(*args, **kwargs)``, or over the element ``name`` if already drawn."""
        target = self.handles.get(name, where)
        self.handles[name] = getattr(target, method)(*args, **kwargs)
        return self.handles[name]


def wait_with_progress(
    job: Future, line: StatusLine, label: str, expected: float | None, after: float = 1.0, blocks=None
) -> None:
    """Wait for ``job``; once it has run ``after`` seconds, ``line`` counts the seconds every
    quarter second, with the blocks done and the time left when ``blocks()`` gives ``(done,
    blocks)``, else the fraction of ``expected`` (the last such run's time) when known."""
    t0 = time.perf_counter()
    wait([job], timeout=after)
    while not job.done():
        spent = time.perf_counter() - t0
        done, total = (blocks() if blocks is not None else None) or (0, 0)
        if done:
            left = spent * (total - done) / done
            line.update(
                label=f"{label} · {progress_text(done / total)} block {done} of {total}, about {left:.0f} s left"
            )
        elif expected:
            bar = progress_text(min(spent / expected, 0.99))
            line.update(label=f"{label} · {bar} {spent:.1f} s of about {expected:.1f} s")
        else:
            line.update(label=f"{label} · {spent:.1f} s")
        wait([job], timeout=0.25)


def done_within(job: Future, seconds: float) -> bool:
    """Whether ``job`` finishes within ``seconds`` (waits at most that long)."""
    wait([job], timeout=seconds)
    return job.done()


def progress_text(fraction: float, width: int = 12) -> str:
    """A text progress bar, ``▰▰▰▱▱▱ 50%``."""
    full = int(round(max(0.0, min(fraction, 1.0)) * width))
    return "▰" * full + "▱" * (width - full) + f" {100 * fraction:.0f}%"


@contextlib.contextmanager
def progress_of(label: str) -> Iterator[None]:
    """A long job's progress on the page, in one slot: every featcal progress bar the block
    draws (on this thread) shows its stage, step and time left here, as it does in the
    terminal; the slot says what finished, and how long it took."""
    from featcal.util.progress import listening

    slot = st.empty()
    slot.progress(0.0, text=f"{label}: starting…")
    t0 = time.perf_counter()

    def on_step(p) -> None:
        slot.progress(min(max(p.fraction, 0.0), 1.0), text=f"{label} · {p.describe()}")

    with listening(on_step):
        yield
    slot.caption(f":material/check_circle: {label}: done in {time.perf_counter() - t0:.1f} s")


def library_warnings(slot, caught: list[tuple[str, int]]) -> None:
    """The sidebar's "Library warnings (N)" badge, in ``slot`` (an ``st.empty()``), on every
    page: the library's warnings ``[(text, times)]`` (:class:`app.warnlog.WarningLog`), the most
    recent first; nothing when there are none."""
    if not caught:
        slot.empty()
        return
    with slot.container(), st.expander(f"Library warnings ({len(caught)})", icon=":material/warning:"):
        for text, times in reversed(caught):
            st.caption(f"{text}" + (f" ({times} times)" if times > 1 else ""))


def table(df: pd.DataFrame, digits: int = 4, index: bool = True, where=None, **kwargs):
    """``st.dataframe`` of ``df`` as :mod:`app.tables` formats it: numbers rounded and
    right-aligned, a dash (never "None") for a missing value; a ``column_config`` given is added
    to those alignments."""
    from app import tables

    frame, texts = tables.dashed(df, digits)
    config = {c: st.column_config.TextColumn(alignment="right") for c in texts} | kwargs.pop("column_config", {})
    kwargs.setdefault("width", "stretch")
    kwargs.setdefault("hide_index", not index)
    return (where or st).dataframe(tables.styled(frame, digits), column_config=config, **kwargs)


def parquet_bytes(df: pd.DataFrame) -> bytes:
    """``df`` as Parquet file bytes (pyarrow)."""
    buf = io.BytesIO()
    df.to_parquet(buf, index=False)
    return buf.getvalue()


def downloads(df: pd.DataFrame, name: str, what: str, container=None) -> None:
    """Two download buttons for a tidy table: ``{name}.csv`` and ``{name}.parquet``, with a
    caption saying ``what`` it holds (the Parquet file is made only when downloaded; a click
    does not rerun the page)."""
    where = st if container is None else container
    row = where.container(horizontal=True, vertical_alignment="center")  # buttons as wide as their labels
    row.download_button(
        f"{name}.csv",
        df.to_csv(index=False),
        f"{name}.csv",
        "text/csv",
        key=f"dl_{name}_csv",
        icon=":material/download:",
        on_click="ignore",
    )
    row.download_button(
        f"{name}.parquet",
        lambda: parquet_bytes(df),
        f"{name}.parquet",
        "application/vnd.apache.parquet",
        key=f"dl_{name}_parquet",
        icon=":material/download:",
        on_click="ignore",
    )
    row.caption(f"Download {what}.")

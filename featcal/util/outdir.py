"""Output directories that never cost the user a file.

Every directory featcal writes carries a marker file, :data:`MARKER`, listing the files featcal
put there. The rules that follow from it, for every writer (``featcal calibrate --out``, in
memory and streamed, ``featcal merge --out``, the zoo store, the app's Export):

1. An output may not be, contain or lie inside any input (base, experts, merged model, data
   file, zoo directory): :func:`check_output` refuses it before any work starts.
2. An existing output is replaced (``--force``, the app's "Replace") only when it carries the
   marker and holds nothing but the files the marker lists (a marker listing none, of a directory
   filled as it went: the names featcal writes in that kind of directory, :data:`UNLISTED_OWN`);
   anything else is the user's and is refused with the path to move away (:func:`check_replaceable`).
3. One run per output at a time: :func:`output_lock` holds an OS file lock (``fcntl.flock``)
   on ``.NAME.featcal-lock`` beside the output for the whole run; a second run is refused,
   naming the holder's pid, host and start time.
4. A finished directory is swapped into place in one rename (:func:`commit_dir`); the old one
   is moved aside first and deleted only once the new one is in place.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import fnmatch
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

MARKER = ".featcal-output.json"
LOCK_SUFFIX = ".featcal-lock"
# A zoo written before the marker existed is recognised by its meta.json (kind and file list).
_LEGACY_ZOO_META, _LEGACY_ZOO_KIND = "meta.json", "featcal-zoo"


class OutputExistsError(FileExistsError):
    """The output exists and ``force`` was not given."""


class UnsafeOutputError(ValueError):
    """The output is an input, overlaps one, or holds files featcal did not write."""


class OutputLockedError(RuntimeError):
    """Another run holds the output's lock."""


# ------------------------------------------------------------------ paths


def _real(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def check_inputs_apart(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None]) -> Path:
    """Refuse an output that is, contains or lies inside one of ``inputs`` (``{what: path}``;
    symlinks followed). Returns the output's resolved path."""
    target = _real(out)
    for what, path in inputs.items():
        if path is None:
            continue
        src = _real(path)
        if target == src:
            how = "is"
        elif src in target.parents:
            how = "lies inside"
        elif target in src.parents:
            how = "contains"
        else:
            continue
        raise UnsafeOutputError(
            f"output {str(target)!r} {how} {what} ({str(src)!r}); featcal never writes over its inputs: "
            "choose an --out outside every input."
        )
    return target


def check_output(
    out: str | os.PathLike, force: bool = False, inputs: Mapping[str, str | os.PathLike | None] | None = None
) -> Path:
    """Every check of an output before work starts: apart from ``inputs``, absent or (with
    ``force``) replaceable. Returns the output's resolved path."""
    target = check_inputs_apart(out, inputs or {})
    if target.exists() or target.is_symlink():
        if not force:
            raise OutputExistsError(f"output {str(target)!r} already exists; pass --force (force=True) to replace it.")
        check_replaceable(target)
    return target


# ------------------------------------------------------------------ the marker


def written_files(root: Path) -> list[str]:
    """Every file and symlink under ``root``, relative, sorted (directories left out)."""
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink() if p.name != MARKER
    )


def mark(root: str | os.PathLike, kind: str, listed: bool = True) -> None:
    """Write the marker into ``root``, listing the files there now (call it once they are all
    written). ``listed=False``: a directory featcal fills as it goes (a streamed run's work
    directory): the files there whose names ``kind`` writes (:data:`UNLISTED_OWN`) are featcal's."""
    root = Path(root)
    doc = {
        "written_by": "featcal",
        "kind": kind,
        "written_at": _now(),
        "files": written_files(root) if listed else None,
    }
    (root / MARKER).write_text(json.dumps(doc, indent=1) + "\n")


def add_listed(root: str | os.PathLike, names: list[str]) -> None:
    """Record files featcal has just added to a directory it wrote (relative ``names``) in that
    directory's marker, so that they count as featcal's (and the directory stays replaceable); only
    those names are added, never what else may lie there. A directory without a listing marker is left
    as it is. The marker is replaced in one rename."""
    root = Path(root)
    try:
        doc = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return
    if not isinstance(doc, dict) or not isinstance(doc.get("files"), list):
        return
    doc["files"] = sorted(set(doc["files"]) | set(names))
    tmp = root.parent / f".{root.name}.marker-{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, root / MARKER)


# What featcal writes, by kind, in a directory it fills as it goes. Its marker lists no files (an older
# featcal's sweep folder, a streamed run's work directory), so only these names (fnmatch patterns of
# the path inside it) count as featcal's there; anything else is the user's and is never deleted.
UNLISTED_OWN = {
    "sweep": (
        *("table.csv", "best.json", "test_report.csv", "rows.csv", "summary.csv", "warnings.txt"),
        *("sweep_parallel.html", "sweep_heatmap.html", "sample_efficiency.html", "robustness.html", "plotly.min.js"),
    ),
    "work": ("state.json", "state.part", "streams*.safetensors", "streams*.part", "blocks/*", "model/*"),
}


@dataclass(frozen=True)
class Unlisted:
    """An unlisted marker of ``kind``: featcal's are the files matching :data:`UNLISTED_OWN`."""

    kind: str

    def __contains__(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in UNLISTED_OWN.get(self.kind, ()))


def _listed(root: Path):
    """The files the marker lists (an :class:`Unlisted` for an unlisted marker, a legacy zoo: its
    meta.json's), or None when neither is there."""
    try:
        doc = json.loads((root / MARKER).read_text())
        return Unlisted(str(doc.get("kind"))) if doc["files"] is None else set(doc["files"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    try:
        meta = json.loads((root / _LEGACY_ZOO_META).read_text())
        if meta.get("kind") == _LEGACY_ZOO_KIND and isinstance(meta.get("files"), dict):
            return set(meta["files"]) | {_LEGACY_ZOO_META}
    except (OSError, ValueError, AttributeError):
        pass
    return None


def check_replaceable(target: str | os.PathLike) -> None:
    """``target`` may be replaced: a directory featcal wrote (its marker) holding only the files
    featcal listed there. Raises :class:`UnsafeOutputError` naming what is in the way."""
    target = Path(target)
    if target.is_symlink() or not target.is_dir():
        raise UnsafeOutputError(
            f"output {str(target)!r} exists and is not a directory featcal wrote; featcal replaces only its "
            "own output directories: choose another --out or move it away yourself."
        )
    if not any(target.iterdir()):
        return  # an empty directory: nothing to lose
    listed = _listed(target)
    if listed is None:
        raise UnsafeOutputError(
            f"output {str(target)!r} was not written by featcal (it has no {MARKER}); featcal replaces only "
            "directories it wrote: choose another --out or move that directory away yourself."
        )
    extra = [f for f in written_files(target) if f not in listed]
    if extra:
        more = f" and {len(extra) - 3} more" if len(extra) > 3 else ""
        why = (
            f" (its marker, from a run that wrote it as it went, lists no files: featcal counts as its own only "
            f"the names a {listed.kind} writes)"
            if isinstance(listed, Unlisted)
            else ""
        )
        raise UnsafeOutputError(
            f"output {str(target)!r} holds files featcal did not write there ({', '.join(extra[:3])}{more}){why}; "
            "move them away first, or choose another --out."
        )


def remove_own(target: str | os.PathLike) -> None:
    """Delete a directory featcal wrote (refused, as by :func:`check_replaceable`, otherwise)."""
    check_replaceable(target)
    shutil.rmtree(target)


def fresh_dir(
    out: str | os.PathLike, force: bool, kind: str, inputs: Mapping[str, str | os.PathLike | None] | None = None
) -> Path:
    """Create output ``out`` to be filled as the run goes (an old one replaced if ``force``
    and featcal's), its marker listing nothing yet: the run marks it again, listing its files, when it
    is done (:func:`mark`). Until then nothing in it counts as featcal's, so a run stopped half-way
    leaves a folder ``--force`` refuses to delete rather than one that takes a file added there with it."""
    target = check_output(out, force, inputs)
    if target.exists():
        remove_own(target)
    target.mkdir(parents=True)
    mark(target, kind)
    return target


# ------------------------------------------------------------------ the swap


def commit_dir(tmp: str | os.PathLike, target: str | os.PathLike, kind: str) -> Path:
    """Mark ``tmp`` and rename it to ``target``. An old ``target`` (checked again to be
    replaceable) is moved aside first, restored if the rename fails, and deleted after."""
    tmp, target = Path(tmp), Path(target)
    mark(tmp, kind)
    if not (target.exists() or target.is_symlink()):
        os.replace(tmp, target)
        return target
    check_replaceable(target)
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rmdir(old)
    os.replace(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return target


# ------------------------------------------------------------------ the lock

_held: dict[Path, tuple[int, int]] = {}  # lock path -> (fd, depth): re-entrant within a process
_held_guard = threading.Lock()


def lock_path(out: str | os.PathLike) -> Path:
    out = Path(out).expanduser().absolute()
    return out.parent / f".{out.name}{LOCK_SUFFIX}"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text())
        return f"pid {h.get('pid')} on {h.get('host')}, started {h.get('started')} ({h.get('command', '?')})"
    except (OSError, ValueError, AttributeError):
        return "another process (its details could not be read)"


def _acquire(path: Path, wait: bool) -> int:
    """An fd holding ``flock(LOCK_EX)`` on ``path``, which is still the file at ``path`` (a
    releasing run unlinks it: a lock on the unlinked file would lock nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES):
                raise OutputLockedError(
                    f"output {str(path.parent / path.name[1 : -len(LOCK_SUFFIX)])!r} is being written by "
                    f"{_holder(path)}; wait for that run to end (or stop it) before starting another on it."
                ) from None
            raise
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def output_lock(out: str | os.PathLike, wait: bool = False) -> Iterator[Path]:
    """Hold the lock of output ``out`` inside the block (re-entrant in one process); raises
    :class:`OutputLockedError` naming the holder if another process has it (``wait``: wait
    for it instead, e.g. a shared cache that another process may be filling)."""
    path = lock_path(out)
    with _held_guard:
        if path in _held:
            fd, depth = _held[path]
            _held[path] = (fd, depth + 1)
        else:
            fd = _acquire(path, wait)
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now(), "command": " ".join(sys.argv)}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
            _held[path] = (fd, 1)
    try:
        yield path
    finally:
        with _held_guard:
            fd, depth = _held[path]
            if depth > 1:
                _held[path] = (fd, depth - 1)
            else:
                del _held[path]
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                os.close(fd)

"""What every subcommand of the ``featcal`` command line shares: options, checks, the zoo.

The subcommands live in :mod:`featcal.cli` (zoo, merge, calibrate, eval),
:mod:`featcal.tune_cli` (tune, study) and :mod:`diagnostics.cli` (diagnose); each
imports this module, and :mod:`featcal.cli` imports them all into one table.

Bad input raises :class:`UserError` (or ``ValueError`` / ``FileNotFoundError``), which
``featcal`` reports as one ``featcal: error: ...`` line.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

from featcal.merging import MERGERS
from featcal.zoo import Zoo, load_any


class UserError(Exception):
    """Bad input on the command line: reported as one line, without a traceback."""


# ------------------------------------------------------------------ options


def add_zoo(p: argparse.ArgumentParser) -> None:
    """``--zoo``: a zoo by name or path (:func:`featcal.zoo.load_any`)."""
    p.add_argument(
        "--zoo",
        default="demo",
        help="'demo', 'demo-fashion', 'real-text', a YAML spec or a zoo directory (default: demo)",
    )


def add_out(p: argparse.ArgumentParser) -> None:
    """``--out`` and ``--force``: where a subcommand writes (see :func:`check_out`)."""
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")


def add_common(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--threads`` and ``--quiet``, shared by every subcommand that loads a zoo."""
    p.add_argument("--device", default="cpu", help="torch device for the models (default: cpu)")
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch CPU threads (default: torch's; 1 is fastest for the demo zoo on a busy machine)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


# ------------------------------------------------------------------ checks


def check_merge_method(method: str) -> None:
    """``method`` must be in :data:`featcal.merging.MERGERS`."""
    if method not in MERGERS:
        raise UserError(f"unknown merge method {method!r}; choose one of {', '.join(sorted(MERGERS))}.")


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_params(items: list[str] | None, method: str) -> dict:
    """``["scale=0.3", ...]`` -> ``{"scale": 0.3}``, checked against the merger's signature."""
    check_merge_method(method)
    allowed = [n for n in inspect.signature(MERGERS[method]).parameters if n not in ("base", "experts")]
    params = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--param {item!r}: expected NAME=VALUE (e.g. scale=0.3).")
        if key not in allowed:
            raise UserError(f"--param {key!r}: {method} takes {', '.join(allowed) or 'no parameters'}.")
        params[key] = _parse_value(value)
    return params


def check_out(out: str, force: bool) -> None:
    """Fail before any work if the output directory exists (unless ``force``); every
    subcommand that writes calls it first (the writers check again when writing)."""
    if Path(out).expanduser().exists() and not force:
        raise UserError(f"output {out!r} already exists; pass --force to replace it.")


# ------------------------------------------------------------------ the zoo


def apply_threads(args: argparse.Namespace) -> None:
    """Honour ``--threads`` (see :func:`add_common`)."""
    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)


def zoo_from_args(args: argparse.Namespace) -> Zoo:
    """The zoo ``--zoo`` names, on ``--device``, after applying ``--threads``."""
    apply_threads(args)
    return load_any(args.zoo, progress=not args.quiet, device=args.device)

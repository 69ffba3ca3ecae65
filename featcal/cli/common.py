"""What every subcommand of the ``featcal`` command line shares: options, checks, the zoo.

The subcommands live in :mod:`featcal.cli.commands` (zoo, merge, calibrate, eval),
:mod:`featcal.cli.sweep` (tune, study) and :mod:`diagnostics.cli` (diagnose); each
imports this module, and :mod:`featcal.cli.commands` imports them all into one table.

Bad input raises :class:`UserError` (or ``ValueError`` / ``FileNotFoundError``), which
``featcal`` reports as one ``featcal: error: ...`` line.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

from featcal.baselines.merging import MERGERS
from featcal.baselines.regmean import MERGERS_WITH_DATA
from featcal.util.threads import default_threads
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
        type=_threads,
        default="auto",
        metavar="N",
        help="torch CPU threads, or 'auto' (default): 1 for small models, else the cores the load "
        "leaves free (featcal.util.threads.default_threads; $FEATCAL_THREADS overrides it)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


# ------------------------------------------------------------------ checks


def check_merge_method(method: str, with_data: bool = False) -> None:
    """``method`` must be in :data:`featcal.baselines.merging.MERGERS` (``with_data``: or in
    :data:`featcal.baselines.regmean.MERGERS_WITH_DATA`)."""
    known = {**MERGERS, **MERGERS_WITH_DATA} if with_data else MERGERS
    if method not in known:
        raise UserError(f"unknown merge method {method!r}; choose one of {', '.join(sorted(known))}.")


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


# Arguments of a merger that the command line fills itself, not --param.
NOT_PARAMS = ("base", "experts", "calib_data", "blocks", "progress")


def parse_params(items: list[str] | None, method: str, with_data: bool = False) -> dict:
    """``["scale=0.3", ...]`` -> ``{"scale": 0.3}``, checked against the merger's signature
    (``with_data``: the data-using mergers are allowed too)."""
    check_merge_method(method, with_data)
    fn = MERGERS_WITH_DATA[method] if method in MERGERS_WITH_DATA else MERGERS[method]
    allowed = [n for n in inspect.signature(fn).parameters if n not in NOT_PARAMS]
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


def _threads(text: str) -> int | str:
    """``--threads``: a positive whole number or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number or 'auto', got {text!r}")
    return n


def apply_threads(args: argparse.Namespace, model=None) -> int | None:
    """Honour ``--threads`` (see :func:`add_common`): a number as given; ``auto`` (or none)
    from ``model`` and the machine (:func:`featcal.util.threads.default_threads`) once a model is
    known. Returns the threads set, None when nothing was set."""
    threads = getattr(args, "threads", None)
    if threads in (None, "auto"):
        if model is None:
            return None
        threads = default_threads(model, getattr(args, "device", "cpu"))
    torch.set_num_threads(threads)
    return threads


def zoo_from_args(args: argparse.Namespace) -> Zoo:
    """The zoo ``--zoo`` names, on ``--device``, with ``--threads`` applied (an explicit number
    before loading, ``auto`` after, from the zoo's base model)."""
    apply_threads(args)
    zoo = load_any(args.zoo, progress=not args.quiet, device=args.device)
    apply_threads(args, zoo.base)
    return zoo

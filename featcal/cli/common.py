"""What every subcommand of the ``featcal`` command line shares: options, checks, the zoo.

The subcommands live in :mod:`featcal.cli.zoo`, :mod:`featcal.cli.merge`, :mod:`featcal.cli.calibrate`,
:mod:`featcal.cli.evaluate` (eval), :mod:`featcal.cli.sweep` (tune, study) and :mod:`diagnostics.cli`
(diagnose); each imports this module, and :mod:`featcal.cli.commands` names them all in one table (each
imported when it runs).

Bad input raises :class:`UserError` (or ``ValueError`` / ``FileNotFoundError``), which
``featcal`` reports as one ``featcal: error: ...`` line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping

import torch

from featcal.baselines import registry
from featcal.util import outdir
from featcal.util.threads import default_threads
from featcal.zoo import Zoo, load_any, source_path


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


def check_merge_method(method: str, with_data: bool = False) -> str:
    """``method``'s registry name; it must be a merger (``with_data``: or a data-using one) of
    :mod:`featcal.baselines.registry` (aliases such as ``ta`` too)."""
    kinds = ("merger", "data_merger") if with_data else ("merger",)
    try:
        return registry.get(method, *kinds).name
    except ValueError as e:
        raise UserError(str(e)) from None


def _parse_value(text: str):
    return registry.parse_value(text)


def parse_params(items: list[str] | None, method: str, with_data: bool = False) -> dict:
    """``--param`` where one method runs: ``["scale=0.3", ...]`` -> ``{"scale": 0.3}``, checked
    against the registry (names and types) before any work; ``METHOD.NAME=VALUE`` naming this
    method is accepted too."""
    name = check_merge_method(method, with_data)
    try:
        return registry.parse_param_items(items, [name]).get(name, {})
    except ValueError as e:
        raise UserError(str(e)) from None


def deprecated_option(old: str, new: str) -> None:
    """Say on stderr that ``old`` is deprecated (kept for one release) and what to write instead."""
    print(f"featcal: warning: {old} is deprecated and goes in the next release; write {new}.", file=sys.stderr)


def add_param(p: argparse.ArgumentParser, what: str = "the merge method") -> None:
    """``--param NAME=VALUE`` (repeatable) into ``args.param``."""
    p.add_argument(
        "--param",
        action="append",
        metavar="NAME=VALUE",
        help=f"a parameter of {what}, e.g. scale=0.3 (repeatable; checked before any work)",
    )


def check_out(out: str, force: bool, inputs: Mapping[str, str | os.PathLike | None] | None = None) -> None:
    """Fail before any work if the output directory exists (unless ``force``, and then only
    featcal's own may be replaced) or overlaps one of ``inputs`` (``{what: path}``); every
    subcommand that writes calls it first (the writers check again when writing), see
    :mod:`featcal.util.outdir`). featcal's own shipped zoos (``assets/zoos``) are always an input."""
    from featcal.zoo.builtin.demo import SHIPPED

    outdir.check_output(out, force, {**(inputs or {}), "featcal's shipped zoos": SHIPPED.parent})


def zoo_inputs(args: argparse.Namespace, zoo: Zoo | None = None) -> dict:
    """``{what: path}`` of what ``--zoo`` reads (and, once loaded, the zoo's own models and data)."""
    return {"the zoo": source_path(args.zoo)} | ({} if zoo is None else zoo.input_paths())


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

"""``featcal diagnose``: every diagnostic of a merged, calibrated or saved model
against a zoo's experts, written as tables plus ``summary.txt``.

    featcal diagnose --zoo demo --model merged --out runs/diag-merged
    featcal diagnose --zoo zoo.yaml --model calibrated --n-per-task 64 --format parquet --out runs/diag-cal
    featcal diagnose --zoo demo --model runs/my-model --out runs/diag-mine

The command line is a thin layer: :func:`add_arguments` declares the options,
:func:`run` loads, builds the model, calls :func:`diagnostics.diagnose` and writes;
both are a row of :data:`featcal.cli.commands.COMMANDS`. Bad input raises ``ValueError`` /
``FileNotFoundError`` (or :class:`featcal.cli.common.UserError` for an existing output),
which ``featcal`` reports as one ``featcal: error:`` line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diagnostics import diagnose
from diagnostics.similarity import TOKENS
from featcal.baselines.registry import MERGERS
from featcal.cli.common import (
    add_common,
    add_out,
    add_param,
    add_zoo,
    check_out,
    parse_params,
    zoo_from_args,
    zoo_inputs,
)
from featcal.config import preset_config, preset_for_zoo
from featcal.engine.run import calibrate
from featcal.model.streams import device_of
from featcal.zoo.io import atomic_dir, load_model

FORMATS = ("csv", "parquet")
MODEL_CHOICES = ("merged", "calibrated")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``diagnose`` options on ``parser``."""
    add_zoo(parser)
    parser.add_argument(
        "--model",
        default="merged",
        help="'merged', 'calibrated' (merged, then FeatCal at the zoo's preset on its calibration split), "
        "or a directory holding a saved model",
    )
    parser.add_argument(
        "--merge", default="task_arithmetic", choices=sorted(MERGERS), help="merge method for --model merged|calibrated"
    )
    add_param(parser)
    parser.add_argument(
        "--n-per-task",
        type=int,
        default=32,
        help="examples per task in D_i (calibration split) for the drift tables and for FeatCal",
    )
    parser.add_argument(
        "--max-test",
        type=int,
        default=None,
        help="test examples per task for the output drift (default: the whole test split)",
    )
    parser.add_argument(
        "--tokens",
        choices=TOKENS,
        default="all",
        help="rows of the drift statistics: every token, or the class token only",
    )
    parser.add_argument("--no-cka", action="store_true", help="skip linear CKA per block")
    parser.add_argument("--seed", type=int, default=42, help="seed drawing D_i from the calibration split")
    parser.add_argument("--format", choices=FORMATS, default="csv", help="table file format")
    add_out(parser)
    add_common(parser)  # --device, --threads, --quiet (also: no summary on stdout)
    return parser


def build_model(zoo, which: str, merge: str, params: dict, n_per_task: int, seed: int, progress: bool):
    """The model to diagnose: ``merged``, ``calibrated`` or a saved model directory."""
    if which not in MODEL_CHOICES:
        if not Path(which).expanduser().is_dir():
            raise FileNotFoundError(
                f"--model {which!r}: choose {' or '.join(MODEL_CHOICES)}, or give a saved model directory."
            )
        return load_model(which, like=zoo.base).to(device_of(zoo.base)).eval()
    merged = zoo.merged(merge, **params)
    if which == "merged":
        return merged
    cfg = preset_config(preset_for_zoo(zoo))  # as the app and `featcal compare` calibrate this zoo
    model, _ = calibrate(
        merged,
        base=zoo.base,
        experts=zoo.experts,
        inplace=True,
        progress=progress,
        calib_data=zoo.calib_data(n_per_task, seed=seed),
        config=cfg,
    )
    return model


def write_tables(tables: dict, summary: str, out: str, fmt: str, force: bool) -> Path:
    """``<name>.<fmt>`` per table plus ``summary.txt``, written atomically into ``out``."""
    with atomic_dir(out, force=force) as tmp:
        for name, df in tables.items():
            if fmt == "parquet":
                df.to_parquet(tmp / f"{name}.parquet", index=False)
            else:
                df.to_csv(tmp / f"{name}.csv", index=False)
        (tmp / "summary.txt").write_text(summary + "\n")
    return Path(out).expanduser().absolute()


def run(args: argparse.Namespace) -> int:
    """1. check the options; 2. load the zoo; 3. build the model; 4. diagnose; 5. write."""
    if args.n_per_task < 1:
        raise ValueError(f"--n-per-task must be at least 1, got {args.n_per_task}.")
    params = parse_params(args.param, args.merge)  # checked against the registry before any work
    saved = {} if args.model in MODEL_CHOICES else {"--model": args.model}
    check_out(args.out, args.force, zoo_inputs(args) | saved)
    zoo = zoo_from_args(args)
    check_out(args.out, args.force, zoo_inputs(args, zoo) | saved)  # and the loaded zoo's own models and data
    model = build_model(zoo, args.model, args.merge, params, args.n_per_task, args.seed, progress=not args.quiet)
    name = args.model if args.model in MODEL_CHOICES else Path(args.model).name
    tables, summary = diagnose(
        model,
        zoo,
        n_per_task=args.n_per_task,
        seed=args.seed,
        max_per_task=args.max_test,
        tokens=args.tokens,
        cka=not args.no_cka,
        progress=not args.quiet,
        name=name,
    )
    out = write_tables(tables, summary, args.out, args.format, args.force)
    if not args.quiet:
        print(summary)
        print(f"tables written to {out}")
    return 0

"""``featcal diagnose``: every diagnostic of a merged, calibrated or saved model
against a zoo's experts, written as tables plus ``summary.txt``.

    featcal diagnose --zoo demo --model merged --out runs/diag-merged
    featcal diagnose --zoo zoo.yaml --model calibrated --n-per-task 64 --format parquet --out runs/diag-cal
    python -m diagnostics.cli --zoo demo --model runs/my-model --out runs/diag-mine

The command line is a thin layer: :func:`add_arguments` declares the options,
:func:`run` loads, builds the model, calls :func:`diagnostics.diagnose` and writes.
:func:`register` hooks ``diagnose`` into ``featcal.cli`` (which imports this module
as one of its ``EXTENSIONS``). Bad input raises ``ValueError`` / ``FileNotFoundError``
(or ``featcal.cli.UserError`` for an existing output), which ``featcal`` reports as one
``featcal: error:`` line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from diagnostics.similarity import TOKENS

FORMATS = ("csv", "parquet")
MODEL_CHOICES = ("merged", "calibrated")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``diagnose`` options on ``parser``."""
    from featcal.merging import MERGERS

    parser.add_argument("--zoo", default="demo",
                        help="'demo', 'demo-fashion', a zoo YAML spec, or a zoo directory (default: demo)")
    parser.add_argument("--model", default="merged",
                        help="'merged', 'calibrated' (merged, then FeatCal on the zoo's calibration split), "
                             "or a directory holding a saved model")
    parser.add_argument("--merge", default="task_arithmetic", choices=sorted(MERGERS),
                        help="merge method for --model merged|calibrated")
    parser.add_argument("--scale", type=float, default=None,
                        help="the merge's scale (Task Arithmetic lambda; default: the method's own)")
    parser.add_argument("--n-per-task", type=int, default=32,
                        help="examples per task in D_i (calibration split) for the drift tables and for FeatCal")
    parser.add_argument("--max-test", type=int, default=None,
                        help="test examples per task for the output drift (default: the whole test split)")
    parser.add_argument("--tokens", choices=TOKENS, default="all",
                        help="rows of the drift statistics: every token, or the class token only")
    parser.add_argument("--no-cka", action="store_true", help="skip linear CKA per block")
    parser.add_argument("--seed", type=int, default=42, help="seed drawing D_i from the calibration split")
    parser.add_argument("--out", required=True, help="output directory (created; see --force)")
    parser.add_argument("--format", choices=FORMATS, default="csv", help="table file format")
    parser.add_argument("--force", action="store_true", help="replace an existing --out directory")
    parser.add_argument("--device", default="cpu", help="torch device for the models (default: cpu)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars, no summary on stdout")
    return parser


def load_zoo(spec: str, progress: bool = True, device: str = "cpu"):
    """A zoo by name or path (``demo``, ``demo-fashion``, a YAML spec, a zoo directory)."""
    from featcal.zoo import load_any

    return load_any(spec, progress=progress, device=device)


def build_model(zoo, which: str, merge: str, scale: float | None, n_per_task: int, seed: int,
                progress: bool):
    """The model to diagnose: ``merged``, ``calibrated`` or a saved model directory."""
    if which not in MODEL_CHOICES:
        from featcal.zoo.io import load_model

        from featcal.streams import device_of

        if not Path(which).expanduser().is_dir():
            raise FileNotFoundError(f"--model {which!r}: choose {' or '.join(MODEL_CHOICES)}, "
                                    "or give a saved model directory.")
        return load_model(which, like=zoo.base).to(device_of(zoo.base)).eval()
    merged = zoo.merged(merge) if scale is None else zoo.merged(merge, scale=scale)
    if which == "merged":
        return merged
    from featcal import FeatCalConfig, calibrate

    cfg = FeatCalConfig.clip() if zoo.fmt in ("hf", "open_clip") else FeatCalConfig()
    model, _ = calibrate(merged, base=zoo.base, experts=zoo.experts, inplace=True, progress=progress,
                         calib_data=zoo.calib_data(n_per_task, seed=seed), config=cfg)
    return model


def write_tables(tables: dict, summary: str, out: str, fmt: str, force: bool) -> Path:
    """``<name>.<fmt>`` per table plus ``summary.txt``, written atomically into ``out``."""
    from featcal.zoo.io import atomic_dir

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
    from diagnostics import diagnose
    from featcal.cli import check_out

    if args.n_per_task < 1:
        raise ValueError(f"--n-per-task must be at least 1, got {args.n_per_task}.")
    check_out(args.out, args.force)
    zoo = load_zoo(args.zoo, progress=not args.quiet, device=args.device)
    model = build_model(zoo, args.model, args.merge, args.scale, args.n_per_task, args.seed,
                        progress=not args.quiet)
    name = args.model if args.model in MODEL_CHOICES else Path(args.model).name
    tables, summary = diagnose(model, zoo, n_per_task=args.n_per_task, seed=args.seed,
                               max_per_task=args.max_test, tokens=args.tokens, cka=not args.no_cka,
                               progress=not args.quiet, name=name)
    out = write_tables(tables, summary, args.out, args.format, args.force)
    if not args.quiet:
        print(summary)
        print(f"tables written to {out}")
    return 0


HELP = "feature-drift diagnostics of a merged, calibrated or saved model against the zoo's experts"


def register(target) -> None:
    """Add ``diagnose`` to featcal's command line: ``target`` is an argparse sub-parsers
    action (the sub-parser gets ``func=run``) or a function ``register(name, add_arguments,
    run[, help])`` (the same convention as :func:`featcal.tune_cli.register`)."""
    if hasattr(target, "add_parser"):
        add_arguments(target.add_parser("diagnose", help=HELP, description=HELP)).set_defaults(func=run)
        return
    try:
        target("diagnose", add_arguments, run, help=HELP)
    except TypeError:
        target("diagnose", add_arguments, run)


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="featcal diagnose", description=HELP))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

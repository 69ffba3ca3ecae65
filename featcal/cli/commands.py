"""The ``featcal`` command line (also ``python -m featcal``).

    featcal zoo build-demo [--variant default|fashion] [--rebuild]
    featcal zoo build real-text [--rebuild]
    featcal zoo info --zoo demo
    featcal merge --zoo demo --method task_arithmetic --param scale=0.3 --out runs/ta
    featcal merge --zoo demo --method regmean_plusplus --n-per-task 256 --out runs/rmpp
    featcal calibrate --zoo demo --merge task_arithmetic --preset clip --n-per-task 256 --out runs/fc
    featcal calibrate --base DIR --expert math=DIR ... --merge task_arithmetic --data toks.safetensors --out DIR
    featcal eval --zoo demo                       # base, experts, Task Arithmetic
    featcal eval --zoo demo --model runs/fc --json runs/fc/eval.json
    featcal diagnose --zoo demo --model merged --out runs/diag     # diagnostics.cli
    featcal tune --zoo demo --out runs/tune                        # featcal.cli.sweep
    featcal study sample-efficiency --zoo demo --out runs/se       # featcal.cli.sweep

Every subcommand is one row of :data:`COMMANDS`: ``name: (add_arguments, run, help)``,
where ``add_arguments(parser)`` declares its options and ``run(args) -> int`` does the
work. This module holds the zoo, merge, calibrate and eval subcommands; the options
and checks they share are in :mod:`featcal.cli.common`.

Bad input (a zoo that does not exist, an output directory that does, an
unknown merge method, an invalid hyper-parameter) ends with one
``featcal: error: ...`` line and exit status 2; ``--traceback`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable

from diagnostics import cli as diagnose_cli
from diagnostics import compare_cli
from featcal.baselines.registry import MERGERS_WITH_DATA, merge_with_data, zoo_logits
from featcal.cli import app as app_launch
from featcal.cli import ranks
from featcal.cli import sweep as tune_cli
from featcal.cli.calibrate import add_calibrate_arguments, config_from_args, run_calibrate
from featcal.cli.common import (
    UserError,
    add_common,
    add_out,
    add_param,
    add_zoo,
    apply_threads,
    check_merge_method,
    check_out,
    parse_params,
    zoo_from_args,
    zoo_inputs,
)
from featcal.cli.evaluate import add_eval_arguments, run_eval, write_output
from featcal.cli.formats import (
    add_from_fusionbench,
    run_from_fusionbench,
)
from featcal.engine.distributed import DistributedError
from featcal.util.outdir import OutputLockedError, output_lock
from featcal.zoo import BUILT, NAMES, load_any, load_demo

__all__ = [
    "COMMANDS",
    "build_parser",
    "main",
    "config_from_args",
    # shared with the other subcommands; defined in featcal.cli.common
    "UserError",
    "add_common",
    "apply_threads",
    "check_out",
    "parse_params",
]

AddArguments = Callable[[argparse.ArgumentParser], object]
Run = Callable[[argparse.Namespace], "int | None"]


# ------------------------------------------------------------------ zoo

BUILTIN = (*NAMES, *BUILT)  # the zoos `featcal zoo build NAME` makes


def add_zoo_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="zoo_command", required=True, metavar="{build,build-demo,info,from-fusionbench}")
    b = sub.add_parser("build-demo", help="build (or rebuild) the embedded demo zoo in the cache")
    b.add_argument("--variant", default="default", choices=("default", "fashion"))
    b.add_argument("--rebuild", action="store_true", help="build afresh even if cached")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    n = sub.add_parser("build", help="build (or rebuild) a built-in zoo in the cache: " + ", ".join(BUILTIN))
    n.add_argument("name", choices=BUILTIN, help="the zoo")
    n.add_argument("--rebuild", action="store_true", help="build afresh even if cached")
    n.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    i = sub.add_parser("info", help="where a zoo is and what it holds")
    add_zoo(i)
    i.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    add_from_fusionbench(sub)


def run_zoo(args) -> int:
    t0 = time.perf_counter()
    if args.zoo_command == "from-fusionbench":
        return run_from_fusionbench(args)
    if args.zoo_command == "build-demo":
        zoo = load_demo(rebuild=args.rebuild, progress=not args.quiet, variant=args.variant)
    elif args.zoo_command == "build":
        zoo = load_any(args.name, progress=not args.quiet, rebuild=args.rebuild)
    else:
        zoo = load_any(args.zoo, progress=not args.quiet)
    _print_zoo_info(zoo, time.perf_counter() - t0)
    return 0


def _print_zoo_info(zoo, seconds: float) -> None:
    meta = zoo.meta
    print(f"zoo {zoo.name}: {len(zoo.tasks)} tasks, format {zoo.fmt}")
    if "path" in meta:
        print(f"  path          {meta['path']}")
    if "disk_bytes" in meta:
        print(f"  disk          {meta['disk_bytes'] / 1e6:.1f} MB")
    if "build_seconds" in meta:
        print(f"  built in      {meta['build_seconds']:.0f} s ({meta.get('built_at', '?')})")
    if "content_sha256" in meta:
        print(f"  sha256        {meta['content_sha256']}")
    print(f"  loaded in     {seconds:.1f} s")
    for task in zoo.tasks:
        sizes = ", ".join(f"{s} {len(zoo.split(task, s)[1])}" for s in zoo.data[task].splits)
        print(f"  {task:14s}{len(zoo.data[task].classes):3d} classes  ({sizes})")


# ------------------------------------------------------------------ merge


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    add_zoo(p)
    p.add_argument("--method", default="task_arithmetic", help="merge method (default: task_arithmetic)")
    add_param(p)
    p.add_argument(
        "--n-per-task",
        type=int,
        default=256,
        help="data-using methods (regmean, regmean_plusplus): examples per task from the calib split (default 256)",
    )
    p.add_argument("--seed", type=int, default=42, help="seed of that sample (default 42)")
    p.add_argument("--batch-size", type=int, default=16, help="its batch size (default 16)")
    add_out(p)
    p.add_argument("--eval", action="store_true", help="also print the test accuracy")
    add_common(p)


def run_merge(args) -> int:
    params = parse_params(args.param, args.method, with_data=True)
    args.method = check_merge_method(args.method, with_data=True)
    with_data = args.method in MERGERS_WITH_DATA
    if with_data and args.n_per_task < 1:
        raise UserError(f"--n-per-task must be at least 1, got {args.n_per_task}.")
    check_out(args.out, args.force, zoo_inputs(args))
    with output_lock(args.out):
        zoo = zoo_from_args(args)
        info = {"zoo": args.zoo, "method": args.method, "params": params}
        if with_data:
            data = zoo.calib_data(args.n_per_task, seed=args.seed, batch_size=args.batch_size)
            model = merge_with_data(
                args.method,
                base=zoo.base,
                experts=zoo.experts,
                calib_data=data,
                logits=zoo_logits(zoo),
                progress=not args.quiet,
                **params,
            )
            info.update(n_per_task=args.n_per_task, seed=args.seed, batch_size=args.batch_size)
        else:
            model = zoo.merged(args.method, **params)
        out = write_output(args, zoo, model, "merge.json", info, scored={args.method: model})
    print(f"wrote {out}")
    return 0


# ------------------------------------------------------------------ the table

COMMANDS: dict[str, tuple[AddArguments, Run, str]] = {
    "zoo": (add_zoo_arguments, run_zoo, "build or inspect zoos"),
    "merge": (add_merge_arguments, run_merge, "merge the experts of a zoo and save the model"),
    "calibrate": (
        add_calibrate_arguments,
        ranks.in_process_group(run_calibrate),  # one process of a torchrun launch each
        "merge, then calibrate with FeatCal; save the model and report.json",
    ),
    "eval": (add_eval_arguments, run_eval, "per-task accuracy of the zoo's models or a saved one"),
    "diagnose": (diagnose_cli.add_arguments, diagnose_cli.run, diagnose_cli.HELP),
    "tune": (tune_cli.add_tune_arguments, tune_cli.run_tune, tune_cli.TUNE_HELP),
    "study": (tune_cli.add_study_arguments, tune_cli.run_study, tune_cli.STUDY_HELP),
    "compare": (
        compare_cli.add_arguments,
        compare_cli.run,
        "run several methods on a zoo and compare them side by side",
    ),
    "app": (app_launch.add_arguments, app_launch.run, app_launch.HELP),
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand in :data:`COMMANDS` (each sets ``args.func``)."""
    parser = argparse.ArgumentParser(prog="featcal", description="Post-merging feature calibration.")
    parser.add_argument("--traceback", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(func=run)
    return parser


# (DistributedError: another rank of a torchrun launch stopped or hangs)
USER_ERRORS = (
    UserError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    ValueError,
    DistributedError,
    OutputLockedError,
)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except USER_ERRORS as err:
        if args.traceback:
            raise
        msg = str(err).strip() or type(err).__name__
        print(f"featcal: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("featcal: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `featcal eval ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""The ``featcal`` command line (also ``python -m featcal``).

    featcal zoo build-demo [--variant default|fashion] [--rebuild]   # featcal.cli.zoo
    featcal zoo info --zoo demo
    featcal merge --zoo demo --method task_arithmetic --param scale=0.3 --out runs/ta   # featcal.cli.merge
    featcal calibrate --zoo demo --merge task_arithmetic --preset clip --n-per-task 256 --out runs/fc
    featcal calibrate --base DIR --expert math=DIR ... --merge task_arithmetic --data toks.safetensors --out DIR
    featcal eval --zoo demo --model runs/fc --json runs/fc/eval.json             # featcal.cli.evaluate
    featcal diagnose --zoo demo --model merged --out runs/diag     # diagnostics.cli
    featcal tune --zoo demo --out runs/tune                        # featcal.cli.sweep
    featcal study sample-efficiency --zoo demo --out runs/se       # featcal.cli.sweep
    featcal compare --zoo demo --methods ta,ta+featcal --out runs/cmp            # diagnostics.compare_cli
    featcal reproduce table1-b32 --dry-run                         # featcal.cli.reproduce
    featcal app                                                    # featcal.cli.app

Every subcommand is one row of :data:`COMMANDS`: ``name: (help, load)``, where ``load()``
imports the subcommand's module and gives ``(add_arguments, run)``: ``add_arguments(parser)``
declares its options and ``run(args) -> int`` does the work. Only the subcommand that runs is
loaded, so ``featcal --help`` and ``featcal app`` never import torch (seconds and hundreds of
MB; the app's launcher would hold them for the app's life). The options and checks the
subcommands share are in :mod:`featcal.cli.common`.

Bad input (a zoo that does not exist, an output directory that does, an
unknown merge method, an invalid hyper-parameter) ends with one
``featcal: error: ...`` line and exit status 2; ``--traceback`` shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Callable

AddArguments = Callable[[argparse.ArgumentParser], object]
Run = Callable[[argparse.Namespace], "int | None"]
Load = Callable[[], tuple[AddArguments, Run]]


# ------------------------------------------------------------------ the subcommands, each loaded when it runs


def _zoo():
    from featcal.cli.zoo import add_zoo_arguments, run_zoo

    return add_zoo_arguments, run_zoo


def _merge():
    from featcal.cli.merge import add_merge_arguments, run_merge

    return add_merge_arguments, run_merge


def _calibrate():
    from featcal.cli import ranks
    from featcal.cli.calibrate import add_calibrate_arguments, run_calibrate

    return add_calibrate_arguments, ranks.in_process_group(run_calibrate)  # one process of a torchrun launch each


def _eval():
    from featcal.cli.evaluate import add_eval_arguments, run_eval

    return add_eval_arguments, run_eval


def _diagnose():
    from diagnostics import cli

    return cli.add_arguments, cli.run


def _tune():
    from featcal.cli.sweep import add_tune_arguments, run_tune

    return add_tune_arguments, run_tune


def _study():
    from featcal.cli.sweep import add_study_arguments, run_study

    return add_study_arguments, run_study


def _compare():
    from diagnostics import compare_cli

    return compare_cli.add_arguments, compare_cli.run


def _reproduce():
    from featcal.cli import reproduce

    return reproduce.add_arguments, reproduce.run


def _app():
    from featcal.cli import app

    return app.add_arguments, app.run


COMMANDS: dict[str, tuple[str, Load]] = {
    "zoo": ("build or inspect zoos", _zoo),
    "merge": ("merge the experts of a zoo and save the model", _merge),
    "calibrate": ("merge, then calibrate with FeatCal; save the model and report.json", _calibrate),
    "eval": ("per-task accuracy of the zoo's models or a saved one", _eval),
    "diagnose": (
        "feature-drift diagnostics of a merged, calibrated or saved model against the zoo's experts",
        _diagnose,
    ),
    "tune": ("choose FeatCal's (lam, rho, alpha) on the validation split", _tune),
    "study": ("the paper's studies: sample efficiency, robustness to corrupted calibration data", _study),
    "compare": ("run several methods on a zoo and compare them side by side", _compare),
    "reproduce": ("run a FeatCal-paper table's rows on a zoo and print them beside the paper's", _reproduce),
    "app": ("run the Streamlit app (on 127.0.0.1 unless --host is given)", _app),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand in :data:`COMMANDS`; ``command``'s options declared (its module
    loaded, ``args.func`` its run), the others' only named with their help."""
    parser = argparse.ArgumentParser(prog="featcal", description="Post-merging feature calibration.")
    parser.add_argument("--traceback", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, load) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            add_arguments, run = load()
            add_arguments(p)
            p.set_defaults(func=run)
    return parser


def command_of(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is not an option (``featcal`` itself takes
    only ``--traceback`` and ``--help``)."""
    return next((word for word in argv if not word.startswith("-")), None)


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that end in one ``featcal: error:`` line: bad input, an output directory that exists or
    is locked, another rank of a torchrun launch that stopped or hangs. Imported when one is raised (the
    last two live beside torch)."""
    from featcal.cli.common import UserError
    from featcal.engine.distributed import DistributedError
    from featcal.util.outdir import OutputLockedError

    builtin = (FileNotFoundError, FileExistsError, NotADirectoryError, ValueError)
    return (UserError, *builtin, DistributedError, OutputLockedError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(command_of(argv)).parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("featcal: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `featcal eval ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as err:
        if isinstance(err, OSError) and err.errno in WRITE_ERRNOS and not args.traceback:
            print(f"featcal: error: {write_error(err)}", file=sys.stderr)
            return 2
        if args.traceback or not isinstance(err, user_errors()):
            raise
        msg = str(err).strip() or type(err).__name__
        print(f"featcal: error: {msg}", file=sys.stderr)
        return 2


# The machine's refusals to write (disk or quota full, a read-only or forbidden place): the user's to fix.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}


def write_error(err: OSError) -> str:
    """One line for a refused write: what the system said, where, and the way forward."""
    where = f" ({err.filename})" if err.filename else ""
    return (
        f"{err.strerror or err}{where}. Free space or choose a writable --out and run the command again "
        "(a streamed calibration continues with --resume)."
    )


if __name__ == "__main__":
    sys.exit(main())

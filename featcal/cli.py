"""The ``featcal`` command line (also ``python -m featcal``).

    featcal zoo build-demo [--variant default|fashion] [--rebuild]
    featcal zoo info --zoo demo
    featcal merge --zoo demo --method task_arithmetic --param scale=0.3 --out runs/ta
    featcal calibrate --zoo demo --merge task_arithmetic --preset clip --n-per-task 256 --out runs/fc
    featcal eval --zoo demo                       # base, experts, Task Arithmetic
    featcal eval --zoo demo --model runs/fc --json runs/fc/eval.json

Subcommands live in ``COMMANDS = {name: (add_arguments, run)}``; another module
adds its own with :func:`register` (``add_arguments(parser)`` declares the
options, ``run(args) -> int`` does the work). The optional modules in
``EXTENSIONS`` are imported when present and given :func:`register`.

Bad input (a zoo that does not exist, an output directory that does, an
unknown merge method, an invalid hyper-parameter) ends with one
``featcal: error: ...`` line and exit status 2; ``--traceback`` shows the
traceback instead. Heavy imports (torch, transformers) happen inside the
subcommands, so ``featcal --help`` is quick.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Callable

AddArguments = Callable[[argparse.ArgumentParser], object]
Run = Callable[[argparse.Namespace], "int | None"]

COMMANDS: dict[str, tuple[AddArguments, Run]] = {}
HELP: dict[str, str] = {}
EXTENSIONS = ("diagnostics.cli", "featcal.tune_cli")


class UserError(Exception):
    """Bad input on the command line: reported as one line, without a traceback."""


def register(name: str, add_arguments: AddArguments, run: Run, help: str | None = None) -> None:
    """Add (or replace) the subcommand ``name``."""
    COMMANDS[name] = (add_arguments, run)
    if help:
        HELP[name] = help


# ------------------------------------------------------------------ shared options

def _add_zoo(p: argparse.ArgumentParser) -> None:
    p.add_argument("--zoo", default="demo",
                   help="'demo', 'demo-fashion', a YAML spec or a zoo directory (default: demo)")


def _add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory (must not exist unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing output directory")


def add_common(p: argparse.ArgumentParser) -> None:
    """``--device``, ``--threads`` and ``--quiet``, shared by every subcommand that loads a zoo."""
    p.add_argument("--device", default="cpu", help="torch device for the models (default: cpu)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: torch's; 1 is fastest for the demo "
                        "zoo on a busy machine)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


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
    from featcal.merging import MERGERS

    if method not in MERGERS:
        raise UserError(f"unknown merge method {method!r}; choose one of {', '.join(sorted(MERGERS))}.")
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
    subcommand that writes calls it first (save_model checks again when writing)."""
    if Path(out).expanduser().exists() and not force:
        raise UserError(f"output {out!r} already exists; pass --force to replace it.")


def apply_threads(args) -> None:
    """Honour ``--threads`` (see :func:`add_common`)."""
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _load_zoo(args):
    from featcal.zoo import load_any

    apply_threads(args)
    return load_any(args.zoo, progress=not args.quiet, device=args.device)


def _model_device(zoo):
    from featcal.zoo.core import _device_of

    return _device_of(zoo.base)


# ------------------------------------------------------------------ zoo

def add_zoo_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="zoo_command", required=True, metavar="{build-demo,info}")
    b = sub.add_parser("build-demo", help="build (or rebuild) the embedded demo zoo in the cache")
    b.add_argument("--variant", default="default", choices=("default", "fashion"))
    b.add_argument("--rebuild", action="store_true", help="build afresh even if cached")
    b.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    i = sub.add_parser("info", help="where a zoo is and what it holds")
    _add_zoo(i)
    i.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def run_zoo(args) -> int:
    from featcal.zoo import load_any, load_demo

    t0 = time.perf_counter()
    if args.zoo_command == "build-demo":
        zoo = load_demo(rebuild=args.rebuild, progress=not args.quiet, variant=args.variant)
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
    _add_zoo(p)
    p.add_argument("--method", default="task_arithmetic", help="merge method (default: task_arithmetic)")
    p.add_argument("--param", action="append", metavar="NAME=VALUE",
                   help="a parameter of the method, e.g. scale=0.3 (repeatable)")
    _add_out(p)
    p.add_argument("--eval", action="store_true", help="also print the test accuracy")
    add_common(p)


def run_merge(args) -> int:
    params = parse_params(args.param, args.method)
    check_out(args.out, args.force)
    zoo = _load_zoo(args)
    model = zoo.merged(args.method, **params)
    info = {"zoo": args.zoo, "method": args.method, "params": params}
    out = _write(args, zoo, model, "merge.json", info, scored={args.method: model})
    print(f"wrote {out}")
    return 0


def _write(args, zoo, model, json_name: str, doc: dict, scored: dict) -> Path:
    """With ``--eval``, score the ``scored`` models on the test split into ``doc``; then save
    ``model`` in the zoo's format with ``doc`` as ``json_name`` (atomically, see save_model)."""
    from featcal.zoo.io import save_model

    if args.eval:
        doc["accuracy"] = _eval_and_print(scored, zoo, "test")
    return save_model(model, args.out, fmt=zoo.fmt, force=args.force, extra_files={json_name: doc})


# ------------------------------------------------------------------ calibrate

def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    _add_zoo(p)
    p.add_argument("--merge", default="task_arithmetic", help="merge method (default: task_arithmetic)")
    p.add_argument("--merge-param", action="append", metavar="NAME=VALUE",
                   help="a parameter of the merge method (repeatable; default: its own defaults)")
    p.add_argument("--preset", default="clip", choices=("clip", "none"),
                   help="clip: the paper's CLIP setting with the reference run's token weights; "
                        "none: plain FeatCalConfig (default: clip)")
    p.add_argument("--lam", type=float, help="lambda, ridge strength toward the anchor")
    p.add_argument("--rho", type=float, help="rho, anchor blend rho*W_mer + (1-rho)*W_0")
    p.add_argument("--alpha", type=float, help="alpha, target interpolation alpha*x_e + (1-alpha)*x_s")
    p.add_argument("--no-bias", action="store_true", help="keep the merged Linear biases")
    p.add_argument("--no-layernorm", action="store_true", help="keep the merged LayerNorm affines")
    p.add_argument("--n-per-task", type=int, default=256, help="calibration examples per task (default 256)")
    p.add_argument("--seed", type=int, default=42, help="seed of the calibration sample (default 42)")
    p.add_argument("--batch-size", type=int, default=16, help="calibration batch size (default 16)")
    _add_out(p)
    p.add_argument("--eval", action="store_true", help="also evaluate (test split) and record it")
    add_common(p)


def config_from_args(args):
    """The :class:`FeatCalConfig` the options ask for (validated by the config itself)."""
    from featcal import FeatCalConfig

    overrides = {k: getattr(args, k) for k in ("lam", "rho", "alpha") if getattr(args, k) is not None}
    if args.no_bias:
        overrides["bias"] = False
    if args.no_layernorm:
        overrides["layernorm"] = False
    return FeatCalConfig.clip(**overrides) if args.preset == "clip" else FeatCalConfig(**overrides)


def run_calibrate(args) -> int:
    from featcal import calibrate

    params = parse_params(args.merge_param, args.merge)
    cfg = config_from_args(args)
    if args.n_per_task < 1:
        raise UserError(f"--n-per-task must be at least 1, got {args.n_per_task}.")
    check_out(args.out, args.force)
    zoo = _load_zoo(args)
    merged = zoo.merged(args.merge, **params)
    data = zoo.calib_data(args.n_per_task, seed=args.seed, batch_size=args.batch_size)
    model, report = calibrate(merged, base=zoo.base, experts=zoo.experts, calib_data=data,
                              config=cfg, progress=not args.quiet)
    doc = {"zoo": args.zoo, "merge": {"method": args.merge, "params": params},
           "n_per_task": args.n_per_task, "seed": args.seed, "batch_size": args.batch_size,
           "preset": args.preset, "report": report.to_dict()}
    out = _write(args, zoo, model, "report.json", doc, scored={args.merge: merged, "featcal": model})
    print(f"calibrated in {report.seconds:.1f} s; wrote {out}")
    return 0


# ------------------------------------------------------------------ eval

def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    _add_zoo(p)
    p.add_argument("--model", action="append", metavar="DIR",
                   help="a saved model to evaluate (repeatable); without it: base, experts, merges")
    p.add_argument("--merge", action="append", metavar="METHOD",
                   help="merges to evaluate with their default parameters when no --model is given "
                        "(repeatable; default: task_arithmetic)")
    p.add_argument("--split", default="test", help="split to score (calib, val, test; default test)")
    p.add_argument("--max-per-task", type=int, help="score only the first N examples of each task")
    p.add_argument("--json", metavar="PATH", help="also write the scores as JSON")
    add_common(p)


def run_eval(args) -> int:
    from featcal.merging import MERGERS
    from featcal.zoo.io import load_model
    from featcal.zoo.scores import expert_accuracies, write_scores

    for d in args.model or []:
        if not Path(d).is_dir():
            raise UserError(f"--model {d!r} does not exist.")
    merges = args.merge or ([] if args.model else ["task_arithmetic"])
    for m in merges:
        if m not in MERGERS:
            raise UserError(f"unknown merge method {m!r}; choose one of {', '.join(sorted(MERGERS))}.")
    zoo = _load_zoo(args)
    kw = {"split": args.split, "max_per_task": args.max_per_task}
    experts = expert_accuracies(zoo, **kw)
    if args.model:
        models = {Path(d).name: load_model(d, like=zoo.base).to(_model_device(zoo)) for d in args.model}
        scores = {}
    else:
        models = {m: zoo.merged(m) for m in merges}
        scores = {"base": _evaluate(zoo.base, zoo, kw), "experts": experts}
    scores.update({name: _evaluate(m, zoo, kw) for name, m in models.items()})
    _print_table(scores, experts)
    if args.json:
        write_scores(args.json, scores, zoo=args.zoo, split=args.split, expert_accs=experts)
        print(f"wrote {args.json}")
    return 0


def _evaluate(model, zoo, kw) -> dict:
    from featcal.zoo.core import evaluate

    return evaluate(model, zoo, **kw)


def _eval_and_print(models: dict, zoo, split: str) -> dict:
    from featcal.zoo.scores import expert_accuracies

    experts = expert_accuracies(zoo, split=split)
    scores = {name: _evaluate(m, zoo, {"split": split}) for name, m in models.items()}
    _print_table({"experts": experts, **scores}, experts)
    return scores


def _print_table(scores: dict, experts: dict) -> None:
    from featcal.zoo.scores import average, markdown_table, normalized

    print(markdown_table(scores))
    for name, accs in scores.items():
        if name != "experts":
            print(f"{name}: average {average(accs):.2f}, "
                  f"expert-normalised {average(normalized(accs, experts)):.2f}")


# ------------------------------------------------------------------ wiring

register("zoo", add_zoo_arguments, run_zoo, "build or inspect zoos")
register("merge", add_merge_arguments, run_merge, "merge the experts of a zoo and save the model")
register("calibrate", add_calibrate_arguments, run_calibrate,
         "merge, then calibrate with FeatCal; save the model and report.json")
register("eval", add_eval_arguments, run_eval, "per-task accuracy of the zoo's models or a saved one")


def load_extensions() -> None:
    """Import each of ``EXTENSIONS`` that exists and let it :func:`register` its
    subcommands. Only a missing module is skipped: an error inside one is raised."""
    for name in EXTENSIONS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name and (name == err.name or name.startswith(err.name + ".")):
                continue
            raise
        hook = getattr(module, "register", None)
        if callable(hook):
            hook(register)


def build_parser() -> argparse.ArgumentParser:
    load_extensions()
    parser = argparse.ArgumentParser(prog="featcal", description="Post-merging feature calibration.")
    parser.add_argument("--traceback", action="store_true", help="show tracebacks of errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=HELP.get(name), description=HELP.get(name))
        add_arguments(p)
        p.set_defaults(func=run)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    return (UserError, FileNotFoundError, FileExistsError, NotADirectoryError, ValueError)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except _user_errors() as err:
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

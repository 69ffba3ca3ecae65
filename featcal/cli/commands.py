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
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from diagnostics import cli as diagnose_cli
from diagnostics import compare_cli
from featcal.baselines.registry import MERGERS_WITH_DATA, merge_with_data, zoo_logits
from featcal.cli import app as app_launch
from featcal.cli import ranks
from featcal.cli import sweep as tune_cli
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
from featcal.cli.formats import (
    add_checkpoint_options,
    add_from_fusionbench,
    run_calibrate_mergekit,
    run_from_fusionbench,
    streamed_options,
)
from featcal.config import FeatCalConfig
from featcal.engine.distributed import DistributedError
from featcal.engine.run import calibrate
from featcal.model.streams import device_of
from featcal.util.outdir import OutputLockedError, output_lock
from featcal.zoo import BUILT, NAMES, evaluate, load_any, load_demo
from featcal.zoo.io import load_model, save_model, zoo_card
from featcal.zoo.scores import average, expert_accuracies, markdown_table, normalized, write_scores

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
        out = _write(args, zoo, model, "merge.json", info, scored={args.method: model})
    print(f"wrote {out}")
    return 0


def _write(args, zoo, model, json_name: str, doc: dict, scored: dict) -> Path:
    """With ``--eval``, score the ``scored`` models on the test split into ``doc``; then save
    ``model`` in the zoo's format with ``doc`` as ``json_name`` (atomically, see save_model)."""
    if args.eval:
        doc["accuracy"] = _eval_and_print(scored, zoo, "test")
    merge = doc.get("merge") or {"method": doc.get("method"), "params": doc.get("params")}
    calibration = {"n_per_task": doc["n_per_task"], "seed": doc["seed"]} if "report" in doc else None
    card = zoo_card(zoo, merge, doc.get("report"), scores=doc.get("accuracy"), calibration=calibration)
    return save_model(
        model,
        args.out,
        fmt=zoo.fmt,
        force=args.force,
        extra_files={json_name: doc},
        hub=card,
        inputs=zoo_inputs(args, zoo),
    )


# ------------------------------------------------------------------ calibrate


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    add_zoo(p)
    p.add_argument("--merge", default="task_arithmetic", help="merge method (default: task_arithmetic)")
    add_param(p, old=("--merge-param",))
    p.add_argument(
        "--preset",
        choices=("auto", *PRESETS),
        help="clip: the paper's CLIP setting with the reference run's token weights; flan-t5, llama-3b, "
        "llama-8b: the paper's FLAN-T5 and Llama settings; none: plain FeatCalConfig; auto (default): the "
        "preset of the architecture loaded (CLIP, T5, Llama-family by width, else none), printed",
    )
    p.add_argument("--lam", type=float, help="lambda, ridge strength toward the anchor")
    p.add_argument("--rho", type=float, help="rho, anchor blend rho*W_mer + (1-rho)*W_0")
    p.add_argument("--alpha", type=float, help="alpha, target interpolation alpha*x_e + (1-alpha)*x_s")
    p.add_argument("--no-bias", action="store_true", help="keep the merged Linear biases")
    p.add_argument("--no-layernorm", action="store_true", help="keep the merged LayerNorm affines")
    p.add_argument("--n-per-task", type=int, default=256, help="calibration examples per task (default 256)")
    p.add_argument("--seed", type=int, default=42, help="seed of the calibration sample (default 42)")
    p.add_argument("--batch-size", type=int, default=16, help="calibration batch size (default 16)")
    add_out(p)
    p.add_argument("--eval", action="store_true", help="also evaluate (test split) and record it")
    c = p.add_argument_group(
        "checkpoints", "calibrate model directories (save_pretrained layout) streamed block by block, instead of a zoo"
    )
    c.add_argument("--base", metavar="DIR", help="the base model's directory")
    c.add_argument(
        "--expert",
        action="append",
        metavar="NAME=DIR",
        help="an expert's task name and directory: a model, or a PEFT LoRA adapter on --base (repeatable)",
    )
    c.add_argument("--merged", metavar="DIR", help="the merged model's directory (instead of --merge on the fly)")
    c.add_argument(
        "--data", metavar="FILE", help="calibration tokens: a safetensors file of TASK.input_ids [TASK.attention_mask]"
    )
    c.add_argument("--resume", action="store_true", help="continue a run that was killed part-way")
    add_checkpoint_options(c)
    p.add_argument("--stats-dtype", choices=("float32", "float64"), help="statistics and solve dtype (default float32)")
    add_common(p)


def config_from_args(args, preset: str | None = None):
    """The :class:`FeatCalConfig` the options ask for (validated by the config itself);
    ``preset`` instead of ``args.preset`` (e.g. to check the options before a zoo is loaded)."""
    overrides = {k: getattr(args, k) for k in ("lam", "rho", "alpha") if getattr(args, k) is not None}
    if args.no_bias:
        overrides["bias"] = False
    if args.no_layernorm:
        overrides["layernorm"] = False
    if getattr(args, "stats_dtype", None):
        overrides["stats_dtype"] = getattr(torch, args.stats_dtype)
    preset = preset or args.preset or "clip"
    if preset == "clip":
        return FeatCalConfig.clip(**overrides)
    if preset == "flan-t5":
        return FeatCalConfig.flan_t5(**overrides)
    if preset.startswith("llama-"):
        return FeatCalConfig.llama(preset.removeprefix("llama-"), **overrides)
    return FeatCalConfig(**overrides)


PRESETS = ("clip", "flan-t5", "llama-3b", "llama-8b", "none")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3", "olmo", "smollm")
LLAMA_8B_WIDTH = 4096  # Llama-3.1-8B's hidden size; narrower Llama-family models take the 3B setting


def preset_for(config: dict) -> tuple[str, str]:
    """``(preset, why)`` for a Hugging Face ``config.json`` dict: ``clip`` for CLIP models,
    ``flan-t5`` for T5, ``llama-8b`` / ``llama-3b`` for Llama-family decoders by width, ``none``
    (plain FeatCalConfig) for any other architecture."""
    model_type = str(config.get("model_type", "")).lower()
    archs = " ".join(config.get("architectures") or []).lower()
    width = config.get("hidden_size") or config.get("d_model")
    if model_type.startswith("clip") or "clip" in archs:
        return "clip", f"model_type {model_type!r} is CLIP"
    if model_type in ("t5", "mt5", "umt5") or "t5" in archs:
        return "flan-t5", f"model_type {model_type!r} is T5"
    if model_type in LLAMA_FAMILY or "llama" in archs:
        size = "8b" if (width or 0) >= LLAMA_8B_WIDTH else "3b"
        return f"llama-{size}", f"model_type {model_type!r} is Llama-family, hidden size {width}"
    return "none", f"model_type {model_type!r} has no paper setting"


def preset_for_model(model) -> tuple[str, str]:
    """:func:`preset_for` of an ``nn.Module``: its Hugging Face config when it has one, else
    its class name (an open_clip or plain torch model)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        cfg = config.to_dict()
        cfg.setdefault("architectures", [type(model).__name__])
        return preset_for(cfg)
    return preset_for({"model_type": "", "architectures": [type(model).__name__]})


def choose_preset(args, found: tuple[str, str]) -> None:
    """Set ``args.preset`` from what was loaded unless the user chose one; say which, and why."""
    if args.preset in (None, "auto"):
        args.preset, why = found
        print(f"featcal: preset {args.preset!r} ({why}; --preset to choose another)", file=sys.stderr)


def run_calibrate_checkpoints(args) -> int:
    """``featcal calibrate --base DIR --expert NAME=DIR ...``: the streamed run (featcal.streaming.run)."""
    if not args.expert:
        raise UserError("--base needs at least one --expert NAME=DIR.")
    experts = {}
    for item in args.expert:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UserError(f"--expert {item!r}: expected NAME=DIR (e.g. math=ckpt/math).")
        if name in experts:
            raise UserError(f"--expert {name}= is given twice ({experts[name]!r} and {path!r}); give each task once.")
        experts[name] = path
    choose_preset(args, preset_for(_read_config(args.base)))
    cfg = config_from_args(args)
    merge = None if args.merged else (args.merge, parse_params(args.param, args.merge))
    kw = streamed_options(args)
    inputs = {"the base": args.base, "--data": args.data, "--merged": args.merged}
    check_out(args.out, args.force, inputs | {f"expert {t!r}": p for t, p in experts.items()})
    apply_threads(args)
    try:
        report = _stream(args, experts, merge, cfg, kw)
    except KeyboardInterrupt:
        print("featcal: the finished blocks are kept; add --resume to continue from them.", file=sys.stderr)
        raise
    if ranks.is_main():
        print(f"calibrated {len(report.blocks)} blocks in {report.seconds:.1f} s; wrote {args.out}")
    return 0


def _read_config(path: str) -> dict:
    """The base directory's ``config.json`` (empty when it has none: the streamed run says why)."""
    import json

    file = os.path.join(path, "config.json")
    return json.loads(open(file).read()) if os.path.isfile(file) else {}


def _stream(args, experts: dict, merge, cfg, kw: dict):
    from featcal.streaming.run import calibrate_checkpoints

    return calibrate_checkpoints(args.base, experts, merge=merge, merged=args.merged, config=cfg, **kw)


def run_calibrate(args) -> int:
    if args.mergekit:
        args.preset = "llama-8b" if args.preset in (None, "auto") else args.preset
        return run_calibrate_mergekit(args, config_from_args(args))
    if args.base:
        return run_calibrate_checkpoints(args)
    if args.expert or args.merged or args.data or args.resume or args.trust_remote_code:
        raise UserError(
            "--expert, --merged, --data, --resume and --trust-remote-code go with --base (model directories), "
            "not --zoo."
        )
    params = parse_params(args.param, args.merge)
    if args.n_per_task < 1:
        raise UserError(f"--n-per-task must be at least 1, got {args.n_per_task}.")
    config_from_args(args, "none" if args.preset in (None, "auto") else None)  # bad values fail before loading
    check_out(args.out, args.force, zoo_inputs(args))
    with output_lock(args.out) if ranks.is_main() else contextlib.nullcontext():  # rank 0 writes
        zoo = ranks.rank0_first(lambda: zoo_from_args(args))
        choose_preset(args, preset_for_model(zoo.base))
        cfg = config_from_args(args)
        merged = zoo.merged(args.merge, **params)
        data = zoo.calib_data(args.n_per_task, seed=args.seed, batch_size=args.batch_size)
        model, report = calibrate(
            merged, base=zoo.base, experts=zoo.experts, calib_data=data, config=cfg, progress=not args.quiet
        )
        if not ranks.is_main():  # rank 0 writes (and evaluates)
            return 0
        doc = {
            "zoo": args.zoo,
            "merge": {"method": args.merge, "params": params},
            "n_per_task": args.n_per_task,
            "seed": args.seed,
            "batch_size": args.batch_size,
            "preset": args.preset,
            "report": report.to_dict(),
        }
        out = _write(args, zoo, model, "report.json", doc, scored={args.merge: merged, "featcal": model})
    print(f"calibrated in {report.seconds:.1f} s; wrote {out}")
    return 0


# ------------------------------------------------------------------ eval


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    add_zoo(p)
    p.add_argument(
        "--model",
        action="append",
        metavar="DIR",
        help="a saved model to evaluate (repeatable); without it: base, experts, merges",
    )
    p.add_argument(
        "--merge",
        action="append",
        metavar="METHOD",
        help="merges to evaluate with their default parameters when no --model is given "
        "(repeatable; default: task_arithmetic)",
    )
    p.add_argument("--split", default="test", help="split to score (calib, val, test; default test)")
    p.add_argument("--max-per-task", type=int, help="score only the first N examples of each task")
    p.add_argument("--json", metavar="PATH", help="also write the scores as JSON")
    add_common(p)


def run_eval(args) -> int:
    for d in args.model or []:
        if not Path(d).is_dir():
            raise UserError(f"--model {d!r} does not exist.")
    merges = args.merge or ([] if args.model else ["task_arithmetic"])
    for m in merges:
        check_merge_method(m)
    zoo = zoo_from_args(args)
    kw = {"split": args.split, "max_per_task": args.max_per_task}
    experts = expert_accuracies(zoo, **kw)
    if args.model:
        models = {Path(d).name: load_model(d, like=zoo.base).to(device_of(zoo.base)) for d in args.model}
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
    return evaluate(model, zoo, **kw)


def _eval_and_print(models: dict, zoo, split: str) -> dict:
    experts = expert_accuracies(zoo, split=split)
    scores = {name: _evaluate(m, zoo, {"split": split}) for name, m in models.items()}
    _print_table({"experts": experts, **scores}, experts)
    return scores


def _print_table(scores: dict, experts: dict) -> None:
    print(markdown_table(scores))
    for name, accs in scores.items():
        if name != "experts":
            print(f"{name}: average {average(accs):.2f}, expert-normalised {average(normalized(accs, experts)):.2f}")


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

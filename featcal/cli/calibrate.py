"""``featcal calibrate``: FeatCal on a zoo (in memory) or on model directories streamed block by block
(``--base/--expert``, ``--mergekit``), the preset chosen from the architecture it loads."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from featcal.cli import ranks
from featcal.cli.common import (
    UserError,
    add_common,
    add_out,
    add_param,
    add_zoo,
    apply_threads,
    check_out,
    parse_params,
    zoo_from_args,
    zoo_inputs,
)
from featcal.cli.evaluate import write_output
from featcal.cli.formats import (
    add_checkpoint_options,
    read_mergekit,
    run_calibrate_mergekit,
    streamed_options,
)
from featcal.config import PRESETS, RANGES, preset_config, preset_for, preset_for_model
from featcal.engine.run import calibrate
from featcal.util.outdir import output_lock


def add_calibrate_arguments(p: argparse.ArgumentParser) -> None:
    add_zoo(p)
    p.add_argument("--merge", default="task_arithmetic", help="merge method (default: task_arithmetic)")
    add_param(p)
    p.add_argument(
        "--preset",
        choices=("auto", *PRESETS),
        help="clip: the paper's CLIP setting with the reference run's token weights; flan-t5, llama-3b, "
        "llama-8b: the paper's FLAN-T5 and Llama settings; none: plain FeatCalConfig; auto (default): the "
        "preset of the architecture loaded (CLIP, T5, Llama-family by width, else none), printed",
    )
    for name in ("lam", "rho", "alpha"):  # their ranges: featcal.config.RANGES, checked by the config
        p.add_argument(f"--{name}", type=float, help=RANGES[name].what)
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
    p.add_argument(
        "--stats-dtype",
        choices=("float32", "float64"),
        help="statistics and solve dtype (default: float64 for the flan-t5 and llama-3b presets, whose lam 1e-5 "
        "needs it; float32 otherwise)",
    )
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
    return preset_config(preset or args.preset or "clip", **overrides)


def choose_preset(args, found: tuple[str, str]) -> None:
    """Set ``args.preset`` from what was loaded unless the user chose one; say which, and why."""
    if args.preset in (None, "auto"):
        args.preset, why = found
        print(f"featcal: preset {args.preset!r} ({why}; --preset to choose another)", file=sys.stderr)


def run_calibrate_checkpoints(args) -> int:
    """``featcal calibrate --base DIR --expert NAME=DIR ...``: the streamed run (featcal.streaming.run)."""
    if not args.expert:
        raise UserError("--base needs at least one --expert NAME=DIR.")
    from featcal.model.checkpoints import model_dir_problem

    problem = model_dir_problem(args.base, "--base")
    if problem:
        raise UserError(problem)
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
        recipe = read_mergekit(args)  # every key checked and every model found before any work
        choose_preset(args, preset_for(_read_config(recipe.base)))  # the architecture the recipe merges
        return run_calibrate_mergekit(args, recipe, config_from_args(args))
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
        out = write_output(args, zoo, model, "report.json", doc, scored={args.merge: merged, "featcal": model})
    print(f"calibrated in {report.seconds:.1f} s; wrote {out}")
    return 0

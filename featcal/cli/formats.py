"""The command line's entry points for models featcal did not make (docs/formats.md):

    featcal calibrate --base DIR --expert math=ADAPTER_DIR ... --data toks.safetensors --out OUT
    featcal calibrate --mergekit merge.yml [--merged DIR] --data toks.safetensors --out OUT [--task-name MODEL=NAME]
    featcal zoo from-fusionbench MODELPOOL.yaml [--taskpool TASKPOOL.yaml] --out my-zoo.yaml

:mod:`featcal.cli.commands` adds these options to its subcommands and calls the runners.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from featcal.cli.common import UserError, apply_threads


def add_checkpoint_options(c: argparse._ArgumentGroup) -> None:
    """``featcal calibrate``'s options for LoRA experts, added vocabularies and mergekit configs."""
    c.add_argument(
        "--common-rows",
        action="store_true",
        help="experts with added tokens (more embedding rows than the base): calibrate the rows the base has",
    )
    c.add_argument(
        "--lora-any-base",
        action="store_true",
        help="accept LoRA adapters whose adapter_config.json names another base (shapes are still checked)",
    )
    c.add_argument(
        "--mergekit",
        metavar="YAML",
        help="a mergekit config: base and experts from it; with --merged, mergekit's output, else featcal's merge",
    )
    c.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="build a model class from the checkpoint's own Python code (config.json's auto_map); off by "
        "default, and never taken from a file",
    )
    c.add_argument(
        "--task-name",
        action="append",
        metavar="MODEL=NAME",
        help="--mergekit: rename an expert (default: its directory's last path component; repeatable)",
    )


def streamed_options(args) -> dict:
    """The keywords of :func:`featcal.calibrate_checkpoints` the options give: ``calib_data``,
    ``out`` and its :class:`~featcal.streaming.options.StreamOptions`."""
    from featcal.model.checkpoints import load_token_data
    from featcal.streaming.options import StreamOptions

    if args.batch_size < 1:
        raise UserError(f"--batch-size must be at least 1, got {args.batch_size}.")
    if not args.data or not os.path.isfile(args.data):
        raise UserError(
            f"--data {args.data!r} does not exist; give a safetensors file of TASK.input_ids "
            "(featcal.model.checkpoints.save_token_data)."
            if args.data
            else "give --data FILE (a safetensors file of TASK.input_ids, see featcal.model.checkpoints)."
        )
    options = StreamOptions(
        device=args.device,
        resume=args.resume,
        force=args.force,
        progress=not args.quiet,
        common_rows=args.common_rows,
        lora_any_base=args.lora_any_base,
        trust_remote_code=args.trust_remote_code,
        card={"preset": args.preset} if args.preset not in (None, "auto") else None,  # (chosen by now)
    )
    return dict(calib_data=load_token_data(args.data, args.batch_size), out=args.out, options=options)


def read_mergekit(args):
    """The ``--mergekit`` YAML, read and checked (:func:`featcal.baselines.mergekit.read_recipe`), with the
    ``--task-name MODEL=NAME`` renames."""
    from featcal.baselines.mergekit import read_recipe

    if args.base or args.expert:
        raise UserError("--mergekit takes the base and experts from its config; drop --base/--expert.")
    names = {}
    for item in args.task_name or []:
        model, sep, name = item.partition("=")
        if not sep or not model or not name:
            raise UserError(f"--task-name {item!r}: expected MODEL=NAME (e.g. ./ckpt/math-7b=math).")
        names[model] = name
    return read_recipe(args.mergekit, names, merged=args.merged is not None)


def run_calibrate_mergekit(args, recipe, config) -> int:
    """``featcal calibrate --mergekit merge.yml ...`` (:func:`featcal.baselines.mergekit.calibrate_mergekit`)
    on the ``recipe`` :func:`read_mergekit` read."""
    from featcal.baselines.mergekit import calibrate_mergekit

    kw = streamed_options(args)
    apply_threads(args)
    try:
        report = calibrate_mergekit(recipe, merged=args.merged, config=config, **kw)
    except KeyboardInterrupt:
        print("featcal: the finished blocks are kept; add --resume to continue from them.", file=sys.stderr)
        raise
    print(f"calibrated {len(report.blocks)} blocks in {report.seconds:.1f} s; wrote {args.out}")
    return 0


def add_from_fusionbench(sub) -> None:
    """``featcal zoo from-fusionbench MODELPOOL.yaml [--taskpool TASKPOOL.yaml] --out my-zoo.yaml``."""
    f = sub.add_parser("from-fusionbench", help="write a zoo spec from a FusionBench model pool (and task pool)")
    f.add_argument("modelpool", help="a FusionBench CLIPVisionModelPool, CausalLMPool or Seq2SeqLMPool YAML")
    f.add_argument("--taskpool", help="its task pool YAML (CLIP: the test data sets and the text model)")
    f.add_argument("--config-dir", help="FusionBench's config/ folder, for the pools' Hydra defaults (dataset/...)")
    f.add_argument("--out", required=True, help="the zoo spec to write (.yaml)")
    f.add_argument("--force", action="store_true", help="replace an existing --out file")


def run_from_fusionbench(args) -> int:
    from featcal.zoo.formats.fusionbench import from_fusionbench, write_spec

    if Path(args.out).suffix.lower() not in (".yaml", ".yml"):
        raise UserError(f"--out {args.out!r}: a zoo spec is a .yaml file.")
    spec = from_fusionbench(args.modelpool, args.taskpool, config_dir=args.config_dir)
    sources = [args.modelpool] + ([args.taskpool] if args.taskpool else [])
    missing = write_spec(spec, args.out, sources, force=args.force)
    print(f"wrote {args.out}: {len(spec['experts'])} experts ({', '.join(spec['experts'])})")
    text = spec.get("heads", {}).get("text_model")  # a generative zoo has no heads
    if text:
        print(
            f"note: the task pool's CLIP model {text.get('id') or text.get('path')} is not the pool's base "
            f"{spec['base'].get('id') or spec['base'].get('path')}; the zero-shot heads use its text tower "
            "(FusionBench's task pools for other bases, e.g. *_B16, *_L14, name theirs)."
        )
    if missing:
        print("\n".join(missing))
    else:
        print(f"everything is in the Hugging Face cache: featcal zoo info --zoo {args.out}")
    return 0

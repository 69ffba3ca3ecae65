"""``featcal eval`` and what every writing subcommand shares: score models on a split, print the
table, and save a model with its JSON record and model card (``write_output``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from featcal.cli.common import (
    UserError,
    add_common,
    add_zoo,
    check_merge_method,
    zoo_from_args,
    zoo_inputs,
)
from featcal.model.streams import device_of
from featcal.zoo import evaluate
from featcal.zoo.io import load_model, save_model, zoo_card
from featcal.zoo.scores import average, expert_accuracies, markdown_table, normalized, write_scores


def write_output(args, zoo, model, json_name: str, doc: dict, scored: dict) -> Path:
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
        if Path(d).is_file():
            raise UserError(
                f"--model {d!r} is a file; give the model's directory (the one featcal calibrate --out wrote, "
                f"here probably {str(Path(d).parent)!r})."
            )
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

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
from featcal.zoo.score.scores import average, expert_accuracies, markdown_table, normalized, write_scores


def write_output(args, zoo, model, json_name: str, doc: dict, scored: dict) -> Path:
    """With ``--eval``, score the ``scored`` models on the test split into ``doc``; then save
    ``model`` in the zoo's format with ``doc`` as ``json_name`` (atomically, see save_model)."""
    if args.eval:
        doc["accuracy"] = _eval_and_print(scored, zoo, "test")
    merge = doc.get("merge") or {"method": doc.get("method"), "params": doc.get("params")}
    calibration = {"n_per_task": doc["n_per_task"], "seed": doc["seed"]} if "report" in doc else None
    card = zoo_card(
        zoo, merge, doc.get("report"), scores=doc.get("accuracy"), calibration=calibration, preset=doc.get("preset")
    )
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
    lm = p.add_argument_group("lm-eval-harness (language models given by --model; no zoo)")
    lm.add_argument(
        "--lm-eval",
        action="append",
        metavar="TASKS",
        help="score each --model with lm-eval on these tasks (comma-separated, repeatable): its registry's "
        "names or the task YAMLs under --lm-eval-tasks",
    )
    lm.add_argument("--lm-eval-tasks", metavar="PATH", help="a folder (or file) of your own lm-eval task YAMLs")
    lm.add_argument("--num-fewshot", type=int, help="lm-eval's few-shot examples per prompt (default: the task's)")
    lm.add_argument("--batch-size", type=int, default=8, help="lm-eval's batch size (default 8)")
    lm.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run Python code the model directory (auto_map) or a task YAML (!function) names",
    )
    add_common(p)


def _check_model_dirs(dirs: list[str]) -> None:
    for d in dirs:
        if Path(d).is_file():
            raise UserError(
                f"--model {d!r} is a file; give the model's directory (the one featcal calibrate --out wrote, "
                f"here probably {str(Path(d).parent)!r})."
            )
        if not Path(d).is_dir():
            raise UserError(f"--model {d!r} does not exist.")


def run_eval(args) -> int:
    _check_model_dirs(args.model or [])
    if args.lm_eval:
        return _run_lm_eval(args)
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


def _run_lm_eval(args) -> int:
    """``--lm-eval``: lm-eval's scores of each ``--model`` (a saved language model), printed as one
    table (rows: models; columns: task and metric) and written with ``--json``."""
    import json

    from featcal.zoo.score.harness import HarnessError, lm_eval_scores, load_lm

    if not args.model:
        raise UserError("--lm-eval scores saved language models: give one or more --model DIR.")
    tasks = [t.strip() for group in args.lm_eval for t in group.split(",") if t.strip()]
    scores = {}
    try:
        for d in args.model:
            model, tokenizer = load_lm(d, device=args.device, trust_remote_code=args.trust_remote_code)
            scores[Path(d).name] = lm_eval_scores(
                model,
                tokenizer,
                tasks,
                include=args.lm_eval_tasks,
                limit=args.max_per_task,
                batch_size=args.batch_size,
                num_fewshot=args.num_fewshot,
                allow_code=args.trust_remote_code,
            )
    except HarnessError as err:
        raise UserError(str(err)) from None
    columns = sorted({(t, m) for rows in scores.values() for t, ms in rows.items() for m in ms})
    print("| model | " + " | ".join(f"{t} {m}" for t, m in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name, rows in scores.items():
        cells = [f"{rows[t][m]:.4f}" if m in rows.get(t, {}) else "" for t, m in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        doc = {"lm_eval": scores, "tasks": tasks, "limit": args.max_per_task, "num_fewshot": args.num_fewshot}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0

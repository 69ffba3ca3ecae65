"""``featcal merge``: merge a zoo's experts with one method of the registry and save the model.

    featcal merge --zoo demo --method task_arithmetic --param scale=0.3 --out runs/ta
    featcal merge --zoo demo --method regmean_plusplus --n-per-task 256 --out runs/rmpp

The data-using methods draw ``--n-per-task`` examples of every task's calib split; ``--param`` is checked
against the registry before any work.
"""

from __future__ import annotations

import argparse

from featcal.baselines import runner
from featcal.baselines.registry import MERGERS_WITH_DATA
from featcal.cli.common import (
    UserError,
    add_common,
    add_out,
    add_param,
    add_zoo,
    check_merge_method,
    check_out,
    parse_params,
    zoo_from_args,
    zoo_inputs,
)
from featcal.cli.evaluate import write_output
from featcal.util.outdir import output_lock


def add_merge_arguments(p: argparse.ArgumentParser) -> None:
    add_zoo(p)
    p.add_argument("--method", default="task_arithmetic", help="merge method (default: task_arithmetic)")
    add_param(p)
    p.add_argument(
        "--n-per-task",
        type=int,
        default=256,
        help="data-using methods (regmean, lot, ...): examples per task from the calib split (default 256)",
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
        data = zoo.calib_data(args.n_per_task, seed=args.seed, batch_size=args.batch_size) if with_data else None
        model = runner.merge(zoo, args.method, data, params, progress=not args.quiet)
        if with_data:
            info.update(n_per_task=args.n_per_task, seed=args.seed, batch_size=args.batch_size)
        out = write_output(args, zoo, model, "merge.json", info, scored={args.method: model})
    print(f"wrote {out}")
    return 0

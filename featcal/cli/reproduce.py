"""``featcal reproduce``: run a FeatCal-paper table's rows on a zoo and print them beside the paper's.

    featcal reproduce --list                                   # the tables, their settings, the cells read
    featcal reproduce table1-b32                               # on assets/zoos/clip-vit-b32-ta8.yaml (offline)
    featcal reproduce table1-b32 --dry-run                     # the plan, forward passes, time and memory
    featcal reproduce table1-b32 --zoo my-b32.yaml --out runs/t1
    featcal reproduce table1-b32 --zoo demo --any-zoo --n 8 --max-test 64   # a smoke run: not comparable

The zoo defaults to the spec the table names (a file under assets/zoos/); a zoo that is not the table's
setting (other tasks, another base model, a built-in zoo) is refused before any work unless
``--any-zoo`` is given, and the printed table then says its numbers are not comparable. The paper's
figures are :mod:`featcal.reproduce.tables`' data (``--tables FILE`` reads another file of that form);
what runs is :mod:`featcal.reproduce.run`, the estimate :mod:`featcal.reproduce.estimate`.
``--out`` gets ``reproduce.json`` and ``reproduce.md`` (never over a directory featcal did not write).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from featcal.baselines import registry
from featcal.cli.common import UserError, add_common, apply_threads, check_out, zoo_from_args, zoo_inputs
from featcal.config import FLOAT64_PRESETS, preset_for_zoo
from featcal.reproduce import estimate, plan, report, setting, tables
from featcal.reproduce import run as runner
from featcal.zoo.io import atomic_dir


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``reproduce`` options on ``p``."""
    p.add_argument("table", nargs="?", help="the paper table to reproduce, e.g. table1-b32 (--list: every table)")
    p.add_argument("--list", action="store_true", help="list the tables: setting, zoo spec, rows and cells read")
    p.add_argument(
        "--zoo",
        default=None,
        help="a zoo spec (YAML), zoo directory, shipped spec name or built-in "
        "zoo (default: the table's spec under assets/zoos/)",
    )
    p.add_argument(
        "--any-zoo",
        action="store_true",
        help="run on a zoo that is not the table's setting (the numbers are then not comparable)",
    )
    p.add_argument(
        "--n",
        type=_positive,
        default=None,
        help="calibration examples per task for every row (default: the table's, e.g. 256)",
    )
    p.add_argument("--seed", type=int, default=42, help="seed of the calibration draw (default 42)")
    p.add_argument(
        "--max-test",
        type=_positive,
        default=None,
        help="score the first N test examples per task (default: all, as the paper)",
    )
    p.add_argument("--rows", default=None, help="comma-separated rows to run, by method or label (default: all)")
    p.add_argument(
        "--param",
        action="append",
        metavar="METHOD.NAME=VALUE",
        help="a parameter over the table's, e.g. surgery.steps=100 (repeatable; checked before any work)",
    )
    p.add_argument("--tables", default=None, help="a tables file of the shipped one's form (default: the paper's)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="say what would run, its forward passes and an estimate of time and memory here",
    )
    p.add_argument("--out", default=None, help="write reproduce.json and reproduce.md here (must not exist)")
    p.add_argument("--force", action="store_true", help="replace an --out that featcal wrote")
    add_common(p)
    return p


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return value


def list_tables(paper: tables.PaperTables) -> str:
    """One line per table: name, model, tasks, zoo spec, rows, and how many cells the data holds."""
    lines = [
        f"{paper.paper}",
        "",
        "| table | model | tasks | zoo spec | rows | cells read |",
        "|---|---|---:|---|---|---:|",
    ]
    for name, t in paper.tables.items():
        rows = ", ".join(r.method or f"{r.label} (not in featcal)" for r in t.rows)
        cells = sum(len(r.cells) for r in t.rows)
        lines.append(f"| {name} | {t.setting.model} | {t.setting.n_tasks} | {t.setting.zoo} | {rows} | {cells} |")
    return "\n".join([*lines, "", *(f"- {n}" for n in paper.notes)])


def _checked_inputs(args: argparse.Namespace):
    """Everything that can be wrong with the command, checked before any model loads: the table,
    the zoo and whether it is the table's setting, the rows and their parameters, the output."""
    paper = tables.load_tables(args.tables)
    if not args.table:
        raise UserError(f"name a table (one of {', '.join(paper.tables)}) or pass --list.")
    try:
        table = tables.get_table(args.table, paper)
    except KeyError as e:
        raise UserError(e.args[0]) from None
    args.zoo = setting.resolve_zoo(args.zoo or table.setting.zoo)
    problems = setting.setting_problems(table.setting, setting.zoo_identity(args.zoo))
    if problems and not args.any_zoo:
        raise UserError(
            f"zoo {args.zoo!r} is not {table.name}'s setting ({table.setting.model}, {table.setting.n_tasks} tasks): "
            f"{'; '.join(problems)}. Run it on the paper's setting (docs/zoos.md, 'Reproducing the paper'), "
            "or pass --any-zoo to run anyway: its numbers are then not comparable with the paper's."
        )
    try:
        extra = registry.parse_param_items(args.param, None)
        only = args.rows.split(",") if args.rows else None
        planned = plan.plan_table(table, args.n, only, extra)
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.out and args.dry_run:
        raise UserError("--dry-run runs and writes nothing; drop --out (or --dry-run).")
    if args.out:
        check_out(args.out, args.force, zoo_inputs(args))
    return paper, table, problems, planned


def _check_sizes(zoo, planned: list[plan.PlannedRow]) -> None:
    """Every task's calib split holds the examples each row draws."""
    need = max((r.n for r in planned if r.runs and not r.reference), default=0)
    short = {t: len(zoo.split(t, "calib")[1]) for t in zoo.tasks}
    short = {t: have for t, have in short.items() if have < need}
    if short:
        raise UserError(
            f"zoo {zoo.name}: the rows draw {need} calibration examples per task, but {short} hold fewer "
            "(the calib split); lower --n or enlarge the zoo's calib split."
        )


def _preset(table: tables.PaperTable, zoo, comparable: bool) -> str:
    """The table's FeatCal preset on its setting; the zoo's own on another zoo (--any-zoo)."""
    return table.setting.preset if comparable and table.setting.preset else preset_for_zoo(zoo)


def _context(args, zoo, tasks: int, preset: str, problems: list[str]) -> dict:
    """What the printed table and reproduce.json say of the run."""
    return {
        "zoo": zoo.name,
        "zoo_source": str(args.zoo),
        "tasks": tasks,
        "unscored": zoo.unscored,
        "n": args.n,
        "seed": args.seed,
        "max_test": args.max_test,
        "device": args.device,
        "preset": preset,
        "comparable": not problems,
        "problems": problems,
    }


def dry_run(args, table: tables.PaperTable, planned: list[plan.PlannedRow], problems: list[str]) -> int:
    """Print the plan, its forward passes and the estimates, having loaded only what the timing needs
    (:func:`featcal.reproduce.estimate.probe_zoo`)."""
    apply_threads(args)
    zoo = estimate.probe_zoo(args.zoo, device=args.device, progress=not args.quiet)
    apply_threads(args, zoo.base)
    names = list(setting.zoo_identity(args.zoo).tasks or zoo.tasks)
    preset = _preset(table, zoo, not problems)
    probe = estimate.probe(zoo)
    sizes = estimate.scored_sizes(zoo, names, args.max_test)
    stats = 8 if preset in FLOAT64_PRESETS else 4
    rows = estimate.estimate_rows(planned, probe, len(names), sizes, stats_bytes=stats)
    context = _context(args, zoo, len(names), preset, problems) | {"room": estimate.device_room(args.device)}
    print(report.plan_markdown(table, rows, probe, context))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list:
        print(list_tables(tables.load_tables(args.tables)))
        return 0
    paper, table, problems, planned = _checked_inputs(args)
    if args.dry_run:
        return dry_run(args, table, planned, problems)
    zoo = zoo_from_args(args)
    planned = plan.on_zoo(planned, zoo)
    _check_sizes(zoo, planned)
    if args.out:  # again, now that the zoo's own models and data are known: before any row runs
        check_out(args.out, args.force, zoo_inputs(args, zoo))
    context = _context(args, zoo, len(zoo.tasks), _preset(table, zoo, not problems), problems)
    results = runner.run_rows(
        zoo, planned, preset=context["preset"], seed=args.seed, max_test=args.max_test, progress=not args.quiet
    )
    records = report.row_records(table, results)
    text = report.markdown(table, records, context)
    print(text)
    if args.out:
        write(Path(args.out), args, zoo, paper, table, records, context, text)
        print(f"wrote {args.out}")
    return 0


def write(out: Path, args, zoo, paper, table, records, context, text: str) -> None:
    """``reproduce.json`` (the table, its setting, the run's context and every row's ours, paper and
    diff) and ``reproduce.md`` (the printed table), written whole or not at all."""
    doc = {
        "paper": paper.paper,
        "table": table.name,
        "source": table.source,
        "caption": table.caption,
        "setting": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(table.setting).items()},
        "sources": {r["source"]: paper.sources[r["source"]] for r in records},
        "run": context,
        "rows": records,
    }
    with atomic_dir(out, force=args.force, inputs=zoo_inputs(args, zoo), kind="reproduce") as tmp:
        (tmp / "reproduce.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
        (tmp / "reproduce.md").write_text(text)

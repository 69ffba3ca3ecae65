"""``featcal compare``: run several merging / calibration methods on a zoo, print the results
table and write the tidy tables (CSV) and figures (HTML) to ``--out``.

    featcal compare --zoo demo --methods ta,ties,iso_c,ta+featcal,ta+escal --param escal.epochs=50 --out out/cmp
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diagnostics import compare as cmp
from featcal.baselines import registry
from featcal.cli.common import UserError, add_common, add_zoo, check_out, zoo_from_args, zoo_inputs
from featcal.model.arch import block_axis_names
from featcal.zoo.io import atomic_dir

DEFAULT_METHODS = "ta,ties,iso_c,regmean_plusplus,ta+featcal,iso_c+featcal,ta+escal,ta+surgery,ta+surgery_v2"


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``compare`` options on ``p``."""
    add_zoo(p)
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated: a merger (ta, ties, iso_c, regmean_plusplus, lot, adamerging, fisher_merging, ...), "
        "then calibrators in order: +svc, +featcal, and last +escal, +surgery, +surgery_v2 or +probsurgery, "
        "e.g. ta+svc+featcal "
        f"(default: {DEFAULT_METHODS})",
    )
    p.add_argument("--n", type=int, default=64, help="calibration examples per task (calib split; default 64)")
    p.add_argument("--seed", type=int, default=42, help="seed of the calibration draw")
    p.add_argument(
        "--param",
        action="append",
        metavar="METHOD.NAME=VALUE",
        help="a merger's or calibrator's parameter, e.g. ta.scale=0.3, svc.alpha=0.5, featcal.lam=0.01, "
        "escal.epochs=50, surgery_v2.steps=250 (repeatable; checked before any work). Defaults: the registry's "
        "(the trained calibrators at their authors' schedules; SVC's alpha FusionBench's after the merger)",
    )
    p.add_argument("--max-test", type=int, default=None, help="test examples per task (default: all)")
    p.add_argument("--drift-n", type=int, default=64, help="test examples per task for the drift per block")
    p.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed forward passes (median) of what each calibrator produced and of the merged model, for the "
        "forward time column (default 5; on a shared CPU a few calls are noise; 0: not measured)",
    )
    p.add_argument("--out", default=None, help="write the tables (CSV) and figures (HTML) here (must not exist)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    add_common(p)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    cals = registry.names("calibrator", "trained")
    p.epilog = "the calibrators' parameters (--param METHOD.NAME=VALUE):\n\n" + "\n\n".join(
        registry.describe(c) for c in cals
    )
    return p


def parse_params(items: list[str] | None, methods: list[str] | None = None) -> tuple[dict, dict]:
    """``["ta.scale=0.3", "escal.epochs=5"]`` -> (merger params, calibrator params), checked
    against the registry. ``methods``: the specs that run (their mergers and calibrators, and
    Task Arithmetic, the gap's reference, may be named; a bare ``NAME=VALUE`` only when that
    makes one method)."""
    running = None
    if methods is not None:
        running = ["task_arithmetic"]
        for spec in methods:
            merger, cal = cmp.parse_method(spec)
            running += [merger, *(cal.split("+") if cal else [])]
        running = list(dict.fromkeys(running))
    try:
        table = registry.parse_param_items(items, running)
    except ValueError as e:
        raise UserError(str(e)) from None
    kinds = {n: registry.get(n).kind for n in table}
    mergers = {n: p for n, p in table.items() if kinds[n] in ("merger", "data_merger")}
    cals = {n: p for n, p in table.items() if kinds[n] not in ("merger", "data_merger")}
    return mergers, cals


def run(args: argparse.Namespace) -> int:
    if args.out:
        check_out(args.out, args.force, zoo_inputs(args))
    methods = [m for m in args.methods.split(",") if m.strip()]
    try:
        for m in methods:
            cmp.parse_method(m)
    except ValueError as e:
        raise UserError(str(e)) from None
    merger_params, cal_params = parse_params(args.param, methods)
    try:
        cmp.check_params(merger_params, cal_params)
    except ValueError as e:
        raise UserError(f"--param: {e}") from None
    zoo = zoo_from_args(args)
    options = cmp.CompareOptions(
        n=args.n,
        seed=args.seed,
        merger_params=merger_params,
        calibrator_params=cal_params,
        max_test=args.max_test,
        drift_n=args.drift_n,
        repeats=args.repeats,
    )
    result = cmp.compare(zoo, methods, options, progress=not args.quiet)
    print(cmp.markdown(result.summary))
    print(notes(zoo, args))
    if args.out:
        write(result, Path(args.out), args.force, block_axis_names(zoo.base))
        print(f"wrote {args.out}")
    return 0


def notes(zoo, args: argparse.Namespace) -> str:
    """What the table's columns mean, printed under it."""
    first = "" if args.max_test is None else f" (first {args.max_test} per task)"
    return (
        f"\nzoo {zoo.name}: {len(zoo.tasks)} tasks; {args.n} calibration examples per task drawn (seed "
        f"{args.seed}), 'n per task' the ones each method read (blank: data-free); test split{first}. Gap closed "
        "= 100 (acc - start) / (experts - start) from TA or from the method's merger. Model: one for all tasks, "
        "or modules per task (the task must be known at inference). Added: numbers per task, counted on what "
        "the method produced. Forward time: of what it produced over the merged model's, on one batch of "
        f"{cmp.CompareOptions.overhead_batch} test examples, median of {args.repeats} calls (1 for a merger "
        "alone; blank: --repeats 0). Peak MB: the most resident memory merging and calibrating took above what "
        "was in use. Brackets: SVC's alpha (FusionBench's after the merger unless --param svc.alpha is given), "
        "a trained calibrator's length when not its authors' schedule."
    )


def write(result: cmp.Comparison, out: Path, force: bool, names: list[str] | None = None) -> None:
    """The tables as CSV, the settings as JSON and the figures in one HTML file, written to a
    temporary folder first and then moved to ``out`` (no half-written output; an old ``out``
    replaced only if featcal wrote it, :func:`featcal.zoo.io.atomic_dir`). ``names``: the blocks'
    names on the drift charts' axis (:func:`featcal.model.arch.block_axis_names`; None: numbered)."""
    with atomic_dir(out, force=force, kind="comparison") as tmp:
        _write_into(result, tmp, names)


def _write_into(result: cmp.Comparison, tmp: Path, names: list[str] | None) -> None:
    from diagnostics import compare_figures as figs

    for name in ("summary", "accuracy", "output", "drift"):
        getattr(result, name).to_csv(tmp / f"{name}.csv", index=False)
    (tmp / "settings.json").write_text(json.dumps(result.settings, indent=2, default=str))
    figures = [figs.accuracy_bars(result.accuracy), figs.output_scatter(result.summary)]
    figures += [figs.drift_lines(result.drift, t, names) for t in dict.fromkeys(result.drift["task"])]
    html = [f.to_html(full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figures)]
    (tmp / "figures.html").write_text("<html><body>\n" + "\n".join(html) + "\n</body></html>\n")

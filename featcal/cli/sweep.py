"""``featcal tune`` and ``featcal study``: the sweep and the paper's studies from the command line.

    featcal tune --zoo demo --out runs/tune                      # grid, previews, 4 exact confirmations
    featcal tune --zoo demo --ray --search adaptive --report --out runs/tune
    featcal tune --zoo demo --grid "lam=0.01,0.05,0.2;rho=1,2;alpha=0.2,0.3,0.5" --out runs/tune
    featcal tune --zoo demo --per-block --trials 60 --groups 3 --report --out runs/tune_pb
    featcal study sample-efficiency --zoo demo --seeds 0,1,2 --out runs/se
    featcal study robustness --zoo demo --severities 1,3,5 --out runs/robust

``tune`` writes ``best.json``, ``table.csv``, ``sweep_parallel.html`` and
``sweep_heatmap.html`` (and with ``--report`` ``test_report.csv``: the test
accuracy of the merged model, the anchor and the tuned setting, measured after
the choice). ``--per-block`` searches a schedule of lam and alpha per block (or per
group of blocks) by TPE instead (:mod:`featcal.sweep.perblock`; no figures).
``study`` writes ``rows.csv`` (tidy), ``summary.csv`` and its figure.
The figures (:mod:`featcal.sweep.figures`) need plotly; without it they are skipped
with a warning.

The command line is a thin layer: ``add_*_arguments`` declare the options, ``run_*``
load the zoo, call :mod:`featcal.sweep.search` / :mod:`featcal.sweep.studies` and write. Both are
rows of :data:`featcal.cli.commands.COMMANDS`.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import torch

from featcal.baselines.registry import MERGERS
from featcal.cli.common import (
    add_common,
    add_out,
    add_param,
    add_zoo,
    check_merge_method,
    check_out,
    deprecated_option,
    parse_params,
    zoo_from_args,
    zoo_inputs,
)
from featcal.config import FLOAT64_PRESETS, PRESETS, RANGES, preset_config, preset_for_zoo
from featcal.sweep import studies
from featcal.sweep.search import Grid, TuneConfig, holdout_report, tune_zoo
from featcal.util import outdir
from featcal.util.collect import collected_warnings

STUDIES = ("sample-efficiency", "robustness")


# ------------------------------------------------------------------ helpers


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(",") if v.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _out_dir(path: str, force: bool) -> Path:
    """Create the output directory once there is something to write (replaced if ``force`` and
    featcal wrote it, :func:`featcal.util.outdir.fresh_dir`)."""
    return outdir.fresh_dir(path, force, kind="sweep")


def _figures():
    """:mod:`featcal.sweep.figures`, or None with a warning when plotly is not installed."""
    try:
        from featcal.sweep import figures as tune_figures
    except ImportError as err:  # plotly is optional (featcal[app])
        warnings.warn(f"no figures written ({err}).", stacklevel=2)
        return None
    return tune_figures


def to_markdown(df, floatfmt: str = ".2f") -> str:
    """A pipe table of ``df`` (no dependency on tabulate)."""

    def cell(v):
        if isinstance(v, float):
            return "" if v != v else format(v, floatfmt)
        return str(v)

    cols = [str(c) for c in df.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _common(p: argparse.ArgumentParser) -> None:
    add_zoo(p)
    add_out(p)
    add_common(p)


def _featcal_config(args):
    """The anchor: the preset (:data:`featcal.config.PRESETS`) with the ``--lam/--rho/--alpha``
    and ``--stats-dtype`` given (float64 statistics for the presets whose lam needs them,
    :func:`featcal.config.preset_config`). ``args.preset`` unset (before :func:`_zoo_preset`):
    ``clip``, only to check the values given before a zoo is loaded."""
    given = {k: getattr(args, k) for k in ("lam", "rho", "alpha") if getattr(args, k) is not None}
    if getattr(args, "stats_dtype", None) is not None:
        given["stats_dtype"] = getattr(torch, args.stats_dtype)
    return preset_config(args.preset or "clip", **given)


def _zoo_preset(args, zoo) -> None:
    """Set ``args.preset`` to the zoo's own unless the user chose one (:func:`featcal.config.preset_for_zoo`,
    as the app and ``featcal compare`` choose: llama-3b on an LLM zoo, whose first token is no class
    token for CLIP's token weights, CLIP elsewhere); say which on stderr."""
    if args.preset is None:
        args.preset = preset_for_zoo(zoo)
        print(f"featcal: preset {args.preset!r} (this zoo's; --preset to choose another)", file=sys.stderr)


class _Preset(argparse.Action):
    """``--preset``: a name of :data:`featcal.config.PRESETS`; ``default``, this command's old
    name for ``none``, still works, with a warning."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values == "default":
            deprecated_option("--preset default", "--preset none (FeatCalConfig's defaults, no token weights)")
            values = "none"
        setattr(namespace, self.dest, values)


def _anchor_args(p: argparse.ArgumentParser) -> None:
    for name in ("lam", "rho", "alpha"):
        what = RANGES[name].what.partition(",")[0]
        help = f"{what} of the anchor / studied setting (default: the preset's)"
        p.add_argument(f"--{name}", type=float, default=None, help=help)
    p.add_argument(
        "--preset",
        choices=(*PRESETS, "default"),
        default=None,
        action=_Preset,
        metavar="{" + ",".join(PRESETS) + "}",
        help="the paper's setting to start from (featcal.config.PRESETS; default: the zoo's own, as the app and "
        "compare choose: llama-3b on an LLM zoo, else clip): clip (lam 0.05, rho 2, alpha 0.3 and the "
        "CLIP preset's last-block token weights), flan-t5, llama-3b, llama-8b, or none (FeatCalConfig(): "
        "the same numbers as clip without token weights, e.g. for mean-pooled text models)",
    )
    p.add_argument(
        "--stats-dtype",
        choices=("float32", "float64"),
        default=None,
        help=f"statistics dtype (default: float64 for {', '.join(FLOAT64_PRESETS)}, whose lam 1e-5 needs it; "
        "float32 otherwise)",
    )


# ------------------------------------------------------------------ featcal tune


def add_tune_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``tune`` options on ``p``."""
    _common(p)
    p.add_argument(
        "--merge", default="task_arithmetic", choices=sorted(MERGERS), help="merge method (default: task_arithmetic)"
    )
    add_param(p)
    p.add_argument("--n-calib", type=int, default=256, help="calibration examples per task (calib split)")
    p.add_argument(
        "--seed", type=int, default=42, help="seed drawing the calibration examples (and of --per-block's TPE)"
    )
    p.add_argument("--val-per-task", type=int, default=None, help="val examples per task scored (default: all)")
    _anchor_args(p)
    p.add_argument(
        "--grid",
        default=None,
        help="axes as 'lam=0.01,0.05;rho=1,2;alpha=0.3' (default: 5 x 5 x 5 around the paper's setting)",
    )
    p.add_argument(
        "--search",
        choices=("grid", "adaptive"),
        default="grid",
        help="'adaptive' refines around the best previews after the grid",
    )
    p.add_argument("--rounds", type=int, default=2, help="adaptive: refinement rounds")
    p.add_argument("--top-k", type=int, default=3, help="adaptive: previews refined per round")
    p.add_argument("--n-confirm", type=int, default=4, help="best previews re-run exactly")
    p.add_argument(
        "--per-block",
        action="store_true",
        help="search lam and alpha per block (a schedule) by TPE, each trial one preview, instead of the grid",
    )
    p.add_argument("--trials", type=int, default=40, help="--per-block: TPE trials (previews)")
    p.add_argument(
        "--groups",
        type=int,
        default=None,
        help="--per-block: cut the blocks into this many groups of consecutive blocks, one setting each "
        "(default: one per block)",
    )
    p.add_argument(
        "--score",
        choices=("auto", "accuracy", "kl"),
        default="auto",
        help="val accuracy (needs labels), KL to the experts, or auto",
    )
    p.add_argument("--ray", action="store_true", help="run previews and exact runs as Ray tasks")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray started by --ray")
    p.add_argument(
        "--ray-address", metavar="auto|HOST:PORT", help="run the jobs on this existing Ray cluster (implies --ray)"
    )
    p.add_argument(
        "--report",
        action="store_true",
        help="after choosing, print and write the TEST accuracy of the anchor and the tuned setting",
    )
    return p


def run_tune(args: argparse.Namespace) -> int:
    params = parse_params(args.param, args.merge)
    grid = Grid.parse(args.grid) if args.grid else None
    check_out(args.out, args.force, zoo_inputs(args))
    zoo = zoo_from_args(args)
    _zoo_preset(args, zoo)
    res = tune_zoo(
        zoo,
        method=args.merge,
        merge_params=params,
        n_calib=args.n_calib,
        seed=args.seed,
        val_per_task=args.val_per_task,
        config=_featcal_config(args),
        options=TuneConfig(
            grid=grid or Grid(),
            search="per_block" if args.per_block else args.search,
            score=args.score,
            n_confirm=args.n_confirm,
            rounds=args.rounds,
            top_k=args.top_k,
            ray=args.ray_address or args.ray,
            num_cpus=args.num_cpus,
            trials=args.trials,
            groups=args.groups,
            seed=args.seed,
        ),
        progress=not args.quiet,
    )
    out = _out_dir(args.out, args.force)
    res.table.to_csv(out / "table.csv", index=False)
    info = res.to_dict()
    figs = None if args.per_block else _figures()  # the figures plot (lam, rho, alpha) points
    if figs is not None:
        figs.sweep_parallel(res.table, res.score).write_html(out / "sweep_parallel.html", include_plotlyjs="directory")
        figs.sweep_heatmap(res.table, score=res.score).write_html(
            out / "sweep_heatmap.html", include_plotlyjs="directory"
        )
    b = res.best
    print(
        f"{len(res.table)} points previewed, {int(res.table.confirmed.sum())} exact runs, {res.seconds:.1f} s "
        f"({'Ray' if args.ray or args.ray_address else 'one process'}); score: val {res.score}"
    )
    anchor = f"anchor lam={res.config.lam:g} rho={res.config.rho:g} alpha={res.config.alpha:g}: {b['anchor_score']:.4f}"
    if args.per_block:
        _print_schedule(res)
    else:
        print(f"best: lam={b['lam']:.4g} rho={b['rho']:.4g} alpha={b['alpha']:.4g}  val {b['score']:.4f} ({anchor})")
    if args.report:
        rep = holdout_report(zoo, res)
        rep.to_csv(out / "test_report.csv", index=False)
        info["test_report"] = rep.to_dict(orient="records")
        print("\nTEST accuracy (%), measured after the choice:\n")
        print(to_markdown(rep))
    (out / "best.json").write_text(json.dumps(info, indent=2, default=str) + "\n")
    outdir.mark(out, "sweep")  # done: the marker now lists its files, so --force never deletes one added since
    print(f"\nwrote {out}/")
    return 0


def _print_schedule(res) -> None:
    """The per-block search's outcome: the schedule chosen (or the global preset kept) and its val
    score against the preset's."""
    b, t = res.best, res.table
    best_other = t.loc[t.stage != "anchor", "exact"].max()
    if not b["schedule"]:
        print(f"kept the global preset: no schedule beat it on val (best confirmed schedule: {best_other:.4f})")
    else:
        print("per-block schedule chosen (block: lam, alpha):")
        for block, v in b["schedule"].items():
            print(f"  {block}: lam={v['lam']:.4g} alpha={v['alpha']:.4g}")
    print(
        f"val {res.score}: per-block {b['score']:.4f} vs global preset (lam={res.config.lam:g} "
        f"rho={res.config.rho:g} alpha={res.config.alpha:g}) {b['anchor_score']:.4f}; {res.seconds:.1f} s in all"
    )


# ------------------------------------------------------------------ featcal study


def add_study_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Declare the ``study`` options on ``p``."""
    p.add_argument("study", choices=STUDIES, help="which study")
    _common(p)
    _anchor_args(p)
    p.add_argument(
        "--seeds",
        type=_ints,
        default=None,
        help="seeds of the calibration draw (default: 0,1,2 for sample-efficiency, 0 for robustness)",
    )
    p.add_argument("--max-test", type=int, default=None, help="test examples per task (default: the whole split)")
    p.add_argument(
        "--budgets", type=_ints, default=studies.BUDGETS, help="sample-efficiency: examples per task, comma-separated"
    )
    p.add_argument(
        "--mergers",
        type=_names,
        default=studies.BASELINES,
        help="sample-efficiency: baseline mergers, each with its own default parameters "
        f"(any of {', '.join(sorted(MERGERS))})",
    )
    p.add_argument("--merge", default="task_arithmetic", help="the merger FeatCal calibrates")
    p.add_argument("--corruptions", type=_names, default=studies.CORRUPTIONS, help="robustness: corruptions")
    p.add_argument("--severities", type=_floats, default=(1.0, 3.0, 5.0), help="robustness: severities in [0, 5]")
    p.add_argument("--n-calib", type=int, default=256, help="robustness: calibration examples per task")
    return p


def run_study(args: argparse.Namespace) -> int:
    _featcal_config(args)  # bad values fail before the zoo loads
    for m in (args.merge, *args.mergers):
        check_merge_method(m)
    check_out(args.out, args.force, zoo_inputs(args))
    zoo = zoo_from_args(args)
    _zoo_preset(args, zoo)
    cfg = _featcal_config(args)
    figs = _figures()
    with collected_warnings() as caught:  # listed after the table, not printed between the bars
        rows, summary, fig, name = _study(args, zoo, cfg, figs)
    out = _out_dir(args.out, args.force)
    rows.to_csv(out / "rows.csv", index=False)
    summary.to_csv(out / "summary.csv", index=False)
    if caught:
        (out / "warnings.txt").write_text("\n".join(caught) + "\n")
    if fig is not None:
        fig.write_html(out / f"{name}.html", include_plotlyjs="directory")
    print(f"{name}: test accuracy (%), task average, mean and std over seeds\n")
    print(to_markdown(summary))
    if caught:
        print(f"\n{len(caught)} distinct library warning(s), also in {out}/warnings.txt:")
        print("\n".join(f"  - {line}" for line in caught))
    outdir.mark(out, "sweep")  # done: the marker now lists its files, so --force never deletes one added since
    print(f"\nwrote {out}/")
    return 0


def _study(args: argparse.Namespace, zoo, cfg, figs):
    """The study ``args`` asks for: ``(rows, summary, figure or None, name)``."""
    if args.study == "sample-efficiency":
        mergers = list(dict.fromkeys((args.merge, *args.mergers)))
        rows = studies.sample_efficiency(
            zoo,
            budgets=args.budgets,
            seeds=args.seeds or (0, 1, 2),
            mergers=mergers,
            calibrate_on=(args.merge,),
            config=cfg,
            max_per_task=args.max_test,
            progress=not args.quiet,
        )
        summary = studies.summarize(rows, by=("method", "n"))
        fig = figs.sample_efficiency_curve(rows) if figs else None
        name = "sample_efficiency"
    else:
        rows = studies.robustness(
            zoo,
            corruptions=args.corruptions,
            severities=args.severities,
            n_calib=args.n_calib,
            seeds=args.seeds or (0,),
            merger=args.merge,
            config=cfg,
            max_per_task=args.max_test,
            progress=not args.quiet,
        )
        summary = studies.summarize(rows, by=("method", "corruption", "severity"))
        fig = figs.robustness_bars(rows) if figs else None
        name = "robustness"
    return rows, summary, fig, name

"""The LLM zoo's table: SmolLM2-135M-Instruct, its four experts, merges and FeatCal.

    python benchmarks/smollm2_table.py --out runs/smollm2-table          # all rows (hours on 2 CPU cores)
    python benchmarks/smollm2_table.py --out runs/smollm2-table --rows base,experts,ta,ta+featcal
    python benchmarks/smollm2_table.py --out runs/smollm2-table --max-per-task 50 --autocast bfloat16
    python benchmarks/smollm2_table.py --out runs/smollm2-table --report     # the rows measured so far

Rows: base, each expert on every task, Task Arithmetic 0.3, TIES, DARE, TSV, Iso-C, RegMean++,
and TA / TIES / TSV + FeatCal at ``FeatCalConfig.llama("3b")`` (statistics in float64: lam 1e-5
needs them) and, with ``--tuned ta=lam,rho,alpha`` (the setting ``featcal tune`` chose on val for
that merge; repeatable), at that setting. Each row's scores are kept in ``OUT/rows.json`` as
soon as they are measured, so a rerun with the same ``--out`` continues where the last one
stopped (the zoo's content hash and the options must match). Prints the raw table, the
MergeBench-style normalised one (each task's score / its own expert's), the share of the
TA-to-experts gap FeatCal closes, and the timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's featcal, not an installed one
import torch

from featcal import FeatCalConfig, calibrate, merge_with_data
from featcal.zoo import load_any
from featcal.zoo.core import evaluate
from featcal.zoo.io import write_json
from featcal.zoo.score.scores import average, normalized

MERGES = {  # row -> (method, params)
    "ta": ("task_arithmetic", {"scale": 0.3}),
    "ties": ("ties", {"density": 0.2, "scale": 0.3}),
    "dare": ("dare", {"drop": 0.9, "scale": 0.3}),
    "tsv": ("tsv", {}),
    "iso_c": ("iso_c", {}),
}
LABELS = {"ta": "TA (0.3)", "ties": "TIES (0.2, 0.3)", "dare": "DARE (0.9, 0.3)", "tsv": "TSV", "iso_c": "Iso-C"}
ORDER = [
    "base",
    "experts",
    "ta",
    "ta+featcal",
    "ties",
    "ties+featcal",
    "tsv",
    "tsv+featcal",
    "dare",
    "iso_c",
    "regmean++",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="smollm2")
    ap.add_argument("--out", required=True, help="folder for rows.json (a rerun continues from it)")
    ap.add_argument(
        "--rows", default=",".join(ORDER), help=f"rows to measure, in this order (default all: {','.join(ORDER)})"
    )
    ap.add_argument("--n-per-task", type=int, default=32, help="calibration examples per task (FeatCal, RegMean++)")
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--split", default="test")
    ap.add_argument("--max-per-task", type=int, default=None, help="score only the first N examples of each task")
    ap.add_argument(
        "--autocast",
        default=None,
        choices=("bfloat16",),
        help="score under CPU autocast (2-3x faster on CPUs with native bfloat16, slower on others)",
    )
    ap.add_argument(
        "--tuned",
        action="append",
        default=[],
        help="[ta|ties|tsv=]lam,rho,alpha: also that merge's +FeatCal row at this setting (what `featcal tune` "
        "chose on val; without a merge's name, every +FeatCal row); repeatable",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", action="store_true", help="only print the table of the rows measured so far")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.report:
        doc = json.loads((Path(args.out) / "rows.json").read_text())
        print(report(doc, list(next(iter(doc["rows"].values())))))
        return

    zoo = load_any(args.zoo, progress=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "rows.json"
    key = {k: getattr(args, k) for k in ("zoo", "n_per_task", "seed", "split", "max_per_task", "autocast")}
    key["zoo_sha256"] = zoo.meta.get("content_sha256")
    doc = json.loads(store.read_text()) if store.is_file() else {}
    if doc.get("key") != key:
        doc = {"key": key, "rows": {}, "seconds": {}}
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    settings = tuned_settings(FeatCalConfig.llama("3b", stats_dtype=torch.float64), args.tuned)
    data = zoo.calib_data(args.n_per_task, seed=args.seed, batch_size=8)
    score = _scorer(zoo, args)
    for row in rows:
        for name, make in _models(row, zoo, data, settings):
            if name in doc["rows"]:
                continue
            t0 = time.perf_counter()
            model, tasks = make()
            built = time.perf_counter() - t0
            doc["rows"][name] = score(model, tasks)
            doc["seconds"][name] = {"make": round(built, 1), "score": round(time.perf_counter() - t0 - built, 1)}
            write_json(store, doc)
            print(f"{name}: {doc['rows'][name]}  ({doc['seconds'][name]})", flush=True)
    print(report(doc, zoo.tasks))


def tuned_settings(preset, tuned: list[str]) -> dict[str, dict]:
    """``{merge row: {setting name: FeatCalConfig}}``: the preset for every +FeatCal row, plus
    each ``--tuned [row=]lam,rho,alpha`` for its row (or all)."""
    out = {row: {"llama-3b": preset} for row in ("ta", "ties", "tsv")}
    for spec in tuned:
        row, _, values = spec.rpartition("=")
        lam, rho, alpha = (float(v) for v in values.split(","))
        for r in [row] if row else list(out):
            if r not in out:
                raise SystemExit(f"--tuned {spec!r}: the merge is one of {', '.join(out)}.")
            out[r][f"tuned on val: {lam:g}, {rho:g}, {alpha:g}"] = preset.with_(lam=lam, rho=rho, alpha=alpha)
    return out


def _scorer(zoo, args):
    def score(model, tasks):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast else contextlib.nullcontext()
        with ctx:
            return evaluate(model, zoo, split=args.split, tasks=tasks, max_per_task=args.max_per_task)

    return score


def _models(row: str, zoo, data, settings):
    """``[(row name, make)]`` for one ``--rows`` entry; ``make() -> (model, tasks scored or None)``."""
    if row == "base":
        return [("base", lambda: (zoo.base, None))]
    if row == "experts":
        return [(f"expert {t}", lambda t=t: (zoo.experts[t], None)) for t in zoo.tasks]
    if row == "regmean++":
        return [
            (
                "RegMean++",
                lambda: (
                    merge_with_data("regmean_plusplus", base=zoo.base, experts=zoo.experts, calib_data=data),
                    None,
                ),
            )
        ]
    if row in MERGES:
        method, params = MERGES[row]
        return [(LABELS[row], lambda: (zoo.merged(method, **params), None))]
    merged_row, _, plus = row.partition("+")
    if plus == "featcal" and merged_row in MERGES:
        method, params = MERGES[merged_row]

        def make(cfg):
            merged = zoo.merged(method, **params)
            model, _ = calibrate(merged, base=zoo.base, experts=zoo.experts, calib_data=data, config=cfg, progress=True)
            return model, None

        return [(f"{LABELS[merged_row]} + FeatCal ({s})", lambda c=c: make(c)) for s, c in settings[merged_row].items()]
    raise SystemExit(f"unknown row {row!r}; choose from {', '.join(ORDER)}.")


def report(doc: dict, tasks: list[str]) -> str:
    rows = doc["rows"]
    experts = {t: rows[f"expert {t}"][t] for t in tasks if f"expert {t}" in rows}
    head = "| model | " + " | ".join(tasks) + " | avg | norm. avg |"
    lines = [head, "|---|" + "---:|" * (len(tasks) + 2)]
    for name, s in rows.items():
        norm = normalized(s, experts) if len(experts) == len(tasks) else {}
        cells = " | ".join(f"{s[t]:.1f}" + (f" ({norm[t]:.0f})" if t in norm else "") for t in tasks)
        lines.append(
            f"| {name} | {cells} | {average(s):.1f} | {average(norm):.1f} |"
            if norm
            else f"| {name} | {cells} | {average(s):.1f} | |"
        )
    notes = []
    if len(experts) == len(tasks) and "TA (0.3)" in rows:
        ta, ex = average(rows["TA (0.3)"]), average(experts)
        notes.append(f"- experts' own-task average {ex:.1f}; TA (0.3) {ta:.1f} ({ex - ta:+.1f} below)")
        for name, s in rows.items():
            if name.startswith("TA (0.3) + FeatCal") and ex != ta:
                gain = average(s) - ta
                notes.append(f"- {name}: {gain:+.1f} points on TA, {100 * gain / (ex - ta):.0f}% of the gap closed")
    key = doc["key"]
    notes.append(
        f"- zoo {key['zoo']} (content sha256 {str(key['zoo_sha256'])[:16]}), {key['split']} split"
        + (f", first {key['max_per_task']} per task" if key["max_per_task"] else "")
        + f", calibration {key['n_per_task']} per task (seed {key['seed']})"
        + (f", scored under {key['autocast']} autocast" if key["autocast"] else ", scored in float32")
    )
    notes += [f"- {name}: made in {t['make']} s, scored in {t['score']} s" for name, t in doc["seconds"].items()]
    return "\n".join([*lines, "", "Cells: raw score (normalised score, % of the task's own expert).", "", *notes])


if __name__ == "__main__":
    main()

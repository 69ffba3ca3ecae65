"""A reproduction's table: our figures beside the paper's, with the difference per cell.

:func:`row_records` pairs each row's results (:class:`~featcal.reproduce.run.RowResult`) with the
paper's cells: ``ours``, ``paper`` and ``diff = ours - paper`` per column, where both exist.
:func:`markdown` prints them under the table's source and caption: one line per row for the
table's summary columns (``avg``; an efficiency table's ``seconds``, ...), and, for a table with
per-task columns, one line per task with each row's ours | paper | diff. A row featcal does not
run is printed "not in featcal" with the paper's figures; a cell the paper does not give is blank.
:func:`plan_markdown` prints what ``--dry-run`` would run, its forward passes and the estimates.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from featcal.reproduce.estimate import GiB, Probe, RowEstimate
from featcal.reproduce.plan import FEATCAL_FWD
from featcal.reproduce.run import RowResult
from featcal.reproduce.tables import AVG, PaperTable


def diff_cells(ours: Mapping[str, float], paper: Mapping[str, float]) -> dict[str, float]:
    """``{column: ours - paper}`` over the columns both give."""
    return {c: ours[c] - paper[c] for c in ours if c in paper}


def row_records(table: PaperTable, results: list[RowResult]) -> list[dict[str, Any]]:
    """One record per row: label, method (None: not in featcal), status, n, params, source, note,
    ``ours``, ``paper``, ``diff`` (``{column: value}``) and the run's seconds and peak memory."""
    out = []
    for r in results:
        p = r.planned
        ours = r.ours(table.setting.metric)
        out.append(
            {
                "label": p.row.label,
                "method": p.method,
                "status": p.status,
                "why_not": p.why_not,
                "n": p.n if p.runs and not p.reference else None,
                "params": {k: dict(v) for k, v in p.params.items()},
                "source": p.row.source,
                "note": p.row.note,
                "ours": ours,
                "paper": dict(p.row.cells),
                "diff": diff_cells(ours, p.row.cells),
                "merge_seconds": r.merge_seconds,
                "calib_seconds": r.calib_seconds,
                "peak_mb": None if math.isnan(r.peak_mb) else r.peak_mb,
                "peak_gpu_mb": r.peak_gpu_mb,
            }
        )
    return out


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "" if v is None else fmt.format(v)


def _paper(v: float | None) -> str:
    return "" if v is None else repr(float(v))


def summary_columns(table: PaperTable) -> list[str]:
    """The columns of the one-line-per-row table: every column but the per-task ones."""
    return [c for c in table.columns if c not in table.task_columns]


def _summary(table: PaperTable, records: list[dict]) -> list[str]:
    cols = summary_columns(table)
    head = ["row", "method", "n"] + [h for c in cols for h in (f"{c}: ours", "paper", "diff")] + ["source"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (1 + 3 * len(cols)) + "---|"]
    for rec in records:
        cells = [rec["label"], rec["method"] if rec["status"] == "ran" else rec["status"], _num(rec["n"], "{}")]
        for c in cols:
            cells += [_num(rec["ours"].get(c)), _paper(rec["paper"].get(c)), _num(rec["diff"].get(c), "{:+.2f}")]
        lines.append("| " + " | ".join(cells + [rec["source"]]) + " |")
    return lines


def _per_task(table: PaperTable, records: list[dict]) -> list[str]:
    """Tasks down, each row's ours | paper | diff across (the zoo's tasks and the table's)."""
    if table.setting.metric != "score":
        return []
    tasks = list(dict.fromkeys([*table.task_columns, *(t for r in records for t in r["ours"] if t != AVG)]))
    if not tasks:
        return []
    head = ["task"] + [h for r in records for h in (f"{r['label']}: ours", "paper", "diff")]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (3 * len(records))]
    for t in tasks:
        cells = [t]
        for r in records:
            cells += [_num(r["ours"].get(t)), _paper(r["paper"].get(t)), _num(r["diff"].get(t), "{:+.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _settings_lines(records: list[dict], preset: str) -> list[str]:
    out = []
    for rec in records:
        if rec["status"] != "ran":
            out.append(f"- {rec['label']}: {rec['status']} ({rec['why_not']})")
            continue
        params = "; ".join(f"{m} " + ", ".join(f"{k}={v}" for k, v in p.items()) for m, p in rec["params"].items())
        with_featcal = f"FeatCal preset {preset}" if "featcal" in (rec["method"] or "") else ""
        said = ", ".join(s for s in (params or "featcal's defaults", with_featcal) if s)
        out.append(f"- {rec['label']} ({rec['method']}): {said}" + (f"; {rec['note']}" if rec["note"] else ""))
    return out


def markdown(table: PaperTable, records: list[dict], context: Mapping[str, Any]) -> str:
    """The whole printed table (see the module docstring); ``context``: zoo, n, seed, max_test,
    device, preset, comparable and problems (why the zoo is not the table's setting)."""
    lines = [f"## {table.source}: {table.name}", "", table.caption, ""]
    lines.append(_context_line(context))
    if context.get("unscored"):
        left, n = context["unscored"], context["tasks"]
        lines.append(
            f"NOT SCORED: {', '.join(left)} (featcal has no metric for it; merged and calibrated on all the same): "
            f"our averages are over the other {n - len(left)} tasks, the paper's over all {n}."
        )
    if not context["comparable"]:
        lines.append(
            f"NOT COMPARABLE: the zoo is not this table's setting ({'; '.join(context['problems'])}); "
            "the paper's figures are shown for reference only."
        )
    lines += ["", *_summary(table, records)]
    per_task = _per_task(table, records)
    if per_task:
        lines += ["", "Per task (ours | paper | diff):", "", *per_task]
    lines += ["", "Rows' settings:", *_settings_lines(records, context["preset"])]
    if table.setting.metric == "seconds":
        lines.append(f"- seconds: the calibration after the merge, scoring excluded; paper on {table.setting.hardware}")
    return "\n".join(lines) + "\n"


def _context_line(c: Mapping[str, Any]) -> str:
    test = "whole test splits" if c["max_test"] is None else f"first {c['max_test']} test examples per task"
    n = f"{c['n']} calibration examples per task" if c["n"] else "the table's calibration examples per task"
    return f"ours: zoo {c['zoo']} ({c['tasks']} tasks) on {c['device']}; {n}, seed {c['seed']}; {test}."


# ------------------------------------------------------------------ --dry-run


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def plan_markdown(table: PaperTable, estimates: list[RowEstimate], p: Probe, context: Mapping[str, Any]) -> str:
    """What a run would do (``--dry-run``): per row its method, forward passes, estimated time and
    memory; the totals; how they were estimated; the room on the device."""
    lines = [
        f"## {table.source}: {table.name} (dry run: nothing is run)",
        "",
        table.caption,
        "",
        _context_line(context),
    ]
    if not context["comparable"]:
        lines.append(f"NOT COMPARABLE: {'; '.join(context['problems'])}.")
    head = "| row | method | n | passes: FeatCal ref. | calibration | training | scoring "
    head += "| time (estimate) | memory (estimate) |"
    lines += ["", head, "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for e in estimates:
        r, ps = e.planned, e.passes
        if not r.runs:
            lines.append(f"| {r.row.label} | not in featcal | | | | | | | |")
            continue
        n = "" if r.reference else str(r.n)
        scoring = "not counted" if ps.scoring is None else f"{ps.scoring:,}"
        cells = [r.row.label, r.method, n, *(f"{v:,}" for v in (ps.featcal, ps.calibration, ps.training)), scoring]
        cells += [_duration(e.seconds), f"{e.memory['total'] / GiB:.2f} GiB"]
        lines.append("| " + " | ".join(cells) + " |")
    total = sum(e.passes.total for e in estimates)
    seconds = sum(e.seconds for e in estimates)
    peak = max((e.memory["total"] for e in estimates), default=0)
    lines += ["", f"total: {total:,} forward passes; about {_duration(seconds)}; peak about {peak / GiB:.2f} GiB."]
    if any(e.passes.scoring is None for e in estimates if e.planned.runs):
        lines.append(
            "Scoring not counted: the test splits are decoded when first scored, and counting them costs as "
            "much; the time leaves scoring out (--max-test N bounds it)."
        )
    lines += _how_estimated(p, context.get("room"), peak)
    return "\n".join(lines) + "\n"


def _how_estimated(p: Probe, room: int | None, peak: int) -> list[str]:
    timed = f"median of {p.repeats} calls on {p.examples} calibration examples, on {p.device}"
    out = [
        "",
        "Estimates, not measurements: one forward pass (an example through one model) took "
        f"{p.seconds_per_pass * 1e3:.2f} ms here ({timed}); FeatCal counts {FEATCAL_FWD:g}x its reference "
        "passes; merging, SVC and module-only training steps are not counted. Memory: every model at once "
        f"({p.model_bytes / 2**20:.0f} MiB each: the base, the experts, the merged and one calibrated copy) plus "
        "FeatCal's streams, call and statistics (featcal.streaming.memory.estimate_peak).",
    ]
    if room is not None:
        fits = "fits" if peak <= room else "DOES NOT FIT: fewer tasks, a smaller --n, or a larger device"
        out.append(f"Room on the device now: {room / GiB:.2f} GiB; the estimated peak {fits}.")
    return out

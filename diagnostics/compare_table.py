"""The summary table of a comparison (:mod:`diagnostics.compare`): one row per method with its
scores beside what it costs, and the markdown ``featcal compare`` prints.

What a method costs, read from the registry (:mod:`featcal.baselines.registry`) and from what
the run produced, never typed in: whether it gives one model for every task or task-specific
modules (the task must be known at inference: :attr:`Method.task_specific`), the numbers it
adds per task (counted on the produced modules or models), the calibration examples per task it
read (``n_per_task``, :func:`examples_read`), its forward time over the merged model's on the
same batch (measured), its seconds and its peak memory.
"""

from __future__ import annotations

from typing import Mapping

import pandas as pd

from featcal.baselines import registry
from featcal.model.validate import batch_len

SUMMARY_COLUMNS = [
    "method",
    "label",
    "merger",
    "calibrator",
    "task_specific",
    "n_per_task",
    "accuracy",
    "gap_closed",
    "gap_closed_vs_merger",
    "kl",
    "agreement",
    "added_trained",
    "added_stored",
    "added_fraction",
    "forward_ratio",
    "merge_seconds",
    "calib_seconds",
    "peak_mb",
    "peak_gpu_mb",
]


def gap_closed(acc: float, start: float, experts: float) -> float:
    """The share (%) of the gap from ``start`` to the experts' accuracy that ``acc`` closes:
    ``100 (acc - start) / (experts - start)``; NaN when there is no gap."""
    gap = experts - start
    return 100.0 * (acc - start) / gap if abs(gap) > 1e-9 else float("nan")


def examples_read(parts: Mapping[str, Mapping], data: Mapping[str, list]) -> int | None:
    """The calibration examples per task a method read: ``parts`` is ``{registry name: the
    parameters it ran with}`` (its merger, then its calibrators), ``data`` the calibration data
    given. Each part that reads data reads all of it, or up to its cap (:attr:`Method.examples_cap`,
    Fisher merging's ``n_examples``); the most any part read, None when every part is data-free."""
    given = min(sum(batch_len(b) for b in batches) for batches in data.values())
    reads = []
    for name, params in parts.items():
        method = registry.get(name)
        if method.data_free:
            continue
        cap = method.examples_cap
        reads.append(given if cap is None else min(given, params.get(cap, method.param(cap).default)))
    return max(reads) if reads else None


def label(method: str, merger: str, calibrators: Mapping[str, Mapping]) -> str:
    """The row's label: ``method`` and, in brackets, what a reader needs to know of the settings
    of its ``calibrators`` (``{name: the parameters given}``): a parameter whose default depends on
    the upstream ``merger`` (SVC's ``alpha``: ``alpha 0.1``), and a trained calibrator's length when
    it is not its authors' schedule (``200 steps``)."""
    notes = []
    for name, given in calibrators.items():
        m = registry.get(name)
        for p in m.params:
            if p.after:
                notes.append(f"{p.name} {given.get(p.name, p.default_after(merger)):g}")
        length = m.length
        if length is not None and given.get(length.name, length.default) != length.default:
            notes.append(f"{given[length.name]} {length.name}")
    return f"{method} ({', '.join(notes)})" if notes else method


def summary_row(r, ta: float, merger_accs: Mapping[str, float], experts: float) -> dict:
    """One method's row (``r``: a :class:`diagnostics.compare.MethodResult`): mean accuracy, the
    gap it closes (from Task Arithmetic and from its own merger), mean KL and agreement, and what
    it costs."""
    out = r.output.pivot_table(index="task", columns="metric", values="value")
    acc = average(r.accuracy)
    return {
        "method": r.method,
        "label": r.label or r.method,
        "merger": r.merger,
        "calibrator": r.calibrator,
        "task_specific": r.task_specific,
        "n_per_task": r.n_per_task,
        "accuracy": acc,
        "gap_closed": gap_closed(acc, ta, experts) if r.merger else float("nan"),
        "gap_closed_vs_merger": gap_closed(acc, merger_accs[r.merger], experts) if r.calibrator else float("nan"),
        "kl": float(out["kl"].mean()),
        "agreement": float(out["agreement"].mean()),
        "added_trained": r.added["trained"],
        "added_stored": r.added["stored"],
        "added_fraction": r.added["fraction"],
        "forward_ratio": r.forward_ratio,
        "merge_seconds": r.merge_seconds,
        "calib_seconds": r.calib_seconds,
        "peak_mb": r.peak_mb,
        "peak_gpu_mb": r.peak_gpu_mb,
    }


def further_than_base(summary: pd.DataFrame, factor: float = 2.0) -> list[str]:
    """The methods that did no better than the pretrained base (mean accuracy at most the base's) while
    their outputs are more than ``factor`` times as far from the experts' (mean KL): a merge that failed
    on this zoo, whose scores measure the failure, not the method."""
    base = summary[summary["method"] == "base"]
    if base.empty or not base[["kl", "accuracy"]].notna().all(axis=None):
        return []
    kl, acc = float(base["kl"].iloc[0]), float(base["accuracy"].iloc[0])
    rows = summary[
        ~summary["method"].isin(["experts", "base"]) & (summary["kl"] > factor * kl) & (summary["accuracy"] <= acc)
    ]
    return [
        f"{m} (accuracy {a:.1f} against the base's {acc:.1f}, KL {k:.3g} against its {kl:.3g})"
        for m, a, k in zip(rows["method"], rows["accuracy"], rows["kl"])
    ]


def average(accs: Mapping[str, float]) -> float:
    return float(sum(accs.values()) / len(accs))


def model_kind(task_specific) -> str:
    """What a row's method gives: one model for all tasks, or modules per task."""
    if pd.isna(task_specific):
        return ""
    return "per task (needs the task)" if task_specific else "one for all tasks"


def markdown(summary: pd.DataFrame) -> str:
    """The summary as a markdown table: each method's label, what it gives (one model or modules
    per task), the calibration examples per task it read, average accuracy, gap to the experts
    closed (from TA and from the method's merger), KL, agreement, numbers added per task, forward
    time over the merged model's, seconds, peak memory (GPU too when any was used)."""
    gpu = summary["peak_gpu_mb"].notna().any()
    head = ["method", "model", "n per task", "avg acc", "gap closed (vs TA)", "gap closed (vs merger)", "KL"]
    head += ["top-1 agr.", "added per task (trained / stored)", "forward time (x merged)", "merge s", "calib s"]
    head += ["peak MB", *(["peak GPU MB"] if gpu else [])]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]

    def num(v, fmt: str = "{:.1f}") -> str:
        return "" if v is None or pd.isna(v) else fmt.format(v)

    for r in summary.itertuples():
        ref, calibrated = _empty(r.merger), not _empty(r.calibrator)  # read back from a CSV, "" is NaN
        added = "" if ref else f"{int(r.added_trained):,} / {int(r.added_stored):,} ({100 * r.added_fraction:.1f}%)"
        cells = [r.label, "" if ref else model_kind(r.task_specific), num(r.n_per_task, "{:.0f}")]
        cells += [f"{r.accuracy:.1f}", num(r.gap_closed), num(r.gap_closed_vs_merger), f"{r.kl:.3f}"]
        cells += [f"{r.agreement:.1f}", added, "" if ref else num(r.forward_ratio, "{:.2f}")]
        cells += ["" if ref else f"{r.merge_seconds:.1f}", "" if ref or not calibrated else f"{r.calib_seconds:.1f}"]
        cells += [num(r.peak_mb, "{:.0f}"), *([num(r.peak_gpu_mb, "{:.0f}")] if gpu else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _empty(v) -> bool:
    return v is None or v == "" or (isinstance(v, float) and pd.isna(v))

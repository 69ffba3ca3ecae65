"""Summaries of per-task accuracies: averages, expert-normalised accuracy, JSON.

All functions take the ``{task: accuracy}`` dicts that :func:`featcal.evaluate`
returns (percent) and are pure, except :func:`expert_accuracies` (which runs
the experts) and :func:`write_scores` (which writes a file).
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Mapping

from featcal.zoo.core import Zoo, evaluate
from featcal.zoo.io import write_json

Scores = Mapping[str, float]


def average(accs: Scores) -> float:
    """The unweighted mean over tasks (the paper's "Avg." column)."""
    if not accs:
        raise ValueError("average of no tasks.")
    return sum(accs.values()) / len(accs)


def normalized(accs: Scores, expert_accs: Scores) -> dict[str, float]:
    """Expert-normalised accuracy per task: ``100 * acc / acc_expert`` (percent of
    what task i's own expert reaches; tasks missing from ``expert_accs`` are skipped)."""
    return {t: 100.0 * a / expert_accs[t] for t, a in accs.items() if t in expert_accs and expert_accs[t] > 0}


def expert_accuracies(zoo: Zoo, split: str = "test", **kwargs) -> dict[str, float]:
    """Each expert's accuracy on its own task: ``{task: acc}``."""
    return {t: evaluate(m, zoo, split=split, tasks=[t], **kwargs)[t] for t, m in zoo.experts.items()}


def summary(accs: Scores, expert_accs: Scores | None = None) -> dict:
    """``{"per_task", "average"}`` plus, given the experts' accuracies,
    ``{"normalized", "normalized_average"}``."""
    out = {"per_task": dict(accs), "average": average(accs)}
    if expert_accs is not None:
        norm = normalized(accs, expert_accs)
        out["normalized"] = norm
        out["normalized_average"] = average(norm) if norm else None
    return out


def write_scores(
    path: str | os.PathLike,
    models: Mapping[str, Scores],
    *,
    zoo: str,
    split: str,
    expert_accs: Scores | None = None,
    extra: dict | None = None,
) -> Path:
    """Write ``{"zoo", "split", "written_at", "models": {name: summary}}`` as JSON
    (atomically); ``models`` maps a model's name to its ``{task: acc}``."""
    doc = {
        "zoo": zoo,
        "split": split,
        "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "models": {name: summary(accs, expert_accs) for name, accs in models.items()},
        **(extra or {}),
    }
    return write_json(path, doc)


def markdown_table(models: Mapping[str, Scores], digits: int = 1) -> str:
    """A markdown table: one row per model, one column per task, then the average."""
    if not models:
        return ""
    tasks = list(next(iter(models.values())))
    head = "| model | " + " | ".join(tasks) + " | avg |"
    rule = "|---|" + "---:|" * (len(tasks) + 1)
    rows = []
    for name, accs in models.items():
        cells = [f"{accs[t]:.{digits}f}" if t in accs else "" for t in tasks]
        rows.append(f"| {name} | " + " | ".join(cells) + f" | {average(accs):.{digits}f} |")
    return "\n".join([head, rule, *rows])

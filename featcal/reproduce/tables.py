"""The FeatCal paper's published tables, shipped as data (``paper_tables.json`` beside this module).

Each table is one setting (a model family, a base model, its tasks, the calibration examples per
task), its caption and source, and its rows: a label, the featcal method that runs it (``ta``,
``ta+featcal``, ``ta+surgery``; ``null`` where featcal has none: "not in featcal"), the row's
parameters and its cells ``{column: value}``. A cell the source did not give is absent, never
guessed; each row names where its cells came from (a key of the file's ``sources``).

The columns of a score table are its tasks and ``avg`` (the mean over the tasks); a table whose
tasks were not read gives only how many there are (``n_tasks``) and its ``avg`` column; an
efficiency table lists its own columns (``seconds``, ...).

    tables = load_tables()                      # {name: PaperTable}
    table = get_table("table1-b32")
    average_mismatches(table)                   # [] when each row's avg is the mean of its tasks

A file of the same form can replace the shipped one (``featcal reproduce --tables FILE``), e.g.
with the cells of the paper's PDF added; :func:`load_tables` checks it before any work and names
the key and the fix of the first problem.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

PAPER_TABLES = Path(__file__).with_name("paper_tables.json")
AVG = "avg"
METRICS = ("score", "seconds")
FAMILIES = ("clip", "flan-t5", "llama")


class TablesError(ValueError):
    """The tables file is malformed (the message names the key and the fix)."""


@dataclass(frozen=True)
class Setting:
    """What a table's numbers were measured on: a model ``family``, the base ``model`` (its hub id),
    the ``tasks`` (None where not recorded: then ``n_tasks`` only), the featcal zoo spec that stands
    for it (``zoo``, a name under assets/zoos/), ``n`` calibration examples per task, the FeatCal
    ``preset`` (:data:`featcal.config.PRESETS`), the ``metric`` (``score``: percent per task and
    their average; ``seconds``), the rounding of the cells (``decimals``) and, for an efficiency
    table, the ``hardware``."""

    family: str
    model: str
    tasks: tuple[str, ...] | None
    n_tasks: int
    zoo: str
    n: int
    preset: str | None
    metric: str = "score"
    decimals: int = 1
    hardware: str = ""


@dataclass(frozen=True)
class PaperRow:
    """One published row: its ``label``, the featcal ``method`` that runs it (None: not in featcal),
    its ``cells``, the key of its ``source``, its ``params`` (``{method: {name: value}}``, over the
    table's), its own ``n`` when not the table's, and a ``note``."""

    label: str
    method: str | None
    cells: Mapping[str, float]
    source: str
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    n: int | None = None
    note: str = ""


@dataclass(frozen=True)
class PaperTable:
    """One table: ``name`` (what ``featcal reproduce`` takes), ``source`` (paper and table), ``caption``,
    ``setting``, the ``params`` every row runs with, its ``columns`` and ``rows``."""

    name: str
    source: str
    caption: str
    setting: Setting
    params: Mapping[str, Mapping[str, Any]]
    columns: tuple[str, ...]
    rows: tuple[PaperRow, ...]

    @property
    def task_columns(self) -> tuple[str, ...]:
        """The per-task columns (every column but ``avg``; none for an efficiency table)."""
        return (self.setting.tasks or ()) if self.setting.metric == "score" else ()


@dataclass(frozen=True)
class PaperTables:
    """The whole file: the ``paper``, its ``sources`` (``{key: what it is}``), ``notes`` and ``tables``."""

    paper: str
    sources: Mapping[str, str]
    notes: tuple[str, ...]
    tables: Mapping[str, PaperTable]


# ------------------------------------------------------------------ reading


def load_tables(path: str | Path | None = None) -> PaperTables:
    """The tables of ``path`` (default: the shipped :data:`PAPER_TABLES`), checked."""
    path = Path(path) if path is not None else PAPER_TABLES
    if not path.is_file():
        raise FileNotFoundError(f"tables file {str(path)!r} does not exist.")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise TablesError(f"{path}: not valid JSON: {err}") from None
    where = str(path)
    sources = _need(raw, "sources", dict, where)
    task_sets = raw.get("task_sets", {})
    tables = {
        name: _table(name, spec, sources, task_sets, f"{where}: tables.{name}")
        for name, spec in _need(raw, "tables", dict, where).items()
    }
    if not tables:
        raise TablesError(f"{where}: 'tables' is empty; give at least one table.")
    return PaperTables(str(raw.get("paper", "")), dict(sources), tuple(raw.get("notes", ())), tables)


def get_table(name: str, tables: PaperTables | None = None) -> PaperTable:
    """The table ``name`` (of ``tables``, default the shipped ones); a ``KeyError`` naming the choices."""
    tables = tables or load_tables()
    if name not in tables.tables:
        raise KeyError(f"unknown table {name!r}; choose one of {', '.join(tables.tables)}.")
    return tables.tables[name]


def _need(raw: Mapping, key: str, kind: type, where: str):
    if not isinstance(raw, Mapping) or key not in raw:
        raise TablesError(f"{where}: missing key {key!r}.")
    value = raw[key]
    if not isinstance(value, kind):
        raise TablesError(f"{where}: {key!r} must be a {kind.__name__}, got {type(value).__name__}.")
    return value


def _setting(raw: Mapping, task_sets: Mapping, where: str) -> Setting:
    where = f"{where}.setting"
    tasks = raw.get("tasks")
    if isinstance(tasks, str):
        if tasks not in task_sets:
            raise TablesError(f"{where}: tasks {tasks!r} is not a key of 'task_sets' ({', '.join(task_sets)}).")
        tasks = task_sets[tasks]
    if tasks is not None and (not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks)):
        raise TablesError(f"{where}: 'tasks' must be a list of task names or a key of 'task_sets'.")
    n_tasks = len(tasks) if tasks is not None else raw.get("n_tasks")
    if not isinstance(n_tasks, int) or n_tasks < 1:
        raise TablesError(f"{where}: give 'tasks' (names) or 'n_tasks' (how many).")
    metric = raw.get("metric", "score")
    family = _need(raw, "family", str, where)
    if metric not in METRICS or family not in FAMILIES:
        raise TablesError(f"{where}: metric must be one of {METRICS} and family one of {FAMILIES}.")
    n = _need(raw, "n", int, where)
    if n < 1:
        raise TablesError(f"{where}: 'n' (calibration examples per task) must be at least 1, got {n}.")
    return Setting(
        family=family,
        model=_need(raw, "model", str, where),
        tasks=tuple(tasks) if tasks is not None else None,
        n_tasks=n_tasks,
        zoo=_need(raw, "zoo", str, where),
        n=n,
        preset=raw.get("preset"),
        metric=metric,
        decimals=int(raw.get("decimals", 1)),
        hardware=str(raw.get("hardware", "")),
    )


def _params(raw: Any, where: str) -> dict[str, dict[str, Any]]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping) or not all(isinstance(v, Mapping) for v in raw.values()):
        raise TablesError(f"{where}: 'params' must be {{method: {{name: value}}}}, e.g. {{'task_arithmetic': ...}}.")
    return {k: dict(v) for k, v in raw.items()}


def _row(raw: Mapping, columns: tuple[str, ...], sources: Mapping, where: str) -> PaperRow:
    label = _need(raw, "label", str, where)
    where = f"{where} ({label!r})"
    source = _need(raw, "source", str, where)
    if source not in sources:
        raise TablesError(f"{where}: source {source!r} is not a key of 'sources' ({', '.join(sources)}).")
    cells = _need(raw, "cells", dict, where)
    for col, value in cells.items():
        if col not in columns:
            raise TablesError(f"{where}: cell {col!r} is not a column of the table ({', '.join(columns)}).")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise TablesError(f"{where}: cell {col!r} must be a finite number, got {value!r}.")
    method = raw.get("method")
    if method is not None and not isinstance(method, str):
        raise TablesError(f"{where}: 'method' must be a featcal method (e.g. 'ta+featcal') or null.")
    n = raw.get("n")
    if n is not None and (not isinstance(n, int) or n < 1):
        raise TablesError(f"{where}: 'n' must be a whole number of at least 1.")
    return PaperRow(
        label=label,
        method=method,
        cells={k: float(v) for k, v in cells.items()},
        source=source,
        params=_params(raw.get("params"), where),
        n=n,
        note=str(raw.get("note", "")),
    )


def _table(name: str, raw: Any, sources: Mapping, task_sets: Mapping, where: str) -> PaperTable:
    if not isinstance(raw, Mapping):
        raise TablesError(f"{where}: a table must be a mapping.")
    setting = _setting(_need(raw, "setting", dict, where), task_sets, where)
    if "columns" in raw:
        columns = tuple(_need(raw, "columns", list, where))
    else:
        columns = (*(setting.tasks or ()), AVG)
    rows = tuple(_row(r, columns, sources, f"{where}.rows[{i}]") for i, r in enumerate(_need(raw, "rows", list, where)))
    if not rows:
        raise TablesError(f"{where}: 'rows' is empty.")
    return PaperTable(
        name=name,
        source=_need(raw, "source", str, where),
        caption=_need(raw, "caption", str, where),
        setting=setting,
        params=_params(raw.get("params"), where),
        columns=columns,
        rows=rows,
    )


# ------------------------------------------------------------------ checks on the data


def average_mismatches(table: PaperTable) -> list[str]:
    """Rows whose ``avg`` is not the mean of their per-task cells (only rows giving both ``avg`` and
    every task): one line each. Allowed: one unit in the last published place (``decimals``), the
    rounding of the mean plus that of the cells."""
    tol = 10.0**-table.setting.decimals
    out = []
    for row in table.rows:
        tasks = table.task_columns
        if AVG not in row.cells or not tasks or not all(t in row.cells for t in tasks):
            continue
        mean = sum(row.cells[t] for t in tasks) / len(tasks)
        if abs(mean - row.cells[AVG]) > tol + 1e-9:
            out.append(f"{table.name}: {row.label}: avg {row.cells[AVG]} but its {len(tasks)} tasks average {mean:.4f}")
    return out


def row_params(table: PaperTable, row: PaperRow) -> dict[str, dict[str, Any]]:
    """The parameters ``row`` runs with: the table's, then the row's over them."""
    out = {k: dict(v) for k, v in table.params.items()}
    for method, params in row.params.items():
        out.setdefault(method, {}).update(params)
    return out

"""The FeatCal paper's figures as shipped (featcal/reproduce/paper_tables.json): they parse, each row's
average is the mean of its per-task figures where both are given, and a malformed file is refused
naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcal.config import PRESETS
from featcal.reproduce.setting import SHIPPED_SPECS
from featcal.reproduce.tables import (
    AVG,
    PAPER_TABLES,
    TablesError,
    average_mismatches,
    get_table,
    load_tables,
    row_params,
)


def _raw() -> dict:
    return json.loads(PAPER_TABLES.read_text())


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "tables.json"
    path.write_text(json.dumps(raw))
    return path


def test_the_shipped_tables_parse_and_name_their_sources():
    paper = load_tables()
    assert "2605.13030" in paper.paper
    for name, table in paper.tables.items():
        assert table.source.startswith("FeatCal, arXiv 2605.13030v1"), name
        assert table.rows and table.caption
        assert table.setting.preset in PRESETS, name  # a preset featcal has
        for row in table.rows:
            assert row.source in paper.sources
            assert set(row.cells) <= set(table.columns)
            assert row.cells or row.source == "none", f"{name}: {row.label} has no cell but names a source"


def test_row_averages_are_the_mean_of_their_tasks():
    """A real check on the data entry: every row giving all its tasks and an average agrees (within
    one unit in the last published place); and there are such rows to check."""
    paper = load_tables()
    checked = [
        (t.name, r.label)
        for t in paper.tables.values()
        for r in t.rows
        if AVG in r.cells and t.task_columns and all(c in r.cells for c in t.task_columns)
    ]
    assert len(checked) >= 2, checked
    bad = [line for t in paper.tables.values() for line in average_mismatches(t)]
    assert not bad, bad


def test_a_mistyped_cell_is_caught(tmp_path):
    raw = _raw()
    cells = raw["tables"]["table1-b32"]["rows"][0]["cells"]
    cells["svhn"] = 87.93  # a slip of one digit: the average no longer follows
    table = get_table("table1-b32", load_tables(_write(tmp_path, raw)))
    found = average_mismatches(table)
    assert len(found) == 1 and "Task Arithmetic" in found[0] and "67.55" in found[0]


def test_the_clip_table_is_the_readme_reference_run():
    table = get_table("table1-b32")
    assert table.setting.tasks == tuple(json.loads(PAPER_TABLES.read_text())["task_sets"]["TA8"])
    assert table.setting.n == 256 and table.setting.zoo == "clip-vit-b32-ta8"
    assert (SHIPPED_SPECS / f"{table.setting.zoo}.yaml").is_file()
    featcal_row = next(r for r in table.rows if r.method == "ta+featcal")
    params = row_params(table, featcal_row)
    assert params == {"task_arithmetic": {"scale": 0.3}, "featcal": {"lam": 0.05, "rho": 2.2, "alpha": 0.25}}


@pytest.mark.parametrize(
    "edit, says",
    [
        (lambda raw: raw["tables"]["table1-b32"]["rows"][0].update(source="blog"), "source 'blog' is not a key"),
        (lambda raw: raw["tables"]["table1-b32"]["rows"][0]["cells"].update(cars=1.0), "cell 'cars' is not a column"),
        (lambda raw: raw["tables"]["table1-b32"]["rows"][0]["cells"].update(dtd="47"), "must be a finite number"),
        (lambda raw: raw["tables"]["table1-b32"]["setting"].update(tasks="TA9"), "tasks 'TA9' is not a key"),
        (lambda raw: raw["tables"]["table1-b32"]["setting"].pop("model"), "missing key 'model'"),
        (lambda raw: raw["tables"]["table1-b32"].update(rows=[]), "'rows' is empty"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_key(tmp_path, edit, says):
    raw = _raw()
    edit(raw)
    with pytest.raises(TablesError, match="tables.table1-b32") as err:
        load_tables(_write(tmp_path, raw))
    assert says in str(err.value)


def test_an_unknown_table_lists_the_choices():
    with pytest.raises(KeyError, match="table1-b32"):
        get_table("table9")

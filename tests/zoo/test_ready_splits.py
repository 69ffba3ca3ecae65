"""A generative spec's ready-made calib / val splits (``data.<task>.calib_split`` / ``val_split``):
tables used as given, every row in order, nothing drawn; refused by name when they overlap another
split, name a split the data lacks, or sit in a zoo that draws its splits (image, text)."""

from __future__ import annotations

import pytest

from featcal.zoo.load.generative import task_examples
from featcal.zoo.spec.locate import locate_data
from featcal.zoo.spec.parsing import from_dict
from featcal.zoo.spec.schema import SpecError


def _write(root, split: str, prompts: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{"q": p, "a": p.upper()} for p in prompts]), root / f"{split}.parquet")


@pytest.fixture
def tables(tmp_path):
    root = tmp_path / "qa"
    _write(root, "train", [f"train {i}" for i in range(10)])
    _write(root, "test", [f"test {i}" for i in range(5)])
    _write(root, "mine", ["zeta", "alpha", "mu"])  # deliberately not sorted: the order must be kept
    _write(root, "held", ["omega", "beta"])
    return root


def _spec(data: dict, **changes) -> dict:
    return {
        "modality": "causal_lm",
        "base": "/nowhere/base",
        "experts": {"qa": "/nowhere/qa"},
        "data": {"qa": data},
        "tasks": {"qa": {"prompt": "{q}", "target": "a", "scorer": "exact_match"}},
        "splits": {"calib": 4, "val": 2, "seed": 0},
    } | changes


def _examples(data: dict) -> dict[str, list[str]]:
    spec = from_dict(_spec(data))
    located, missing = locate_data(spec.data["qa"])
    assert missing is None, missing
    return {name: [ex.prompt for ex in exs] for name, exs in task_examples(spec, "qa", located).items()}


def test_named_splits_are_used_as_given_and_in_order(tables):
    both = _examples({"path": str(tables), "calib_split": "mine", "val_split": "held"})
    assert both == {"calib": ["zeta", "alpha", "mu"], "val": ["omega", "beta"], "test": [f"test {i}" for i in range(5)]}
    # splits.calib (4) does not cut a named calib split of 3; val (2) is still drawn from train
    one = _examples({"path": str(tables), "calib_split": "mine"})
    assert one["calib"] == ["zeta", "alpha", "mu"] and len(one["val"]) == 2
    assert all(p.startswith("train ") for p in one["val"])
    drawn = _examples({"path": str(tables)})  # without the keys: drawn from train as before
    assert len(drawn["calib"]) == 4 and set(drawn["calib"]).isdisjoint(drawn["val"])


def test_both_named_reads_no_train_split(tmp_path):
    root = tmp_path / "qa"
    for split, prompts in {"calib": ["c1", "c0"], "val": ["v0"], "test": ["t0", "t1"]}.items():
        _write(root, split, prompts)
    got = _examples({"path": str(root), "calib_split": "calib", "val_split": "val"})
    assert got == {"calib": ["c1", "c0"], "val": ["v0"], "test": ["t0", "t1"]}


def test_a_split_the_data_lacks_is_named_with_its_folder_and_the_fix(tables):
    spec = from_dict(_spec({"path": str(tables), "calib_split": "calibration"}))
    located, missing = locate_data(spec.data["qa"])
    assert located is None
    looked = " ".join(missing.looked)
    assert str(tables) in looked and "none for split(s) ['calibration']" in looked and "'mine'" in looked
    assert "calib_split: calibration" in missing.fix


@pytest.mark.parametrize(
    "data, key, match",
    [
        ({"calib_split": "test"}, "calib_split", "also the test_split"),
        ({"calib_split": "mine", "val_split": "mine"}, "val_split", "also the calib_split"),
        ({"val_split": "train"}, "val_split", "also the train_split"),  # calib is still drawn from train
        ({"calib_split": ""}, "calib_split", "non-empty string"),
        ({"val_split": 3}, "val_split", "non-empty string"),
    ],
)
def test_overlapping_or_malformed_named_splits_are_refused(tables, data, key, match):
    with pytest.raises(SpecError, match=rf"data\.qa\.{key}: .*{match}") as err:
        from_dict(_spec({"path": str(tables), **data}), source="zoo.yaml")
    assert str(err.value).startswith("zoo.yaml: ")


def test_a_zoo_that_draws_its_splits_refuses_them():
    spec = {
        "base": "/nowhere/base",
        "experts": {"mnist": "/nowhere/mnist"},
        "data": {"mnist": {"path": "/nowhere/mnist", "calib_split": "calib"}},
    }
    with pytest.raises(SpecError, match=r"data\.mnist\.calib_split: only a generative zoo"):
        from_dict(spec)


def test_a_one_split_set_gives_test_what_calib_and_val_leave_and_refuses_when_they_leave_none():
    from types import SimpleNamespace

    from featcal.zoo.load.generative import _drawn_from_one

    rows = [f"row {i}" for i in range(6)]
    parts = _drawn_from_one("data 'x'", rows, 2, 1, SimpleNamespace(test=None, seed=0))
    assert len(parts["calib"]) == 2 and len(parts["val"]) == 1
    assert sorted(parts["calib"] + parts["val"] + parts["test"]) == rows  # disjoint, nothing lost
    assert parts["test"] == [r for r in rows if r not in parts["calib"] + parts["val"]]  # in the data's order
    assert len(_drawn_from_one("data 'x'", rows, 2, 1, SimpleNamespace(test=2, seed=0))["test"]) == 2
    with pytest.raises(ValueError, match=r"data 'x'.*6 rows, all in calib and val; lower splits.calib"):
        _drawn_from_one("data 'x'", rows, 4, 2, SimpleNamespace(test=None, seed=0))

"""The demo zoo: synthetic data, the on-disk layout, the build, evaluation and calibration data.

Most tests use tiny random models (``app_zoo.write_tiny_zoo``) or a micro build
recipe; the ``demo_zoo`` ones load the real cached demo (building it if needed).
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from featcal.zoo import load_any, store
from featcal.zoo.builtin import demo, demo_data, demo_recipe, fashion
from featcal.zoo.core import evaluate
from featcal.zoo.score import scores

# ------------------------------------------------------------------ data


@pytest.mark.parametrize("task", sorted(demo_data.TASKS))
def test_tasks_are_seeded_balanced_uint8(task):
    x, y = demo_data.make_task(task, 24, seed=3)
    x2, y2 = demo_data.make_task(task, 24, seed=3)
    x3, _ = demo_data.make_task(task, 24, seed=4)
    assert x.shape == (24, 32, 32, 3) and x.dtype == np.uint8 and y.dtype == np.int64
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert not np.array_equal(x, x3)
    counts = np.bincount(y, minlength=len(demo_data.TASKS[task].classes))
    assert counts.max() - counts.min() <= 1


def test_digit_pools_are_disjoint():
    train, test = set(demo_data._digit_pool("train")), set(demo_data._digit_pool("test"))
    assert not train & test and len(train) + len(test) == 1797


def test_drop_duplicates():
    x = np.arange(4 * 2).reshape(4, 2).astype(np.uint8)
    kx, ky = demo_data.drop_duplicates(x, np.arange(4), against=x[[1, 3]])
    assert np.array_equal(ky, [0, 2]) and np.array_equal(kx, x[[0, 2]])


MICRO = demo_recipe.micro_recipe()


def test_make_data_splits_are_disjoint():
    arrays, pools = demo_recipe.make_data(MICRO, progress=False)
    for task, s in arrays.items():
        calib, val, test = ({r.tobytes() for r in s[k][0]} for k in ("calib", "val", "test"))
        train = {r.tobytes() for r in s["train"][0]}
        assert len(s["calib"][1]) == 32 and len(s["val"][1]) == 16 and len(s["test"][1]) == 24
        assert calib <= train and val <= train and not calib & val
        assert not test & train and not test & {r.tobytes() for r in pools[task][0]}


# ------------------------------------------------------------------ build and layout


def test_micro_build_is_atomic_hashed_and_deterministic(tmp_path):
    steps = []
    path = demo.build_demo(tmp_path / "z", progress=False, recipe=MICRO, on_step=steps.append)
    meta = store.read_meta(path)
    assert meta["kind"] == store.KIND and list(meta["tasks"]) == ["colour", "position"]
    assert meta["recipe_sha256"] == demo.recipe_sha256(MICRO)
    assert meta["demo_version"] == demo.DEMO_VERSION and meta["storage_dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["z"]
    zoo = store.read_zoo_dir(path)
    assert zoo.split("colour", "test")[0].shape == (24, 3, 32, 32)
    weight = zoo.base.state_dict()["encoder.layers.0.mlp.fc1.weight"]
    assert weight.dtype == torch.float32 and torch.equal(weight, weight.half().float())  # stored in fp16
    again = demo.build_demo(tmp_path / "z2", progress=False, recipe=MICRO)
    assert store.read_meta(again)["files"] == meta["files"]  # same seeds, same bytes
    assert store.read_meta(again)["content_sha256"] == meta["content_sha256"]
    # progress: every stage, steps up to their totals, the whole build's fraction rising to 1
    stages = list(dict.fromkeys(p.stage for p in steps))
    assert stages == [
        "draw the tasks' images",
        "pretrain the base",
        "fine-tune the colour expert",
        "fine-tune the position expert",
    ]
    assert [p.fraction for p in steps] == sorted(p.fraction for p in steps) and steps[-1].fraction == 1.0
    ends = {p.stage: (p.step, p.total) for p in steps}
    assert ends["pretrain the base"] == (MICRO.pretrain_steps, MICRO.pretrain_steps)
    assert "step 2/2" in steps[-1].describe()


def test_interrupted_build_leaves_no_zoo(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_recipe, "finetune", boom)
    with pytest.raises(KeyboardInterrupt):
        demo.build_demo(tmp_path / "z", progress=False, recipe=MICRO)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the shipped copy


def _no_build(*a, **k):
    raise AssertionError("the demo zoo was built although a current copy was there")


def test_shipped_zoo_loads_without_building(tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(demo, "build_demo", _no_build)
    monkeypatch.setattr(demo_recipe, "build_parts", _no_build)
    meta = store.read_meta(demo.SHIPPED)
    assert meta["demo_version"] == demo.DEMO_VERSION and meta["recipe_sha256"] == demo.recipe_sha256(demo.Recipe())
    assert meta["disk_bytes"] < 30e6
    assert not demo.needs_build()
    zoo = demo.load_demo(progress=False)
    assert zoo.meta["path"] == str(demo.SHIPPED) and zoo.meta["content_sha256"] == meta["content_sha256"]
    store.verify_zoo_dir(demo.SHIPPED)  # the files are the ones the hash was recorded for
    assert not (tmp_path / "empty-cache").exists()


def _as_shipped(tmp_path, monkeypatch, **meta_changes):
    """A micro zoo posing as the shipped copy of the current recipe (meta.json is outside the hash)."""
    path = demo.build_demo(tmp_path / "shipped", progress=False, recipe=MICRO)
    meta = store.read_meta(path)
    meta.update(recipe_sha256=demo.recipe_sha256(demo.Recipe()), **meta_changes)
    (path / store.META).write_text(json.dumps(meta))
    monkeypatch.setattr(demo, "SHIPPED", path)
    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path / "cache"))
    return path


class _Built(Exception):
    pass


def _builder(*a, **k):
    raise _Built


def test_current_shipped_copy_is_used(tmp_path, monkeypatch):
    path = _as_shipped(tmp_path, monkeypatch)
    monkeypatch.setattr(demo, "build_demo", _builder)
    assert demo.shipped_path() == path and not demo.needs_build()
    assert demo.load_demo(progress=False).tasks == ["colour", "position"]
    with pytest.raises(_Built):  # rebuild goes to the cache
        demo.load_demo(rebuild=True, progress=False)


def test_stale_shipped_copy_is_not_used(tmp_path, monkeypatch):
    _as_shipped(tmp_path, monkeypatch, demo_version="0")
    monkeypatch.setattr(demo, "build_demo", _builder)
    assert demo.shipped_path() is None and demo.needs_build()
    with pytest.raises(_Built):
        demo.load_demo(progress=False)


def test_corrupted_shipped_copy_warns_and_is_not_used(tmp_path, monkeypatch):
    path = _as_shipped(tmp_path, monkeypatch)
    heads = path / "heads.safetensors"
    heads.write_bytes(heads.read_bytes()[:-1] + b"x")
    monkeypatch.setattr(demo, "build_demo", _builder)
    with pytest.warns(UserWarning, match="heads.safetensors"):
        assert demo.shipped_path() is None
    with pytest.warns(UserWarning), pytest.raises(_Built):
        demo.load_demo(progress=False)


@pytest.fixture(scope="module")
def tiny_zoo(tiny_zoo_dir):
    return store.read_zoo_dir(tiny_zoo_dir)


def test_zoo_dir_round_trip(tiny_zoo, tmp_path):
    again = load_any(tiny_zoo.meta["path"])
    assert again.tasks == tiny_zoo.tasks
    for t in tiny_zoo.tasks:
        assert torch.equal(again.heads[t].weight, tiny_zoo.heads[t].weight)
        x, y = again.split(t, "calib")
        assert x.dtype == torch.float32 and x.min() >= -1 and x.max() <= 1 and y.dtype == torch.long


def test_corruption_is_detected(tmp_path):
    from app_zoo import write_tiny_zoo

    path = write_tiny_zoo(tmp_path / "zoo")
    heads = path / "heads.safetensors"
    raw = bytearray(heads.read_bytes())
    raw[-1] ^= 0xFF
    heads.write_bytes(bytes(raw))
    with pytest.raises(store.ZooCorruptedError, match="heads.safetensors"):
        store.read_zoo_dir(path)
    store.read_zoo_dir(path, verify=False)


def test_load_any_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_any(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="not a featcal zoo"):
        load_any(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_any(tmp_path / "nope.yaml")


# ------------------------------------------------------------------ evaluation and calibration data


def _direct_accuracy(zoo, model, task, split="test"):
    x, y = zoo.split(task, split)
    with torch.no_grad():
        feats = model(pixel_values=x).pooler_output
        pred = zoo.heads[task](feats).argmax(-1)
    return 100.0 * (pred == y).float().mean().item()


def test_evaluate_equals_direct_forward(tiny_zoo):
    for task, expert in tiny_zoo.experts.items():
        got = evaluate(expert, tiny_zoo, tasks=[task], batch_size=7)[task]  # uneven batches
        assert got == pytest.approx(_direct_accuracy(tiny_zoo, expert, task))


def test_calib_data_is_seeded_and_from_calib(tiny_zoo):
    a = tiny_zoo.calib_data(40, seed=42, batch_size=16)
    b = tiny_zoo.calib_data(40, seed=42, batch_size=16)
    c = tiny_zoo.calib_data(40, seed=7, batch_size=16)
    for t in tiny_zoo.tasks:
        assert [len(x) for x in a[t]] == [16, 16, 8]
        assert all(torch.equal(p, q) for p, q in zip(a[t], b[t]))
        assert not torch.equal(torch.cat(a[t]), torch.cat(c[t]))
        rows = {r.numpy().tobytes() for r in torch.cat(a[t])}
        calib = {r.numpy().tobytes() for r in tiny_zoo.split(t, "calib")[0]}
        test = {r.numpy().tobytes() for r in tiny_zoo.split(t, "test")[0]}
        assert len(rows) == 40 and rows <= calib and not rows & test


def test_scores():
    accs, experts = {"a": 50.0, "b": 90.0}, {"a": 100.0, "b": 90.0}
    assert scores.average(accs) == 70.0
    assert scores.normalized(accs, experts) == {"a": 50.0, "b": 100.0}
    assert scores.summary(accs, experts)["normalized_average"] == 75.0
    table = scores.markdown_table({"m": accs})
    assert table.splitlines()[2] == "| m | 50.0 | 90.0 | 70.0 |"


# ------------------------------------------------------------------ fashion


def _idx(path, arr):
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(n).to_bytes(4, "big") for n in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def test_fashion_reader_and_missing_package(tmp_path, monkeypatch):
    monkeypatch.setattr(fashion, "SEARCH_GLOBS", (str(tmp_path / "none" / "*.gz"),))
    monkeypatch.delenv("FEATCAL_FASHION_MNIST", raising=False)
    with pytest.raises(fashion.FashionMNISTMissing, match="apt-get install -y dataset-fashion-mnist"):
        fashion.find_fashion_mnist()
    rng = np.random.default_rng(0)
    for split, n in (("train", 80), ("t10k", 40)):
        _idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    monkeypatch.setenv("FEATCAL_FASHION_MNIST", str(tmp_path))
    arrays = fashion.make_fashion_arrays(n_train=30, n_calib=10, n_val=5, n_test=20)
    x, y = arrays["fashion"]["train"]
    assert x.shape == (30, 32, 32, 3) and x[:, :2].max() == 0  # padded with black
    assert set(arrays["fashion-group"]["test"][1]) <= {0, 1, 2, 3}
    with pytest.raises(ValueError, match="IDX"):
        (tmp_path / "bad.gz").write_bytes(gzip.compress(b"\x01\x02\x03\x04"))
        fashion.read_idx(tmp_path / "bad.gz")


def test_fashion_variant_build(tmp_path, monkeypatch):
    """The fashion variant = the default zoo (here a micro one) plus two experts."""
    rng = np.random.default_rng(1)
    for split, n in (("train", 300), ("t10k", 60)):
        _idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        _idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    monkeypatch.setenv("FEATCAL_FASHION_MNIST", str(tmp_path))
    micro = store.read_zoo_dir(demo.build_demo(tmp_path / "default", progress=False, recipe=MICRO))
    monkeypatch.setattr(demo, "load_demo", lambda **kw: micro)
    recipe = demo.Recipe(**{**MICRO.__dict__, "n_train": 120, "n_test": 24})
    zoo = store.read_zoo_dir(demo.build_demo(tmp_path / "fashion", variant="fashion", progress=False, recipe=recipe))
    assert zoo.tasks == ["colour", "position", "fashion", "fashion-group"]
    assert zoo.meta["variant"] == "fashion" and len(zoo.data["fashion-group"].classes) == 4
    for t in micro.tasks:
        assert torch.equal(
            zoo.experts[t].state_dict()["post_layernorm.weight"], micro.experts[t].state_dict()["post_layernorm.weight"]
        )


# ------------------------------------------------------------------ the real demo zoo


@pytest.fixture(scope="module")
def demo_zoo():
    return demo.load_demo(progress=False)


@pytest.mark.demo_zoo
def test_demo_zoo_contents(demo_zoo):
    assert len(demo_zoo.tasks) >= 6 and demo_zoo.fmt == "hf"
    assert type(demo_zoo.base).__name__ == "CLIPVisionModel"
    assert demo_zoo.meta["disk_bytes"] < 30e6
    for task in demo_zoo.tasks:
        sizes = {s: len(demo_zoo.split(task, s)[1]) for s in ("calib", "val", "test")}
        assert sizes["calib"] >= 512 and sizes["val"] >= 200 and 200 <= sizes["test"] <= 500
        rows = {s: {r.numpy().tobytes() for r in demo_zoo.split(task, s)[0]} for s in sizes}
        assert not rows["test"] & (rows["calib"] | rows["val"]) and not rows["calib"] & rows["val"]


@pytest.mark.demo_zoo
def test_demo_expert_matches_direct_forward_and_gap(demo_zoo):
    task = demo_zoo.tasks[0]
    expert = demo_zoo.experts[task]
    assert evaluate(expert, demo_zoo, tasks=[task])[task] == pytest.approx(_direct_accuracy(demo_zoo, expert, task))
    experts = scores.expert_accuracies(demo_zoo)
    ta = evaluate(demo_zoo.merged("task_arithmetic", scale=0.3), demo_zoo)
    assert scores.average(experts) >= scores.average(ta) + 15  # the merging gap the paper studies
    assert scores.average(evaluate(demo_zoo.base, demo_zoo)) <= scores.average(ta) - 5  # and a weak base


@pytest.mark.demo_zoo
def test_demo_loads_from_the_shipped_copy_or_cache_without_building(demo_zoo, monkeypatch):
    """Once shipped or cached, the demo zoo is read, never built again (about 1 s on an idle 2-core machine)."""

    def build(*args, **kwargs):
        raise AssertionError("load_demo built the zoo again")

    monkeypatch.setattr(demo, "build_demo", build)
    assert demo.load_demo(progress=False).tasks == demo_zoo.tasks

"""featcal against mergekit 0.1.5 over a generated grid of YAML configs (issue: every key of a
mergekit YAML honoured exactly or refused by name). Each config is merged by mergekit's own
``run_merge`` and read by featcal (:func:`~featcal.baselines.mergekit.read_recipe`, then its
merge); the outcome is one of

- equal: both merged, every tensor the same to float tolerance;
- refused (KEY): featcal refused the config by name (a :class:`MergekitError` naming KEY) before
  any work, where mergekit merged it;
- both refuse: mergekit refused it too;
- random (not compared): DARE at density < 1 draws random masks in both tools, which no seed
  makes the same; only finiteness is checked here (featcal's DARE is held to its definition in
  tests/baselines/test_merging.py);
- wrong: both merged and the models differ, or featcal merged what mergekit refuses.

wrong must be 0. The table is printed at the end of the test run (tests/conftest.py)."""

from __future__ import annotations

import copy
import importlib.util
import itertools
import random

import pytest
import torch
import yaml

import tiny
from featcal.baselines import registry
from featcal.baselines.mergekit import MergekitError, read_recipe
from featcal.model.checkpoints import read_state_dict

pytestmark = pytest.mark.skipif(importlib.util.find_spec("mergekit") is None, reason="mergekit is not installed")

TASKS = ("math", "code")
METHODS = ("linear", "task_arithmetic", "ties", "dare_linear", "dare_ties")
# the values each key takes in the grid (None: the key is absent); quoted strings are YAML
# strings, which featcal must refuse (a quoted 'false' is true to Python)
TOP = {
    "normalize": (None, True, False, "false"),
    "rescale": (None, True, False),
    "lambda": (None, 0.7),
    "int8_mask": (None, True),
    "dtype": ("float32", "bfloat16", None),
}
PER_MODEL = {
    "weight": ((0.6, 0.4), (1.0, 0.5), (0.5, float("nan"))),
    "density": (None, (1.0, 1.0), (0.5, 0.25), (0.3, 0.7)),
}
SAMPLE = 240  # configs drawn from the product (seeded), beside its corners


def _grid() -> list[dict]:
    """Every method with each key alone at each value, then a seeded sample of the full product."""
    docs = []
    for method in METHODS:
        plain = {"method": method, "weight": (0.6, 0.4), "density": None, "dtype": "float32"}
        docs.append(plain)
        for key, values in {**TOP, **PER_MODEL}.items():
            docs += [plain | {key: v} for v in values if v != plain.get(key)]
    keys = ["method", *TOP, *PER_MODEL]
    product = list(itertools.product(METHODS, *TOP.values(), *PER_MODEL.values()))
    docs += [dict(zip(keys, row)) for row in random.Random(0).sample(product, SAMPLE)]
    return docs


def _yaml(case: dict) -> dict:
    params = {k: case[k] for k in TOP if k != "dtype" and case.get(k) is not None}
    models = []
    for i, t in enumerate(TASKS):
        p = {"weight": case["weight"][i]}
        if case.get("density") is not None:
            p["density"] = case["density"][i]
        models.append({"model": f"models/{t}", "parameters": p})
    doc = {"merge_method": case["method"], "base_model": "models/base", "models": models}
    if params:
        doc["parameters"] = params
    if case.get("dtype") is not None:
        doc["dtype"] = case["dtype"]
    return doc


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("mkgrid")
    base = tiny.tiny_llama(0, 1, vocab=64, hidden=16, intermediate=32)
    base.save_pretrained(root / "models" / "base")
    for i, t in enumerate(TASKS):
        tiny.perturbed(base, 0.05, i + 1).save_pretrained(root / "models" / t)
    return root


def _mergekit(root, doc, out):
    """mergekit's merge of ``doc`` (a state dict), or the exception it raised."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    doc = copy.deepcopy(doc)
    doc["base_model"] = str(root / doc["base_model"])
    for m in doc["models"]:
        m["model"] = str(root / m["model"])
    try:
        run_merge(
            MergeConfiguration.model_validate(doc),
            str(out),
            options=MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True, random_seed=0),
        )
    except Exception as e:  # noqa: BLE001 (any refusal of mergekit's counts as one)
        return e
    return read_state_dict(out)


def _featcal(root, path):
    """featcal's merge of the YAML at ``path`` (a state dict), or the MergekitError it raised."""
    try:
        recipe = read_recipe(path)
        method, params = recipe.featcal_merge()
    except MergekitError as e:
        return e
    base = read_state_dict(root / "models" / "base")
    return registry.merge(method, base, {t: read_state_dict(root / "models" / t) for t in recipe.experts}, **params)


def _outcome(root, tmp_path, i, case) -> str:
    doc = _yaml(case)
    path = root / f"grid{i}.yml"
    path.write_text(yaml.safe_dump(doc))
    want = _mergekit(root, doc, tmp_path / f"mk{i}")
    got = _featcal(root, path)
    if isinstance(got, MergekitError):
        if isinstance(want, Exception):
            return "both refuse"
        key = str(got).split(": ")[1]  # the message is "FILE: KEY: why and the way forward"
        return f"refused ({key.split('.')[-1]})"
    if isinstance(want, Exception):
        return "wrong"
    densities = case.get("density") or (1.0, 1.0)
    if case["method"].startswith("dare") and min(densities) < 1.0:
        finite = all(torch.isfinite(v).all() for v in got.values())
        return "random (not compared)" if finite else "wrong"
    same = want.keys() <= got.keys() and all(
        torch.allclose(got[k], v.to(got[k].dtype), rtol=1e-5, atol=1e-6) for k, v in want.items()
    )
    return "equal" if same else "wrong"


def test_featcal_equals_mergekit_or_refuses_over_the_grid(root, tmp_path, differential_tables):
    cases = _grid()
    outcomes = {}
    wrong = []
    for i, case in enumerate(cases):
        got = _outcome(root, tmp_path, i, case)
        outcomes[got] = outcomes.get(got, 0) + 1
        if got == "wrong":
            wrong.append(_yaml(case))
    differential_tables["mergekit 0.1.5 vs featcal, generated YAML grid"] = {"configs": len(cases), **outcomes}
    assert not wrong, f"{len(wrong)} configs merged differently from mergekit, e.g. {wrong[:3]}"
    refused = sum(n for k, n in outcomes.items() if k.startswith("refused"))
    assert outcomes.get("equal", 0) >= 20 and refused >= 20  # the grid exercises both

"""mergekit configs (featcal.baselines.mergekit): hand-written YAML on tiny Llamas -> featcal's
merge of the supported methods (equal to mergekit's own output where mergekit is installed)
-> `featcal calibrate --mergekit` -> a model from_pretrained loads; bad configs named."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

import tiny
from featcal import StreamOptions, calibrate_checkpoints
from featcal.baselines import registry
from featcal.baselines.mergekit import MergekitError, read_recipe
from featcal.cli.commands import main
from featcal.config import preset_config
from featcal.model.checkpoints import load_token_data, read_state_dict, save_token_data

TASKS = ("math-7b", "code-7b")


def _llama(seed=0):
    return tiny.tiny_llama(seed, 2, vocab=64, hidden=16, intermediate=32)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("mk")
    base = _llama()
    base.save_pretrained(root / "models" / "base")
    for i, t in enumerate(TASKS):
        e = copy.deepcopy(base)
        g = torch.Generator().manual_seed(i + 1)
        with torch.no_grad():
            for p in e.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        e.save_pretrained(root / "models" / t)
    g = torch.Generator().manual_seed(9)
    save_token_data(
        root / "d.safetensors", {t: {"input_ids": torch.randint(0, 64, (4, 8), generator=g)} for t in TASKS}
    )
    return root


# every featcal-mergeable method, with per-model weights and densities (density * numel is whole
# for every tensor of the tiny Llama, so featcal's rounding and mergekit's floor agree)
RECIPES = {
    "linear": ({}, [{"weight": 0.7}, {"weight": 0.3}], True),
    "task_arithmetic": ({"lambda": 0.8}, [{"weight": 0.6}, {"weight": 0.4}], False),
    "task_arithmetic_normalized": ({"normalize": True}, [{"weight": 2.0}, {"weight": 1.0}], False),
    "ties": ({"lambda": 0.9}, [{"weight": 1.0, "density": 0.5}, {"weight": 0.5, "density": 0.25}], False),
    "ties_sum": ({"normalize": False}, [{"weight": 0.8, "density": 0.5}, {"weight": 0.6, "density": 0.5}], False),
    "dare_linear": ({}, [{"weight": 0.5, "density": 1.0}, {"weight": 0.5, "density": 1.0}], False),
    "dare_ties": ({}, [{"weight": 0.5, "density": 1.0}, {"weight": 0.7, "density": 1.0}], False),
}


def _yaml(root, name, base_in_models=False) -> str:
    params, per_model, with_base = RECIPES[name]
    models = [{"model": f"models/{t}", "parameters": p} for t, p in zip(TASKS, per_model)]
    if with_base or base_in_models:
        models.append({"model": "models/base", "parameters": {"weight": 0.5}})
    method = name.removesuffix("_normalized").removesuffix("_sum")
    doc = {"merge_method": method, "base_model": "models/base", "models": models, "dtype": "float32"}
    if params:
        doc["parameters"] = params
    path = root / f"{name}.yml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _featcal_merge(root, path):
    recipe = read_recipe(path)
    method, params = recipe.featcal_merge()
    base = read_state_dict(root / "models" / "base")
    return registry.merge(method, base, {t: read_state_dict(root / "models" / t) for t in recipe.experts}, **params)


def test_recipe_reads_models_tasks_and_parameters(root):
    r = read_recipe(_yaml(root, "ties"))
    assert list(r.experts) == list(TASKS) and r.base.endswith("models/base")
    assert r.featcal_merge() == (
        "ties",
        {
            "density": {"math-7b": 0.5, "code-7b": 0.25},
            "scale": 0.9,
            "disjoint": "mean",
            "weights": {"math-7b": 1.0, "code-7b": 0.5},
        },
    )
    linear = read_recipe(_yaml(root, "linear")).featcal_merge()[1]["weights"]
    assert linear == pytest.approx({"math-7b": 0.7 / 1.5, "code-7b": 0.3 / 1.5})  # the base's 0.5 counts
    assert list(read_recipe(_yaml(root, "ties"), {"models/math-7b": "math"}).experts) == ["math", "code-7b"]


def test_hand_computed_task_arithmetic_and_linear(root):
    base = read_state_dict(root / "models" / "base")
    ex = {t: read_state_dict(root / "models" / t) for t in TASKS}
    got = _featcal_merge(root, _yaml(root, "task_arithmetic"))
    k = "model.layers.0.mlp.up_proj.weight"
    want = base[k] + 0.8 * (0.6 * (ex[TASKS[0]][k] - base[k]) + 0.4 * (ex[TASKS[1]][k] - base[k]))
    assert torch.allclose(got[k], want, atol=1e-6)
    got = _featcal_merge(root, _yaml(root, "linear"))
    want = (0.7 * ex[TASKS[0]][k] + 0.3 * ex[TASKS[1]][k] + 0.5 * base[k]) / 1.5
    assert torch.allclose(got[k], want, atol=1e-6)


def test_cli_mergekit_calibrates_to_a_loadable_model(root, tmp_path):
    path = _yaml(root, "ties")
    argv = [
        "calibrate",
        "--mergekit",
        str(path),
        "--data",
        str(root / "d.safetensors"),
        "--batch-size",
        "2",
        "--preset",
    ]
    argv += ["llama-3b"]
    assert main([*argv, "--out", str(tmp_path / "fc"), "-q"]) == 0
    model = LlamaForCausalLM.from_pretrained(tmp_path / "fc")
    card = (tmp_path / "fc" / "README.md").read_text()
    assert "merge_method: ties" in card and "density: 0.25" in card
    # the same run through the API equals calibrating featcal's merge given as merged=
    merged_dir = tmp_path / "merged"
    m = LlamaForCausalLM.from_pretrained(root / "models" / "base")
    m.load_state_dict(_featcal_merge(root, path))
    m.save_pretrained(merged_dir)
    data = load_token_data(root / "d.safetensors", batch_size=2)
    calibrate_checkpoints(
        root / "models" / "base",
        {t: root / "models" / t for t in TASKS},
        calib_data=data,
        out=tmp_path / "ref",
        merged=merged_dir,
        config=preset_config("llama-3b"),  # as the CLI (float64 statistics)
        options=StreamOptions(progress=False),
    )
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "ref").state_dict()
    for k, v in model.state_dict().items():
        assert torch.allclose(v, ref[k], rtol=1e-4, atol=1e-5), k
    # --merged DIR: the merge given is calibrated as it is (here featcal's, so the same model)
    assert main([*argv, "--merged", str(merged_dir), "--out", str(tmp_path / "m"), "-q"]) == 0
    for k, v in LlamaForCausalLM.from_pretrained(tmp_path / "m").state_dict().items():
        assert torch.allclose(v, ref[k], rtol=1e-4, atol=1e-5), k
    renamed = [*argv, "--task-name", f"models/{TASKS[0]}=math", "--out", str(tmp_path / "r"), "-q"]
    assert main(renamed) == 2  # the data has no task "math"


def test_bad_configs_are_named(root, tmp_path, capsys):
    p = tmp_path / "bad.yml"
    cases = [
        (
            {"merge_method": "slerp", "base_model": "models/base", "models": [{"model": "models/math-7b"}]},
            "merge_method 'slerp' has no featcal counterpart; featcal merges linear, task_arithmetic, ties, dare_ties",
        ),
        ({"merge_method": "ties", "models": [{"model": "models/math-7b"}]}, "FeatCal needs the base model"),
        (
            {
                "merge_method": "ties",
                "base_model": "models/base",
                "models": [{"model": "models/math-7b", "parameters": {"weight": [0.1, 0.9]}}],
            },
            "gradients",
        ),
        ({"merge_method": "ties", "base_model": "models/base", "slices": []}, "slices/modules"),
    ]
    for doc, match in cases:
        for where in (root,):
            p = where / "bad.yml"
            p.write_text(yaml.safe_dump(doc))
            with pytest.raises(MergekitError, match=match):
                read_recipe(p).featcal_merge()
    p.write_text(yaml.safe_dump({"merge_method": "ties", "base_model": "models/base", "models": ["models/nope"]}))
    with pytest.raises(FileNotFoundError, match="'models/nope': no such directory"):
        read_recipe(p)


@pytest.mark.skipif(importlib.util.find_spec("mergekit") is None, reason="mergekit is not installed")
@pytest.mark.parametrize("name", list(RECIPES))
def test_featcal_merge_equals_mergekits(root, tmp_path, name):
    """mergekit's own merge of the YAML (its run_merge on the CPU) and featcal's are the same model."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    path = _yaml(root, name)
    doc = yaml.safe_load(path.read_text())
    for m in doc["models"]:
        m["model"] = str(root / m["model"])
    doc["base_model"] = str(root / doc["base_model"])
    run_merge(
        MergeConfiguration.model_validate(doc),
        str(tmp_path / "mk"),
        options=MergeOptions(copy_tokenizer=False, write_model_card=False, quiet=True),
    )
    want = read_state_dict(tmp_path / "mk")
    got = _featcal_merge(root, path)
    assert want.keys() <= got.keys()
    for k, v in want.items():
        assert torch.allclose(got[k], v.to(got[k].dtype), rtol=1e-5, atol=1e-6), (name, k)

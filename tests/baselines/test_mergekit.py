"""mergekit configs (featcal.baselines.mergekit): hand-written YAML on tiny Llamas -> featcal's
merge of the supported methods (equal to mergekit's own output where mergekit is installed)
-> `featcal calibrate --mergekit` -> a model from_pretrained loads; bad configs named."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

import tiny
from featcal import StreamOptions, calibrate_checkpoints
from featcal.baselines import registry
from featcal.baselines.mergekit import SUPPORTED, MergekitError, read_recipe
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
        tiny.perturbed(base, 0.05, i + 1).save_pretrained(root / "models" / t)
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
    # keys mergekit reads without effect on these merges: int8_mask (the mask's dtype), a density in
    # task_arithmetic (no sparsification), rescale in task_arithmetic
    "ties_int8_mask": ({"int8_mask": True}, [{"weight": 1.0, "density": 0.5}, {"weight": 0.5, "density": 0.5}], False),
    "task_arithmetic_density": ({"rescale": True}, [{"weight": 0.6, "density": 0.5}, {"weight": 0.4}], False),
}


def _yaml(root, name, base_in_models=False) -> str:
    params, per_model, with_base = RECIPES[name]
    models = [{"model": f"models/{t}", "parameters": p} for t, p in zip(TASKS, per_model)]
    if with_base or base_in_models:
        models.append({"model": "models/base", "parameters": {"weight": 0.5}})
    method = max((m for m in SUPPORTED if name.startswith(m)), key=len)
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
            "merge_method: 'slerp' has no featcal counterpart; featcal merges linear, task_arithmetic, ties, dare_ties",
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


def _doc(method="ties", params=None, per_model=({"weight": 0.6, "density": 0.5}, {"weight": 0.4}), **top):
    models = [{"model": f"models/{t}", "parameters": dict(p)} for t, p in zip(TASKS, per_model)]
    doc = {"merge_method": method, "base_model": "models/base", "models": models, **top}
    if params is not None:
        doc["parameters"] = params
    return doc


def _read(root, doc, merged=False, name="k.yml"):
    path = root / name
    path.write_text(yaml.safe_dump(doc) if isinstance(doc, dict) else doc)
    return read_recipe(path, merged=merged)


@pytest.mark.parametrize(
    "doc, match",
    [
        # honoured by mergekit, not by featcal's TIES: refused, never dropped
        (_doc(params={"rescale": True}), r"parameters\.rescale: true: featcal's TIES does not rescale"),
        # a quoted 'false' is a string, which Python reads as true
        (_doc(params={"normalize": "false"}), r"parameters\.normalize: 'false': expected true or false, unquoted"),
        (_doc(per_model=({"weight": float("nan")}, {"weight": 0.4})), r"models\[0\]\.weight: nan is not a finite"),
        (_doc(params={"lambda": float("inf")}), r"parameters\.lambda: inf is not a finite"),
        (_doc(params={"t": 0.5}), r"parameters\.t: not a parameter of mergekit's ties \(it takes int8_mask"),
        (_doc("linear", params={"lambda": 0.5}), r"parameters\.lambda: not a parameter of mergekit's linear"),
        (_doc(merge_methd="ties"), r"merge_methd: not a mergekit key \(mergekit's are merge_method, base_model"),
        (_doc(tokenizer_source="union"), r"tokenizer_source: 'union': featcal writes the base's tokenizer files"),
        (_doc(chat_template="chatml"), r"chat_template: featcal writes the base's tokenizer files"),
        (_doc(tokenizer={"source": "base"}), r"tokenizer: featcal writes the base's tokenizer files"),
        (_doc(dtype="bfloat16"), r"dtype: 'bfloat16': featcal merges in float32"),
        (
            _doc(dtype="float32", out_dtype="float16"),
            r"out_dtype: 'float16': featcal writes the base's dtype \(float32\)",
        ),
        (_doc("slerp", params={"t": 0.5}), r"merge_method: 'slerp' has no featcal counterpart.*--merged DIR"),
    ],
)
def test_every_key_is_honoured_or_refused_by_name(root, doc, match):
    with pytest.raises(MergekitError, match=match):
        _read(root, doc)


def test_keys_featcal_honours_are_read(root):
    r = _read(root, _doc(params={"int8_mask": True, "normalize": False, "lambda": 0.5}, dtype="float32"))
    assert r.params == {"int8_mask": True, "normalize": False, "lambda": 0.5}
    assert r.featcal_merge()[1]["disjoint"] == "sum" and r.featcal_merge()[1]["scale"] == 0.5
    assert _read(root, _doc(tokenizer_source="base", out_dtype="float32")).card()["mergekit"]["out_dtype"] == "float32"


def test_with_merged_any_method_is_taken_and_its_parameters_recorded(root):
    slerp = _doc("slerp", params={"t": [0, 0.5, 1]}, per_model=({}, {}))
    r = _read(root, slerp, merged=True)
    assert list(r.experts) == list(TASKS) and r.params == {}
    assert r.card()["mergekit"]["parameters"] == {"t": [0, 0.5, 1]}
    with pytest.raises(MergekitError, match="merge_methd: not a mergekit key"):  # a typo is still a typo
        _read(root, {**slerp, "merge_methd": "x"}, merged=True)


def test_a_multi_document_config_is_refused_without_a_traceback(root):
    two = yaml.safe_dump(_doc()) + "---\n" + yaml.safe_dump(_doc("task_arithmetic"))
    with pytest.raises(MergekitError, match="2 YAML documents \\(a mergekit-multi config\\)"):
        _read(root, two)
    with pytest.raises(MergekitError, match="not valid YAML"):
        _read(root, "merge_method: [ties\n")


def test_every_missing_model_is_named_at_once(root):
    doc = {**_doc(), "base_model": "models/nobase"}
    doc["models"] = [{"model": "models/nope1", "parameters": {"weight": 1}}, {"model": "models/nope2"}]
    with pytest.raises(FileNotFoundError, match="3 model\\(s\\) not found") as e:
        _read(root, doc)
    assert all(name in str(e.value) for name in ("nobase", "nope1", "nope2"))


def _hub_cache(cache, repo: str, revisions: dict) -> None:
    """A Hugging Face cache holding ``repo`` at each ``{revision: model}`` (as huggingface_hub lays it out)."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    for i, (rev, model) in enumerate(revisions.items()):
        commit = f"{i + 1:040x}"
        model.save_pretrained(folder / "snapshots" / commit)
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / rev).write_text(commit)


def test_a_revision_is_read_from_the_cache_at_that_revision(root, tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    expert = LlamaForCausalLM.from_pretrained(root / "models" / TASKS[0])
    _hub_cache(cache, "org/math-7b", {"main": LlamaForCausalLM.from_pretrained(root / "models" / "base"), "ft": expert})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    doc = _doc()
    doc["models"][0]["model"] = "org/math-7b@ft"
    r = _read(root, doc)
    got = read_state_dict(Path(r.experts["math-7b"]))
    want = expert.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)  # the fine-tuned revision, not main's base weights
    assert r.card()["mergekit"]["models"]["math-7b"]["model"] == "org/math-7b@ft"
    doc["models"][0]["model"] = "org/math-7b@nope"
    with pytest.raises(FileNotFoundError, match="at revision 'nope'"):
        _read(root, doc)
    doc["models"][0]["model"] = "models/math-7b@ft"
    with pytest.raises(MergekitError, match="a local directory, which has no revisions"):
        _read(root, doc)


def test_cli_calibrates_a_slerp_merge_given_as_merged(root, tmp_path):
    merged_dir = tmp_path / "merged"
    m = LlamaForCausalLM.from_pretrained(root / "models" / "base")
    m.load_state_dict(_featcal_merge(root, _yaml(root, "task_arithmetic")))
    m.save_pretrained(merged_dir)
    path = root / "slerp.yml"
    path.write_text(yaml.safe_dump(_doc("slerp", params={"t": 0.5}, per_model=({}, {}))))
    argv = ["calibrate", "--mergekit", str(path), "--data", str(root / "d.safetensors"), "--batch-size", "2"]
    assert main([*argv, "--out", str(tmp_path / "no"), "-q"]) == 2  # featcal cannot make a SLERP merge
    assert main([*argv, "--merged", str(merged_dir), "--out", str(tmp_path / "fc"), "-q"]) == 0
    assert "merge_method: slerp" in (tmp_path / "fc" / "README.md").read_text()


def test_cli_mergekit_picks_the_preset_of_the_architecture_it_merges(root, tmp_path, capsys):
    argv = ["calibrate", "--mergekit", str(_yaml(root, "ties")), "--data", str(root / "d.safetensors")]
    assert main([*argv, "--batch-size", "2", "--out", str(tmp_path / "fc"), "-q"]) == 0
    # the tiny Llama is 16 wide: the 3B setting (as --base/--expert on it), said on the terminal
    assert "featcal: preset 'llama-3b' (model_type 'llama' is Llama-family, hidden size 16" in capsys.readouterr().err
    card = (tmp_path / "fc" / "README.md").read_text()  # and the model card records it, with its settings
    assert "## FeatCal settings" in card and "preset: llama-3b" in card and "lam: 1.0e-05" in card

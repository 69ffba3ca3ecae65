"""FusionBench model pools -> featcal zoo specs (featcal.zoo.formats.fusionbench), on a fake Hugging
Face cache the test writes: a tiny CLIPModel base, a dense CLIPVisionModel expert and a LoRA
expert (FusionBench's `_lora` pools: peft on the vision transformer) in the hub's
models--ORG--NAME/snapshots/REV layout, tiny parquet image data sets (image, label) in the
datasets layout, FusionBench-style pool YAML with Hydra defaults into config/dataset/."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from test_zero_shot import tiny_clip
from test_zoo_spec import _image, _perturbed_vision, _png, write_hf_cache_model

from featcal.cli.commands import main
from featcal.zoo import load_any
from featcal.zoo.formats.fusionbench import ENV_DEFAULT, FusionBenchError, from_fusionbench

SHAPES = ["round", "square", "pointy"]


@pytest.fixture(autouse=True)
def offline_hf(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _snapshot_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def _dataset(repo: str, n_classes: int, subset: str | None = None, names: list[str] | None = None) -> None:
    """A parquet image data set (train 520, test 6, 12 px) in the HF datasets cache layout."""
    ds = Path(os.environ["HF_HOME"]) / "hub" / f"datasets--{repo.replace('/', '--')}"
    snap = ds / "snapshots" / "feedbeef"
    data = snap / (subset or "data")
    data.mkdir(parents=True)
    (ds / "refs").mkdir()
    (ds / "refs" / "main").write_text("feedbeef")
    meta = None
    if names:
        feats = {"image": {"_type": "Image"}, "label": {"names": names, "_type": "ClassLabel"}}
        meta = {b"huggingface": json.dumps({"info": {"features": feats}}).encode()}
    for split, n, seed in (("train", 520, 0), ("test", 6, 100)):  # 520: room for the default 256 + 256
        labels = [i % n_classes for i in range(n)]
        imgs = [{"bytes": _png(_image(y, seed + i, size=12)), "path": None} for i, y in enumerate(labels)]
        table = pa.table({"image": imgs, "label": labels})
        pq.write_table(table.replace_schema_metadata(meta) if meta else table, data / f"{split}-00000-of-00001.parquet")


def _lora_adapter(clip, out: Path):
    """A peft LoRA on the CLIP vision transformer (names relative to it, as FusionBench's
    load_lora_vision_model_hf saves them), random factors, saved to ``out``; returns peft's
    merge_and_unload of it."""
    from peft import LoraConfig, get_peft_model

    vision = _perturbed_vision(clip, 0, std=0.0)
    pm = get_peft_model(vision, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(5)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.add_(0.2 * torch.randn_like(p))
    pm.peft_config["default"].base_model_name_or_path = "org/tiny-clip"
    pm.save_pretrained(out)
    return pm.merge_and_unload()


@pytest.fixture
def fake_fusionbench(tmp_path):
    """The fake HF cache and a FusionBench-style config tree; returns the pool and task pool paths."""
    clip = tiny_clip(tmp_path / "clip", seed=0)
    write_hf_cache_model("org/tiny-clip", _snapshot_files(tmp_path / "clip"))
    _perturbed_vision(clip, 1).save_pretrained(tmp_path / "mnist")
    write_hf_cache_model("org/tiny-clip_mnist", _snapshot_files(tmp_path / "mnist"))
    want_lora = _lora_adapter(clip, tmp_path / "svhn_lora")
    write_hf_cache_model("org/tiny-clip_svhn_lora-2", _snapshot_files(tmp_path / "svhn_lora"))
    _perturbed_vision(clip, 3).save_pretrained(tmp_path / "shapes")
    write_hf_cache_model("org/tiny-clip_shapes", _snapshot_files(tmp_path / "shapes"))
    _dataset("ylecun/mnist", 10)
    _dataset("ufldl-stanford/svhn", 10, subset="cropped_digits")
    _dataset("org/shapes", 3, names=SHAPES)
    cfg = tmp_path / "config"
    datasets = {
        "mnist": {"path": "ylecun/mnist"},
        "svhn": {"_args_": ["ufldl-stanford/svhn", "cropped_digits"]},
        "shapes": {"path": "org/shapes"},
    }
    for split in ("train", "test"):
        folder = cfg / "dataset" / "image_classification" / split
        folder.mkdir(parents=True)
        for name, entry in datasets.items():
            doc = {name: {"_target_": "datasets.load_dataset", **entry, "split": split}}
            (folder / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    pool = {
        "defaults": [{"/dataset/image_classification/train@train_datasets": list(datasets)}, "_self_"],
        "_target_": "fusion_bench.modelpool.CLIPVisionModelPool",
        "_recursive_": False,
        "processor": "org/tiny-clip",
        "models": {
            "_pretrained_": "org/tiny-clip",
            "mnist": "org/tiny-clip_mnist",
            "svhn": {
                "_target_": "fusion_bench.models.linearized.vision_model.load_lora_vision_model_hf",
                "base_model_name": "org/tiny-clip",
                "peft_name": "org/tiny-clip_svhn_lora-2",
                "merge_and_unload": True,
            },
            "shapes": "org/tiny-clip_shapes",
        },
        "platform": "hf",
    }
    pool_path = cfg / "modelpool" / "CLIPVisionModelPool" / "tiny.yaml"
    pool_path.parent.mkdir(parents=True)
    pool_path.write_text(yaml.safe_dump(pool, sort_keys=False))
    tp_dir = cfg / "taskpool" / "CLIPVisionModelTaskPool"
    tp_dir.mkdir(parents=True)
    template = {
        "_target_": "fusion_bench.taskpool.CLIPVisionModelTaskPool",
        "test_datasets": "???",
        "base_model": "org/tiny-clip",
        "clip_model": {
            "_target_": "transformers.CLIPModel.from_pretrained",
            "pretrained_model_name_or_path": "${..base_model}",
        },
    }
    (tp_dir / "_template.yaml").write_text(yaml.safe_dump(template))
    tp = {
        "defaults": [
            {"CLIPVisionModelTaskPool@": "_template"},
            {"/dataset/image_classification/test@test_datasets": list(datasets)},
        ]
    }
    (tp_dir / "tiny.yaml").write_text(yaml.safe_dump(tp))
    return pool_path, tp_dir / "tiny.yaml", want_lora


def test_pool_to_spec_to_zoo_info_and_calibrate_offline(fake_fusionbench, tmp_path, capsys):
    pool, taskpool, want_lora = fake_fusionbench
    out = tmp_path / "my-zoo.yaml"
    assert main(["zoo", "from-fusionbench", str(pool), "--taskpool", str(taskpool), "--out", str(out)]) == 0
    assert "everything is in the Hugging Face cache" in capsys.readouterr().out
    spec = yaml.safe_load(out.read_text())
    assert spec["base"] == {"id": "org/tiny-clip"} and spec["experts"]["svhn"] == {"id": "org/tiny-clip_svhn_lora-2"}
    assert spec["data"]["svhn"] == {
        "hub": "ufldl-stanford/svhn",
        "train_split": "train",
        "test_split": "test",
        "subset": "cropped_digits",
    }
    assert spec["heads"]["classes"] == {"shapes": SHAPES}  # read from the cached parquet's metadata
    spec["splits"] = {"calib": 6, "val": 3, "test": 4, "seed": 0}
    out.write_text(yaml.safe_dump(spec))
    assert main(["zoo", "info", "--zoo", str(out), "-q"]) == 0
    info = capsys.readouterr().out
    assert "3 tasks" in info and "shapes" in info
    zoo = load_any(out)
    for k, v in want_lora.state_dict().items():  # the LoRA expert is peft's merge_and_unload
        assert torch.allclose(zoo.experts["svhn"].state_dict()[k], v, atol=1e-6), k
    spec["experts"]["svhn"] = {"path": str(tmp_path / "svhn_lora")}  # a local adapter directory does the same
    out.write_text(yaml.safe_dump(spec))
    local = load_any(out).experts["svhn"].state_dict()
    assert all(torch.equal(local[n], v) for n, v in zoo.experts["svhn"].state_dict().items())
    pool_zoo = load_any(pool)  # the pool itself is a zoo (--zoo POOL.yaml, the app's "other (path)")
    assert sorted(pool_zoo.tasks) == sorted(zoo.tasks)
    assert all(torch.equal(pool_zoo.experts["svhn"].state_dict()[n], v) for n, v in local.items())
    argv = ["calibrate", "--zoo", str(out), "--n-per-task", "6", "--batch-size", "3", "--eval"]
    assert main([*argv, "--out", str(tmp_path / "cal"), "-q"]) == 0
    for name in ("README.md", "report.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (tmp_path / "cal" / name).is_file(), name  # the card, and the base's tokenizer copied


def test_missing_things_give_download_lines(fake_fusionbench, tmp_path, capsys):
    pool, taskpool, _ = fake_fusionbench
    doc = yaml.safe_load(pool.read_text())
    doc["models"]["mnist"] = "org/not-downloaded_mnist"
    pool.write_text(yaml.safe_dump(doc))
    out = tmp_path / "z.yaml"
    assert main(["zoo", "from-fusionbench", str(pool), "--taskpool", str(taskpool), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "huggingface-cli download org/not-downloaded_mnist" in printed
    assert "# " + "    huggingface-cli download org/not-downloaded_mnist" in out.read_text()
    assert main(["zoo", "from-fusionbench", str(pool), "--out", str(out)]) == 2  # exists, no --force


def test_unsupported_pools_are_named(fake_fusionbench, tmp_path):
    pool, _, _ = fake_fusionbench
    doc = yaml.safe_load(pool.read_text())
    doc["models"]["mnist"] = {"_target_": "fusion_bench.models.linearized.vision_model.load_l_lora_vision_model_hf"}
    pool.write_text(yaml.safe_dump(doc))
    with pytest.raises(FusionBenchError, match="load_l_lora_vision_model_hf is not a model featcal reads"):
        from_fusionbench(pool)
    doc["_target_"] = "fusion_bench.modelpool.NYUv2ModelPool"
    pool.write_text(yaml.safe_dump(doc))
    with pytest.raises(FusionBenchError, match="featcal reads CLIPVisionModelPool pools"):
        from_fusionbench(pool)
    doc["_target_"] = "fusion_bench.modelpool.CausalLMPool"  # read, but its tasks are not MergeBench's domains
    pool.write_text(yaml.safe_dump(doc))
    with pytest.raises(FusionBenchError, match="does not read them for a language-model pool"):
        from_fusionbench(pool)


def _installed_configs() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("fusion_bench_config")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


def _refusal_kind(err: FusionBenchError) -> str:
    """A refusal's reason in a few words, for the table: the pool class, or the key it names."""
    why = str(err).split(": ", 1)[1]
    if why.startswith("_target_"):
        return "refused: " + why.split("'")[1].rsplit(".", 1)[-1]
    return "refused: " + why.split(":")[0].split(" has ")[0][:40]


@pytest.mark.skipif(_installed_configs() is None, reason="fusion-bench's configs are not installed")
def test_every_shipped_pool_is_translated_or_refused_never_crashes_or_keeps_hydra(offline_hf, differential_tables):
    """FusionBench 0.2.33's own model pools (all of them) and task pools (each with the TA8 CLIP pool):
    each one gives a spec with no Hydra value left in it, or a FusionBenchError; never a traceback,
    never an OpenCLIP pool read as a Hugging Face one. The CLIP TALL14 / TALL20 pools translate
    (class names of all 20 tasks built in; FER2013 through FusionBench's own loader)."""
    root = _installed_configs()
    outcome, kinds = {}, {}
    for pool in sorted(root.glob("modelpool/**/*.yaml")):
        try:
            spec = from_fusionbench(pool)
        except FusionBenchError as err:
            outcome[str(pool.relative_to(root))] = "refused"
            kinds[_refusal_kind(err)] = kinds.get(_refusal_kind(err), 0) + 1
            continue
        text = ENV_DEFAULT.sub("", json.dumps(spec))  # featcal's own ${VAR:-default} may stay
        assert "${" not in text and "???" not in text, pool
        assert "OpenCLIP" not in pool.read_text(), pool
        outcome[str(pool.relative_to(root))] = "translated"
    translated = sum(v == "translated" for v in outcome.values())
    table = {"pools": len(outcome), "translated": translated}  # (a crash fails the test)
    differential_tables["FusionBench 0.2.33 model pools -> featcal zoo specs"] = table | dict(sorted(kinds.items()))
    assert outcome["modelpool/CLIPVisionModelPool/clip-vit-base-patch32_TA8.yaml"] == "translated"
    for size in ("base-patch32", "base-patch16", "large-patch14"):
        for n in (14, 20):
            assert outcome[f"modelpool/CLIPVisionModelPool/clip-vit-{size}_TALL{n}.yaml"] == "translated"
            only = root / "modelpool" / "CLIPVisionModelPool" / f"clip-vit-{size}_TALL{n}_model_only.yaml"
            tasks = root / "taskpool" / "CLIPVisionModelTaskPool" / f"clip-vit-classification_TALL{n}.yaml"
            spec = from_fusionbench(only, tasks)
            assert len(spec["experts"]) == n and "classes" not in spec["heads"]  # every task's names built in
            assert spec["data"]["fer2013"]["label_column"] == "cls"
    assert (
        outcome["modelpool/OpenCLIPVisionModelPool/ViT-B-32_TA8.yaml"] == "refused"
    )  # OpenCLIP: pickle_path checkpoints, not hub ids
    assert (
        outcome["modelpool/CLIPVisionModelPool/clip-vit-base-patch32_robustness_corrupted.yaml"] == "refused"
    )  # ${...corruption} unresolved
    assert outcome["modelpool/CLIPVisionModelPool/_template.yaml"] == "refused"  # models: ???
    assert outcome["modelpool/Seq2SeqLMPool/_template.yaml"] == "refused"
    for lm in (
        "Seq2SeqLMPool/flan-t5-base_glue",
        "Seq2SeqLMPool/flan-t5-base_glue_lora16",
        "Seq2SeqLMPool/flan-t5-large_glue_lora16",
        "CausalLMPool/mergebench/Llama-3.2-3B-Instruct",
        "CausalLMPool/mergebench/Llama-3.1-8B-Instruct",
        "CausalLMPool/mergebench/gemma-2-9b-it",
    ):
        assert outcome[f"modelpool/{lm}.yaml"] == "translated", lm  # fmt: skip
    clip = root / "modelpool" / "CLIPVisionModelPool" / "clip-vit-base-patch32_TA8.yaml"
    for taskpool in sorted(root.glob("taskpool/**/*.yaml")):
        try:
            spec = from_fusionbench(clip, taskpool)
        except FusionBenchError:
            continue
        assert "${" not in json.dumps(spec), taskpool

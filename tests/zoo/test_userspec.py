"""The spec of the user's own models (featcal.zoo.userspec): tasks found in a data folder,
model directories checked, the written YAML loads as a zoo; LoRA adapters and token files
get a clear message; a file featcal did not write is never replaced."""

from __future__ import annotations

import json

import pytest
import torch
from test_zero_shot import tiny_clip
from test_zoo_spec import _perturbed_vision, write_image_folder

from featcal.zoo import spec as zoo_spec
from featcal.zoo import userspec
from featcal.zoo.core import evaluate


def write_user_models(root):
    """A tiny CLIP base (with its tokenizer) in ``root/base``, two experts as save_pretrained
    dirs in ``root/experts/<task>``, an image folder per task in ``root/data/<task>``."""
    clip = tiny_clip(root / "base", seed=0)
    for i, task in enumerate(("red", "blue")):
        _perturbed_vision(clip, i + 1).save_pretrained(root / "experts" / task)
        write_image_folder(root / "data" / task, ["dark", "light"], n_train=6, n_test=3)
    return root


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return write_user_models(tmp_path)


def test_a_spec_from_folders_loads_as_a_zoo(user_models):
    tasks = userspec.find_tasks(user_models / "data")
    assert list(tasks) == ["blue", "red"]
    experts = {t: str(user_models / "experts" / t) for t in tasks}
    spec = userspec.user_spec("mine", str(user_models / "base"), experts, tasks, splits={"calib": 4, "val": 2})
    text = userspec.spec_text(spec)
    assert text.startswith(userspec.HEADER) and "experts:" in text
    path = userspec.write_spec(user_models / "zoos" / "mine.yaml", text)
    zoo = zoo_spec.load(path)
    assert zoo.tasks == ["blue", "red"] and zoo.name == "mine"
    assert zoo.split("red", "calib")[0].shape[0] == 4
    assert set(evaluate(zoo.merged("task_arithmetic"), zoo)) == {"blue", "red"}
    userspec.write_spec(path, text)  # featcal's own file: replaced


def test_what_cannot_make_a_zoo_is_a_clear_message(user_models):
    data = userspec.find_tasks(user_models / "data")
    base = str(user_models / "base")
    with pytest.raises(userspec.UserSpecError, match="no dataset"):
        userspec.find_tasks(user_models / "experts")
    with pytest.raises(userspec.UserSpecError, match="not a model directory"):
        userspec.user_spec("mine", base, {"red": str(user_models / "data")}, data)
    with pytest.raises(userspec.UserSpecError, match=r"\['green'\] have no data"):
        userspec.user_spec("mine", base, {"green": str(user_models / "experts" / "red")}, data)
    adapter = user_models / "lora_red"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    assert userspec.model_kind(adapter) == "lora"
    with pytest.raises(userspec.UserSpecError, match="base.*LoRA adapter"):
        userspec.user_spec("mine", str(adapter), {"red": str(user_models / "experts" / "red")}, data)
    if userspec.lora_supported():  # the expert entry is the adapter's directory, merged on load
        spec = userspec.user_spec("mine", base, {"red": str(adapter)}, data)
        assert spec["experts"]["red"] == {"path": str(adapter)}
    else:
        with pytest.raises(userspec.UserSpecError, match="LoRA adapter.*does not load yet"):
            userspec.user_spec("mine", base, {"red": str(adapter)}, data)
    from safetensors.torch import save_file

    save_file({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, str(user_models / "data" / "text.safetensors"))
    data = userspec.find_tasks(user_models / "data")
    with pytest.raises(userspec.UserSpecError, match="token files.*featcal calibrate --base"):
        userspec.user_spec("mine", base, {"text": str(user_models / "experts" / "red")}, data)
    theirs = user_models / "theirs.yaml"
    theirs.write_text("name: theirs\n")
    with pytest.raises(userspec.UserSpecError, match="did not write it"):
        userspec.write_spec(theirs, "x")
    assert theirs.read_text() == "name: theirs\n"


def test_the_worked_example_in_docs_zoos_md_is_a_valid_spec(tmp_path):
    import re
    from pathlib import Path

    import yaml

    from featcal.zoo import parsing, schema

    doc = (Path(__file__).resolve().parents[2] / "docs" / "zoos.md").read_text()
    example = re.search(r"^```yaml\n(.*?)^```$", doc, flags=re.S | re.M).group(1)
    spec = parsing.from_dict(yaml.safe_load(example), root=tmp_path, source="zoos.md")
    assert list(spec.tasks) == ["flowers", "stanford-cars"]
    assert set(yaml.safe_load(example)) <= set(schema.SCHEMA["zoo"])  # every key it shows is documented

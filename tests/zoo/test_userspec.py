"""The spec of the user's own models (featcal.zoo.spec.userspec): tasks found in a data folder,
model directories checked, the written YAML loads as a zoo (image folders, or text and token
files with a text encoder; a merged model of the user's own as the merger "given"); LoRA
adapters and bad token files get a clear message; a file featcal did not write is never replaced."""

from __future__ import annotations

import json

import pytest
import torch
from test_zero_shot import tiny_clip
from test_zoo_spec import _perturbed_vision, write_image_folder

from featcal.zoo.core import GIVEN, evaluate
from featcal.zoo.load import from_spec as zoo_spec
from featcal.zoo.spec import userspec
from featcal.zoo.tokens import TokenRows


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
    assert zoo.given_merged is None
    with pytest.raises(ValueError, match="no merged model of its own"):
        zoo.merged(GIVEN)
    userspec.write_spec(path, text)  # featcal's own file: replaced


def test_a_merged_model_of_ones_own_is_the_merger_given(user_models):
    """The spec's ``merged:`` (e.g. a mergekit output) is loaded as the merger "given": its
    weights, not featcal's merge of the experts."""
    tasks = userspec.find_tasks(user_models / "data")
    experts = {t: str(user_models / "experts" / t) for t in tasks}
    theirs = zoo_spec.load(
        userspec.write_spec(
            user_models / "mine.yaml",
            userspec.spec_text(
                userspec.user_spec(
                    "mine",
                    str(user_models / "base"),
                    experts,
                    tasks,
                    splits={"calib": 4, "val": 2},
                    merged=experts["red"],
                )
            ),
        )
    )
    assert yaml_key(user_models / "mine.yaml", "merged") == {"path": experts["red"]}
    given = theirs.merged(GIVEN)
    want = theirs.experts["red"].state_dict()
    assert all(torch.equal(v, want[k]) for k, v in given.state_dict().items())
    ta = theirs.merged("task_arithmetic").state_dict()
    assert not all(torch.equal(v, ta[k]) for k, v in given.state_dict().items())
    assert given is not theirs.given_merged  # a copy: calibrating it leaves the zoo's alone


def yaml_key(path, key):
    import yaml

    return yaml.safe_load(path.read_text())[key]


def write_text_models(root):
    """A tiny BERT base with its tokenizer in ``root/base``, two experts, and per task a text
    file (``colour.txt``: label<TAB>text lines) and a token file (``animal.npz``) in ``root/data``."""
    import numpy as np

    from tiny import perturbed, tiny_text_encoder

    base = tiny_text_encoder(root / "base")
    for i, task in enumerate(("colour", "animal")):
        perturbed(base, 0.05, 10 + i).save_pretrained(root / "experts" / task)
    (root / "data").mkdir()
    lines = [f"{c}\tthis is {c} {w}" for w in ("cat", "dog", "sun", "rain", "snow", "big") for c in ("red", "blue")]
    (root / "data" / "colour.txt").write_text("\n".join(lines) + "\n")
    rng = np.random.default_rng(0)
    arrays = {}
    for split, n in (("train", 12), ("test", 4)):
        arrays[f"{split}_input_ids"] = np.concatenate(
            [np.full((n, 1), 2), rng.integers(10, 25, (n, 4)), np.full((n, 1), 3)], 1
        )
        arrays[f"{split}_labels"] = np.arange(n) % 2
    np.savez(root / "data" / "animal.npz", classes=np.array(["cat", "dog"]), **arrays)
    return root


@pytest.mark.filterwarnings("ignore:task .* token rows")
def test_text_and_token_files_make_a_text_zoo(tmp_path, monkeypatch):
    """Per task a text file (tokenised with the base's tokenizer) or a token file: the spec is a
    ``modality: text`` zoo of the encoder, with zero-shot heads through the base."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = write_text_models(tmp_path)
    data = userspec.find_tasks(root / "data")
    assert {t: userspec.data_kind(p) for t, p in data.items()} == {"animal": "tokens", "colour": "text"}
    experts = {t: str(root / "experts" / t) for t in data}
    spec = userspec.user_spec("words", str(root / "base"), experts, data, merged=experts["colour"])
    assert spec["modality"] == "text" and spec["heads"]["classes"] == {"animal": ["cat", "dog"]}
    # halves of the smaller train split: the text file's 12 lines less its test fifth, 10
    assert (spec["splits"]["calib"], spec["splits"]["val"]) == (5, 5)
    zoo = zoo_spec.load(userspec.write_spec(root / "words.yaml", userspec.spec_text(spec)))
    assert zoo.data["colour"].classes == ["blue", "red"] and zoo.data["animal"].classes == ["cat", "dog"]
    x, y = zoo.split("colour", "test")
    assert isinstance(x, TokenRows) and len(x) == 12 // 5 and set(y.tolist()) <= {0, 1}
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(root / "base"))("this is red cat")["input_ids"]
    assert ids[0] == 2 and ids[-1] == 3 and 1 not in ids  # [CLS] ... [SEP], every word in the vocabulary
    calib = zoo.calib_data(2)
    assert set(calib["animal"][0]) == {"input_ids", "attention_mask"}
    assert set(evaluate(zoo.merged(GIVEN), zoo)) == {"colour", "animal"}
    from featcal import FeatCalConfig, calibrate

    merged = zoo.merged("task_arithmetic")
    cal, report = calibrate(merged, base=zoo.base, experts=zoo.experts, calib_data=calib, config=FeatCalConfig())
    assert report.blocks and set(evaluate(cal, zoo)) == {"colour", "animal"}


def test_a_text_zoo_says_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from featcal.zoo.spec import parsing, schema

    root = write_text_models(tmp_path)
    good = {
        "modality": "text",
        "base": str(root / "base"),
        "experts": {"colour": str(root / "experts" / "colour")},
        "data": {"colour": str(root / "data" / "colour.txt")},
    }
    with pytest.raises(schema.SpecError, match="need `modality: text`"):
        parsing.from_dict({**good, "modality": "image", "data": {"colour": {"path": "x.txt", "format": "text"}}})
    with pytest.raises(schema.SpecError, match="use format: hf"):
        parsing.from_dict({**good, "format": "open_clip", "arch": "ViT-B-32"})
    with pytest.raises(zoo_spec.SpecError, match="text.*set `modality: text`"):
        zoo_spec.load(zoo_spec.from_dict({**good, "modality": "image", "heads": {"classes": {"colour": ["r"]}}}))
    (root / "data" / "colour.txt").write_text("red\tok\nno tab here\n")
    with pytest.raises(ValueError, match="line 2: write one example per line as label<TAB>text"):
        zoo_spec.load(zoo_spec.from_dict(good))


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
    with pytest.raises(userspec.UserSpecError, match="bare input_ids.*train_input_ids"):
        userspec.user_spec("mine", base, {"text": str(user_models / "experts" / "red")}, data)
    (user_models / "data" / "text.safetensors").unlink()
    (user_models / "data" / "words.txt").write_text("a\tsome words\nb\tother words\n")
    data = userspec.find_tasks(user_models / "data")
    experts = {t: str(user_models / "experts" / "red") for t in ("red", "words")}
    with pytest.raises(userspec.UserSpecError, match="mix image and text"):
        userspec.user_spec("mine", base, experts, data)
    with pytest.raises(userspec.UserSpecError, match="merged.*LoRA adapter.*must be dense"):
        userspec.user_spec("mine", base, {"red": experts["red"]}, data, merged=str(adapter))
    theirs = user_models / "theirs.yaml"
    theirs.write_text("name: theirs\n")
    with pytest.raises(userspec.UserSpecError, match="did not write it"):
        userspec.write_spec(theirs, "x")
    assert theirs.read_text() == "name: theirs\n"


def test_the_worked_example_in_docs_zoos_md_is_a_valid_spec(tmp_path):
    import re
    from pathlib import Path

    import yaml

    from featcal.zoo.spec import parsing, schema

    doc = (Path(__file__).resolve().parents[2] / "docs" / "zoos.md").read_text()
    example, text, generative, ready = re.findall(r"^```yaml\n(.*?)^```$", doc, flags=re.S | re.M)
    spec = parsing.from_dict(yaml.safe_load(example), root=tmp_path, source="zoos.md")
    assert list(spec.tasks) == ["flowers", "stanford-cars"]
    assert set(yaml.safe_load(example)) <= set(schema.SCHEMA["zoo"])  # every key it shows is documented
    spec = parsing.from_dict(yaml.safe_load(text), root=tmp_path, source="zoos.md")  # the text zoo's
    assert spec.modality == "text" and spec.preprocess.max_length == 64 and list(spec.tasks) == ["reviews", "topics"]
    spec = parsing.from_dict(yaml.safe_load(generative), root=tmp_path, source="zoos.md")  # the decoder LLM's
    assert spec.modality == "causal_lm" and spec.generation["code"].scorer == "code_pass_at_1"
    spec = parsing.from_dict(yaml.safe_load(ready), root=tmp_path, source="zoos.md")  # ready-made calib and val
    assert (spec.data["math"].calib_split, spec.data["math"].val_split) == ("my_calib", "my_val")
    assert spec.data["math"].splits_read == ("test", "my_calib", "my_val")  # no train split read

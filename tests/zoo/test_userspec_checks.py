"""Your models ends in a zoo that loads or in a refusal the user can act on (issue 40): the spec is
loaded by the zoo loader before it is written (a CLIPVisionModel base without features: pooled is
refused naming the fix, and loads with it and a heads file), the preset comes from the architecture
loaded, a Llama-family base gets the featcal calibrate command after that command's own checks (a
PEFT adapter it takes is taken, one it refuses is refused in its words), and a missing tokenizer is a
sentence, never transformers' own text."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_userspec import write_text_models, write_user_models
from test_zero_shot import tiny_clip
from test_zoo_spec import _perturbed_vision, write_image_folder

from featcal.zoo.spec import userspec


def write_vision_models(root):
    """A tiny ``CLIPVisionModel`` base (no projection, no text tower) in ``root/base``, two experts,
    an image folder per task, and ``root/heads.safetensors`` (a (2, 32) head per task on the pooled
    output)."""
    from safetensors.torch import save_file

    clip = tiny_clip(seed=0)
    _perturbed_vision(clip, 0, std=0.0).save_pretrained(root / "base")
    for i, task in enumerate(("red", "blue")):
        _perturbed_vision(clip, i + 1).save_pretrained(root / "experts" / task)
        write_image_folder(root / "data" / task, ["dark", "light"], n_train=6, n_test=3)
    gen = torch.Generator().manual_seed(3)
    save_file(
        {f"{t}.weight": torch.randn(2, 32, generator=gen) for t in ("red", "blue")}, str(root / "heads.safetensors")
    )
    return root


def write_llama_models(root, dense: bool = False):
    """A tiny Llama base in ``root/base`` (saved without a tokenizer, as a bare model often is), a
    text file per task in ``root/data``, and per task an expert in ``root/experts/<task>``: a PEFT
    LoRA adapter trained on the base as loaded from its directory, or (``dense``) a whole model."""
    from tiny import perturbed, tiny_llama

    tiny_llama(seed=0).save_pretrained(root / "base")
    (root / "data").mkdir(parents=True)
    for i, task in enumerate(("math", "code")):
        (root / "data" / f"{task}.txt").write_text(
            "".join(f"{c}\tsome {task} text {j}\n" for j in range(5) for c in "ab")
        )
        if dense:
            perturbed(tiny_llama(seed=0), 0.02, 10 + i).save_pretrained(root / "experts" / task)
        else:
            from peft import LoraConfig, get_peft_model
            from transformers import LlamaForCausalLM

            base = LlamaForCausalLM.from_pretrained(str(root / "base"))
            cfg = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
            get_peft_model(base, cfg).save_pretrained(str(root / "experts" / task))
    return root


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_a_clip_vision_base_is_refused_naming_the_fix_then_loads_with_pooled_features(tmp_path):
    root = write_vision_models(tmp_path)
    data = userspec.find_tasks(root / "data")
    experts = {t: str(root / "experts" / t) for t in data}
    spec = userspec.user_spec("vis", str(root / "base"), experts, data, splits={"calib": 4, "val": 2})
    target = root / "zoos" / "vis.yaml"
    with pytest.raises(userspec.UserSpecError) as err:
        userspec.load_checked(spec, target)
    assert "Nothing was written" in str(err.value) and "visual_projection" in str(err.value)
    assert "features: pooled" in str(err.value) and "heads" in str(err.value)  # the fix, in the form's words
    assert not target.exists() and not (root / "zoos").exists()
    with pytest.raises(userspec.UserSpecError, match="give file heads"):  # pooled needs a heads file
        userspec.user_spec("vis", str(root / "base"), experts, data, features="pooled")
    heads = {"type": "file", "path": str(root / "heads.safetensors")}
    spec = userspec.user_spec("vis", str(root / "base"), experts, data, heads, features="pooled")
    assert spec["features"] == "pooled"
    zoo = userspec.load_checked(spec, target)
    assert zoo.tasks == ["blue", "red"] and zoo.meta["spec"] == str(target) and zoo.meta["features"] == "pooled"
    assert userspec.preset_of(zoo)[0] == "clip" and "CLIP" in userspec.preset_of(zoo)[1]


def test_a_clip_model_base_loads_and_its_preset_is_named(tmp_path):
    root = write_user_models(tmp_path)
    data = userspec.find_tasks(root / "data")
    spec = userspec.user_spec("mine", str(root / "base"), {t: str(root / "experts" / t) for t in data}, data)
    zoo = userspec.load_checked(spec, root / "mine.yaml")
    assert set(zoo.experts) == {"red", "blue"} and zoo.features.kind == "embedding"
    preset, why = userspec.preset_of(zoo)
    assert preset == "clip" and "clip" in why


def test_a_llama_base_with_a_peft_adapter_gets_the_featcal_calibrate_command(tmp_path):
    """The adapter fits its base (featcal calibrate's own checks pass): no "another architecture"
    error, but the command line that calibrates it, with the preset it picks."""
    root = write_llama_models(tmp_path)
    experts = {t: str(root / "experts" / t) for t in ("math", "code")}
    with pytest.raises(userspec.UserSpecError) as err:
        userspec.refuse_generative(str(root / "base"), experts)
    text, command = str(err.value), err.value.command
    assert "another architecture" not in text and "trained on" not in text
    assert "generative language model" in text and "llama-3b" in text and "checks passed" in text
    assert command.startswith(f"featcal calibrate --base {root / 'base'} ")
    assert f"--expert math={root / 'experts' / 'math'}" in command and "--data " in command
    userspec.refuse_generative(str(write_user_models(tmp_path / "clip") / "base"), {})  # a CLIP base: no refusal


def test_an_adapter_featcal_calibrate_refuses_is_refused_in_its_words(tmp_path):
    from featcal.streaming.run import open_checkpoints
    from tiny import tiny_llama

    root = write_llama_models(tmp_path)
    other = tmp_path / "wider"
    tiny_llama(seed=1, hidden=48, intermediate=64).save_pretrained(other)
    experts = {"math": str(root / "experts" / "math")}
    with pytest.raises(ValueError) as cli:
        open_checkpoints(str(other), experts, None, None)
    with pytest.raises(userspec.UserSpecError) as form:
        userspec.refuse_generative(str(other), experts)
    assert str(cli.value) in str(form.value) and form.value.command is None


def test_dense_llama_experts_without_a_tokenizer_get_a_readable_message(tmp_path):
    root = write_llama_models(tmp_path, dense=True)
    assert not any((root / "base").glob("tokenizer*"))
    with pytest.raises(userspec.UserSpecError) as err:
        userspec.refuse_generative(str(root / "base"), {t: str(root / "experts" / t) for t in ("math", "code")})
    assert "sentencepiece or tiktoken" not in str(err.value) and "featcal calibrate" in str(err.value)


def test_a_text_zoo_without_tokenizer_files_says_so_and_takes_a_tokenizer_directory(tmp_path):
    """The loader's message names the folder and the fix (never transformers' wording); the
    spec's ``tokenizer:`` (the form's tokenizer field) points at the tokenizer kept elsewhere."""
    from featcal.zoo.load import text as text_spec

    root = write_text_models(tmp_path)
    kept = tmp_path / "tokenizer"
    kept.mkdir()
    for f in list((root / "base").iterdir()):
        if f.name.startswith(("tokenizer", "vocab", "special_tokens")):
            shutil.move(str(f), kept / f.name)
    data = userspec.find_tasks(root / "data")
    experts = {t: str(root / "experts" / t) for t in data}
    spec = userspec.user_spec("words", str(root / "base"), experts, data)
    with pytest.raises(userspec.UserSpecError) as err:
        userspec.load_checked(spec, root / "words.yaml")
    assert "no tokenizer files there" in str(err.value) and "tokenizer" in str(err.value).split("Fix:")[1]
    assert "sentencepiece or tiktoken" not in str(err.value)
    with pytest.raises(ValueError, match="sentencepiece package is not installed|cannot read") as bad:
        (tmp_path / "sp").mkdir()
        (tmp_path / "sp" / "tokenizer.model").write_text("not a sentencepiece model")  # a slow tokenizer's file
        text_spec.load_tokenizer(tmp_path / "sp")
    assert "Fix:" in str(bad.value) and "Couldn't instantiate" not in str(bad.value)
    spec = userspec.user_spec("words", str(root / "base"), experts, data, tokenizer=str(kept))
    assert spec["tokenizer"] == str(kept)
    zoo = userspec.load_checked(spec, root / "words.yaml")
    assert zoo.data["colour"].classes == ["blue", "red"]
    with pytest.raises(userspec.UserSpecError, match="an image zoo tokenises nothing"):
        data = userspec.find_tasks(write_user_models(tmp_path / "img") / "data")
        userspec.user_spec(
            "img",
            str(tmp_path / "img" / "base"),
            {"red": str(tmp_path / "img" / "experts" / "red")},
            data,
            tokenizer=str(kept),
        )

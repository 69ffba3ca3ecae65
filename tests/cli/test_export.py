"""The hub-style export (featcal.model.export): every writer leaves a model card that
huggingface_hub's ModelCard parses, with the merge, the FeatCal settings, the calibration
sizes, the scores and a drift summary; the streamed writer copies the base's tokenizer, chat
template and generation config."""

from __future__ import annotations

import json

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import LlamaForCausalLM

import tiny
from featcal import FeatCalConfig, StreamOptions, calibrate_checkpoints
from featcal.cli.commands import main
from featcal.model.checkpoints import INDEX, load_token_data, save_token_data
from featcal.model.export import hub_id, model_card


def card_of(out) -> ModelCard:
    card = ModelCard.load(out / "README.md")
    assert card.data.tags == ["merge", "featcal"]
    return card


def test_zoo_merge_and_calibrate_write_a_card(tiny_zoo_dir, tmp_path):
    assert main(["merge", "--zoo", tiny_zoo_dir, "--method", "ties", "--out", str(tmp_path / "m"), "-q"]) == 0
    card = card_of(tmp_path / "m")
    assert card.data.featcal["merge"] == {"method": "ties", "params": {}}
    assert "settings" not in card.data.featcal
    argv = ["calibrate", "--zoo", tiny_zoo_dir, "--lam", "0.1", "--n-per-task", "16", "--preset", "none", "--eval"]
    assert main([*argv, "--out", str(tmp_path / "c"), "-q"]) == 0
    fc = card_of(tmp_path / "c").data.featcal
    assert fc["settings"]["lam"] == 0.1 and fc["settings"]["preset"] == "none" and fc["calibration"]["n_per_task"] == 16
    assert set(fc["scores"]) == {"task_arithmetic", "featcal"}
    assert fc["drift"]["mean_residual_after"] < fc["drift"]["mean_residual_before"]


def _llama(vocab=64):
    return tiny.tiny_llama(0, 2, vocab=vocab)


@pytest.fixture
def ckpts(tmp_path):
    base = _llama()
    base.save_pretrained(tmp_path / "base")
    (tmp_path / "base" / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (tmp_path / "base" / "chat_template.jinja").write_text("{{ messages }}")
    for i, t in enumerate(("a", "b")):
        torch.manual_seed(i + 1)
        e = _llama()
        e.load_state_dict({k: v + 0.02 * torch.randn_like(v) for k, v in base.state_dict().items()})
        e.save_pretrained(tmp_path / t)
    g = torch.Generator().manual_seed(0)
    save_token_data(
        tmp_path / "d.safetensors", {t: {"input_ids": torch.randint(0, 64, (3, 8), generator=g)} for t in "ab"}
    )
    return tmp_path


def test_streamed_output_is_hub_shaped(ckpts):
    out = ckpts / "out"
    data = load_token_data(ckpts / "d.safetensors", batch_size=2)
    calibrate_checkpoints(
        ckpts / "base",
        {t: ckpts / t for t in "ab"},
        calib_data=data,
        out=out,
        merge=("task_arithmetic", {"scale": 0.4}),
        config=FeatCalConfig.llama("3b"),
        options=StreamOptions(progress=False, max_shard_bytes=40_000),
    )
    assert (out / INDEX).is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    for name in ("config.json", "generation_config.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    card = card_of(out)
    assert card.data.base_model == "base"
    fc = card.data.featcal
    assert fc["merge"] == {"method": "task_arithmetic", "params": {"scale": 0.4}}
    assert fc["calibration"] == {"a": 3, "b": 3} and fc["settings"]["lam"] == FeatCalConfig.llama("3b").lam
    assert fc["drift"]["blocks"] == 2
    LlamaForCausalLM.from_pretrained(out)


def test_vocabulary_mismatch_is_named_and_common_rows_calibrates(ckpts):
    big = _llama(vocab=70)
    with torch.no_grad():
        for k, v in LlamaForCausalLM.from_pretrained(ckpts / "a").state_dict().items():
            big.state_dict()[k][: v.shape[0]].copy_(v)
    big.save_pretrained(ckpts / "a")
    data = load_token_data(ckpts / "d.safetensors", batch_size=2)
    kw = dict(calib_data=data, merge="task_arithmetic")
    quiet, common_rows = StreamOptions(progress=False), StreamOptions(progress=False, common_rows=True)
    with pytest.raises(ValueError, match=r"(embed_tokens|lm_head).weight' has 70 rows .*base has 64.*common_rows=True"):
        calibrate_checkpoints(ckpts / "base", {t: ckpts / t for t in "ab"}, out=ckpts / "o1", options=quiet, **kw)
    calibrate_checkpoints(ckpts / "base", {t: ckpts / t for t in "ab"}, out=ckpts / "o2", options=common_rows, **kw)
    assert LlamaForCausalLM.from_pretrained(ckpts / "o2").model.embed_tokens.weight.shape == (64, 32)
    # a merged model with the grown vocabulary (mergekit's tokenizer union, say): cut, with the base's config
    kw.pop("merge")
    experts = {"a": ckpts / "b", "b": ckpts / "b"}
    calibrate_checkpoints(ckpts / "base", experts, out=ckpts / "o3", merged=ckpts / "a", options=common_rows, **kw)
    assert LlamaForCausalLM.from_pretrained(ckpts / "o3").lm_head.weight.shape == (64, 32)


def test_card_text_and_hub_id(tmp_path):
    snap = tmp_path / "models--org--name" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    assert hub_id(snap) == "org/name" and hub_id(tmp_path) is None
    text = model_card(
        name="m", base="org/name", experts={"x": "p"}, merge={"method": "ties", "params": {"density": 0.2}}
    )
    (tmp_path / "README.md").write_text(text)
    assert ModelCard.load(tmp_path / "README.md").data.base_model == "org/name"

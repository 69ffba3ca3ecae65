"""PEFT LoRA adapters as experts (featcal.model.lora): the merged expert equals peft's own
``merge_and_unload`` to 1e-6 (plain, rsLoRA, rank/alpha patterns, fan_in_fan_out, embeddings,
modules_to_save, regex targets), streamed per block equals in memory, and adapters that do
not fit the base or are not plain LoRA are refused by name."""

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

import tiny
from featcal import StreamOptions, calibrate, calibrate_checkpoints, merge
from featcal.config import preset_config
from featcal.model.checkpoints import Checkpoint, save_token_data
from featcal.model.lora import LoraAdapter, LoraError, lora_scale, merge_lora

QUIET = StreamOptions(progress=False)


def _llama(seed=0, layers=2, vocab=64):
    return tiny.tiny_llama(seed, layers, vocab=vocab)


def _gpt2(seed=0):
    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32)).eval()


def _adapter(base, out, seed, **lora_kw):
    """Save ``base`` to ``out/base`` (once) and a random-initialised LoRA of it to ``out/NAME``;
    returns ``(adapter dir, peft's merge_and_unload state dict)``."""
    import copy

    from peft import LoraConfig, get_peft_model

    base_dir = out / "base"
    if not base_dir.exists():
        base.save_pretrained(base_dir)
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    model.name_or_path = str(base_dir)
    pm = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kw))
    with torch.no_grad():  # LoRA B starts at zero in training; move every factor away from it
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.add_(0.1 * torch.randn_like(p))
    ad = out / f"lora{seed}"
    pm.save_pretrained(ad)
    want = {k: v.clone() for k, v in pm.merge_and_unload().state_dict().items()}
    return ad, want


CASES = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "rslora-all-mlp": dict(r=4, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "patterns-regex": dict(
        r=2,
        lora_alpha=4,
        target_modules=r".*\.(q_proj|o_proj)",
        rank_pattern={"layers.1.self_attn.q_proj": 6},
        alpha_pattern={"o_proj": 3},
    ),
    "embedding-modules-to-save": dict(
        r=3, lora_alpha=5, target_modules=["embed_tokens", "k_proj"], modules_to_save=["lm_head"]
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_merged_expert_equals_peft_merge_and_unload(tmp_path, case):
    base = _llama()
    ad, want = _adapter(base, tmp_path, 1, **CASES[case])
    got = LoraAdapter(ad).merged(base.state_dict(), [str(tmp_path / "base")])
    assert got.keys() == want.keys()
    changed = 0
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-6), k
        changed += not torch.equal(v, base.state_dict()[k])
    assert changed >= 2  # the adapter did change the model


def test_fan_in_fan_out_gpt2(tmp_path):
    base = _gpt2()
    kw = dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, lora_bias=True)
    ad, want = _adapter(base, tmp_path, 2, **kw)
    got = LoraAdapter(ad).merged(base.state_dict(), [str(tmp_path / "base")])
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=0, atol=1e-6), k


def test_merge_lora_is_w_plus_scaled_ba():
    g = torch.Generator().manual_seed(0)
    W, A, B = torch.randn(5, 3, generator=g), torch.randn(2, 3, generator=g), torch.randn(5, 2, generator=g)
    assert torch.allclose(merge_lora(W, A, B, lora_scale(2, 4)), W + 2.0 * B @ A, atol=1e-6)
    assert lora_scale(4, 8, rslora=True) == pytest.approx(4.0)
    assert torch.allclose(merge_lora(W.T.contiguous(), A, B, 0.5, transpose=True), (W + 0.5 * B @ A).T, atol=1e-6)


def _data(tasks, vocab=64):
    g = torch.Generator().manual_seed(3)
    return {t: {"input_ids": torch.randint(0, vocab, (4, 10), generator=g)} for t in tasks}


def test_lora_experts_streamed_equal_in_memory(tmp_path):
    """calibrate(experts={task: adapter dir}) and calibrate_checkpoints with adapters (merged per
    block as read) give the model calibrated on peft's merged experts, and the CLI takes
    --expert NAME=ADAPTER_DIR."""
    from featcal.cli.commands import main
    from featcal.model.checkpoints import load_token_data

    base = _llama(layers=3)
    ads, dense = {}, {}
    for i, t in enumerate(("a", "b")):
        ads[t], sd = _adapter(base, tmp_path, 10 + i, **CASES["plain" if i == 0 else "rslora-all-mlp"])
        dense[t] = _load(base, sd)
    save_token_data(tmp_path / "d.safetensors", _data(ads))
    data = load_token_data(tmp_path / "d.safetensors", batch_size=2)
    cfg = preset_config("llama-3b", lam=1e-3)  # as the CLI below (float64 statistics)
    sd = merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in dense.items()})
    merged = _load(base, sd)
    want, _ = calibrate(merged, base=base, experts=dense, calib_data=data, config=cfg, progress=False)
    got, _ = calibrate(merged, base=base, experts=ads, calib_data=data, config=cfg, progress=False)
    _same(got.state_dict(), want.state_dict())
    out = tmp_path / "streamed"
    calibrate_checkpoints(
        tmp_path / "base", ads, calib_data=data, out=out, merge="task_arithmetic", config=cfg, options=QUIET
    )
    _same(LlamaForCausalLM.from_pretrained(out).state_dict(), want.state_dict())
    argv = ["calibrate", "--base", str(tmp_path / "base"), "--expert", f"a={ads['a']}", "--expert", f"b={ads['b']}"]
    argv += ["--data", str(tmp_path / "d.safetensors"), "--batch-size", "2", "--preset", "llama-3b", "--lam", "1e-3"]
    assert main([*argv, "--out", str(tmp_path / "cli"), "-q"]) == 0
    _same(LlamaForCausalLM.from_pretrained(tmp_path / "cli").state_dict(), want.state_dict())
    cfg_file = ads["a"] / "adapter_config.json"  # an adapter naming another base: refused, unless told
    cfg_file.write_text(json.dumps(json.loads(cfg_file.read_text()) | {"base_model_name_or_path": "org/other"}))
    assert main([*argv, "--out", str(tmp_path / "cli2"), "-q"]) == 2
    assert main([*argv, "--lora-any-base", "--out", str(tmp_path / "cli2"), "-q"]) == 0


def _load(base, sd):
    import copy

    m = copy.deepcopy(base)
    m.load_state_dict(sd)
    return m


def _same(got, want, tol=1e-5):
    for k, v in want.items():
        assert torch.allclose(got[k], v, rtol=1e-4, atol=tol), k


def test_refused_adapters_name_the_problem(tmp_path):
    base = _llama()
    ad, _ = _adapter(base, tmp_path, 1, **CASES["plain"])
    cfg = json.loads((ad / "adapter_config.json").read_text())
    sd = base.state_dict()
    for key, value, match in [
        ("use_dora", True, "use_dora=True: DoRA"),
        ("peft_type", "IA3", "is a IA3 adapter"),
        ("base_model_name_or_path", "meta-llama/Llama-3.1-8B", "trained on 'meta-llama/Llama-3.1-8B'"),
        ("r", 8, "rank 4, adapter_config.json says r=8"),
    ]:
        (ad / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(LoraError, match=match):
            LoraAdapter(ad).merged(sd, [str(tmp_path / "base")])
    (ad / "adapter_config.json").write_text(json.dumps({**cfg, "base_model_name_or_path": "other/llama"}))
    LoraAdapter(ad).merged(sd, [str(tmp_path / "base")], strict_name=False)  # --lora-any-base: shapes only
    (ad / "adapter_config.json").write_text(json.dumps(cfg))
    wide = _llama(layers=2, vocab=64)
    wide_sd = {k: v for k, v in wide.state_dict().items() if "layers.1." not in k}
    with pytest.raises(LoraError, match="layers.1.self_attn.q_proj.weight', which the base has not"):
        LoraAdapter(ad).merged(wide_sd, [str(tmp_path / "base")])
    deeper = tiny.tiny_llama(0, 3, vocab=64).state_dict()  # a base with a block the adapter never saw
    with pytest.raises(LoraError, match=r"target_modules \[.*\] names 'model.layers.2.self_attn"):
        LoraAdapter(ad).merged(deeper, [str(tmp_path / "base")])
    other = tiny.tiny_llama(0, 2, vocab=64, hidden=48)
    with pytest.raises(LoraError, match=r"B A for 'model.layers.0.self_attn.q_proj.weight' is \(32, 32\)"):
        LoraAdapter(ad).merged(other.state_dict(), [str(tmp_path / "base")])
    with pytest.raises(ValueError, match="LoRA adapter is an expert only on its base"):
        from featcal.model.loading import as_model

        as_model(ad, base, "expert 'x'")


def test_adapter_with_added_tokens_needs_common_rows(tmp_path):
    """An adapter trained after adding tokens saves the resized embedding and head (70 rows on a
    64-row base): the vocabulary error names it; with common_rows the expert is peft's merged model
    cut to the base's 64 rows."""
    import copy

    from featcal.model.checkpoints import load_token_data

    base = _llama(layers=2)
    base.save_pretrained(tmp_path / "base")
    grown = copy.deepcopy(base)
    grown.resize_token_embeddings(70)
    grown.name_or_path = str(tmp_path / "base")
    ad, want = _adapter(
        grown, tmp_path, 3, r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj"], modules_to_save=["lm_head"]
    )
    assert want["model.embed_tokens.weight"].shape == (70, 32)
    save_token_data(tmp_path / "d.safetensors", _data(["x", "y"]))
    data = load_token_data(tmp_path / "d.safetensors", batch_size=2)
    kw = dict(calib_data=data, merge="task_arithmetic")
    with pytest.raises(ValueError, match=r"has 70 rows .*base has 64.*common_rows=True"):
        calibrate_checkpoints(tmp_path / "base", {"x": ad, "y": ad}, out=tmp_path / "o1", options=QUIET, **kw)
    common_rows = StreamOptions(progress=False, common_rows=True)
    calibrate_checkpoints(tmp_path / "base", {"x": ad, "y": ad}, out=tmp_path / "o2", options=common_rows, **kw)
    from featcal.model.checkpoints import Checkpoint
    from featcal.model.lora import LoraCheckpoint

    expert = LoraCheckpoint(ad, Checkpoint(tmp_path / "base"))
    got = expert.read_raw(["model.embed_tokens.weight"])["model.embed_tokens.weight"]
    assert torch.allclose(got, want["model.embed_tokens.weight"], atol=1e-6)
    assert LlamaForCausalLM.from_pretrained(tmp_path / "o2").model.embed_tokens.weight.shape == (64, 32)


def test_the_adapters_base_is_recognised_by_its_weights_not_its_name(tmp_path):
    """An adapter trained on ``other/base`` is refused on ``mine/base`` (same last name, other weights),
    and taken on a copy of its base in a directory of any name (same weights)."""
    import shutil

    from featcal.model.lora import LoraCheckpoint

    trained_on = tmp_path / "other"
    ad, _ = _adapter(_llama(seed=0), trained_on, 1, **CASES["plain"])  # trained on other/base
    cfg = json.loads((ad / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(trained_on / "base")
    mine = tmp_path / "mine" / "base"
    _llama(seed=5).save_pretrained(mine)  # same architecture and directory name, other weights
    with pytest.raises(LoraError, match=r"found at '.*other/base' with other weights, but the base given is"):
        LoraCheckpoint(ad, Checkpoint(mine, "base"))
    with pytest.raises(LoraError, match="with other weights"):  # in memory: the model's own directory
        LoraAdapter(ad).merged(_llama(seed=5).state_dict(), [str(mine)])
    copy = tmp_path / "elsewhere" / "renamed"
    shutil.copytree(trained_on / "base", copy)
    LoraCheckpoint(ad, Checkpoint(copy, "base"))  # the same weights under another name: taken
    LoraCheckpoint(ad, Checkpoint(mine, "base"), strict_name=False)  # --lora-any-base: shapes only

"""Streaming calibration from checkpoint shards (featcal.streaming.run): the streamed run equals the
in-memory `calibrate` on the same models and data, with a merge on the fly and with a merged
directory; a killed run leaves no complete-looking output and resumes to the same model."""

import copy
import json
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiny
from featcal import FeatCalConfig, StreamOptions, calibrate, calibrate_checkpoints, merge
from featcal.config import preset_config
from featcal.model.checkpoints import INDEX, load_token_data, save_token_data
from featcal.streaming.run import partial_dir

TASKS = ("math", "code", "chat")
CFG = preset_config("llama-3b", lam=1e-3)  # as `featcal calibrate --preset llama-3b` (float64)
QUIET = StreamOptions(progress=False)


def _llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def _data():
    g = torch.Generator().manual_seed(3)
    data = {}
    for t in TASKS:
        ids = torch.randint(0, 64, (5, 12), generator=g)
        mask = torch.ones(5, 12, dtype=torch.long)
        mask[1, 8:] = 0
        data[t] = {"input_ids": ids, "attention_mask": mask}
    return data


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    """A tiny 8-block Llama base and three experts saved sharded (several shards each), the
    Task Arithmetic merge saved too, and the calibration data as a token file."""
    root = tmp_path_factory.mktemp("ckpts")
    base = _llama()
    experts = {t: tiny.perturbed(base, 0.02, i + 1) for i, t in enumerate(TASKS)}
    base.save_pretrained(root / "base", max_shard_size="20KB")
    for t, m in experts.items():
        m.save_pretrained(root / t, max_shard_size="20KB")
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}))
    merged.save_pretrained(root / "merged", max_shard_size="20KB")
    save_token_data(root / "data.safetensors", _data())
    return {"root": root, "base": base, "experts": experts, "merged": merged}


def _batches(zoo):
    return load_token_data(zoo["root"] / "data.safetensors", batch_size=3)  # 2 batches per task


def _in_memory(zoo):
    model, report = calibrate(
        zoo["merged"], base=zoo["base"], experts=zoo["experts"], calib_data=_batches(zoo), config=CFG, progress=False
    )
    return model, report


def _assert_same_weights(got: dict, want: dict, tol: float = 1e-6) -> None:
    assert set(got) >= set(k for k in want if k != "lm_head.weight" or k in got)
    for k, w in want.items():
        if k not in got:
            continue
        rel = (got[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)
        assert rel <= tol, f"{k}: relative difference {rel:.2e}"


def _experts(zoo):
    return {t: zoo["root"] / t for t in TASKS}


@pytest.mark.parametrize("how", ["merge", "merged"])
def test_streamed_equals_in_memory(zoo, tmp_path, how):
    want, report_want = _in_memory(zoo)
    kw = {"merge": ("task_arithmetic", {"scale": 0.3})} if how == "merge" else {"merged": zoo["root"] / "merged"}
    out = tmp_path / "cal"
    report = calibrate_checkpoints(
        zoo["root"] / "base", _experts(zoo), calib_data=_batches(zoo), config=CFG, out=out, options=QUIET, **kw
    )
    assert (out / INDEX).is_file() or (out / "model.safetensors").is_file()
    assert (out / "config.json").is_file() and (out / "featcal_report.json").is_file()
    got = LlamaForCausalLM.from_pretrained(out)
    assert type(got) is LlamaForCausalLM
    _assert_same_weights(got.state_dict(), want.state_dict())
    # calibration did change the merged model (the comparison is not between two untouched copies)
    moved = got.model.layers[5].mlp.down_proj.weight - zoo["merged"].model.layers[5].mlp.down_proj.weight
    assert moved.abs().max() > 1e-4
    assert len(report.modules) == len(report_want.modules) == 8 * 7
    assert not partial_dir(out).exists()


@pytest.mark.parametrize("every", [1, 3])
def test_killed_run_resumes_to_same_model(zoo, tmp_path, every):
    """Killed after block 4; the streams were last saved after block 4 (every block) or 2 (every
    third), so the resumed run visits the blocks after that one and ends with the same model."""
    out = tmp_path / "cal"
    common = dict(merge=("task_arithmetic", {"scale": 0.3}), calib_data=_batches(zoo), config=CFG, out=out)
    quiet = StreamOptions(progress=False, checkpoint_every=every)

    def die_at_4(block, info):  # calibrate's keys, the streamed block's wall time and memory added
        assert info["done"] == block + 1 and info["blocks"] == 8
        assert 0 <= info["seconds"] <= info["wall_seconds"] and info["peak_rss_mb"] > 0
        if block == 4:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        calibrate_checkpoints(zoo["root"] / "base", _experts(zoo), options=replace(quiet, on_block=die_at_4), **common)
    assert not out.exists()  # nothing that looks complete
    saved = 4 if every == 1 else 2
    assert json.loads((partial_dir(out) / "state.json").read_text())["done"] == saved
    with pytest.raises(FileExistsError, match="resume"):  # neither resumed nor forced
        calibrate_checkpoints(zoo["root"] / "base", _experts(zoo), options=quiet, **common)
    visited = []
    resume = replace(quiet, resume=True, on_block=lambda b, i: visited.append((b, i["done"])))
    report = calibrate_checkpoints(zoo["root"] / "base", _experts(zoo), options=resume, **common)
    assert visited == [(b, b + 1) for b in range(saved + 1, 8)]  # the earlier blocks count as done
    assert [b.block for b in report.blocks] == list(range(8))
    want, _ = _in_memory(zoo)
    _assert_same_weights(LlamaForCausalLM.from_pretrained(out).state_dict(), want.state_dict())
    with pytest.raises(FileExistsError, match="force"):  # an existing output is never overwritten
        calibrate_checkpoints(zoo["root"] / "base", _experts(zoo), options=quiet, **common)


def test_resume_refuses_other_settings(zoo, tmp_path):
    out = tmp_path / "cal"
    common = dict(merge=("task_arithmetic", {"scale": 0.3}), calib_data=_batches(zoo), out=out)

    def die(block, info):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        calibrate_checkpoints(
            zoo["root"] / "base", _experts(zoo), config=CFG, options=replace(QUIET, on_block=die), **common
        )
    with pytest.raises(ValueError, match="config"):
        resume = replace(QUIET, resume=True)
        calibrate_checkpoints(zoo["root"] / "base", _experts(zoo), config=CFG.with_(lam=1.0), options=resume, **common)


def test_bad_inputs_name_the_problem(zoo, tmp_path):
    base, exps, data = zoo["root"] / "base", _experts(zoo), _batches(zoo)
    with pytest.raises(ValueError, match="exactly one"):
        calibrate_checkpoints(base, exps, calib_data=data, out=tmp_path / "o")
    with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 1, got 0"):
        StreamOptions(checkpoint_every=0)  # the options check themselves, before anything is read
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        calibrate_checkpoints(
            base, {**exps, "math": tmp_path / "empty"}, calib_data=data, out=tmp_path / "o", merge="average"
        )
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            on_gpu = StreamOptions(device="cuda")
            calibrate_checkpoints(base, exps, calib_data=data, out=tmp_path / "o", merge="average", options=on_gpu)
        with pytest.raises(ValueError, match="cuda"):
            calibrate(zoo["merged"], base=zoo["base"], experts=zoo["experts"], calib_data=data, device="cuda")


def test_cli_streams_checkpoints(zoo, tmp_path):
    from featcal.cli.commands import main

    out = tmp_path / "cal"
    argv = ["calibrate", "--base", str(zoo["root"] / "base")]
    for t in TASKS:
        argv += ["--expert", f"{t}={zoo['root'] / t}"]
    argv += ["--merge", "task_arithmetic", "--param", "scale=0.3", "--data", str(zoo["root"] / "data.safetensors")]
    argv += [
        "--batch-size",
        "3",
        "--preset",
        "llama-3b",
        "--lam",
        "1e-3",
        "--out",
        str(out),
        "-q",
    ]
    assert main(argv) == 0
    want, _ = _in_memory(zoo)
    _assert_same_weights(LlamaForCausalLM.from_pretrained(out).state_dict(), want.state_dict())


def test_one_block_at_a_time_source_gives_the_same_model(zoo):
    """The in-memory run with ``device=`` another device than the models' goes through
    DeviceBlocks (block l of every model moved there and back, the streams moved once); on the
    CPU the moves are no-ops, but every step of that path runs and must leave the result as is."""
    from featcal.engine.blocksource import DeviceBlocks
    from featcal.model import arch

    want, _ = _in_memory(zoo)
    model = copy.deepcopy(zoo["merged"])
    lists = [arch.resolve_blocks(m)[1] for m in (model, zoo["base"], *zoo["experts"].values())]
    source = DeviceBlocks(torch.device("cpu"), lists[0], lists[1:])
    got, _ = calibrate(
        model,
        base=zoo["base"],
        experts=zoo["experts"],
        calib_data=_batches(zoo),
        config=CFG,
        progress=False,
        inplace=True,
        block_source=source,
    )
    _assert_same_weights(got.state_dict(), want.state_dict(), tol=0.0)
    assert all(p.device.type == "cpu" for p in got.parameters())


def test_bf16_tied_single_file_checkpoints(tmp_path):
    """bf16 models with tied input and output embeddings, each in one model.safetensors: the
    stems load the shared embedding (a head skipped with it would leave the streams on meta), the
    output keeps bf16 and the tie, and equals calibrate on the same checkpoints loaded whole."""
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(cfg).eval()
    for i, t in enumerate("ab"):
        tiny.perturbed(base, 0.02, i + 1).to(torch.bfloat16).save_pretrained(tmp_path / t)
    base.to(torch.bfloat16).save_pretrained(tmp_path / "base")
    assert (tmp_path / "base" / "model.safetensors").is_file()
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(2))
    data = {t: [{"input_ids": ids}] for t in "ab"}
    config = FeatCalConfig.llama("3b", lam=1e-2)
    out = tmp_path / "out"
    calibrate_checkpoints(
        tmp_path / "base",
        {t: tmp_path / t for t in "ab"},
        merge="average",
        calib_data=data,
        config=config,
        out=out,
        options=QUIET,
    )
    got = LlamaForCausalLM.from_pretrained(out)
    assert got.dtype == torch.bfloat16 and got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()

    def load(d):
        return LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()

    base, experts = load(tmp_path / "base"), {t: load(tmp_path / t) for t in "ab"}
    merged = load(tmp_path / "base")
    merged.load_state_dict(merge("average", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}))
    want, _ = calibrate(merged, base=base, experts=experts, calib_data=data, config=config, progress=False)
    _assert_same_weights(got.state_dict(), want.state_dict(), tol=0.0)
    assert not torch.equal(got.model.layers[2].mlp.up_proj.weight, merged.model.layers[2].mlp.up_proj.weight)

"""The streamed run never mixes states, never runs on changed inputs and checks before work
(issue 24, items 2, 3, 6 and 10): a concurrent run is refused naming the holder; a failure
injected between the streams' and the state's writes resumes to the uninterrupted model;
experts overwritten in place are refused on resume; architectures that differ where shapes
cannot tell are refused as in memory; bad shards, indexes, token ids, merge parameters and NaN
are named before block 0 (the file, the fix); T5EncoderModel streams like in memory."""

import copy
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tiny
from featcal import FeatCalConfig, StreamOptions, calibrate, merge
from featcal.model.checkpoints import INDEX
from featcal.streaming import workdir
from featcal.streaming.run import calibrate_checkpoints, partial_dir
from featcal.util.outdir import OutputLockedError

REPO = Path(__file__).resolve().parents[2]
TASKS = ("math", "code")
CFG = FeatCalConfig.llama("3b", lam=1e-3)


def _data(vocab: int = 50):
    g = torch.Generator().manual_seed(3)
    return {t: [{"input_ids": torch.randint(0, vocab, (3, 10), generator=g)} for _ in range(2)] for t in TASKS}


@pytest.fixture
def ckpts(tmp_path):
    base = tiny.tiny_llama(layers=4)
    experts = {t: tiny.perturbed(base, 0.02, i + 1) for i, t in enumerate(TASKS)}
    base.save_pretrained(tmp_path / "base", max_shard_size="30KB")
    for t, m in experts.items():
        m.save_pretrained(tmp_path / t, max_shard_size="30KB")
    return {"root": tmp_path, "base": base, "experts": experts}


def _run(c, out=None, calib_data=None, merge=("task_arithmetic", {"scale": 0.3}), **options):
    """The streamed run on the checkpoints ``c``, quiet, with ``options`` (StreamOptions' fields)."""
    return calibrate_checkpoints(
        c["root"] / "base",
        {t: c["root"] / t for t in TASKS},
        calib_data=calib_data or _data(),
        config=CFG,
        out=out or c["root"] / "out",
        merge=merge,
        options=StreamOptions(progress=False, **options),
    )


def _weights(out: Path) -> dict:
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


class Stop(Exception):
    pass


def _stop_after(block: int):
    def on_block(b, info):
        if b == block:
            raise Stop

    return on_block


# ------------------------------------------------------------------ item 2: one run per output


def test_a_concurrent_run_on_one_output_is_refused_naming_the_holder(ckpts):
    out = ckpts["root"] / "out"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom featcal.util.outdir import output_lock\n"
            f"with output_lock({str(out)!r}):\n    print('held', flush=True)\n    time.sleep(1800)\n",
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputLockedError, match=f"pid {holder.pid} on "):
            _run(ckpts, force=True)
        with pytest.raises(OutputLockedError, match="started"):
            _run(ckpts, resume=True)
        assert not out.exists() and not partial_dir(out).exists()  # the refused runs wrote nothing
    finally:
        holder.kill()
        holder.wait()
    _run(ckpts)  # the lock went with its holder
    assert (out / "config.json").is_file()


# ------------------------------------------------------------------ item 3: resume cannot mix states


def test_failure_between_the_two_checkpoint_writes_resumes_correctly(ckpts, monkeypatch):
    _run(ckpts, out=ckpts["root"] / "want")
    want = _weights(ckpts["root"] / "want")
    real = workdir.write_json_atomic
    calls = {"n": 0}

    def enospc_on_third(doc, path):
        calls["n"] += 1
        if calls["n"] == 3:  # block 2: its streams are written, its state is not
            raise OSError(28, "No space left on device (injected)")
        return real(doc, path)

    monkeypatch.setattr(workdir, "write_json_atomic", enospc_on_third)
    with pytest.raises(OSError, match="injected"):
        _run(ckpts)
    monkeypatch.setattr(workdir, "write_json_atomic", real)
    state = json.loads((partial_dir(ckpts["root"] / "out") / "state.json").read_text())
    assert state["done"] == 1  # the last commit stands
    _run(ckpts, resume=True)
    got = _weights(ckpts["root"] / "out")
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_experts_overwritten_in_place_are_refused_on_resume(ckpts):
    with pytest.raises(Stop):
        _run(ckpts, on_block=_stop_after(1))
    other = tiny.perturbed(ckpts["base"], 0.02, 99)  # another fine-tune, same shapes and file names
    other.save_pretrained(ckpts["root"] / "code", max_shard_size="30KB")
    with pytest.raises(ValueError, match="resume: .*experts"):
        _run(ckpts, resume=True)


# ------------------------------------------------------------------ item 6: architectures


@pytest.mark.parametrize(
    "change",
    [
        {"rope_theta": 500000.0},
        {"rms_norm_eps": 1e-3},
        {"hidden_act": "gelu"},
        {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 4},  # same shapes, other heads
    ],
    ids=["rope_theta", "rms_norm_eps", "hidden_act", "heads"],
)
def test_streamed_architecture_mismatch_is_refused(ckpts, change):
    cfg_path = ckpts["root"] / "code" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(change)
    if "rope_theta" in change:
        cfg["rope_parameters"] = {**cfg.get("rope_parameters", {}), "rope_theta": change["rope_theta"]}
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="expert 'code'.*differs from the merged model"):
        _run(ckpts)
    assert not (ckpts["root"] / "out").exists() and not partial_dir(ckpts["root"] / "out").exists()


def test_streamed_class_mismatch_is_refused(ckpts):
    cfg_path = ckpts["root"] / "code" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="expert 'code'"):
        _run(ckpts)


# ------------------------------------------------------------------ item 10: checks before work


def _shard(ckpts, role="code") -> Path:
    return (
        ckpts["root"] / role / sorted(json.loads((ckpts["root"] / role / INDEX).read_text())["weight_map"].values())[0]
    )


def test_corrupted_header_names_the_file(ckpts):
    shard = _shard(ckpts)
    raw = bytearray(shard.read_bytes())
    raw[12:16] = b"\xff\xfe\xff\xfe"
    shard.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=f"{shard.name}.*not a readable safetensors"):
        _run(ckpts)


def test_truncated_shard_names_the_file(ckpts):
    shard = _shard(ckpts)
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match=f"{shard.name}.*truncated"):
        _run(ckpts)


def test_misindexed_and_missing_tensors_are_named_before_block_0(ckpts):
    index_path = ckpts["root"] / "code" / INDEX
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[-1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"{name}.*does not hold it"):
        _run(ckpts)
    del index["weight_map"][name]  # now no file holds it for the index
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="no tensor|lacks"):
        _run(ckpts)
    assert not partial_dir(ckpts["root"] / "out").exists()


def test_token_ids_out_of_the_vocabulary_are_refused_up_front(ckpts):
    with pytest.raises(ValueError, match="vocabulary has 50"):
        _run(ckpts, calib_data=_data(vocab=100))
    assert not partial_dir(ckpts["root"] / "out").exists()


def test_nan_in_an_expert_shard_is_blamed_on_that_file(ckpts):
    index = json.loads((ckpts["root"] / "code" / INDEX).read_text())["weight_map"]
    name = "model.layers.2.mlp.up_proj.weight"
    shard = ckpts["root"] / "code" / index[name]
    tensors = load_file(shard)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(FloatingPointError, match=f"expert 'code'.*{name}.*{shard.name}"):
        _run(ckpts)


def test_bad_merge_parameter_leaves_no_work_directory(ckpts):
    for bad in ({"scale": float("nan")}, {"density": 2.0}):
        with pytest.raises((ValueError, TypeError)):
            _run(ckpts, merge=("ties" if "density" in bad else "task_arithmetic", bad))
        assert not partial_dir(ckpts["root"] / "out").exists()
    _run(ckpts)  # nothing in the way of the next run


def test_t5_encoder_streams_like_in_memory(tmp_path):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(0)
    base = T5EncoderModel(T5Config(vocab_size=40, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=4)).eval()
    experts = {t: tiny.perturbed(base, 0.02, i + 1) for i, t in enumerate(TASKS)}
    base.save_pretrained(tmp_path / "base")
    for t, m in experts.items():
        m.save_pretrained(tmp_path / t)
    g = torch.Generator().manual_seed(0)
    data = {t: [{"input_ids": torch.randint(0, 40, (4, 6), generator=g)}] for t in TASKS}
    cfg = FeatCalConfig(lam=0.05)
    calibrate_checkpoints(
        tmp_path / "base",
        {t: tmp_path / t for t in TASKS},
        calib_data=data,
        out=tmp_path / "out",
        merge="task_arithmetic",
        config=cfg,
        options=StreamOptions(progress=False),
    )
    merged = copy.deepcopy(base)
    merged.load_state_dict(merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}))
    want, report = calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    assert any("fewer than its input width" in n for n in report.notes)  # a note: the ridge keeps it defined
    got = _weights(tmp_path / "out")
    for k, v in want.state_dict().items():
        if k in got:
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    moved = (
        got["encoder.block.1.layer.1.DenseReluDense.wo.weight"]
        - merged.state_dict()["encoder.block.1.layer.1.DenseReluDense.wo.weight"]
    )
    assert moved.abs().max() > 1e-5


def test_struct_of_a_good_shard_is_accepted(ckpts):
    """(the header checks accept what save_pretrained writes: aligned headers, every dtype used)"""
    shard = _shard(ckpts, "base")
    (n,) = struct.unpack("<Q", shard.read_bytes()[:8])
    assert n > 0
    _run(ckpts)

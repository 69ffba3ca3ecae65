"""The streamed run's up-front memory estimate (featcal.streaming.memory): each term as its
docstring counts it; a run it does not fit is refused before anything is written (or, forced,
warned); and on a real run it is within a factor of 2 of the peak resident memory the run added."""

import json
import subprocess
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import tiny
from featcal import StreamOptions, calibrate_checkpoints
from featcal.streaming import memory
from featcal.streaming.memory import NotEnoughMemoryError, RunSize, estimate_peak

TESTS = Path(__file__).resolve().parents[1]


def test_each_term_is_what_its_docstring_counts():
    size = RunSize(
        block_bytes=1000,
        tokens={"a": 10, "b": 30},
        hidden=8,
        stream_bytes=4,
        call_tokens=16,
        widths=100,
        stats_elems=50,
        stats_bytes=8,
    )
    got = estimate_peak(size)
    assert got["blocks"] == 1000
    assert got["streams"] == memory.STREAM_COPIES * 40 * 8 * 4
    assert got["call"] == memory.CALL_COPIES * 16 * 100 * 4
    assert got["statistics"] == 3 * 50 * 8  # two tasks' sums and the systems
    assert got["total"] == sum(v for k, v in got.items() if k != "total")
    on_gpu = estimate_peak(replace(size, on_gpu=True))  # the calls and statistics on the GPU
    assert on_gpu["call"] == on_gpu["statistics"] == 0 and on_gpu["blocks"] == 1000
    assert on_gpu["streams"] == memory.HOST_COPIES_ON_GPU * 40 * 8 * 4


@pytest.fixture
def small(tmp_path):
    base = tiny.tiny_llama(layers=2)
    base.save_pretrained(tmp_path / "base")
    for i, t in enumerate(("math", "code")):
        tiny.perturbed(base, 0.02, i + 1).save_pretrained(tmp_path / t)
    g = torch.Generator().manual_seed(0)
    data = {t: [{"input_ids": torch.randint(0, 50, (4, 8), generator=g)}] for t in ("math", "code")}
    kw = dict(calib_data=data, merge="task_arithmetic")
    return tmp_path, {t: tmp_path / t for t in data}, kw


def test_a_run_that_does_not_fit_is_refused_before_any_work_and_force_warns(small, monkeypatch):
    root, experts, kw = small
    out = root / "out"
    monkeypatch.setattr(memory, "available_bytes", lambda: 1024)  # 1 KiB available
    with pytest.raises(NotEnoughMemoryError, match=r"needs about .* GiB of memory .* 0\.00 GiB is available") as err:
        calibrate_checkpoints(root / "base", experts, out=out, options=StreamOptions(progress=False), **kw)
    assert "fewer calibration examples" in str(err.value) and "--force" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == ["base", "code", "math"]  # no out, work directory or lock
    with pytest.warns(UserWarning, match="needs about"):
        calibrate_checkpoints(root / "base", experts, out=out, options=StreamOptions(progress=False, force=True), **kw)
    assert (out / "config.json").is_file()
    monkeypatch.undo()  # the machine's real memory: the same run passes without a word
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="this streamed run needs")
        calibrate_checkpoints(root / "base", experts, out=root / "out2", options=StreamOptions(progress=False), **kw)
    assert (root / "out2" / "config.json").is_file()


def test_the_cli_says_it_in_one_line_and_force_runs_anyway(small, monkeypatch, capsys):
    from featcal.cli.commands import main
    from featcal.model.checkpoints import save_token_data

    root, experts, kw = small
    save_token_data(root / "d.safetensors", {t: b[0] for t, b in kw["calib_data"].items()})
    monkeypatch.setattr(memory, "available_bytes", lambda: 1024)
    argv = ["calibrate", "--base", str(root / "base"), "--data", str(root / "d.safetensors"), "--out", str(root / "o")]
    argv += [f"--expert={t}={d}" for t, d in experts.items()] + ["-q"]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # (the preset's line aside)
    assert len(errors) == 1 and errors[0].startswith("featcal: error: this streamed run needs about")
    assert not any(p.name in ("o", ".o.featcal-lock", ".o.featcal-partial") for p in root.iterdir())
    with pytest.warns(UserWarning, match="needs about"):
        assert main(argv + ["--force"]) == 0
    assert (root / "o" / "config.json").is_file()


def test_available_memory_is_the_lesser_of_the_system_and_the_cgroup(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text(str(600 << 20))
    (tmp_path / "memory.stat").write_text(f"anon 1\nfile {100 << 20}\n")
    assert memory._cgroup_free(tmp_path) == (1 << 30) - (500 << 20)  # the page cache is reclaimable
    (tmp_path / "memory.max").write_text("max\n")
    assert memory._cgroup_free(tmp_path) is None
    monkeypatch.setattr(memory, "_cgroup_free", lambda: 12345)
    assert memory.available_bytes() == 12345


MEASURE = """
import json, sys, torch
sys.path.insert(0, {tests!r})
import tiny
from pathlib import Path
from featcal import StreamOptions, calibrate_checkpoints
from featcal.streaming import memory
from featcal.util.memory import peak_rss_mb, rss_mb, trim_heap

torch.set_num_threads(1)
root, got = Path({root!r}), {{}}
estimate = memory.estimate_peak
memory.estimate_peak = lambda size: got.setdefault("estimate", estimate(size))
base = tiny.tiny_llama(hidden=256, intermediate=512, layers=2)
base.save_pretrained(root / "base")
for i in range(2):
    tiny.perturbed(base, 0.02, 10 + i).save_pretrained(root / f"t{{i}}")
del base
g = torch.Generator().manual_seed(0)
data = {{f"t{{i}}": [{{"input_ids": torch.randint(0, 50, (32, 64), generator=g)}} for _ in range(8)] for i in range(2)}}
trim_heap()
before = rss_mb()
calibrate_checkpoints(root / "base", {{t: root / t for t in data}}, calib_data=data, out=root / "out",
                      merge="task_arithmetic", options=StreamOptions(progress=False))
print(json.dumps({{"grown_mb": peak_rss_mb() - before, "estimate_mb": got["estimate"]["total"] / 2**20}}))
"""


@pytest.mark.slow
def test_the_estimate_is_within_a_factor_of_two_of_the_measured_peak(tmp_path):
    """A fresh process (its peak is the run's, not an earlier test's): 2 tasks of 256 x 64 tokens
    on a 256-wide Llama, where the streams and the calls' working memory dominate."""
    code = MEASURE.format(tests=str(TESTS), root=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["grown_mb"] > 50, got  # the run did hold something to measure
    assert got["grown_mb"] / 2 <= got["estimate_mb"] <= 2 * got["grown_mb"], got

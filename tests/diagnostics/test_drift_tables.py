"""Diagnostics: the one-pass cost (one extra block call per block), the cached streams (the
experts', and the model's own kept while reading it), the tables' rows and shapes, padding, and
the command lines (tiny seeded models, offline). The drift identity and the maths:
test_diagnostics.py."""

from __future__ import annotations

import argparse
import json

import pandas as pd
import pytest
import torch

from diagnostics import (
    WHOLE,
    diagnose,
    drift_table,
    drift_tables,
    expert_streams,
)
from featcal.model.arch import resolve_blocks
from featcal.model.streams import catch_block_inputs
from tiny import (
    ToyModel,
    model_expert_batches,
    perturbed,
    toy_data,
    toy_zoo,
    toy_zoo_object,
)

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- cost and shape


def test_one_extra_block_call_per_block():
    model, expert, batches = model_expert_batches("toy")
    calls: dict[str, int] = {}

    def counter(key):
        def hook(*_):
            calls[key] = calls.get(key, 0) + 1

        return hook

    handles = [b.register_forward_hook(counter(f"mod{l}")) for l, b in enumerate(model.blocks)]
    handles += [b.register_forward_hook(counter(f"exp{l}")) for l, b in enumerate(expert.blocks)]
    handles += [
        model.stem.register_forward_hook(counter("mod_stem")),
        model.head.register_forward_hook(counter("mod_head")),
        expert.stem.register_forward_hook(counter("exp_stem")),
    ]
    try:
        drift_table(model, {"a": expert}, {"a": batches})
    finally:
        for h in handles:
            h.remove()
    n = len(batches)
    assert calls == {
        "mod_stem": n,
        "exp_stem": n,
        **{f"mod{l}": 2 * n for l in range(3)},
        **{f"exp{l}": n for l in range(3)},
    }


@pytest.mark.parametrize("kind", ["toy", "hf_clip", "open_clip"])
def test_cached_expert_streams_give_the_same_table_without_expert_blocks(kind):
    model, expert, batches = model_expert_batches(kind)
    other = perturbed(model, 0.1, 7)  # a second diagnosed model
    data = {"a": batches}
    cache = expert_streams({"a": expert}, data)
    _, eblks = resolve_blocks(expert)
    assert len(cache.calls["a"]) == len(eblks) + 1 and cache.nbytes > 0
    calls = []
    handles = [b.register_forward_hook(lambda *_: calls.append(1)) for b in eblks]
    try:
        got = [drift_table(m, {"a": expert}, data, expert_cache=cache) for m in (model, other)]
    finally:
        for h in handles:
            h.remove()
    assert calls == []  # the experts' blocks never ran
    for m, g in zip((model, other), got):
        pd.testing.assert_frame_equal(g, drift_table(m, {"a": expert}, data))


@pytest.mark.parametrize("kind", ["toy", "hf_clip", "open_clip"])
def test_a_models_own_streams_kept_while_reading_it_give_the_same_table(kind):
    """streams_while keeps the model's stream while ``fn`` runs it; drift_table given both
    caches then runs the model's blocks once per batch (the cross call) and the experts' none."""
    from diagnostics import streams_while
    from featcal.model.streams import call_model

    model, expert, batches = model_expert_batches(kind)
    data = {"a": batches}

    def fn(m, b):
        return call_model(m, b)

    results, own = streams_while(model, data, fn)
    assert len(results["a"]) == len(batches)
    with torch.no_grad():
        first = fn(model.eval(), batches[0])
    want, got = (
        x[0] if isinstance(x, (tuple, list)) else getattr(x, "last_hidden_state", x) for x in (first, results["a"][0])
    )
    torch.testing.assert_close(got, want)  # fn's own results
    _, blks = resolve_blocks(model)
    calls = []
    handles = [b.register_forward_hook(lambda *_: calls.append(1)) for b in blks]
    try:
        table = drift_table(
            model, {"a": expert}, data, expert_cache=expert_streams({"a": expert}, data), model_cache=own
        )
    finally:
        for h in handles:
            h.remove()
    assert len(calls) == len(blks) * len(batches)  # only f_mod(h_exp): once per block and batch
    pd.testing.assert_frame_equal(table, drift_table(model, {"a": expert}, data))


def test_streams_while_needs_a_function_that_runs_every_block():
    from diagnostics import streams_while

    model, expert, batches = model_expert_batches("toy")
    _, blks = resolve_blocks(model)
    with pytest.raises(RuntimeError, match="did not run every block"):
        streams_while(model, {"a": batches}, lambda m, b: catch_block_inputs(m, blks[0], b))
    _, own = streams_while(model, {"a": batches}, lambda m, b: m(b))
    with pytest.raises(ValueError, match="model_cache .*streams_while"):
        drift_table(model, {"a": expert}, {"a": batches[:1]}, model_cache=own)


def test_cached_expert_streams_must_match_the_data():
    model, expert, batches = model_expert_batches("toy")
    cache = expert_streams({"a": expert}, {"a": batches})
    with pytest.raises(ValueError, match="tasks"):
        drift_table(model, {"b": expert}, {"b": batches}, expert_cache=cache)
    with pytest.raises(ValueError, match="batches"):
        drift_table(model, {"a": expert}, {"a": batches[:1]}, expert_cache=cache)


def test_per_example_rows_only_for_final_features():
    zoo = toy_zoo_object()
    tables, summary = diagnose(zoo.merged("task_arithmetic"), zoo, n_per_task=6, batch_size=4)
    assert set(tables) == {"drift", "expert_cosine", "task_vector", "output"}
    assert [n for n, df in tables.items() if "example" in df.columns] == ["expert_cosine"]
    cos = tables["expert_cosine"]
    assert (cos.block == WHOLE).all() and (cos.metric == "expert_cosine").all()
    assert sorted(cos.groupby("task").example.apply(list).iloc[0]) == list(range(6))
    drift = tables["drift"]
    assert list(drift.columns) == ["task", "block", "metric", "value"]
    assert sorted(drift.block.unique()) == [0, 1, 2]
    assert len(drift) == 2 * 3 * drift.metric.nunique()
    assert "KL(expert" in summary and "task-vector cosine" in summary


def test_padding_is_excluded():
    class MaskedToy(ToyModel):
        def forward(self, x, attention_mask=None):
            return super().forward(x)

    torch.manual_seed(0)
    model = MaskedToy()
    expert = perturbed(model, 0.2, 3)
    x = torch.randn(4, 5, 6)
    padded = x.clone()
    padded[:, 3:] = 100.0  # garbage in the padding
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[:, 3:] = 0
    got = drift_table(model, {"a": expert}, {"a": [{"x": padded, "attention_mask": mask}]})
    want = drift_table(model, {"a": expert}, {"a": [x[:, :3]]})  # tokens never mix in the toy
    torch.testing.assert_close(torch.tensor(got.value.values), torch.tensor(want.value.values))


def test_drift_tables_and_model_column():
    base, experts, merged = toy_zoo(n_tasks=2)
    df = drift_tables({"merged": merged, "base": base}, experts, toy_data(experts, n=3, batch=3), cka=False)
    assert list(df.columns[:2]) == ["model", "task"] and set(df.model) == {"merged", "base"}
    assert "cka" not in set(df.metric)


# ----------------------------------------------------------------------------- CLI plumbing


@pytest.mark.parametrize("which", ["merged", "calibrated", "DIR"])
def test_cli_writes_tables_and_summary(tmp_path, monkeypatch, which):
    from diagnostics import cli
    from featcal.zoo.io import save_model

    zoo = toy_zoo_object()
    monkeypatch.setattr("featcal.cli.common.load_any", lambda spec, progress=True, device="cpu": zoo)
    if which == "DIR":
        which = str(save_model(zoo.merged("task_arithmetic"), tmp_path / "saved", fmt="torch"))
    parser = cli.add_arguments(argparse.ArgumentParser(prog="featcal diagnose"))
    args = parser.parse_args(
        ["--zoo", "toy", "--model", which, "--n-per-task", "4", "--out", str(tmp_path / "diag"), "--quiet", "--no-cka"]
    )
    assert cli.run(args) == 0
    files = sorted(p.name for p in (tmp_path / "diag").iterdir())
    tables = ["drift.csv", "expert_cosine.csv", "output.csv", "summary.txt", "task_vector.csv"]
    assert files == [".featcal-output.json", *tables]  # the tables and featcal's marker listing them
    assert json.loads((tmp_path / "diag" / ".featcal-output.json").read_text())["files"] == tables
    drift = pd.read_csv(tmp_path / "diag" / "drift.csv")
    assert list(drift.columns) == ["task", "block", "metric", "value"]
    assert "relative drift" in (tmp_path / "diag" / "summary.txt").read_text()


def test_featcal_cli_has_diagnose(tmp_path, monkeypatch, capsys):
    from featcal.cli import commands as featcal_cli

    zoo = toy_zoo_object()
    monkeypatch.setattr("featcal.cli.common.load_any", lambda spec, progress=True, device="cpu": zoo)
    argv = ["diagnose", "--zoo", "toy", "--n-per-task", "4", "--format", "parquet", "--out", str(tmp_path / "d")]
    assert featcal_cli.main(argv) == 0
    assert "KL(expert || merged)" in capsys.readouterr().out
    assert (tmp_path / "d" / "drift.parquet").is_file()
    assert featcal_cli.main(argv) == 2  # the output exists: one error line, no traceback
    assert "already exists" in capsys.readouterr().err


def test_an_expert_trace_keeps_the_streams_the_drift_table_reads():
    """One type for the experts' streams at every block: what a calibration's ExpertTrace
    kept serves drift_table as its expert cache (the same table, no expert block run)."""
    from featcal import ExpertTrace, FeatCalConfig, calibrate

    base, experts, merged = toy_zoo(n_tasks=2, n_blocks=2)
    data = toy_data(experts, n=16)
    trace = ExpertTrace()
    model, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig(), expert_trace=trace, progress=False
    )
    kept = trace.streams[report.blocks_path]
    assert all(len(kept.calls[t]) == 3 for t in experts)  # block 0, 1 inputs and block 1's output
    want = drift_table(model, experts, data, cka=False)
    calls = []
    for e in experts.values():
        for blk in resolve_blocks(e)[1]:
            blk.register_forward_hook(lambda *a: calls.append(1))
    got = drift_table(model, experts, data, cka=False, expert_cache=kept)
    pd.testing.assert_frame_equal(got, want)
    assert calls == []  # the experts' blocks did not run again

"""FeatCal tuned per block (featcal.sweep.perblock): TPE over each group's (lam, alpha), each trial
a preview scored on val, the best confirmed exactly, the global preset kept on a tie or a loss."""

import json

import pandas as pd
import pytest
import torch

import tiny
from featcal import FeatCalConfig
from featcal.sweep import search
from featcal.sweep.perblock import block_groups, schedule_of
from featcal.sweep.search import TuneConfig, tune


def _val(tasks, n=12, seed=7):
    gen = torch.Generator().manual_seed(seed)
    return {t: (torch.randn(n, 5, 6, generator=gen), None) for t in tasks}


def _toy():
    base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=3)
    return merged, base, experts, tiny.toy_data(experts, n=16), _val(experts)


def test_blocks_are_cut_into_consecutive_groups():
    assert block_groups(list(range(6)), 4) == [(0, 1), (2, 3), (4,), (5,)]
    assert block_groups([0, 1, 2], None) == block_groups([0, 1, 2], 9) == [(0,), (1,), (2,)]
    assert block_groups([0, 1, 2], 1) == [(0, 1, 2)]
    params = {"log10_lam/0-1": -1.0, "alpha/0-1": 0.2, "log10_lam/2": 0.0, "alpha/2": 0.9}
    assert schedule_of(params, [(0, 1), (2,)]) == {
        0: {"lam": 0.1, "alpha": 0.2},
        1: {"lam": 0.1, "alpha": 0.2},
        2: {"lam": 1.0, "alpha": 0.9},
    }
    with pytest.raises(ValueError, match="trials must be >= 1"):
        TuneConfig(search="per_block", trials=0)


def test_per_block_search_is_seeded_confirms_its_best_and_never_loses_to_the_preset():
    merged, base, experts, data, val = _toy()
    cfg = FeatCalConfig(stats_dtype=torch.float64)
    kw = dict(config=cfg, search="per_block", trials=8, groups=2, n_confirm=2)
    a, b = tune(merged, base, experts, data, val, seed=3, **kw), tune(merged, base, experts, data, val, seed=3, **kw)
    other = tune(merged, base, experts, data, val, seed=4, **kw)
    t = a.table
    pd.testing.assert_frame_equal(t.drop(columns="seconds"), b.table.drop(columns="seconds"))
    assert not t["preview"].equals(other.table["preview"])  # another seed, other trials
    assert list(t["stage"]) == ["anchor"] + ["tpe"] * 8
    assert {"lam/0-1", "alpha/0-1", "lam/2", "alpha/2"} <= set(t.columns)
    assert t["confirmed"].sum() == 3  # the preset and the two best previews
    assert a.best["score"] == t["exact"].max() >= a.best["anchor_score"]
    assert (a.best["stage"] == "anchor") == (a.best["schedule"] == {})
    chosen = a.best_config()
    assert chosen.with_(schedule=()) == cfg
    if a.best["stage"] != "anchor":  # the schedule chosen is the confirmed row's
        row = t[t["point"] == a.best["point"]].iloc[0]
        assert chosen.setting_at(2).lam == pytest.approx(row["lam/2"]) and row["exact"] > a.best["anchor_score"]


def test_a_tie_keeps_the_global_preset(monkeypatch):
    """Every confirmation scores exactly the preset's val score: the preset is kept, no schedule."""
    merged, base, experts, data, val = _toy()
    real, preset = search._anchor, {}

    def anchor(*args):  # the preset's exact run, its per-task val scores kept
        work, rows = real(*args)
        preset.update({k.removeprefix("exact/"): v for k, v in rows[0].items() if k.startswith("exact/")})
        return work, rows

    monkeypatch.setattr(search, "_anchor", anchor)
    monkeypatch.setattr(search, "exact_job", lambda work, at: {"scores": preset, "rel_dist": 0.0, "seconds": 0.0})
    res = tune(merged, base, experts, data, val, search="per_block", trials=4, n_confirm=2)
    t = res.table
    assert t["confirmed"].sum() == 3 and (t.loc[t["confirmed"], "exact"] == res.best["anchor_score"]).all()
    assert res.best["stage"] == "anchor" and res.best["schedule"] == {}
    assert res.best_config() == FeatCalConfig.clip()


def test_tune_per_block_command_line_prints_the_schedule_and_writes_its_table(tiny_zoo_dir, tmp_path, capsys):
    from featcal.cli.commands import main

    def run(out):
        args = ["tune", "--zoo", tiny_zoo_dir, "--n-calib", "8", "--per-block", "--trials", "5", "--groups", "2"]
        assert main(args + ["--n-confirm", "1", "--report", "--out", str(out), "-q"]) == 0
        return pd.read_csv(out / "table.csv"), json.loads((out / "best.json").read_text())

    table, best = run(tmp_path / "a")
    printed = capsys.readouterr().out
    assert {p.name for p in (tmp_path / "a").iterdir()} == {
        ".featcal-output.json",
        "best.json",
        "table.csv",
        "test_report.csv",
    }
    assert len(table) == 6 and table["confirmed"].sum() == 2
    assert [c for c in table.columns if c.startswith("lam/")] == ["lam/0", "lam/1"]  # the tiny zoo's 2 blocks
    assert best["tune"]["search"] == "per_block" and best["tune"]["trials"] == 5
    assert best["best"]["score"] >= best["best"]["anchor_score"]
    assert "vs global preset" in printed and "TEST accuracy" in printed
    again, _ = run(tmp_path / "b")  # the same seed: the same trials and scores
    pd.testing.assert_frame_equal(table.drop(columns="seconds"), again.drop(columns="seconds"))


def test_tune_page_runs_a_per_block_search_on_a_tiny_zoo(tmp_path):
    pytest.importorskip("streamlit")
    from app_zoo import app_page_on_tiny_zoo

    at = app_page_on_tiny_zoo(tmp_path, "pages/tune.py")
    at.select_slider(key="tune_n").set_value(8)
    at.slider(key="tune_confirm").set_value(1)
    at.selectbox(key="tune_search").set_value("per_block").run()
    at.select_slider(key="tune_trials").set_value(20)
    next(b for b in at.button if b.label == "Run sweep").click().run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    metrics = {m.label: m.value for m in at.metric}
    assert {"chosen", "val accuracy, chosen", "val accuracy, paper setting"} <= set(metrics)
    trials = at.dataframe[-1].value
    assert len(trials) == 21 and list(trials["stage"]).count("tpe") == 20  # the preset and 20 trials
    assert not at.get("plotly_chart")  # no grid, no figures

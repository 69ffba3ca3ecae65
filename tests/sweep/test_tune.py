"""Sweeps and automatic selection (featcal.sweep.search) on tiny seeded models."""

import collections
import copy
import math
import os

import pandas as pd
import pytest
import torch

import tiny
from featcal import FeatCalConfig
from featcal.sweep.search import Grid, TuneConfig, tune, tune_zoo
from featcal.zoo.core import TaskData, Zoo

SMALL = Grid(lam=(0.01, 0.5), rho=(0.5, 2.0), alpha=(0.0, 0.6))


def _val(tasks, n=12, seed=7):
    """Unlabelled validation inputs: the score is -KL to the experts."""
    gen = torch.Generator().manual_seed(seed)
    return {t: (torch.randn(n, 5, 6, generator=gen), None) for t in tasks}


def test_tune_preview_equals_exact_when_features_do_not_move():
    """One calibrated block: every preview is an exact solve, so preview == exact score
    and the preview's weights are the exact run's."""
    base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=1)
    cfg = FeatCalConfig(stats_dtype=torch.float64)
    res = tune(
        merged,
        base,
        experts,
        tiny.toy_data(experts, n=16),
        _val(experts),
        config=cfg,
        grid=SMALL,
        n_confirm=len(SMALL.points()),
    )
    t = res.table
    assert t["confirmed"].all() and len(t) == 1 + len(SMALL.points())
    assert (t["rel_dist"] < 1e-6).all()
    pd.testing.assert_series_equal(t["preview"], t["exact"], check_names=False, rtol=1e-6, atol=1e-9)
    assert res.best["score"] == t["exact"].max()


def test_tune_keeps_the_anchor_unless_beaten_and_records_every_point():
    base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=2)
    data, val = tiny.toy_data(experts, n=16), _val(experts)
    none = tune(merged, base, experts, data, val, grid=SMALL, n_confirm=0)
    assert none.best["stage"] == "anchor" and none.best_config() == FeatCalConfig.clip()
    res = tune(merged, base, experts, data, val, grid=SMALL, n_confirm=2, search="adaptive", rounds=1, top_k=1)
    t = res.table
    assert list(t["point"]) == list(range(len(t)))
    assert set(t["stage"]) == {"anchor", "grid", "refine"}
    assert t["confirmed"].sum() == 3  # the anchor and two previews
    assert res.best["score"] == t["exact"].max() >= res.best["anchor_score"]
    assert sorted(t["preview_rank"]) == list(range(len(t)))
    assert res.score == "kl" and (t["preview"] <= 0).all()  # -KL without labels


def test_grid_and_options_are_validated():
    assert Grid.parse("lam=0.1,1;alpha=0.2").points() == [(lam, rho, 0.2) for lam in (0.1, 1.0) for rho in Grid().rho]
    with pytest.raises(ValueError):
        Grid(lam=(0.0,))
    with pytest.raises(ValueError, match=r"Grid.rho values must lie in \[-10, 10\] \(rho, the anchor blend"):
        Grid(rho=(2.0, 11.0))  # what a run accepts: featcal.config.RANGES, checked before any work
    with pytest.raises(ValueError):
        Grid.parse("beta=1")
    with pytest.raises(ValueError):
        TuneConfig(search="random")
    base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=1)
    with pytest.raises(ValueError, match="labels"):
        tune(merged, base, experts, tiny.toy_data(experts), _val(experts), score="accuracy", grid=SMALL)


# ------------------------------------------------------------------ the test split stays unread


class _Poison:
    """Stands in for test-split tensors: any use at all fails."""

    def __getattr__(self, name):
        raise AssertionError(f"the test split was used ({name})")

    def __len__(self):
        raise AssertionError("the test split was used (len)")

    def __iter__(self):
        raise AssertionError("the test split was used (iter)")


class _CountingSplits(dict):
    def __init__(self, *a, reads, **kw):
        super().__init__(*a, **kw)
        self.reads = reads

    def __getitem__(self, split):
        self.reads[split] += 1
        return super().__getitem__(split)

    def get(self, split, default=None):
        self.reads[split] += 1
        return super().get(split, default)


def toy_features(model, x):
    return model.hidden(x)[:, 0]


def _toy_zoo(reads):
    base, experts, _ = tiny.toy_zoo(n_tasks=2, n_blocks=2)
    gen = torch.Generator().manual_seed(3)
    heads, data = {}, {}
    for t, m in experts.items():
        heads[t] = copy.deepcopy(m.head).requires_grad_(False)
        splits = {}
        for split, n in (("calib", 24), ("val", 12)):
            x = torch.randn(n, 5, 6, generator=gen)
            splits[split] = (x, heads[t](toy_features(m, x)).argmax(-1).detach())
        splits["test"] = (_Poison(), _Poison())
        data[t] = TaskData(t, ["a", "b", "c", "d"], _CountingSplits(splits, reads=reads))
    return Zoo("toy", base, experts, heads, data, toy_features)


def test_tune_zoo_never_reads_the_test_split():
    reads = collections.Counter()
    zoo = _toy_zoo(reads)
    res = tune_zoo(zoo, n_calib=16, grid=SMALL, n_confirm=2, search="adaptive", rounds=1)
    assert reads["test"] == 0
    assert reads["calib"] > 0 and reads["val"] > 0
    assert res.score == "accuracy" and res.meta["n_calib"] == 16


# ------------------------------------------------------------------ Ray == one process


@pytest.mark.slow
def test_ray_and_single_process_give_the_same_table():
    ray = pytest.importorskip("ray")
    base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=2)
    data, val = tiny.toy_data(experts, n=16), _val(experts)
    grid = Grid(lam=(0.01, 0.5), rho=(2.0,), alpha=(0.0, 0.6))
    local = tune(merged, base, experts, data, val, grid=grid, n_confirm=2)
    # The workers must import tests/tiny.py to unpickle the toy models.
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}},
    )
    try:
        remote = tune(merged, base, experts, data, val, grid=grid, n_confirm=2, ray=True)
    finally:
        ray.shutdown()
    cols = [c for c in local.table.columns if c != "seconds"]
    pd.testing.assert_frame_equal(local.table[cols], remote.table[cols], check_exact=True)
    assert local.best == remote.best


# ------------------------------------------------------------------ the app page


def test_tune_page_runs_a_sweep_on_a_tiny_zoo(tmp_path):
    pytest.importorskip("streamlit")
    from app_zoo import app_page_on_tiny_zoo

    at = app_page_on_tiny_zoo(tmp_path, "pages/tune.py")
    at.select_slider(key="tune_n").set_value(8)
    at.slider(key="tune_confirm").set_value(1)
    next(b for b in at.button if b.label == "Run sweep").click().run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    assert {"chosen setting", "val accuracy, chosen"} <= {m.label for m in at.metric}
    assert len(at.dataframe[0].value) == 27  # the quick grid holds the anchor
    best = at.dataframe[0].value.query("confirmed").sort_values("exact").iloc[-1]  # the chosen point
    at.button(key="tune_apply").click().run()
    assert not at.exception, [e.value for e in at.exception]
    from app.controls import on_slider

    # The Calibrate page opened, its sliders on the chosen setting (on their steps).
    assert at.slider(key="log_lam").value == pytest.approx(on_slider("log_lam", math.log10(best["lam"])))
    assert at.slider(key="rho").value == pytest.approx(on_slider("rho", best["rho"]))
    assert at.slider(key="alpha").value == pytest.approx(on_slider("alpha", best["alpha"]))


def test_sweep_parallel_labels_lambda_at_the_values_tried():
    from featcal.sweep.figures import sweep_parallel

    table = pd.DataFrame(
        {"point": range(3), "lam": [0.005, 0.05, 0.3], "rho": 2.0, "alpha": 0.3, "preview": [1.0, 2.0, 3.0]}
    ).assign(confirmed=[False, True, False])
    lam_axis = sweep_parallel(table).data[0].dimensions[0]
    assert list(lam_axis.ticktext) == ["0.005", "0.05", "0.3"]
    assert list(lam_axis.tickvals) == pytest.approx([math.log10(v) for v in (0.005, 0.05, 0.3)])


def test_grid_edges_and_widening():
    from featcal.sweep.figures import grid_edges, widen

    axes = {"lam": (0.01, 0.05, 0.3), "rho": (1.0, 2.0, 2.5), "alpha": (0.3,)}
    assert grid_edges({"lam": 0.05, "rho": 2.0, "alpha": 0.3}, axes) == {}  # one-value axes have no edge
    assert grid_edges({"lam": 0.01, "rho": 2.5, "alpha": 0.3}, axes) == {"lam": "low", "rho": "high"}
    assert widen((0.01, 0.05, 0.3), "low", log=True) == (0.002, 0.01, 0.05, 0.3)  # one ratio step below
    assert widen((1.0, 2.0, 2.5), "high") == (1.0, 2.0, 2.5, 3.0)
    assert widen((0.5, 0.7), "high", bounds=(0.0, 1.0)) == (0.5, 0.7, 0.9)
    assert widen((0.0, 0.15), "low", bounds=(0.0, 1.0)) == (0.0, 0.15)  # at the bound: unchanged
    with pytest.raises(ValueError, match="two values"):
        widen((0.3,), "high")


def test_sweep_heatmap_labels_are_rounded_and_the_star_explained():
    from featcal.sweep.figures import sweep_heatmap

    alphas = (0.1 + 0.2, 0.5)  # 0.30000000000000004: a value as a refinement makes it
    rows = [
        {"lam": 0.05, "rho": r, "alpha": a, "preview": r + a, "exact": r + a, "confirmed": a == alphas[0]}
        for r in (1.0, 2.123456)
        for a in alphas
    ]
    fig = sweep_heatmap(pd.DataFrame(rows), lam=0.05)
    assert list(fig.data[0].x) == ["0.3", "0.5"] and list(fig.data[0].y) == ["1", "2.12"]
    assert "chosen" in fig.data[-1].hovertemplate and fig.data[-1].marker.symbol == "star"
    assert (fig.data[-1].x, fig.data[-1].y) == (("0.3",), ("2.12",))  # the best exact run, not the best preview


def test_tune_and_study_command_lines_write_their_files(tmp_path, capsys):
    import json

    from app_zoo import write_tiny_zoo
    from featcal.cli.commands import main

    zoo = str(write_tiny_zoo(tmp_path / "tiny"))
    out = tmp_path / "tune"
    assert (
        main(
            [
                "tune",
                "--zoo",
                zoo,
                "--n-calib",
                "8",
                "--grid",
                "lam=0.05,0.5;rho=2;alpha=0.3",
                "--n-confirm",
                "1",
                "--report",
                "--out",
                str(out),
                "-q",
            ]
        )
        == 0
    )
    assert {p.name for p in out.iterdir()} == {
        ".featcal-output.json",  # featcal's marker: --force may replace this directory
        "best.json",
        "table.csv",
        "test_report.csv",
        "sweep_parallel.html",
        "sweep_heatmap.html",
        "plotly.min.js",  # beside the HTML figures, which then open offline
    }
    best = json.loads((out / "best.json").read_text())
    assert best["meta"]["n_calib"] == 8 and len(best["test_report"]) == 3
    assert "TEST accuracy" in capsys.readouterr().out
    assert main(["tune", "--zoo", zoo, "--out", str(out), "-q"]) == 2  # never overwrites silently
    (out / "my_analysis.txt").write_text("mine")  # a file the user adds to a finished sweep's folder
    assert main(["tune", "--zoo", zoo, "--out", str(out), "--force", "-q"]) == 2
    assert "my_analysis.txt" in capsys.readouterr().err and (out / "my_analysis.txt").read_text() == "mine"
    (out / "my_analysis.txt").unlink()
    se = tmp_path / "se"
    assert (
        main(
            [
                "study",
                "sample-efficiency",
                "--zoo",
                zoo,
                "--budgets",
                "4",
                "--seeds",
                "0",
                "--mergers",
                "task_arithmetic",
                "--out",
                str(se),
                "-q",
            ]
        )
        == 0
    )
    written = {p.name for p in se.iterdir()}
    files = {".featcal-output.json", "rows.csv", "summary.csv", "sample_efficiency.html", "plotly.min.js"}
    assert written - {"warnings.txt"} == files
    out, err = capsys.readouterr()
    assert "Warning:" not in err  # the library's warnings are collected, not printed between the bars
    if "warnings.txt" in written:  # 4 examples per task: fewer token rows than some input widths
        lines = (se / "warnings.txt").read_text().splitlines()
        assert lines and all(line in out for line in lines) and "distinct library warning" in out


def test_tune_options_are_one_object_with_keyword_overrides():
    from featcal.sweep.search import tune_options

    base = TuneConfig(search="adaptive", n_confirm=1)
    opts = tune_options(base, n_confirm=3, grid=None)
    assert opts.search == "adaptive" and opts.n_confirm == 3 and opts.grid == Grid()
    assert tune_options() == TuneConfig()
    with pytest.raises(TypeError, match=r"unknown tune option\(s\) \['n_confrim'\]"):
        tune_options(n_confrim=2)


def test_the_default_grid_lies_in_the_one_table_of_ranges():
    """featcal tune's default axes lie inside the ranges the app's sliders span
    (featcal.config.RANGES); a refined point a run would refuse is not previewed."""
    from featcal.config import RANGES
    from featcal.sweep.search import _searchable

    for name in ("lam", "rho", "alpha"):
        r = RANGES[name]
        assert all(r.low <= v <= r.high for v in getattr(Grid(), name)), name
    assert _searchable((0.05, 2.0, 0.3)) and _searchable((0.05, 2.0, -0.075))  # alpha < 0 is still a run
    assert not _searchable((0.05, 10.5, 0.3)) and not _searchable((0.0, 2.0, 0.3))

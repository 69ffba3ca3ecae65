"""featcal.baselines.runner on a tiny zoo: the one merge and calibration chain behind ``featcal
compare`` and ``featcal reproduce``: what it runs equals running each step by hand, both front ends
get the same weights from it, a trained calibrator gives each task its own model, and a chain it
cannot run is refused before any work."""

from __future__ import annotations

import pytest
import torch

from diagnostics import compare as cmp
from featcal import FeatCalConfig, calibrate, svc
from featcal.baselines import registry, runner
from featcal.config import preset_config
from featcal.reproduce.plan import PlannedRow
from featcal.reproduce.run import run_rows
from featcal.reproduce.tables import PaperRow
from featcal.zoo import load_any

N, SEED = 16, 42
PARAMS = {"task_arithmetic": {"scale": 0.4}, "svc": {"alpha": 0.5}, "featcal": {"rho": 1.5}}


@pytest.fixture(scope="module")
def zoo(tiny_zoo_dir):
    return load_any(tiny_zoo_dir)


@pytest.fixture(scope="module")
def data(zoo):
    return zoo.calib_data(N, seed=SEED)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_merge_is_the_zoos_merge_or_the_data_mergers(zoo, data):
    assert _same_weights(runner.merge(zoo, "task_arithmetic", data, {"scale": 0.4}), zoo.merged("ta", scale=0.4))
    by_hand = registry.merge_with_data("regmean", base=zoo.base, experts=zoo.experts, calib_data=data)
    assert _same_weights(runner.merge(zoo, "regmean", data), by_hand)
    assert not _same_weights(runner.merge(zoo, "regmean", data), zoo.merged("ta"))


def test_svc_then_featcal_is_the_two_steps_by_hand(zoo, data):
    merged = zoo.merged("ta", scale=0.4)
    before = {k: v.clone() for k, v in merged.state_dict().items()}
    models, costs = runner.run_chain(zoo, "task_arithmetic", ["svc", "featcal"], merged, data, PARAMS)
    experts = {t: m.state_dict() for t, m in zoo.experts.items()}
    after_svc = zoo.merged("ta", scale=0.4)
    after_svc.load_state_dict(svc(merged.state_dict(), zoo.base.state_dict(), experts, alpha=0.5))
    config = FeatCalConfig.clip(rho=1.5)  # the tiny zoo's preset, with the chain's change
    by_hand, _ = calibrate(after_svc, base=zoo.base, experts=zoo.experts, calib_data=data, config=config)
    assert len({id(m) for m in models.values()}) == 1 and list(models) == list(zoo.tasks)  # one for every task
    assert _same_weights(models[zoo.tasks[0]], by_hand)
    assert all(torch.equal(v, before[k]) for k, v in merged.state_dict().items())  # the input left as it was
    assert costs.added == {"trained": 0, "stored": 0, "fraction": 0.0}


def test_a_preset_or_a_config_replaces_the_zoos_preset(zoo, data, monkeypatch):
    seen = []
    monkeypatch.setattr(runner, "calibrate", lambda model, **kw: (seen.append(kw["config"]), (model, None))[1])
    merged = zoo.merged("ta")
    runner.run_chain(zoo, "task_arithmetic", ["featcal"], merged, data, {"featcal": {"lam": 0.2}})
    runner.run_chain(zoo, "task_arithmetic", ["featcal"], merged, data, {"featcal": {"lam": 0.2}}, preset="none")
    given = {"featcal": {"config": FeatCalConfig.clip(rho=3.0), "lam": 0.2}}
    runner.run_chain(zoo, "task_arithmetic", ["featcal"], merged, data, given, preset="none")
    assert seen == [
        FeatCalConfig.clip(lam=0.2),  # the tiny zoo's (CLIP) preset: compare's default
        preset_config("none").with_(lam=0.2),  # a table's preset: reproduce's
        FeatCalConfig.clip(rho=3.0, lam=0.2),  # a config given wins over both
    ]
    assert seen[1] != seen[0]


def test_compare_and_reproduce_get_the_same_weights(zoo, monkeypatch):
    produced = []

    def recording(*args, **kwargs):
        models, costs = run_chain(*args, **kwargs)
        produced.append(models[zoo.tasks[0]])
        return models, costs

    run_chain = runner.run_chain
    monkeypatch.setattr(runner, "run_chain", recording)
    options = cmp.CompareOptions(
        n=N,
        seed=SEED,
        merger_params={"ta": PARAMS["task_arithmetic"]},
        calibrator_params={"svc": PARAMS["svc"], "featcal": PARAMS["featcal"]},
        drift_n=4,
        repeats=0,
    )
    compared = cmp.run_method(zoo, "ta+svc+featcal", options, cache={})
    row = PlannedRow(
        PaperRow("TA + SVC + FeatCal", "ta+svc+featcal", {}, "test"),
        "ta+svc+featcal",
        "task_arithmetic",
        ("svc", "featcal"),
        PARAMS,
        N,
    )
    (reproduced,) = run_rows(zoo, [row], preset="clip", seed=SEED, progress=False)
    assert len(produced) == 2 and _same_weights(produced[0], produced[1])
    assert reproduced.scores == pytest.approx(compared.accuracy)


def test_a_trained_calibrator_gives_each_task_its_own_model(zoo, data):
    merged = zoo.merged("ta")
    models, costs = runner.run_chain(
        zoo, "task_arithmetic", ["surgery"], merged, data, {"surgery": {"steps": 2, "rank": 4}}
    )
    assert list(models) == list(zoo.tasks) and len({id(m) for m in models.values()}) == len(zoo.tasks)
    first, second = (models[t].state_dict() for t in zoo.tasks[:2])
    added = [k for k in first if k not in merged.state_dict()]
    assert added and any(not torch.equal(first[k], second[k]) for k in added)  # the tasks' own modules
    assert costs.added["trained"] > 0 and costs.added["stored"] >= costs.added["trained"]
    assert costs.added["fraction"] == pytest.approx(costs.added["stored"] / sum(p.numel() for p in merged.parameters()))


def test_a_chain_it_cannot_run_is_refused(zoo, data):
    merged = zoo.merged("ta")
    with pytest.raises(ValueError, match="unknown calibrator 'ties'"):
        runner.run_chain(zoo, "task_arithmetic", ["ties"], merged, data)
    with pytest.raises(ValueError, match="unknown calibrator 'wemoe'"):
        runner.run_chain(zoo, "task_arithmetic", ["svc", "wemoe"], merged, data)
    with pytest.raises(ValueError, match="a trained calibrator .* must come last, once"):
        runner.run_chain(zoo, "task_arithmetic", ["surgery", "featcal"], merged, data)
    with pytest.raises(ValueError, match="appears twice"):
        runner.run_chain(zoo, "task_arithmetic", ["svc", "SVC"], merged, data)
    assert runner.parse_method("TA+SVC+FeatCal") == ("task_arithmetic", ("svc", "featcal"))
    with pytest.raises(ValueError, match="method 'ta\\+escal\\+surgery': a trained calibrator"):
        runner.parse_method("ta+escal+surgery")


def test_run_uses_a_shared_merged_model_and_keeps_each_methods_params_apart(zoo, data):
    shared = zoo.merged("ta")
    model, models, costs = runner.run(zoo, "task_arithmetic", [], data, get_merged=lambda: shared)
    assert model is shared and all(m is shared for m in models.values())
    assert costs.added == {"trained": 0, "stored": 0, "fraction": 0.0}
    merged, _, _ = runner.run(zoo, "task_arithmetic", [], data, PARAMS)
    assert _same_weights(merged, zoo.merged("ta", scale=0.4))
    assert runner.params_key({"b": 1, "a": [2]}) == runner.params_key({"a": [2], "b": 1}) == (("a", "[2]"), ("b", "1"))

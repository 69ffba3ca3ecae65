"""Per-block settings (``FeatCalConfig.schedule``): the exact run and the preview read each block's
setting from ``setting_at``; an empty schedule is the global setting (tests/engine/test_pinned.py
holds it bit for bit), a schedule equal to it everywhere is the same run, a schedule changing one
block moves that block and the later ones only, and its preview is as close to its exact run as a
global preview is to its own."""

import json

import pytest
import torch

import tiny
from featcal import FeatCalConfig, calibrate
from featcal.model.arch import block_targets, get_params

CFG = FeatCalConfig(lam=0.05, rho=2.0, alpha=0.3, stats_dtype=torch.float64)


def _params(model):
    """``{(block, module): [W, b]}`` of every calibrated module."""
    return {
        (i, t.name): [p.clone() for p in get_params(blk, t) if p is not None]
        for i, blk in enumerate(model.blocks)
        for t in block_targets(blk)
    }


def _run(merged, base, experts, data, cfg, **kw):
    return calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, **kw)


def _same(a, b, atol=None):
    """Whether every tensor of ``a`` equals ``b``'s (bit for bit, or within ``atol``)."""
    eq = torch.equal if atol is None else (lambda x, y: torch.allclose(x, y, atol=atol, rtol=0))
    return all(eq(x, y) for x, y in zip(a, b))


def test_a_schedule_is_frozen_hashable_validated_and_recorded():
    cfg = CFG.with_(schedule={2: {"lam": 0.5}, 0: {"alpha": 0.7, "lam": 1.0}})
    assert cfg.schedule == ((0, (("alpha", 0.7), ("lam", 1.0))), (2, (("lam", 0.5),)))
    assert cfg == CFG.with_(schedule={"0": {"lam": 1.0, "alpha": 0.7}, 2: {"lam": 0.5}})  # JSON's string keys
    assert hash(cfg) == hash(CFG.with_(schedule=cfg.schedule)) and cfg != CFG
    assert cfg.setting_at(0) == CFG.setting.replace(lam=1.0, alpha=0.7)
    assert cfg.setting_at(1) == CFG.setting and cfg.setting_at(2).lam == 0.5
    assert FeatCalConfig(schedule={}) == FeatCalConfig() and FeatCalConfig(schedule={1: {}}) == FeatCalConfig()
    d = json.loads(json.dumps(cfg.to_dict()))
    assert d["schedule"] == {"0": {"alpha": 0.7, "lam": 1.0}, "2": {"lam": 0.5}}
    assert "schedule" not in CFG.to_dict()  # nothing recorded without one
    assert FeatCalConfig(**{**d, "stats_dtype": torch.float64}) == cfg  # read back from its record
    with pytest.raises(ValueError, match=r"schedule, block 1: unknown name\(s\) \['beta'\]"):
        CFG.with_(schedule={1: {"beta": 1.0}})
    with pytest.raises(ValueError, match=r"schedule, block 1: lam .* must be a finite number"):
        CFG.with_(schedule={1: {"lam": -1.0}})
    with pytest.raises(ValueError, match=r"schedule, block -1: a block is its number"):
        CFG.with_(schedule={-1: {"lam": 1.0}})


def test_a_schedule_naming_a_missing_block_is_refused_before_any_work():
    base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=2)
    with pytest.raises(ValueError, match=r"sets block\(s\) \[5\], but 'blocks' has 2 blocks"):
        _run(merged, base, experts, tiny.toy_data(experts), CFG.with_(schedule={5: {"lam": 1.0}}))


def test_a_schedule_of_the_global_values_is_the_same_run():
    base, experts, merged = tiny.toy_zoo(n_tasks=3, n_blocks=3)
    data = tiny.toy_data(experts, n=40)
    for cfg in (CFG, CFG.with_(stats_dtype=torch.float32)):
        want = _params(_run(merged, base, experts, data, cfg)[0])
        same = {b: {"lam": cfg.lam, "rho": cfg.rho, "alpha": cfg.alpha} for b in range(3)}
        got = _params(_run(merged, base, experts, data, cfg.with_(schedule=same))[0])
        assert all(_same(got[k], want[k]) for k in want)


def test_changing_one_block_changes_that_block_and_the_later_ones_only():
    base, experts, merged = tiny.toy_zoo(n_tasks=3, n_blocks=3)
    data = tiny.toy_data(experts, n=40)
    want = _params(_run(merged, base, experts, data, CFG)[0])
    got = _params(_run(merged, base, experts, data, CFG.with_(schedule={1: {"lam": 1.0, "alpha": 0.8}}))[0])
    for key in want:
        assert _same(got[key], want[key]) == (key[0] == 0), key  # block 0 as it was; 1 and 2 moved
    # Block 0 sees the same features whatever the setting: set there alone, it is the global run's.
    alone = _params(_run(merged, base, experts, data, CFG.with_(schedule={0: {"lam": 1.0, "alpha": 0.8}}))[0])
    glob = _params(_run(merged, base, experts, data, CFG.with_(lam=1.0, alpha=0.8))[0])
    assert all(_same(alone[k], glob[k], atol=1e-12) for k in glob if k[0] == 0)
    assert not all(_same(alone[k], glob[k], atol=1e-6) for k in glob if k[0] == 2)


def test_the_preview_of_a_schedule_is_as_close_to_its_exact_run_as_a_global_preview():
    """Where a global preview is exact (one block; the first block; every block up to the first
    changed one), a schedule's preview is exact to the same tolerance (tests/engine/test_preview.py's)."""
    base, experts, merged = tiny.toy_zoo(n_tasks=3, n_blocks=1)
    data = tiny.toy_data(experts, n=40)
    _, report = _run(merged, base, experts, data, CFG, keep_stats=True)
    sched = CFG.with_(schedule={0: {"lam": 1.0, "alpha": 0.9, "rho": 0.5}})
    exact, prev = _params(_run(merged, base, experts, data, sched)[0]), _params(report.preview(schedule=sched.schedule))
    assert all(_same(prev[k], exact[k], atol=1e-5) for k in exact)

    base, experts, merged = tiny.toy_zoo(n_tasks=3, n_blocks=3)
    data = tiny.toy_data(experts, n=40)
    _, report = _run(merged, base, experts, data, CFG, keep_stats=True)
    last = CFG.with_(schedule={2: {"lam": 0.5, "alpha": 0.8}})  # blocks 0 and 1 as the kept run's
    exact, prev = _params(_run(merged, base, experts, data, last)[0]), _params(report.preview(schedule=last.schedule))
    assert all(_same(prev[k], exact[k], atol=1e-5) for k in exact)
    assert not all(_same(prev[k], _params(report.preview())[k], atol=1e-5) for k in exact if k[0] == 2)
    # Schedule every block: exact in block 0, and no farther from the exact run than the global preview at
    # the same values is from its exact run.
    both = {b: {"lam": 0.5, "alpha": 0.8} for b in range(3)}
    glob = CFG.with_(lam=0.5, alpha=0.8)
    for at in (CFG.with_(schedule=both), glob):
        exact, prev = _params(_run(merged, base, experts, data, at)[0]), _params(report.preview_state.model(at))
        assert all(_same(prev[k], exact[k], atol=1e-5) for k in exact if k[0] == 0)
    from featcal.sweep.jobs import preview_distance

    d_sched = preview_distance(
        report.preview_state, CFG.with_(schedule=both), _run(merged, base, experts, data, CFG.with_(schedule=both))[0]
    )
    d_glob = preview_distance(report.preview_state, (0.5, 2.0, 0.8), _run(merged, base, experts, data, glob)[0])
    assert d_sched == pytest.approx(d_glob, rel=1e-6)  # the same setting everywhere, scheduled or not


def test_a_scheduled_runs_own_preview_reproduces_it():
    base, experts, merged = tiny.toy_zoo(n_tasks=2, n_blocks=3)
    data = tiny.toy_data(experts, n=40)
    cfg = CFG.with_(schedule={1: {"lam": 0.4}, 2: {"alpha": 0.6}})
    cal, report = _run(merged, base, experts, data, cfg, keep_stats=True)
    want, got = _params(cal), _params(report.preview())
    assert all(_same(got[k], want[k], atol=1e-5) for k in want)
    assert report.to_dict()["config"]["schedule"] == {1: {"lam": 0.4}, 2: {"alpha": 0.6}}

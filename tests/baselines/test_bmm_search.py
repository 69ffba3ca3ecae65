"""BMM's outer level (featcal.merge_with_data("bmm_search")): the validation split, the kept
problems re-solved exactly as the inner level solves them, a seeded TPE search that never loses to
the global sigma, every architecture, and bad input refused by name."""

import pytest
import torch

import tiny
from featcal import merge_with_data
from featcal.baselines import bmm_search as bs
from featcal.baselines.registry import ParamError


def test_the_validation_split_takes_the_last_examples_of_each_task():
    data = {"a": [torch.arange(8).reshape(4, 2), torch.arange(8, 14).reshape(3, 2)]}
    fit, val = bs.split_off(data, 0.3)  # 7 examples: 2 held out
    assert [b.tolist() for b in fit["a"]] == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9]]]
    assert [b.tolist() for b in val["a"]] == [[[10, 11], [12, 13]]]
    ids, mask = torch.arange(12).reshape(3, 4), torch.ones(3, 4)
    fit, val = bs.split_off({"t": [{"input_ids": ids, "attention_mask": mask, "note": 1}]}, 0.5)
    assert fit["t"][0]["input_ids"].tolist() == ids[:1].tolist() and val["t"][0]["input_ids"].shape == (2, 4)
    assert val["t"][0]["note"] == 1
    with pytest.raises(ValueError, match=r"task 't' has 1 calibration example\(s\); val_fraction=0.5 leaves none"):
        bs.split_off({"t": [torch.zeros(1, 2)]}, 0.5)


def test_no_trials_is_the_inner_level_on_the_fit_split():
    """The kept problems' eigen-solve equals the Cholesky solve of featcal.baselines.bmm."""
    base, experts, _, data = tiny.zoo("toy", n_tasks=3)
    fit, _ = bs.split_off(data, 0.25)
    want = merge_with_data("bmm", base=base, experts=experts, calib_data=fit, sigma=0.2, progress=False)
    got, rows = bs.search_bmm(base=base, experts=experts, calib_data=data, sigma=0.2, trials=0, progress=False)
    for k, v in want.state_dict().items():
        assert torch.allclose(got.state_dict()[k], v, atol=1e-5), k
    assert len(rows) == 1 and rows[0]["stage"] == "start" and rows[0]["chosen"]
    assert set(rows[0]) == {"trial", "stage", "score", "chosen"} | {
        f"sigma/{b}/{n}" for b in range(3) for n in ("proj", "fc1", "fc2")
    }


def _logits(model, task, x):
    return model(x)  # the toy model's own head: 4 classes for every task


def test_the_search_is_seeded_and_never_loses_to_the_global_sigma():
    base, experts, _, data = tiny.zoo("toy", n_tasks=2)
    kw = dict(base=base, experts=experts, calib_data=data, logits=_logits, trials=6, groups=2, progress=False)
    a_model, a = bs.search_bmm(granularity="block", seed=1, **kw)
    _, b = bs.search_bmm(granularity="block", seed=1, **kw)
    _, other = bs.search_bmm(granularity="block", seed=2, **kw)
    assert a == b and [r["score"] for r in a] != [r["score"] for r in other]
    assert [r["stage"] for r in a] == ["start"] + ["tpe"] * 6
    assert {k for k in a[0] if k.startswith("sigma/")} == {"sigma/0-1", "sigma/2"}  # 3 blocks in 2 groups
    chosen = [r for r in a if r.get("chosen")]
    assert len(chosen) == 1 and chosen[0]["score"] == max(r["score"] for r in a) >= a[0]["score"]
    # The model returned is the chosen trial's: its validation score, recomputed, is the row's.
    _, val = bs.split_off(data, 0.25)
    refs = {t: [bs.outputs(experts[t], t, x, _logits) for x in val[t]] for t in experts}
    assert bs.score(a_model, val, refs, _logits) == pytest.approx(chosen[0]["score"], rel=1e-9, abs=1e-12)
    assert all(r["score"] <= 0 for r in a)  # -KL: 0 only for the experts themselves
    assert bs.score(experts["t0"], {"t0": val["t0"]}, refs, _logits) == 0.0


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip", "bert", "t5", "llama"])
def test_runs_through_the_registry_on_every_architecture(kind):
    base, experts, _, data = tiny.any_zoo(kind)
    out = merge_with_data("bmm_search", base=base, experts=experts, calib_data=data, trials=2, progress=False)
    assert all(torch.isfinite(v.float()).all() for v in out.state_dict().values())
    assert not out.training


def test_the_models_given_are_not_modified():
    base, experts, _, data = tiny.zoo("open_clip")
    experts["t1"].train()
    before = tiny.state_snapshot(base), {t: tiny.state_snapshot(m) for t, m in experts.items()}
    merge_with_data("bmm_search", base=base, experts=experts, calib_data=data, trials=2, progress=False)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in before[0].items())
    for t, snap in before[1].items():
        assert all(torch.equal(v, experts[t].state_dict()[k]) for k, v in snap.items())
    assert experts["t1"].training and not experts["t0"].training


def test_bad_input_is_refused_by_name_before_any_work():
    base, experts, _, data = tiny.zoo("toy")
    kw = dict(base=base, experts=experts, calib_data=data)
    with pytest.raises(ParamError, match=r"bmm_search: parameter 'anchor' takes one of ta, tsv, wudi, got 'x'"):
        merge_with_data("bmm_search", anchor="x", **kw)
    with pytest.raises(ParamError, match=r"'granularity' takes one of module, block, got 'layer'"):
        merge_with_data("bmm_search", granularity="layer", **kw)
    with pytest.raises(ParamError, match=r"'sigma' takes a number in \[1e-08, 1e\+06\]"):
        merge_with_data("bmm_search", sigma=0.0, **kw)
    with pytest.raises(ParamError, match=r"'trials' takes a whole number, got 2.5"):
        merge_with_data("bmm_search", trials=2.5, **kw)
    with pytest.raises(ValueError, match=r"calib_data has no batches for task\(s\) \['t1'\]; BMM reads"):
        merge_with_data("bmm_search", base=base, experts=experts, calib_data={"t0": data["t0"]})
    with pytest.raises(ValueError, match=r"bmm_search: trials must be a whole number >= 0, got -1"):
        bs.bmm_search(trials=-1, **kw)
    with pytest.raises(ValueError, match=r"bmm_search: groups must be None or a whole number >= 1, got 0"):
        bs.bmm_search(groups=0, **kw)
    with pytest.raises(ValueError, match=r"bmm_search: val_fraction must be in \(0, 1\), got 1.0"):
        bs.bmm_search(val_fraction=1.0, **kw)
    with pytest.raises(ValueError, match=r"bmm_search: anchor must be one of ta, tsv, wudi"):
        bs.bmm_search(anchor="ties", **kw)

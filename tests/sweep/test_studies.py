"""Corruptions (featcal.sweep.corrupt) and the paper's studies (featcal.sweep.studies) on tiny models."""

import itertools

import pytest
import torch

import tiny
from featcal import FeatCalConfig
from featcal.sweep.corrupt import CORRUPTIONS, corrupt
from featcal.sweep.studies import robustness, sample_efficiency, summarize
from featcal.zoo.core import TaskData, Zoo
from featcal.zoo.store import pooler_output


def _images(n=3, seed=0):
    return torch.rand(n, 3, 12, 10, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corruptions_keep_shape_and_severity_zero_is_identity(kind):
    x = _images()
    fn = CORRUPTIONS[kind]
    assert torch.equal(fn(x, 0), x)
    dists = []
    for sev in (1, 2.5, 5):
        y = fn(x, sev, seed=3)
        assert y.shape == x.shape and y.dtype == x.dtype
        assert 0.0 <= float(y.min()) and float(y.max()) <= 1.0
        assert torch.equal(y, fn(x, sev, seed=3))  # seeded: reproducible
        dists.append(float((y - x).abs().mean()))
    assert 0 < dists[0] < dists[-1]  # more severe, further away
    assert torch.equal(x, _images())  # the input is left alone
    with pytest.raises(ValueError):
        fn(x, 6)


def test_corrupt_works_in_normalised_space():
    x = _images() * 2 - 1  # (pixels - 0.5) / 0.5
    assert torch.equal(corrupt(x, "fog", 0), x)
    y = corrupt(x, "blur", 3)
    assert y.shape == x.shape and float(y.min()) >= -1 and float(y.max()) <= 1
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt(x, "snow", 1)


def _toy_zoo():
    """A tiny HF CLIP zoo on 16 px images; labels are each expert's own predictions."""
    base = tiny.tiny_hf_clip(seed=0)
    experts = {f"t{i}": tiny.perturbed(base, 0.05, seed=10 + i) for i in range(2)}
    gen = torch.Generator().manual_seed(3)
    heads, data = {}, {}
    for t, m in experts.items():
        heads[t] = torch.nn.Linear(32, 4).requires_grad_(False)
        with torch.no_grad():
            heads[t].weight.copy_(torch.randn(4, 32, generator=gen))
        splits = {}
        for split, n in (("calib", 16), ("val", 8), ("test", 8)):
            x = torch.rand(n, 3, 16, 16, generator=gen) * 2 - 1
            with torch.no_grad():
                splits[split] = (x, heads[t](pooler_output(m, x)).argmax(-1))
        data[t] = TaskData(t, ["a", "b", "c", "d"], splits)
    return Zoo("toy", base, experts, heads, data, pooler_output)


def test_sample_efficiency_has_a_row_for_every_n_seed_method_and_task():
    zoo = _toy_zoo()
    mergers = {"task_arithmetic": {"scale": 0.3}, "average": {}}
    df = sample_efficiency(zoo, budgets=(2, 4), seeds=(0, 1), mergers=mergers, config=FeatCalConfig(lam=0.1))
    methods = ["task_arithmetic", "average", "task_arithmetic+featcal"]
    cells = set(itertools.product((2, 4), (0, 1), methods, zoo.tasks))
    assert set(zip(df.n, df.seed, df.method, df.task)) == cells and len(df) == len(cells)
    assert df.accuracy.between(0, 100).all()
    s = summarize(df)
    assert len(s) == 2 * len(methods) and (s.seeds == 2).all()
    assert (s[s.method == "average"]["std"] == 0).all()  # baselines ignore the draw


def test_robustness_rows_cover_every_corruption_and_the_clean_run():
    zoo = _toy_zoo()
    df = robustness(zoo, corruptions=("gaussian_noise",), severities=(2,), n_calib=8, config=FeatCalConfig(lam=0.1))
    assert set(zip(df.method, df.corruption, df.severity)) == {
        ("task_arithmetic", "none", 0.0),
        ("task_arithmetic+featcal", "none", 0.0),
        ("task_arithmetic", "gaussian_noise", 2.0),
        ("task_arithmetic+featcal", "gaussian_noise", 2.0),
    }
    assert (df.groupby(["method", "corruption"]).size() == len(zoo.tasks)).all()


def test_studies_page_runs_both_studies_on_a_tiny_zoo(tmp_path):
    pytest.importorskip("streamlit")
    from app_zoo import app_page_on_tiny_zoo

    at = app_page_on_tiny_zoo(tmp_path, "pages/zoo.py")
    at.selectbox(key="merge").set_value("average").run()  # the merger chosen on the Zoo page
    at.switch_page("pages/studies.py").run()
    at.select_slider(key="study_test").set_value(50)  # the page's own control, not the sidebar's
    at.multiselect(key="se_budgets").set_value([4, 8])
    at.number_input(key="se_seeds").set_value(2)
    at.multiselect(key="rb_kinds").set_value(["blur"])
    at.multiselect(key="rb_sev").set_value([2])
    at.select_slider(key="rb_n").set_value(8)
    at.button(key="sample-efficiency_run").click().run()
    at.button(key="robustness_run").click().run()
    assert not at.exception and not at.error, [e.value for e in [*at.exception, *at.error]]
    se, rb = (d.value for d in at.dataframe)
    assert len(se) == 2 * 4 and set(se["n"]) == {4, 8}  # 3 mergers + FeatCal, 2 budgets
    assert set(rb["corruption"]) == {"none", "blur"}
    # FeatCal runs on the merger the Zoo page chose, the other mergers stay as baselines.
    assert "average+featcal" in set(se["method"]) and "task_arithmetic+featcal" not in set(se["method"])
    assert {"average", "average+featcal"} == set(rb["method"])


def test_a_zoos_own_merged_model_is_a_merger_name():
    """``given`` (a zoo spec's ``merged:``, featcal.zoo.core.GIVEN) passes the check; other
    unknown names are still refused by name."""
    from featcal.sweep import studies
    from featcal.zoo.core import GIVEN

    assert studies._mergers([GIVEN, "task_arithmetic"]) == {GIVEN: {}, "task_arithmetic": {}}
    with pytest.raises(ValueError, match=r"unknown merger\(s\) \['nope'\].*'given'"):
        studies._mergers(["nope"])

"""The one method registry (featcal.baselines.registry): every merger and calibrator by name,
what the public names, the comparison and the app read from it, and the one --param dialect
(the command line's use of it: tests/cli/test_cli.py)."""

import inspect

import pytest

import featcal
from app import settings
from diagnostics import compare as cmp
from featcal.baselines import registry


def test_every_method_is_registered_once_with_its_kind_label_and_parameters():
    names = [m.name for m in registry.METHODS]
    assert len(names) == len(set(names))
    assert set(registry.names("merger")) == {
        "average",
        "task_arithmetic",
        "ties",
        "dare",
        "iso_c",
        "iso_cts",
        "tsv",
        "wudi",
    }
    assert set(registry.names("data_merger")) == {"regmean", "regmean_plusplus", "adamerging", "fisher_merging"}
    assert registry.names("calibrator") == ["featcal", "svc"]  # FeatCal is one entry, like every other
    assert registry.names("trained") == ["escal", "surgery", "surgery_v2"]
    for m in registry.METHODS:
        assert m.kind in registry.KINDS and m.label
        sig = inspect.signature(m.fn).parameters
        for p in m.params:
            if m.name != "featcal" or p.name in sig:  # FeatCal's preset fields live on FeatCalConfig
                assert sig[p.name].default == p.default, (m.name, p.name)
            if p.range is not None:
                lo, hi, _ = p.range
                assert lo <= p.default <= hi or m.name == "featcal", (m.name, p.name)
    assert registry.get("featcal").defaults["lam"] == featcal.FeatCalConfig.clip().lam


def test_the_public_names_are_derived_from_it():
    assert featcal.MERGERS == {n: registry.get(n).fn for n in registry.names("merger")}
    assert featcal.MERGERS_WITH_DATA == {n: registry.get(n).fn for n in registry.names("data_merger")}
    assert set(cmp.CALIBRATORS) == {"featcal", "svc", "escal", "surgery", "surgery_v2"}
    assert cmp.TRAINED == ("escal", "surgery", "surgery_v2")
    assert registry.get("TA") is registry.get("task_arithmetic") and registry.get("fisher").name == "fisher_merging"


def test_the_apps_labels_and_ranges_come_from_it():
    assert settings.MERGE_METHODS["task_arithmetic"] == registry.get("task_arithmetic").label
    assert set(settings.MERGE_METHODS) == {m.name for m in registry.METHODS if m.app}
    assert settings.MERGE_PARAMS["ties"] == {"density": (0.05, 1.0, 0.05), "scale": (0.05, 2.0, 0.05)}
    assert settings.merge_default("ties", "density") == 0.2


def test_parameters_are_checked_by_name_and_type():
    assert registry.check_params("ta", {"scale": 1}) == {"scale": 1.0}
    with pytest.raises(ValueError, match="ties takes no parameter 'dens'; it takes density, scale, disjoint"):
        registry.check_params("ties", {"dens": 0.1})
    with pytest.raises(ValueError, match="'disjoint' takes one of mean, sum, got 'max'"):
        registry.check_params("ties", {"disjoint": "max"})
    with pytest.raises(ValueError, match="'steps' takes a whole number, got 2.5"):
        registry.check_params("surgery", {"steps": 2.5})
    with pytest.raises(TypeError, match="takes no parameter"):  # as a function called with a wrong keyword
        featcal.merge("task_arithmetic", {}, {}, density=0.3)
    with pytest.raises(ValueError, match="unknown calibrator 'feat'"):
        registry.get("feat", "calibrator", "trained")


def test_one_param_dialect_where_one_method_runs_and_method_dot_name_where_several():
    assert registry.parse_param_items(["scale=0.4"], ["ta"]) == {"task_arithmetic": {"scale": 0.4}}
    assert registry.parse_param_items(["ta.scale=0.4"], ["task_arithmetic"]) == {"task_arithmetic": {"scale": 0.4}}
    got = registry.parse_param_items(["ta.scale=0.4", "svc.alpha=0.1", "surgery.steps=5"], None)
    assert got == {"task_arithmetic": {"scale": 0.4}, "svc": {"alpha": 0.1}, "surgery": {"steps": 5}}
    with pytest.raises(ValueError, match="several methods run here; say whose it is: METHOD.NAME=VALUE"):
        registry.parse_param_items(["scale=0.4"], None)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        registry.parse_param_items(["scale"], ["ta"])


def test_a_number_may_come_per_task():
    assert registry.check_params("ties", {"density": {"a": 0.5, "b": 1}}) == {"density": {"a": 0.5, "b": 1.0}}
    with pytest.raises(ValueError, match="'density' takes a number, got 'x'"):
        registry.check_params("ties", {"density": {"a": "x"}})

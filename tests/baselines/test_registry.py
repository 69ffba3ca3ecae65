"""The one method registry (featcal.baselines.registry): every merger and calibrator by name,
what the public names, the comparison and the app read from it, and the one --param dialect
(the command line's use of it: tests/cli/test_cli.py)."""

import dataclasses
import inspect

import pytest

import featcal
from app import settings
from diagnostics import compare as cmp
from featcal.baselines import registry
from featcal.config import RANGES


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
        "ace",
        "bmm_datafree",
    }
    assert set(registry.names("data_merger")) == {
        "regmean",
        "regmean_plusplus",
        "adamerging",
        "fisher_merging",
        "lot",
        "esm",
        "bmm",
        "bmm_search",
    }
    assert registry.names("calibrator") == ["featcal", "svc"]  # FeatCal is one entry, like every other
    assert registry.names("trained") == ["escal", "surgery", "surgery_v2", "probsurgery"]
    for m in registry.METHODS:
        assert m.kind in registry.KINDS and m.label
        declared = _declared(m)
        for p in m.params:
            if p.name in declared and p.after:  # None in the function: the default depends on the merger
                assert declared[p.name] is None, (m.name, p.name)
            elif p.name in declared:  # FeatCal's run options are calibrate's keywords
                assert declared[p.name] == p.default, (m.name, p.name)
            if p.range is not None:
                assert p.range.low <= p.default <= p.range.high, (m.name, p.name)
    assert registry.get("featcal").defaults["lam"] == featcal.FeatCalConfig.clip().lam


def _declared(m) -> dict:
    """Where a method's parameters are declared: a trained calibrator's options dataclass, FeatCal's
    CLIP preset (what a comparison starts from), a merger's function."""
    if m.options is not None:
        return {f.name: f.default for f in dataclasses.fields(m.options)}
    if m.name == "featcal":
        return dataclasses.asdict(featcal.FeatCalConfig.clip())
    return {k: p.default for k, p in inspect.signature(m.fn).parameters.items()}


def test_trained_calibrators_read_their_options_with_help_and_choices():
    escal = registry.get("escal")
    assert escal.options is featcal.ESCalOptions and registry.get("surgery_v2").options is featcal.SurgeryOptions
    assert escal.defaults == {
        "rank": 128,
        "lr": 3e-3,
        "batch": 16,
        "seed": 0,
        "blocks": None,
        "device": None,
        "epochs": 200,
        "block_weights": None,
        "last_read": "write",
        "qkv": None,
        "mlp_out": None,
        "tokens": "all",
    }  # ESCal's defaults, exactly as before they were options; progress is the runner's
    assert all(p.help for m in ("escal", "surgery", "featcal") for p in registry.get(m).params)
    assert escal.param("last_read").choices == ("write", "own_qkv")
    with pytest.raises(ValueError, match="'tokens' takes one of all, cls, got 'mean'"):
        registry.check_params("escal", {"tokens": "mean"})
    with pytest.raises(ValueError, match="SurgeryOptions: rank, steps and batch must be >= 1"):
        registry.check_params("surgery", {"steps": 0})  # the options check themselves, before any work


def test_featcal_reads_the_one_table_of_ranges():
    lam = registry.get("featcal").param("lam")
    assert lam.range is RANGES["lam"] and tuple(lam.range) == (-6.0, 2.0, 0.1)  # the app's log10 slider
    assert registry.check_params("featcal", {"lam": 1e3, "rho": -5}) == {"lam": 1e3, "rho": -5.0}  # accepted
    with pytest.raises(ValueError, match=r"featcal: parameter 'lam' takes a number in \[0, inf\] \(lambda"):
        registry.check_params("featcal", {"lam": -1.0})
    with pytest.raises(ValueError, match=r"'alpha' takes a number in \[-1, 2\]"):
        registry.check_params("featcal", {"alpha": 3})


def test_the_public_names_are_derived_from_it():
    assert featcal.MERGERS == {n: registry.get(n).fn for n in registry.names("merger")}
    assert featcal.MERGERS_WITH_DATA == {n: registry.get(n).fn for n in registry.names("data_merger")}
    calibrators = {"featcal", "svc", "escal", "surgery", "surgery_v2", "probsurgery"}
    assert set(registry.names("calibrator", "trained")) == calibrators
    assert cmp.TRAINED == ("escal", "surgery", "surgery_v2", "probsurgery")
    assert registry.get("TA") is registry.get("task_arithmetic") and registry.get("fisher").name == "fisher_merging"


def test_the_apps_labels_and_ranges_come_from_it():
    assert settings.MERGE_METHODS["task_arithmetic"] == registry.get("task_arithmetic").label
    assert set(settings.MERGE_METHODS) == {m.name for m in registry.METHODS if m.app}
    ties = {k: tuple(v) for k, v in settings.MERGE_PARAMS["ties"].items()}  # a Range unpacks as (min, max, step)
    assert ties == {"density": (0.05, 1.0, 0.05), "scale": (0.05, 2.0, 0.05)}
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


def test_svc_alpha_default_depends_on_the_upstream_merger():
    from featcal.baselines.svc import ALPHA_AFTER, ALPHA_FALLBACK

    svc = registry.get("svc")
    assert svc.defaults_after("task_arithmetic") == {"alpha": 0.1}
    assert svc.defaults_after("iso_cts") == {"alpha": 0.2}
    assert svc.defaults_after("tsv") == {"alpha": 1.0}
    assert svc.defaults_after("regmean") == svc.defaults_after(None) == {"alpha": ALPHA_FALLBACK}
    assert svc.param("alpha").after is ALPHA_AFTER  # one copy of the table
    assert set(ALPHA_AFTER) <= set(registry.names("merger"))  # keyed by the registry's names
    assert "after ta 0.1" in registry.describe("svc") and "iso_cts 0.2" in registry.describe("svc")
    assert registry.check_params("svc", {"alpha": 1}) == {"alpha": 1.0}  # still typed and ranged
    with pytest.raises(ValueError, match="takes a number"):
        registry.check_params("svc", {"alpha": "high"})


def test_what_each_kind_costs_is_the_registrys():
    assert [n for n in registry.names() if registry.get(n).task_specific] == [
        "escal",
        "surgery",
        "surgery_v2",
        "probsurgery",
    ]
    assert registry.get("escal").length.name == "epochs" and registry.get("surgery").length.name == "steps"
    assert registry.get("surgery").length.default == featcal.SurgeryOptions().steps  # the authors' schedule
    assert registry.get("featcal").length is None
    assert registry.get("fisher").examples_cap == "n_examples"

"""Issue 28: the CLI's preset follows the architecture it loads; a calibration whose mean
relative residual rises says so in ``report.warnings``; ``merge_model`` returns a model."""

from __future__ import annotations

import argparse
import copy
import warnings

import pytest
import torch

from featcal import FeatCalConfig, calibrate, merge, merge_model
from featcal.cli.calibrate import choose_preset, config_from_args
from featcal.config import preset_config, preset_for, preset_for_model, preset_for_zoo
from featcal.engine.report import RESIDUAL_ROSE
from tiny import toy_data, toy_zoo, toy_zoo_object


@pytest.mark.parametrize(
    "config,want",
    [
        ({"model_type": "clip_vision_model", "hidden_size": 768}, "clip"),
        ({"model_type": "t5", "d_model": 512, "architectures": ["T5ForConditionalGeneration"]}, "flan-t5"),
        ({"model_type": "llama", "hidden_size": 4096}, "llama-8b"),
        ({"model_type": "llama", "hidden_size": 576}, "llama-3b"),  # SmolLM2-135M: the 3B setting
        ({"model_type": "qwen2", "hidden_size": 3584}, "llama-3b"),
        ({"model_type": "bert", "hidden_size": 128}, "none"),
        ({}, "none"),
    ],
)
def test_the_preset_follows_the_architecture(config, want):
    assert preset_for(config)[0] == want


def test_the_chosen_preset_is_printed_and_a_users_choice_kept(capsys):
    args = argparse.Namespace(preset=None, lam=None, rho=None, alpha=None, no_bias=False, no_layernorm=False)
    choose_preset(args, preset_for({"model_type": "t5"}))
    assert args.preset == "flan-t5" and "preset 'flan-t5'" in capsys.readouterr().err
    assert config_from_args(args) == FeatCalConfig.flan_t5(stats_dtype=torch.float64)  # lam 1e-5 needs float64
    args.stats_dtype = "float32"
    assert config_from_args(args) == FeatCalConfig.flan_t5()  # unless the user says otherwise
    args.preset = "llama-8b"
    choose_preset(args, preset_for({"model_type": "t5"}))
    assert args.preset == "llama-8b" and capsys.readouterr().err == ""
    base, _, _ = toy_zoo()
    assert preset_for_model(base)[0] == "none"  # a plain torch model: no paper setting


def test_merge_model_is_a_new_model_with_the_merged_weights():
    base, experts, merged = toy_zoo()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    model = merge_model("task_arithmetic", base, experts, scale=0.3)
    assert model is not base and not model.training
    for k, v in merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}).items():
        assert torch.equal(model.state_dict()[k], v) and torch.equal(merged.state_dict()[k], v)
    assert all(torch.equal(base.state_dict()[k], v) for k, v in before.items())  # the base untouched
    as_list = merge_model("average", base, list(experts.values()))
    assert torch.equal(as_list.stem.weight, merge_model("average", base, experts).stem.weight)


def test_a_rising_residual_is_a_warning_in_the_report():
    base, experts, merged = toy_zoo()
    data = toy_data(experts)
    good, rep = calibrate(merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig())
    assert not any(w.startswith(RESIDUAL_ROSE) for w in rep.warnings)
    # A strong pull toward an anchor far behind the base (rho = -1): worse than the merged model.
    bad = FeatCalConfig(lam=1e4, rho=-1.0)
    with pytest.warns(UserWarning, match=RESIDUAL_ROSE):
        _, rep = calibrate(merged, base=base, experts=experts, calib_data=data, config=bad)
    before, after = rep.mean_residuals()
    assert after > before
    msg = [w for w in rep.warnings if w.startswith(RESIDUAL_ROSE)]
    assert len(msg) == 1 and f"{before:.4g} to {after:.4g}" in msg[0] and "featcal tune" in msg[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert rep.check_residuals() == msg[0] and len(rep.warnings) == len(set(rep.warnings))


def test_a_rise_within_rounding_is_not_warned_of():
    """A single expert equal to the merged model at lam 0 (its fixed point): both residuals are
    rounding (~1e-9), and the run must not warn that the calibrated model is worse (it once said
    'rose from 0.0000 to 0.0000')."""
    base, experts, _ = toy_zoo()
    one = {"t0": experts["t0"]}
    data = {"t0": toy_data(experts)["t0"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = FeatCalConfig(lam=0.0)
        _, rep = calibrate(copy.deepcopy(one["t0"]), base=base, experts=one, calib_data=data, config=cfg)
    before, after = rep.mean_residuals()
    assert before < 1e-5 and after < 1e-5 and not any(w.startswith(RESIDUAL_ROSE) for w in rep.warnings)
    rep.modules[0].residual_after = rep.modules[0].residual_before + 0.5  # a real rise is still warned of
    assert rep.check_residuals().startswith(RESIDUAL_ROSE)


def test_a_preset_by_name_is_the_presets_own_config():
    assert FeatCalConfig.preset("clip", rho=1.5) == FeatCalConfig.clip(rho=1.5)
    assert FeatCalConfig.preset("flan-t5") == FeatCalConfig.flan_t5()
    assert FeatCalConfig.preset("llama-3b", lam=0.1) == FeatCalConfig.llama("3b", lam=0.1)
    assert FeatCalConfig.preset("llama-8b") == FeatCalConfig.llama("8b")
    assert FeatCalConfig.preset("none") == FeatCalConfig()
    with pytest.raises(ValueError, match="unknown preset"):
        FeatCalConfig.preset("gpt")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
    return LlamaForCausalLM(cfg)


def test_a_zoo_nobody_chose_a_preset_for_takes_its_own_with_float64_at_lam_1e_5():
    """The app, ``featcal compare`` and ``featcal diagnose``: a language model's preset (float64
    statistics where its lam is 1e-5), the CLIP preset on every other zoo; a given dtype is kept."""
    assert preset_config("llama-3b") == FeatCalConfig.llama("3b", stats_dtype=torch.float64)
    assert preset_config("flan-t5") == FeatCalConfig.flan_t5(stats_dtype=torch.float64)
    assert preset_config("llama-3b", stats_dtype=torch.float32).stats_dtype == torch.float32
    assert preset_config("clip", rho=1.5) == FeatCalConfig.clip(rho=1.5)
    assert preset_config("llama-8b") == FeatCalConfig.llama("8b")  # lam 3: float32 is enough
    assert preset_for_zoo(type("Zoo", (), {"base": _tiny_llama()})()) == "llama-3b"
    assert preset_for_zoo(toy_zoo_object()) == "clip"


def test_compare_calibrates_a_zoo_at_its_preset(monkeypatch):
    from featcal.baselines import runner  # compare's FeatCal, given no preset

    seen = {}

    def fake_calibrate(merged, **kw):
        seen.update(kw)
        return merged, None

    monkeypatch.setattr(runner, "calibrate", fake_calibrate)
    model = _tiny_llama()
    zoo = type("Zoo", (), {"base": model, "experts": {}, "tasks": ["t"]})()
    runner.run_chain(zoo, "task_arithmetic", ["featcal"], model, {}, {"featcal": {"lam": 0.1}})
    assert seen["config"] == FeatCalConfig.llama("3b", lam=0.1, stats_dtype=torch.float64)

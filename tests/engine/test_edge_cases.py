"""Edge cases where featcal must be exact or refuse clearly (issue 16, items 4-10): each
test here failed before its fix."""

from __future__ import annotations

import warnings

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.method.reference import calibrate_reference
from tiny import ToyModel, all_target_params, assert_same_calibration, toy_data, toy_zoo


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_lam_zero_with_fewer_rows_than_width_is_resolved_in_float64_and_warned():
    """lam = 0, 10 rows for a width of 32 (fc2): float32 statistics make S + eps I numerically
    indefinite. The solve must match the float64 spec solution (a float32 LU was 7x off) and
    say so in report.warnings and a Python warning."""
    base, experts, merged = toy_zoo(n_tasks=2, std=0.3, d=16, hidden=32)
    data = toy_data(experts, n=1, tokens=5, batch=1)
    cfg = FeatCalConfig(lam=0.0, modules=("fc2",), layernorm=False)  # fc2 reads well-posed rows (no LayerNorm)
    want = all_target_params(calibrate_reference(merged, base=base, experts=experts, calib_data=data, config=cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, report = calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    for key, (W, b) in all_target_params(model).items():
        if key[1] == "fc2":
            assert _rel(W, want[key][0]) < 1e-4, key
            assert _rel(b, want[key][1]) < 1e-4, key
    fallback = [m for m in report.warnings if "re-solved in float64" in m]
    assert fallback and "block 0 fc2" in fallback[0]
    assert any("re-solved in float64" in str(w.message) for w in caught)
    # float64 statistics need no fallback
    _, report64 = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg.with_(stats_dtype=torch.float64), progress=False
    )
    assert not [m for m in report64.warnings if "re-solved" in m]


class _MaskedToy(ToyModel):
    """A ToyModel called as ``model(**{"x": ..., "attention_mask": ...})`` (its blocks act token by
    token, so what sits in a padded token stays there)."""

    def forward(self, x, attention_mask=None):
        return super().forward(x)


def _masked_toy_zoo():
    base, experts, merged = toy_zoo(n_tasks=2, std=0.3)
    for m in (base, merged, *experts.values()):
        m.__class__ = _MaskedToy
    return base, experts, merged


def _padded_data(tasks, fill: float):
    """Dict batches whose padded tokens (the last two of every other example) hold ``fill``."""
    out = {}
    for t, batches in toy_data(tasks, n=12, batch=4).items():
        out[t] = []
        for x in batches:
            mask = torch.ones(x.shape[:2], dtype=torch.long)
            mask[::2, -2:] = 0
            out[t].append({"x": x.masked_fill(mask[..., None] == 0, fill), "attention_mask": mask})
    return out


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_nan_or_inf_in_padding_only_changes_nothing(fill):
    """Padding is excluded from the statistics, so what it holds cannot matter: NaN or Inf in
    padded tokens give the calibration that zeros there give (it raised before: masked rows
    were weighted by 0, and NaN * 0 is NaN)."""
    base, experts, merged = _masked_toy_zoo()
    cfg = FeatCalConfig(stats_dtype=torch.float64)
    want, rep_want = calibrate(
        merged, base=base, experts=experts, calib_data=_padded_data(experts, 0.0), config=cfg, progress=False
    )
    got, rep_got = calibrate(
        merged, base=base, experts=experts, calib_data=_padded_data(experts, fill), config=cfg, progress=False
    )
    assert_same_calibration(got, rep_got, want, rep_want)


def test_drift_table_ignores_nan_in_padding():
    from diagnostics import drift_table

    base, experts, merged = _masked_toy_zoo()
    want = drift_table(merged, experts, _padded_data(experts, 0.0))
    got = drift_table(merged, experts, _padded_data(experts, float("nan")))
    assert got["value"].notna().all()
    assert torch.allclose(torch.tensor(got["value"].values), torch.tensor(want["value"].values), rtol=1e-9, atol=1e-12)


def test_expert_trace_takes_dict_batches():
    """An ExpertTrace with dict batches ({x, attention_mask}) (it raised: a dict takes no weak
    reference): the second run reuses the experts' work and gives the model a run without the
    trace gives; new batches with other tensors clear it."""
    from featcal import ExpertTrace

    base, experts, merged = _masked_toy_zoo()
    data = _padded_data(experts, 0.0)
    calls = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for e in experts.values() for m in e.modules()]
    trace, cfg = ExpertTrace(), FeatCalConfig(lam=0.1)
    try:
        calibrate(merged, base=base, experts=experts, calib_data=data, progress=False, expert_trace=trace)
        assert calls
        calls.clear()
        got, _ = calibrate(
            merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, expert_trace=trace
        )
        assert calls == []
        fresh = {t: [{k: v.clone() for k, v in b.items()} for b in bs] for t, bs in data.items()}
        calibrate(merged, base=base, experts=experts, calib_data=fresh, config=cfg, progress=False, expert_trace=trace)
        assert calls  # other tensors: the trace was cleared and the experts ran again
    finally:
        for h in handles:
            h.remove()
    want, _ = calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    ref = all_target_params(want)
    for name, (W, b) in all_target_params(got).items():
        assert torch.equal(W, ref[name][0]) and torch.equal(b, ref[name][1]), name


def test_experts_and_base_as_state_dicts_files_or_directories(tmp_path):
    """A state dict, a safetensors directory (HF save_pretrained layout) or a weights_only
    checkpoint file stand for a model (it raised AttributeError): loaded into a copy of the
    merged model, they give the calibration the models give."""
    from safetensors.torch import save_file

    base, experts, merged = toy_zoo(n_tasks=2, std=0.3)
    data = toy_data(experts)
    want, rep_want = calibrate(merged, base=base, experts=experts, calib_data=data, progress=False)
    (tmp_path / "t1").mkdir()
    save_file(experts["t1"].state_dict(), str(tmp_path / "t1" / "model.safetensors"))
    torch.save(base.state_dict(), tmp_path / "base.pt")
    given = {"t0": experts["t0"].state_dict(), "t1": str(tmp_path / "t1")}
    got, rep_got = calibrate(merged, base=tmp_path / "base.pt", experts=given, calib_data=data, progress=False)
    assert_same_calibration(got, rep_got, want, rep_want)


def test_a_state_dict_that_does_not_fit_names_its_keys(tmp_path):
    base, experts, merged = toy_zoo(n_tasks=2, std=0.3)
    sd = dict(experts["t0"].state_dict())
    sd.pop("blocks.0.fc1.weight")
    sd["blocks.0.extra"] = torch.zeros(3)
    sd["head.bias"] = torch.zeros(7)
    with pytest.raises(ValueError, match=r"expert 't0'.*missing 'blocks.0.fc1.weight'.*unexpected 'blocks.0.extra'"):
        calibrate(merged, base=base, experts={**experts, "t0": sd}, calib_data=toy_data(experts), progress=False)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        calibrate(merged, base=tmp_path, experts=experts, calib_data=toy_data(experts), progress=False)
    with pytest.raises(TypeError, match="state dict must map names to tensors"):
        calibrate(merged, base={"a": 1}, experts=experts, calib_data=toy_data(experts), progress=False)


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
def test_an_expert_with_other_heads_but_the_same_shapes_is_refused(kind):
    """2 attention heads instead of 4 change no weight's shape; the calibration ran silently.
    Now the error names the differing config field (HF) or module attribute (any model)."""
    import tiny

    base, experts, merged, data = tiny.zoo(kind)
    if kind == "hf_clip":
        from transformers import CLIPVisionModel

        cfg = base.config.to_dict() | {"num_attention_heads": 2}
        odd = CLIPVisionModel(type(base.config).from_dict(cfg)).eval()
        match = r"expert 't1'.*config.num_attention_heads: 4 vs 2"
    else:
        from open_clip.transformer import VisionTransformer

        odd = VisionTransformer(
            image_size=16, patch_size=8, width=32, layers=2, heads=2, mlp_ratio=2.0, output_dim=16
        ).eval()
        match = r"expert 't1'.*attn.num_heads: 4 vs 2"
    odd.load_state_dict(experts["t1"].state_dict())
    with pytest.raises(ValueError, match=match):
        calibrate(merged, base=base, experts={**experts, "t1": odd}, calib_data=data, progress=False)
    from diagnostics import drift_table

    with pytest.raises(ValueError, match=match):
        drift_table(merged, {**experts, "t1": odd}, data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_solve_like_the_float64_reference(dtype, monkeypatch):
    """On a bf16/fp16 model, the statistics add no error of their own: block 0's solution
    (before it is rounded into the model) equals the float64 reference's on the same model's
    captured inputs. It was 2.5e-4 (W) and 5e-4 (b) off in bf16: ``W_i xe`` came from the
    module's bf16 output less its bias."""
    import featcal.method.reference
    import featcal.model.arch
    import tiny

    solved: list[tuple] = []
    set_params = featcal.model.arch.set_params

    def spy(blk, t, W, b):
        solved.append((t.name, W.double().clone(), None if b is None else b.double().clone()))
        return set_params(blk, t, W, b)

    monkeypatch.setattr(featcal.model.arch, "set_params", spy)
    monkeypatch.setattr(featcal.method.reference, "set_params", spy)
    base, experts, merged, data = tiny.zoo("hf_clip")
    base, merged = base.to(dtype), merged.to(dtype)
    experts = {t: e.to(dtype) for t, e in experts.items()}
    cfg = FeatCalConfig(stats_dtype=torch.float64)
    calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    got, solved[:] = solved[:], []
    calibrate_reference(merged, base=base, experts=experts, calib_data=data, config=cfg)
    n0 = len(featcal.model.arch.block_targets(featcal.model.arch.resolve_blocks(merged)[1][0]))
    for (name, W, b), (name_r, W_r, b_r) in zip(got[:n0], solved[:n0]):
        assert name == name_r
        assert _rel(W, W_r) < 1e-9, name
        assert b is None or _rel(b, b_r) < 1e-9, name


def _sequence_first(model):
    """The same open_clip ViT run as older open_clip builds run it: the transformer's stream
    sequence-first ``(T, B, d)``, its ``nn.MultiheadAttention`` with ``batch_first=False``."""
    import copy

    out = copy.deepcopy(model)
    out.transformer.batch_first = False
    for blk in out.transformer.resblocks:
        blk.attn.batch_first = False
    return out


@pytest.mark.parametrize("pooling", [True, False], ids=["pooled", "per-batch"])
def test_sequence_first_open_clip_calibrates_like_batch_first(pooling):
    """Sequence-first streams (open_clip's Transformer with batch_first=False): pooling
    concatenated along the token axis and crashed; per batch, the class-token weights landed on
    the batch axis. Same weights in either layout must give the same calibration."""
    import tiny
    from featcal import FastPaths

    base, experts, merged, data = tiny.zoo("open_clip", n=8)
    x = torch.randn(1, 3, 16, 16)
    assert torch.allclose(_sequence_first(merged)(x), merged(x), atol=1e-5)  # really the same model
    cfg = FeatCalConfig.clip(stats_dtype=torch.float64)
    fast = FastPaths() if pooling else FastPaths.plainest()
    want, rep_want = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, fast=fast
    )
    sf = {t: _sequence_first(e) for t, e in experts.items()}
    got, rep_got = calibrate(
        _sequence_first(merged),
        base=_sequence_first(base),
        experts=sf,
        calib_data=data,
        config=cfg,
        progress=False,
        fast=fast,
    )
    assert_same_calibration(got, rep_got, want, rep_want)


def test_sequence_first_open_clip_drift_table_matches_batch_first():
    import tiny
    from diagnostics import drift_table

    base, experts, merged, data = tiny.zoo("open_clip", n=8)
    want = drift_table(merged, experts, data, tokens="cls")
    got = drift_table(_sequence_first(merged), {t: _sequence_first(e) for t, e in experts.items()}, data, tokens="cls")
    assert torch.allclose(torch.tensor(got["value"].values), torch.tensor(want["value"].values), rtol=1e-4, atol=1e-6)


def test_a_hugging_face_save_pretrained_directory_is_an_expert(tmp_path):
    """An expert saved by ``save_pretrained`` calibrates like the model; a directory whose
    config.json has other heads (the weights fit all the same) is refused, naming the field."""
    import tiny

    base, experts, merged, data = tiny.zoo("hf_clip")
    experts["t0"].save_pretrained(tmp_path / "t0")
    want, _ = calibrate(merged, base=base, experts=experts, calib_data=data, progress=False)
    got, _ = calibrate(merged, base=base, experts={**experts, "t0": tmp_path / "t0"}, calib_data=data, progress=False)
    for (k, a), b in zip(want.state_dict().items(), got.state_dict().values()):
        assert torch.equal(a, b), k
    experts["t1"].config.num_attention_heads = 2
    experts["t1"].save_pretrained(tmp_path / "t1")
    with pytest.raises(ValueError, match=r"expert 't1'.*config.json.*num_attention_heads: 4 vs 2"):
        calibrate(merged, base=base, experts={**experts, "t1": str(tmp_path / "t1")}, calib_data=data, progress=False)


def test_preview_at_lam_zero_matches_the_exact_float64_resolve():
    """The preview re-solves from an eigendecomposition of the same float32 S: at lam = 0 its
    noise eigenvalues blew the weights up (5.5x off the exact run); now they count as zeros,
    as in the exact solve's float64 fallback."""
    base, experts, merged = toy_zoo(n_tasks=2, std=0.3, d=16, hidden=32)
    data = toy_data(experts, n=1, tokens=5, batch=1)
    cfg = FeatCalConfig(lam=0.0, modules=("fc2",), layernorm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, report = calibrate(
            merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, keep_stats=True
        )
    exact, preview = all_target_params(model), all_target_params(report.preview(lam=0.0, rho=cfg.rho, alpha=cfg.alpha))
    assert _rel(preview[0, "fc2"][0], exact[0, "fc2"][0]) < 1e-4  # block 0: the preview is exact there

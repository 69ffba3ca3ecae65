"""The FeatCal engine end to end on tiny seeded models (toy blocks, HF CLIP, open_clip)."""

import copy

import pytest
import torch

import tiny
from featcal import FeatCalConfig, calibrate
from featcal.model.arch import block_targets, resolve_blocks
from featcal.model.streams import catch_block_inputs, run_block

ARCHS = ["toy", "hf_clip", "open_clip"]


def _features(model, batch):
    """The hidden state after the last block, through the same catcher the engine uses."""
    _, blks = resolve_blocks(model)
    call = catch_block_inputs(model, blks[0], batch)
    h = call.hidden
    for blk in blks:
        h = run_block(blk, call.with_hidden(h))
    return h


@pytest.mark.parametrize("kind", ARCHS)
def test_fixed_point_single_expert_equal_to_merged(kind):
    # Enough token rows (40 x 5) that every input Gram matrix has full rank (widest input: 64).
    # float64 models: block l's inputs then match the expert's to ~1e-12, and the fixed point
    # is checked on the weights themselves (poorly conditioned LayerNorm outputs amplify float32 noise).
    base, experts, merged, data = tiny.zoo(kind, n_tasks=1, n=40)
    base, merged = base.double(), merged.double()
    data = {t: [b.double() for b in bs] for t, bs in data.items()}
    expert = copy.deepcopy(merged)
    cfg = FeatCalConfig(lam=0.0, rho=2.0, alpha=0.3, eps=1e-15, stats_dtype=torch.float64)
    out, _ = calibrate(
        merged, base=base, experts={"t0": expert}, calib_data={"t0": data["t0"]}, config=cfg, progress=False
    )
    got, want = tiny.all_target_params(out), tiny.all_target_params(expert)
    for key, (W, b) in want.items():
        assert torch.allclose(got[key][0], W, atol=1e-6), key
        if b is not None:
            assert torch.allclose(got[key][1], b, atol=1e-6), key


@pytest.mark.parametrize("kind", ARCHS)
def test_lambda_to_infinity_returns_the_anchor(kind):
    base, experts, merged, data = tiny.zoo(kind)
    rho = 2.2
    out, _ = calibrate(
        merged,
        base=base,
        experts=experts,
        calib_data=data,
        config=FeatCalConfig(lam=1e12, rho=rho, alpha=0.25, stats_dtype=torch.float64),
        progress=False,
    )
    got, mer, b0 = tiny.all_target_params(out), tiny.all_target_params(merged), tiny.all_target_params(base)
    for key, (W, b) in got.items():
        assert torch.allclose(W, rho * mer[key][0] + (1 - rho) * b0[key][0], atol=1e-5), key
        if b is not None:
            assert torch.allclose(b, rho * mer[key][1] + (1 - rho) * b0[key][1], atol=1e-5), key


@pytest.mark.parametrize("kind", ARCHS)
def test_inputs_are_left_untouched(kind):
    base, experts, merged, data = tiny.zoo(kind)
    before = {n: tiny.state_snapshot(m) for n, m in [("base", base), ("merged", merged), *experts.items()]}
    data_before = {t: [b.clone() for b in bs] for t, bs in data.items()}
    out, _ = calibrate(merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig(), progress=False)
    assert out is not merged
    for n, m in [("base", base), ("merged", merged), *experts.items()]:
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[n][k]), (n, k)
    for t in data:
        assert all(torch.equal(a, b) for a, b in zip(data[t], data_before[t]))


def test_training_flags_are_kept_exactly_and_calibration_runs_in_eval_mode():
    base, experts, merged, data = tiny.zoo("hf_clip")

    def flags(m):
        return [x.training for x in m.modules()]

    merged.train()
    resolve_blocks(merged)[1][0].eval()  # mixed: one block in eval, the rest training
    experts["t0"].train()
    before = {n: flags(m) for n, m in [("base", base), ("merged", merged), *experts.items()]}
    seen = []
    hook = experts["t0"].register_forward_pre_hook(lambda m, _: seen.append(any(flags(m))))
    try:
        out, _ = calibrate(merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig(), progress=False)
    finally:
        hook.remove()
    assert seen and not any(seen)  # every module in eval mode while it ran
    assert flags(out) == before["merged"]  # the copy has the merged model's flags
    for n, m in [("base", base), ("merged", merged), *experts.items()]:
        assert flags(m) == before[n], n


@pytest.mark.parametrize("kind", ARCHS)
def test_calibrated_features_are_closer_to_the_experts(kind):
    base, experts, merged, data = tiny.zoo(kind, n_tasks=3)
    out, report = calibrate(
        merged,
        base=base,
        experts=experts,
        calib_data=data,
        config=FeatCalConfig(lam=0.05, rho=1.0, alpha=0.5),
        progress=False,
    )
    for t, batches in data.items():
        x = torch.cat(batches)
        with torch.no_grad():
            he = _features(experts[t], x)
            d_mer = (_features(merged, x) - he).norm()
            d_cal = (_features(out, x) - he).norm()
        assert d_cal < d_mer, (t, float(d_cal), float(d_mer))
    frame = report.to_frame()
    assert (frame.residual_after <= frame.residual_before + 1e-6).all()


@pytest.mark.parametrize("kind", ARCHS)
def test_batch_by_batch_equals_one_shot(kind):
    base, experts, merged, data = tiny.zoo(kind)
    one = {t: [torch.cat(bs)] for t, bs in data.items()}
    cfg = FeatCalConfig(stats_dtype=torch.float64)
    a, _ = calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    b, _ = calibrate(merged, base=base, experts=experts, calib_data=one, config=cfg, progress=False)
    for (key, (Wa, ba)), (Wb, bb) in zip(tiny.all_target_params(a).items(), tiny.all_target_params(b).values()):
        assert torch.allclose(Wa, Wb, atol=1e-5), key


@pytest.mark.parametrize("kind", ARCHS)
def test_block_by_block_streams_equal_the_full_forward(kind):
    base, experts, merged, data = tiny.zoo(kind)
    x = data["t0"][0]
    h = _features(merged, x)
    with torch.no_grad():
        if kind == "toy":
            full = merged.hidden(x)
        elif kind == "hf_clip":
            full = merged(pixel_values=x, output_hidden_states=True).hidden_states[-1]
        else:  # open_clip: hook the output of the last block
            seen = {}
            _, blks = resolve_blocks(merged)
            hd = blks[-1].register_forward_hook(lambda m, i, o: seen.setdefault("h", o))
            merged(x)
            hd.remove()
            full = seen["h"]
    assert torch.allclose(h, full, atol=1e-5)


def test_packed_attention_context_is_the_out_proj_input():
    from featcal.model.capture import capture

    model = tiny.tiny_open_clip_vit(3)
    _, blks = resolve_blocks(model)
    blk = blks[0]
    targets = block_targets(blk)
    x = torch.randn(2, 5, 32)
    with torch.no_grad(), capture(blk, targets) as cap:
        blk(x)
    ctx = cap.inputs["attn#context"]
    attn = blk.attn
    expect = attn(cap.inputs["attn"], cap.inputs["attn"], cap.inputs["attn"], need_weights=False)[0]
    assert torch.allclose(torch.nn.functional.linear(ctx, attn.out_proj.weight, attn.out_proj.bias), expect, atol=1e-5)
    names = [t.name for t in targets]
    assert {"attn.in_proj[q]", "attn.in_proj[k]", "attn.in_proj[v]", "attn.out_proj"} <= set(names)


def test_clip_token_weights_reach_the_last_block_only():
    base, experts, merged, data = tiny.zoo("hf_clip")
    plain, _ = calibrate(
        merged,
        base=base,
        experts=experts,
        calib_data=data,
        config=FeatCalConfig.clip(token_weights=None),
        progress=False,
    )
    weighted, _ = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig.clip(), progress=False
    )
    p, w = tiny.all_target_params(plain), tiny.all_target_params(weighted)
    last = max(k[0] for k in p)
    for key in p:
        same = torch.allclose(p[key][0], w[key][0], atol=1e-6)
        if key[0] != last or key[1].endswith(("k_proj", "v_proj")):
            assert same, key
        else:
            assert not same, key


def test_clip_preset_values():
    c = FeatCalConfig.clip(rho=2.2, alpha=0.25)
    assert (c.lam, c.rho, c.alpha, c.bias, c.layernorm) == (0.05, 2.2, 0.25, True, True)
    assert c.token_weights is not None and c.token_weights.other == 0.01
    assert not c.token_weights.applies(0, 12, "mlp.fc1") and c.token_weights.applies(11, 12, "mlp.fc1")
    assert not c.token_weights.applies(11, 12, "self_attn.k_proj")


def test_switches_bias_and_layernorm_keep_merged_values():
    base, experts, merged, data = tiny.zoo("toy")
    out, _ = calibrate(
        merged,
        base=base,
        experts=experts,
        calib_data=data,
        config=FeatCalConfig(bias=False, layernorm=False),
        progress=False,
    )
    for bo, bm in zip(out.blocks, merged.blocks):
        assert torch.equal(bo.ln1.weight, bm.ln1.weight) and torch.equal(bo.fc1.bias, bm.fc1.bias)
        assert not torch.equal(bo.fc1.weight, bm.fc1.weight)


def test_padding_rows_do_not_count():
    """Rows masked out by attention_mask (dict batches) must not change the solve."""

    class DictModel(tiny.ToyModel):
        def forward(self, x, attention_mask=None):  # same forward, dict batch
            return super().forward(x)

    torch.manual_seed(0)
    base = DictModel()
    experts = {"a": tiny.perturbed(base, 0.3, 1)}
    x = torch.randn(4, 5, 6)
    mask = torch.ones(4, 5)
    mask[:, 3:] = 0
    junk = x.clone()
    junk[:, 3:] = 100 * torch.randn(4, 2, 6)
    cfg = FeatCalConfig(stats_dtype=torch.float64, layernorm=False)
    # Tokens 3: never influence tokens <3 here (blocks act per token), so masked junk must be ignored.
    a, _ = calibrate(
        base,
        base=base,
        experts=experts,
        calib_data={"a": [{"x": x, "attention_mask": mask}]},
        config=cfg,
        progress=False,
    )
    b, _ = calibrate(
        base,
        base=base,
        experts=experts,
        calib_data={"a": [{"x": junk, "attention_mask": mask}]},
        config=cfg,
        progress=False,
    )
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-6)


def test_bf16_model_keeps_its_dtype():
    base, experts, merged, data = tiny.zoo("toy")

    def to16(m):
        return copy.deepcopy(m).to(torch.bfloat16)

    out, _ = calibrate(
        to16(merged),
        base=to16(base),
        experts={t: to16(m) for t, m in experts.items()},
        calib_data=data,  # float32 batches: cast to the model's dtype on the way in
        config=FeatCalConfig(),
        progress=False,
    )
    assert all(p.dtype == torch.bfloat16 for p in out.parameters())
    assert not torch.equal(out.blocks[0].fc1.weight, merged.blocks[0].fc1.weight.bfloat16())


def test_report_lists_every_module_with_time_and_residuals():
    base, experts, merged, data = tiny.zoo("hf_clip")
    _, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig.clip(), progress=False
    )
    frame = report.to_frame()
    assert len(frame) == 2 * 8  # 2 blocks x (q, k, v, out, fc1, fc2, 2 LayerNorms)
    assert set(frame.columns) >= {"block", "name", "residual_before", "residual_after", "seconds"}
    assert len(report.blocks) == 2 and report.seconds > 0
    d = report.to_dict()
    assert d["config"]["lam"] == 0.05 and len(d["modules"]) == 16


def test_llama_blocks_with_keyword_arguments_and_padding():
    """The generic path: blocks get position embeddings and masks as keyword arguments;
    padding tokens (attention_mask 0) are left out of the statistics."""
    base = tiny.tiny_llama()
    experts = {t: tiny.perturbed(base, 0.02, i) for i, t in enumerate("ab")}
    ids = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[0, 9:] = 0
    data = {t: [{"input_ids": ids, "attention_mask": mask}] for t in experts}  # the model's KV cache is on
    snap = tiny.state_snapshot(base)
    out, report = calibrate(
        base, base=base, experts=experts, calib_data=data, config=FeatCalConfig.llama("3b"), progress=False
    )
    frame = report.to_frame()
    assert set(frame.rows) == {int(mask.sum())}  # 57 real tokens, the 7 padded ones excluded
    assert (frame.residual_after < frame.residual_before).all()
    assert {"self_attn.q_proj", "mlp.down_proj"} <= set(frame.name)
    assert all(torch.equal(v, snap[k]) for k, v in base.state_dict().items())

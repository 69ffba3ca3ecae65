"""calibrate on the text architectures: T5's two stacks in one call, padding kept out of the
statistics through the right mask per input, BERT/RoBERTa found without blocks=."""

import pytest
import torch

import tiny
from featcal import FeatCalConfig, calibrate
from featcal.engine.blockstats import token_weights
from featcal.model.arch import block_targets, get_params, resolve_stacks

CFG = FeatCalConfig(stats_dtype=torch.float64)


def _params(model):
    return {
        (path, i, t.name): get_params(blk, t)
        for path, blks in resolve_stacks(model)
        for i, blk in enumerate(blks)
        for t in block_targets(blk)
    }


def _assert_same(a, b, rel=1e-6):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for key, (W, bias) in pa.items():
        W2, b2 = pb[key]
        assert float((W - W2).abs().max()) <= rel * float(W2.abs().max()), key
        assert bias is None or float((bias - b2).abs().max()) <= rel * float(b2.abs().max()), key


@pytest.fixture(scope="module")
def t5():
    return tiny.text_zoo(tiny.tiny_t5, lambda seed: tiny.t5_batches(seed=seed))


@pytest.mark.filterwarnings("ignore:task .* token rows")
def test_t5_one_call_is_the_encoder_then_the_decoder(t5):
    """Without blocks=, the encoder stack and then the decoder stack, the decoder reading the
    calibrated encoder: the same as calibrating the encoder, then the decoder of the result."""
    base, experts, merged, data = t5
    both, report = calibrate(merged, base=base, experts=experts, calib_data=data, config=CFG, progress=False)
    assert report.blocks_path == "encoder.block+decoder.block"
    assert [b.block for b in report.blocks] == [0, 1, 2, 3]
    kw = dict(base=base, experts=experts, calib_data=data, config=CFG, progress=False)
    enc, _ = calibrate(merged, blocks="encoder.block", **kw)
    two, _ = calibrate(enc, blocks="decoder.block", **kw)
    _assert_same(both, two)
    # ... and not the decoder calibrated on the merged encoder's output.
    dec_only, _ = calibrate(merged, blocks="decoder.block", **kw)
    w_both = both.decoder.block[1].layer[0].SelfAttention.q.weight.detach()
    w_dec = dec_only.decoder.block[1].layer[0].SelfAttention.q.weight.detach()
    assert float((w_both - w_dec).abs().max()) > 1e-5


@pytest.mark.filterwarnings("ignore:task .* token rows")
def test_t5_padding_is_out_of_the_statistics(t5):
    """Other token ids in the padding of the encoder and of the decoder change no weight: the
    decoder's rows are masked by decoder_attention_mask, the cross-attention's keys and values
    by attention_mask (with the encoder's mask on the decoder's rows the result would move)."""
    base, experts, merged, data = t5

    def junk(b):
        b = dict(b)
        b["input_ids"] = torch.where(b["attention_mask"] > 0, b["input_ids"], 5)
        b["decoder_input_ids"] = torch.where(b["decoder_attention_mask"] > 0, b["decoder_input_ids"], 5)
        return b

    kw = dict(base=base, experts=experts, config=CFG, progress=False)
    a, _ = calibrate(merged, calib_data=data, **kw)
    b, _ = calibrate(merged, calib_data={t: [junk(x) for x in bs] for t, bs in data.items()}, **kw)
    _assert_same(a, b)


def test_flan_t5_preset_is_the_papers_setting():
    cfg = FeatCalConfig.flan_t5()
    assert (cfg.lam, cfg.rho, cfg.alpha, cfg.bias, cfg.layernorm) == (1e-5, 2.0, 0.6, True, False)


@pytest.mark.parametrize("roberta", [False, True])
@pytest.mark.filterwarnings("ignore:task .* token rows")
def test_bert_and_roberta_are_found_and_padding_excluded(roberta):
    base, experts, merged, data = tiny.text_zoo(
        lambda seed: tiny.tiny_bert(seed, roberta=roberta), lambda seed: tiny.text_batches(seed=seed)
    )
    got, report = calibrate(merged, base=base, experts=experts, calib_data=data, config=CFG, progress=False)
    assert report.blocks_path == ("roberta" if roberta else "bert") + ".encoder.layer"
    assert {m.kind for m in report.modules} == {"linear", "layernorm"}
    pad = 1 if roberta else 0
    junk = {
        t: [dict(b, input_ids=torch.where(b["attention_mask"] > 0, b["input_ids"], pad + 3)) for b in bs]
        for t, bs in data.items()
    }
    again, _ = calibrate(merged, base=base, experts=experts, calib_data=junk, config=CFG, progress=False)
    _assert_same(got, again)


def test_a_mask_that_does_not_fit_its_input_is_an_error():
    x = torch.zeros(2, 5, 4)
    with pytest.raises(ValueError, match="decoder_attention_mask"):
        token_weights(x, False, 1.0, torch.ones(2, 7), torch.float64)
    w = token_weights(x, False, 1.0, torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]), torch.float64)
    assert w.tolist() == [1, 1, 1, 0, 0, 1, 1, 1, 1, 1]


# ---------------------------------------------------------------------------- norms with a scale and no shift


def test_rms_norms_are_calibrated_behind_the_layernorm_switch():
    """Llama's RMSNorm and T5's LayerNorm (no mean, no bias) are scale targets with
    layernorm=True and left alone with layernorm=False; other norms are named in the report."""
    from torch import nn

    from featcal.model.arch import LAYERNORM, untouched_norms

    for model, block in ((tiny.tiny_llama(), "model.layers"), (tiny.tiny_t5(), "encoder.block")):
        blk = model.get_submodule(block)[0]
        norms = [t for t in block_targets(blk) if t.kind == LAYERNORM]
        assert norms and all(not t.centred for t in norms)
        assert not [t for t in block_targets(blk, layernorm=False) if t.kind == LAYERNORM]
        assert untouched_norms(blk) == []

    class OddNorm(nn.Module):  # a norm featcal knows nothing about
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.weight

    base, experts, merged = tiny.toy_zoo(n_tasks=2)
    for m in (base, merged, *experts.values()):
        m.blocks[0].odd = OddNorm()
    assert untouched_norms(merged.blocks[0]) == ["odd (OddNorm)"]
    data = tiny.toy_data(experts)
    with pytest.warns(UserWarning, match="odd"):
        _, report = calibrate(merged, base=base, experts=experts, calib_data=data, progress=False)
    assert any("odd (OddNorm)" in w for w in report.warnings)


def test_norm_scale_is_the_least_squares_fit():
    """Per channel, the scale update is the ridge least-squares fit of ``gamma z`` to every
    expert's ``gamma_i z`` (``z`` the RMS-normalised input, rows weighted within a task)."""
    from featcal.method import solve
    from featcal.method.reference import layernorm_moments, norm_scale

    gen = torch.Generator().manual_seed(0)
    d, lam, eps = 5, 0.3, 1e-6
    tasks = [
        (torch.randn(12, d, generator=gen, dtype=torch.float64) * (i + 1), torch.rand(12, generator=gen).double() + 0.1)
        for i in range(3)
    ]
    gammas = [torch.randn(d, generator=gen, dtype=torch.float64) for _ in tasks]
    g_anc = torch.linspace(0.5, 1.5, d, dtype=torch.float64)
    es = [layernorm_moments(x, w, eps, centred=False)[0] for x, w in tasks]
    gamma = norm_scale(es, gammas, g_anc, lam, 1e-12)
    torch.testing.assert_close(solve.norm_scale(torch.stack(es), torch.stack(gammas), g_anc, lam, 1e-12), gamma)
    for c in range(d):
        A, y = [], []
        for (x, w), g in zip(tasks, gammas):
            z = (x / (x.square().mean(-1, keepdim=True) + eps).sqrt())[:, c]
            sw = (w / w.sum()).sqrt()
            A.append((sw * z)[:, None])
            y.append(sw * g[c] * z)
        A.append(torch.full((1, 1), lam**0.5, dtype=torch.float64))  # the pull toward the anchor
        y.append(lam**0.5 * g_anc[c : c + 1])
        fit = torch.linalg.lstsq(torch.cat(A), torch.cat(y)[:, None]).solution[0, 0]
        assert torch.allclose(fit, gamma[c], atol=1e-12), c


@pytest.mark.filterwarnings("ignore:task .* token rows")
def test_t5_expert_trace_keeps_both_stacks_apart(t5):
    """An ExpertTrace over the two stacks: the second call reuses it and gives the same model."""
    from featcal import ExpertTrace

    base, experts, merged, data = t5
    kw = dict(base=base, experts=experts, calib_data=data, config=CFG, progress=False)
    plain, _ = calibrate(merged, **kw)
    trace = ExpertTrace()
    calibrate(merged, expert_trace=trace, **kw)
    assert set(trace.streams) == {"encoder.block", "decoder.block"}
    again, _ = calibrate(merged, expert_trace=trace, **kw)
    _assert_same(again, plain)

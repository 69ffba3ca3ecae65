"""A stream moved block by block (featcal.model.streams) is the model's own forward pass: at every
block it equals the hidden states that hooks on the real model's blocks see, per architecture.
The engine, the reference and the drift table all move their streams this way."""

import pytest
import torch

import tiny
from featcal.model.arch import block_kind, resolve_blocks, resolve_stacks
from featcal.model.streams import advance, call_model, catch_block_inputs


def _real_hidden(model, blks, batch):
    """Every block's input (block 0) and output in one real forward pass of ``model``."""
    seen = {}

    def pre(_m, args, kwargs):
        seen.setdefault("in", args[0] if args else next(iter(kwargs.values())))

    def post(i):
        def hook(_m, _a, out):
            seen[i] = out[0] if isinstance(out, (tuple, list)) else out

        return hook

    handles = [blks[0].register_forward_pre_hook(pre, with_kwargs=True)]
    handles += [b.register_forward_hook(post(i)) for i, b in enumerate(blks)]
    try:
        with torch.no_grad():
            call_model(model, batch)
    finally:
        for h in handles:
            h.remove()
    return [seen["in"]] + [seen[i] for i in range(len(blks))]


def _assert_stream_is_forward(model, path, batches):
    blks = resolve_blocks(model, path)[1]
    for batch in batches:
        want = _real_hidden(model, blks, batch)
        call = catch_block_inputs(model, blks[0], batch)
        got = [call.hidden]
        with torch.no_grad():
            for blk in blks:
                call = advance(blk, call)
                got.append(call.hidden)
        for i, (g, w) in enumerate(zip(got, want)):
            err = float((g - w).abs().max() / w.abs().max())
            assert err <= 1e-6, f"{path} block input {i}: relative error {err:.1e}"


def _sequence_first_open_clip():
    """open_clip's ViT with a sequence-first transformer (``(T, B, d)`` streams, as older builds)."""
    from open_clip.transformer import Transformer

    vit = tiny.tiny_open_clip_vit(layers=3)
    torch.manual_seed(1)
    vit.transformer = Transformer(width=32, layers=3, heads=4, mlp_ratio=2.0, batch_first=False).eval()
    assert not vit.transformer.resblocks[0].attn.batch_first
    return vit


def _real_models():
    yield "hf_clip", tiny.tiny_hf_clip(layers=3), None, [torch.randn(2, 3, 16, 16), torch.randn(3, 3, 16, 16)]
    yield "open_clip", tiny.tiny_open_clip_vit(layers=3), None, [torch.randn(2, 3, 16, 16)]
    yield "open_clip sequence-first", _sequence_first_open_clip(), None, [torch.randn(2, 3, 16, 16)]
    for name, roberta in (("bert", False), ("roberta", True)):
        yield name, tiny.tiny_bert(layers=3, roberta=roberta), None, tiny.text_batches()
    for path in ("encoder.block", "decoder.block"):
        yield f"t5 {path}", tiny.tiny_t5(layers=3), path, tiny.t5_batches()
    for side in ("right", "left"):
        yield f"llama {side}", tiny.tiny_llama(layers=3), None, tiny.text_batches(vocab=50, left=side == "left")


CASES = {name: (model, path, batches) for name, model, path, batches in _real_models()}


@pytest.mark.parametrize("name", CASES)
def test_stream_moved_block_by_block_is_the_real_forward(name):
    model, path, batches = CASES[name]
    _assert_stream_is_forward(model, path, batches)


def test_t5_blocks_hand_on_their_position_biases():
    """Without the carried position biases the T5 streams leave the real forward from block 1 on:
    the test above would fail (what featcal did before)."""
    model = tiny.tiny_t5(layers=3)
    assert block_kind(model.encoder.block[0]).carries and block_kind(model.decoder.block[0]).memory_sites
    batch = tiny.t5_batches()[0]
    blks = model.encoder.block
    want = _real_hidden(model, blks, batch)
    call = catch_block_inputs(model, blks[0], batch)
    with torch.no_grad():
        h1 = blks[0](call.hidden, *call.args, **call.kwargs)[0]
        stale = blks[1](h1, *call.args, **call.kwargs)[0]  # block 0's arguments again
    assert float((stale - want[2]).abs().max() / want[2].abs().max()) > 1e-2


def test_encoder_decoder_stacks_in_forward_order():
    model = tiny.tiny_t5()
    assert [p for p, _ in resolve_stacks(model)] == ["encoder.block", "decoder.block"]
    with pytest.raises(ValueError, match="two stacks"):
        resolve_blocks(model)
    bert = tiny.tiny_bert()
    assert resolve_blocks(bert)[0] == "bert.encoder.layer"
    assert resolve_blocks(tiny.tiny_bert(roberta=True))[0] == "roberta.encoder.layer"
    assert resolve_blocks(bert.bert)[0] == "encoder.layer"

"""The drift identity and its squared split on the text architectures: T5 (encoder and
decoder stacks, padded, of different lengths) and padded Llama (right and left)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

import tiny
from diagnostics import drift_table, drift_tokens
from featcal.model.arch import resolve_blocks
from featcal.model.streams import catch_block_inputs

torch.set_num_threads(1)


def _junk(batches, pad_keys):
    """The batches with every padded token id replaced (``pad_keys``: id key -> its mask's key)."""
    out = []
    for b in batches:
        b = dict(b)
        for ids, mask in pad_keys.items():
            b[ids] = torch.where(b[mask] > 0, b[ids], 7)
        out.append(b)
    return out


CASES = {
    "t5 encoder": ("encoder.block", tiny.tiny_t5, tiny.t5_batches, {"input_ids": "attention_mask"}),
    "t5 decoder": (
        "decoder.block",
        tiny.tiny_t5,
        tiny.t5_batches,
        {"input_ids": "attention_mask", "decoder_input_ids": "decoder_attention_mask"},
    ),
    "llama right": (None, tiny.tiny_llama, lambda: tiny.text_batches(vocab=50), {"input_ids": "attention_mask"}),
    "llama left": (
        None,
        tiny.tiny_llama,
        lambda: tiny.text_batches(vocab=50, left=True),
        {"input_ids": "attention_mask"},
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request):
    path, make, data, pads = CASES[request.param]
    model = make(0)
    return path, model, tiny.perturbed(model, 0.05, 1), data(), pads


def test_drift_is_mismatch_plus_propagation_per_token(case):
    path, model, expert, batches, _ = case
    blks, eblks = resolve_blocks(model, path)[1], resolve_blocks(expert, path)[1]
    cm, ce = catch_block_inputs(model, blks[0], batches[0]), catch_block_inputs(expert, eblks[0], batches[0])
    for blk, eblk in zip(blks, eblks):
        dt = drift_tokens(blk, eblk, cm, ce)
        assert dt.e.abs().max() > 1e-4  # a real drift, not a trivial zero
        torch.testing.assert_close(dt.m + dt.p, dt.e, rtol=0, atol=1e-12)
        cm, ce = dt.next_mod, dt.next_exp


def test_squared_drift_splits_exactly_and_padding_is_excluded(case):
    path, model, expert, batches, pads = case
    df = drift_table(model, {"a": expert}, {"a": batches}, blocks=path)
    w = df.pivot_table(index=["task", "block"], columns="metric", values="value")
    split = torch.tensor((w.drift_sq_mismatch + w.drift_sq_propagation).values)
    torch.testing.assert_close(torch.tensor(w.drift_sq.values), split, rtol=1e-9, atol=1e-12)
    # Other token ids in the padding: the table does not move (those rows are out of it, and
    # the masks keep them out of every other row).
    junk = drift_table(model, {"a": expert}, {"a": _junk(batches, pads)}, blocks=path)
    pd.testing.assert_frame_equal(df, junk, rtol=1e-5, atol=1e-7)


def test_cached_streams_give_the_same_table(case):
    """The experts' streams kept by expert_streams and the model's kept while running it
    (streams_while) carry what each block hands on: the same table as computing them."""
    from diagnostics import expert_streams
    from diagnostics.drift import streams_while
    from featcal.model.streams import call_model

    path, model, expert, batches, _ = case
    data = {"a": batches}
    plain = drift_table(model, {"a": expert}, data, blocks=path)
    _, own = streams_while(model, data, call_model, blocks=path)
    cached = drift_table(
        model,
        {"a": expert},
        data,
        blocks=path,
        expert_cache=expert_streams({"a": expert}, data, blocks=path),
        model_cache=own,
    )
    pd.testing.assert_frame_equal(plain, cached, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------- both stacks of T5


@pytest.fixture(scope="module")
def t5():
    model = tiny.tiny_t5(0, layers=2)
    return model, tiny.perturbed(model, 0.05, 1), tiny.t5_batches()


def test_an_encoder_decoder_is_diagnosed_stack_by_stack_in_forward_order(t5):
    """Without blocks=, both stacks: the encoder's blocks 0-1, then the decoder's numbered 2-3
    (as featcal.model.arch.block_names names them), each equal to the table of its stack alone."""
    from featcal.model.arch import block_names

    model, expert, batches = t5
    data = {"a": batches}
    both = drift_table(model, {"a": expert}, data)
    enc = drift_table(model, {"a": expert}, data, blocks="encoder.block")
    dec = drift_table(model, {"a": expert}, data, blocks="decoder.block").assign(block=lambda d: d.block + 2)
    assert block_names(model) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    assert sorted(both.block.unique()) == [0, 1, 2, 3]
    pd.testing.assert_frame_equal(both, pd.concat([enc, dec], ignore_index=True), rtol=1e-6, atol=1e-9)
    assert (both[both.metric == "drift_rel"].value > 0).all()


def test_cached_streams_of_both_stacks_give_the_same_table(t5):
    """The experts' streams of both stacks, and the model's kept while running it whole or its
    encoder alone (the seq2seq zoo's features: the decoder's stream is then run by the table)."""
    from diagnostics import expert_streams
    from diagnostics.drift import streams_while
    from featcal.model.streams import call_model

    model, expert, batches = t5
    data = {"a": batches}
    plain = drift_table(model, {"a": expert}, data)
    cache = expert_streams({"a": expert}, data)
    assert cache.blocks == "encoder.block+decoder.block" and len(cache.calls["a"]) == 3 + 3

    def encoder_only(m, b):
        return m.get_encoder()(input_ids=b["input_ids"], attention_mask=b["attention_mask"])

    for fn, held in ((call_model, "encoder.block+decoder.block"), (encoder_only, "encoder.block")):
        _, own = streams_while(model, data, fn)
        assert own.blocks == held
        cached = drift_table(model, {"a": expert}, data, expert_cache=cache, model_cache=own)
        pd.testing.assert_frame_equal(plain, cached, rtol=1e-6, atol=1e-9)


def test_task_vectors_are_read_per_block_of_both_stacks(t5):
    """Per-block task-vector cosines and weight views number the decoder's blocks after the
    encoder's; block 2 is decoder.block.0, summed here by hand from its parameters."""
    from diagnostics import task_vector_cosine
    from diagnostics.weights import weight_table

    model, expert, _ = t5
    other = tiny.perturbed(model, 0.05, 2)
    tv = task_vector_cosine(other, model, {"a": expert})
    cos = tv[tv.metric == "task_vector_cosine"].set_index("block").value
    assert sorted(cos.index) == [-1, 0, 1, 2, 3]
    sd, sd0, sde = other.state_dict(), model.state_dict(), expert.state_dict()
    names = [n for n in sd0 if n.startswith("decoder.block.0.")]
    tau = torch.cat([(sd[n].double() - sd0[n].double()).reshape(-1) for n in names])
    tau_e = torch.cat([(sde[n].double() - sd0[n].double()).reshape(-1) for n in names])
    assert cos[2] == pytest.approx(float(tau @ tau_e / (tau.norm() * tau_e.norm())), rel=1e-9)
    layers = weight_table(model, {"a": expert, "b": other})
    dec0 = layers[(layers.block == 2) & (layers.task == "a") & (layers.metric == "tau_sq")]
    assert sorted(dec0.layer) == sorted(n[len("decoder.block.0.") :] for n in names)
    assert dec0.value.sum() == pytest.approx(float(tau_e @ tau_e), rel=1e-9)

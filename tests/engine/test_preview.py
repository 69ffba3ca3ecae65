"""The instant preview against exact runs."""

import torch

import tiny
from featcal import FeatCalConfig, calibrate
from featcal.model.arch import block_targets, get_params


def _params(model):
    return {
        (i, t.name): [p.clone() for p in get_params(blk, t) if p is not None]
        for i, blk in enumerate(model.blocks)
        for t in block_targets(blk)
    }


def test_preview_equals_exact_run_for_a_single_block():
    """With one block the features never depend on the hyper-parameters: preview == exact."""
    base, experts, merged = tiny.toy_zoo(n_tasks=3, n_blocks=1)
    data = tiny.toy_data(experts, n=40)
    cfg = FeatCalConfig(lam=0.05, rho=2.0, alpha=0.3, stats_dtype=torch.float64)
    _, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, keep_stats=True, progress=False
    )
    for lam, rho, alpha in [(0.05, 2.0, 0.3), (1.0, 0.5, 0.9), (1e-4, 1.2, 0.0)]:
        exact, _ = calibrate(
            merged,
            base=base,
            experts=experts,
            calib_data=data,
            config=cfg.with_(lam=lam, rho=rho, alpha=alpha),
            progress=False,
        )
        prev = report.preview(lam=lam, rho=rho, alpha=alpha)
        pe, pp = _params(exact), _params(prev)
        for key in pe:
            for a, b in zip(pe[key], pp[key]):
                assert torch.allclose(a, b, atol=1e-5), (lam, rho, alpha, key)


def test_preview_is_a_new_model_and_differs_from_exact_in_deep_models():
    base, experts, merged = tiny.toy_zoo(n_tasks=3, n_blocks=3)
    data = tiny.toy_data(experts, n=40)
    cfg = FeatCalConfig(stats_dtype=torch.float64)
    cal, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, keep_stats=True, progress=False
    )
    snap = tiny.state_snapshot(cal)
    same = report.preview()  # the run's own setting reproduces the run exactly
    assert all(torch.allclose(v, same.state_dict()[k], atol=1e-5) for k, v in snap.items())
    other = report.preview(lam=0.5, alpha=0.8)
    assert other is not cal
    assert all(torch.equal(v, cal.state_dict()[k]) for k, v in snap.items())
    exact, _ = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg.with_(lam=0.5, alpha=0.8), progress=False
    )
    # Block 0 is exact; later blocks differ (the preview keeps the first run's features).
    assert torch.allclose(other.blocks[0].fc1.weight, exact.blocks[0].fc1.weight, atol=1e-5)
    assert not torch.allclose(other.blocks[2].fc1.weight, exact.blocks[2].fc1.weight, atol=1e-5)


def test_preview_needs_kept_stats():
    import pytest

    base, experts, merged = tiny.toy_zoo()
    _, report = calibrate(merged, base=base, experts=experts, calib_data=tiny.toy_data(experts), progress=False)
    with pytest.raises(RuntimeError, match="keep_stats=True"):
        report.preview(lam=1.0)


def test_prepare_on_another_thread_beside_previews_changes_nothing():
    """The app decomposes a run's systems in the background while a preview may already be
    reading them: every previewed parameter is the one a single thread computes."""
    import threading

    base, experts, merged = tiny.toy_zoo(n_tasks=3, n_blocks=3)
    data = tiny.toy_data(experts, n=40)
    cfg = FeatCalConfig(stats_dtype=torch.float64)
    runs = [
        calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, keep_stats=True, progress=False)[1]
        for _ in range(2)
    ]
    at = cfg.with_(lam=0.3, rho=1.5, alpha=0.6).setting
    want = runs[0].preview_state.params(at)
    state = runs[1].preview_state
    assert not state._eig  # nothing decomposed yet
    worker = threading.Thread(target=state.prepare)
    worker.start()
    got = [state.params(at) for _ in range(3)]  # beside the worker, racing it
    worker.join()
    assert len(state._eig) == sum(e.target.kind == "linear" for e in state.entries)
    for params in got:
        for (blk, t, W, b), (blk0, t0, W0, b0) in zip(params, want):
            assert (blk, t.name) == (blk0, t0.name) and torch.allclose(W, W0, atol=1e-10)
            assert (b is None) == (b0 is None) and (b is None or torch.allclose(b, b0, atol=1e-10))


def _kept_run(kind: str):
    """A run with kept statistics on a tiny model with biases (``hf_clip``: q/k/v with biases)
    or a tiny Llama (q/k/v without, grouped-query attention)."""
    from functools import partial

    if kind == "llama":
        base, experts, merged, data = tiny.text_zoo(tiny.tiny_llama, partial(tiny.text_batches, vocab=50))
    else:
        base, experts, merged, data = tiny.zoo(kind)
    cfg = FeatCalConfig(lam=0.1, stats_dtype=torch.float64)
    _, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, keep_stats=True, progress=False
    )
    return report, cfg


def _qkv(preview):
    return {e.target.name: i for i, e in enumerate(preview.entries) if e.block == 0 and e.target.kind == "linear"}


def test_compacting_a_preview_frees_its_statistics_and_gives_the_same_previews():
    """``prepare(compact=True)`` (the app's, on a language model's gigabytes of statistics):
    bit-identical weights and biases, a smaller footprint, and no statistics left to read."""
    for kind in ("hf_clip", "llama"):
        report_a, cfg = _kept_run(kind)
        report_b, _ = _kept_run(kind)
        full, compact = report_a.preview_state, report_b.preview_state
        full.prepare()
        compact.prepare(compact=True)  # the decompositions alone: the statistics and both, before
        assert compact.nbytes() < 0.8 * full.nbytes(), (kind, compact.nbytes(), full.nbytes())
        linears = [e for e in compact.entries if e.target.kind == "linear"]
        assert linears and all(e.system.S is None and e.ends.W_mer is None for e in linears)
        assert any(e.ends.b_mer is not None for e in linears) == (kind == "hf_clip")
        for lam, rho, alpha in [(0.1, 1.0, 0.5), (1e-3, 0.5, 0.15), (3.0, 1.5, 0.9)]:
            at = cfg.with_(lam=lam, rho=rho, alpha=alpha).setting
            for (blk, t, W, b), (blk0, t0, W0, b0) in zip(compact.params(at), full.params(at)):
                assert (blk, t.name) == (blk0, t0.name) and torch.equal(W, W0), (kind, t.name)
                assert (b is None) == (b0 is None) and (b is None or torch.equal(b, b0)), (kind, t.name)


def test_linears_that_read_one_input_share_one_decomposition():
    """q, k and v read one input, so share one S: it is decomposed once, found before any
    compaction lets S go (a tiny Llama, whose k and v are narrower than q)."""
    report, _ = _kept_run("llama")
    preview = report.preview_state
    qkv = _qkv(preview)
    q, k, v, o = (qkv[n] for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"))
    assert preview.entries[q].system.S is preview.entries[k].system.S is preview.entries[v].system.S
    preview.prepare(compact=True)
    assert preview._eig[q].Q is preview._eig[k].Q is preview._eig[v].Q
    assert preview._eig[o].Q is not preview._eig[q].Q
    assert preview._eig[k].QU.shape[1] < preview._eig[q].QU.shape[1]  # grouped-query attention


def test_a_preview_pickles_and_copies_with_its_previews():
    """``featcal tune`` on Ray sends the preview to other processes (pickle); the app copies
    models beside it: its lock stays behind, its previews are the same."""
    import copy
    import pickle

    report, cfg = _kept_run("hf_clip")
    preview = report.preview_state
    preview.prepare(compact=True)
    at = cfg.with_(lam=0.3, alpha=0.6).setting
    for other in (pickle.loads(pickle.dumps(preview)), copy.deepcopy(preview)):
        assert other._lock is not preview._lock
        for (_, _, W, b), (_, _, W0, b0) in zip(other.params(at), preview.params(at)):
            assert torch.equal(W, W0) and (b is None or torch.equal(b, b0))


def test_a_preview_covers_both_stacks_of_an_encoder_decoder():
    """T5: the preview writes the decoder's blocks (numbered after the encoder's) as well as the
    encoder's. At the run's own setting it is the run; at another, the encoder's first block is
    the exact run's (its features do not depend on the setting) and every block of both stacks moved."""
    base, experts, merged, data = tiny.text_zoo(tiny.tiny_t5, lambda seed: tiny.t5_batches(n=6, batch=2, seed=seed))
    cfg = FeatCalConfig.flan_t5(lam=1e-3, stats_dtype=torch.float64)
    cal, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, keep_stats=True, progress=False
    )
    assert report.blocks_path == "encoder.block+decoder.block"
    same = report.preview()
    assert all(torch.allclose(v, same.state_dict()[k], atol=1e-5) for k, v in cal.state_dict().items())
    other = report.preview(lam=0.5, alpha=0.8)
    exact, _ = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg.with_(lam=0.5, alpha=0.8), progress=False
    )
    q = "layer.0.SelfAttention.q.weight"
    first = other.encoder.block[0].get_parameter(q)
    assert torch.allclose(first, exact.encoder.block[0].get_parameter(q), atol=1e-5)
    for stack in ("encoder.block", "decoder.block"):
        for moved, run in zip(other.get_submodule(stack), cal.get_submodule(stack)):
            assert not torch.allclose(moved.get_parameter(q), run.get_parameter(q), atol=1e-6), stack

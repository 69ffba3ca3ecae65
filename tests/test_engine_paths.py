"""The engine's faster paths give the calibration of the plain one: each statistics form,
pooled calls of every task's batches, all tasks reduced as one stack, direct sums of one-batch
tasks, and an expert trace reused from one run to the next (tiny seeded models)."""
import copy

import pytest
import torch

import tiny
from featcal import FeatCalConfig, calibrate

ARCHS = ["toy", "hf_clip", "open_clip"]


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
def test_every_statistics_form_gives_the_same_calibration(kind, monkeypatch):
    """The engine picks P, Q or QQ per module by cost, and sums for one alpha only unless
    the statistics are kept; forcing each gives the same model and the same report (the
    merged residual from the data equals the one from S)."""
    from featcal import solve, stats

    base, experts, merged, data = tiny.zoo(kind)
    runs = {}
    for form in stats.FORMS:
        monkeypatch.setattr(stats, "cheapest_form", lambda *a, _f=form, **k: _f)
        for keep in (True, False):
            runs[form, keep] = calibrate(merged, base=base, experts=experts, calib_data=data,
                                         config=FeatCalConfig.clip(), keep_stats=keep, progress=False)
    ref_model, ref_report = runs["P", True]
    ref = tiny.all_target_params(ref_model)
    for form, (model, report) in runs.items():
        for name, (W, b) in tiny.all_target_params(model).items():
            assert torch.allclose(W, ref[name][0], rtol=1e-4, atol=1e-5), (form, name)
            assert b is None or torch.allclose(b, ref[name][1], rtol=1e-4, atol=1e-5), (form, name)
        for a, b in zip(report.modules, ref_report.modules):
            assert a.residual_before == pytest.approx(b.residual_before, rel=1e-3, abs=1e-6), (form, a.name)
            assert a.residual_after == pytest.approx(b.residual_after, rel=1e-3, abs=1e-6), (form, a.name)
        if report.preview_state is None:
            continue
        seen = [e[2].k_mm is not None for e in report.preview_state.entries if e[1].kind == "linear"]
        assert sum(seen) >= 4, "the report's residual before should come from the merged outputs seen"
        for blk, t, sysm, W_mer, b_mer, _, _ in report.preview_state.entries:
            if t.kind == "linear":
                direct = solve.linear_residual(sysm, W_mer, b_mer, 0.3)       # through S W_mer^T
                rec = next(m for m in report.modules if m.block == blk and m.name == t.name)
                assert rec.residual_before == pytest.approx(direct, rel=1e-3, abs=1e-6), (form, t.name)


@pytest.mark.parametrize("kind", ARCHS)
def test_pooling_the_calibrating_streams_changes_nothing(kind, monkeypatch):
    """Small runs move every task's calibrating batches through a block in one call; the
    model and the report equal those of one call per batch."""
    import featcal.streams as streams

    base, experts, merged, data = tiny.zoo(kind)
    calls = {}
    real = streams.pool_spans
    monkeypatch.setattr("featcal.engine.pool_spans", lambda c, m=None: calls.setdefault(len(c), real(c, m)))
    pooled, rep_pooled = calibrate(merged, base=base, experts=experts, calib_data=data,
                                   config=FeatCalConfig.clip(), progress=False)
    # The toy model's blocks get a tensor keyword argument (which might have a batch dimension): never pooled.
    assert (calls[sum(len(b) for b in data.values())] is not None) == (kind != "toy")
    monkeypatch.setattr(streams, "POOL_ROWS", 0)
    calls.clear()
    single, rep_single = calibrate(merged, base=base, experts=experts, calib_data=data,
                                   config=FeatCalConfig.clip(), progress=False)
    assert all(v is None for v in calls.values())
    tiny.assert_same_calibration(pooled, rep_pooled, single, rep_single)


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
@pytest.mark.parametrize("keep_stats", [False, True])
@pytest.mark.parametrize("form", [None, "P", "Q", "QQ"])
def test_reducing_every_task_as_one_stack_changes_nothing(kind, keep_stats, form, monkeypatch):
    """One batch per task, pooled: every task's statistics are reduced as one stack (CLIP
    preset: token weights in the last block, biases, LayerNorms; each statistics form, or
    the cheapest); the model, the report and the kept statistics (a preview) equal those of
    one task at a time."""
    import featcal.engine as engine
    from featcal import stats

    if form is not None:
        monkeypatch.setattr(stats, "cheapest_form", lambda *a, _f=form, **k: _f)
    base, experts, merged, data = tiny.zoo(kind, n_tasks=3)
    one = {t: [torch.cat(bs)] for t, bs in data.items()}
    taken = []
    real = engine._batchable
    monkeypatch.setattr(engine, "_batchable", lambda *a: taken.append(real(*a)) or taken[-1])
    cfg = FeatCalConfig.clip(alpha=0.4)
    run = lambda: calibrate(merged, base=base, experts=experts, calib_data=one, config=cfg,  # noqa: E731
                            keep_stats=keep_stats, progress=False)
    stack, rep_stack = run()
    assert taken and all(taken)
    monkeypatch.setattr(engine, "BATCH_TASKS_MAX", 0)
    taken.clear()
    each, rep_each = run()
    assert taken and not any(taken)
    tiny.assert_same_calibration(stack, rep_stack, each, rep_each, preview=keep_stats)


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
@pytest.mark.parametrize("keep_stats", [False, True])
@pytest.mark.parametrize("threads", [1, None], ids=["syrk", "torch"])
def test_direct_sums_of_one_batch_tasks_change_nothing(kind, keep_stats, threads, monkeypatch):
    """Tasks of one batch with few rows for their inputs' widths add their rows' Gram matrix
    straight into the systems (BLAS syrk on one thread): the model, the report and a preview
    equal those of the running Gram sums, and a second run (buffers reused) is the same."""
    import featcal.blockstats as blockstats
    import featcal.engine as engine
    from featcal import stats

    base, experts, merged, data = tiny.zoo(kind, n_tasks=3)
    one = {t: [bs[0][:1]] for t, bs in data.items()}        # 5 token rows against widths 32, 64, 96
    monkeypatch.setattr(engine, "BATCH_TASKS_MAX", 0)       # task by task
    direct = []
    real = stats.add_rows_gram
    monkeypatch.setattr(stats, "add_rows_gram", lambda *a: direct.append(a[0].shape) or real(*a))
    monkeypatch.setattr("featcal.solve.add_rows_gram", stats.add_rows_gram)
    cfg = FeatCalConfig.clip(alpha=0.4)
    old = torch.get_num_threads()
    torch.set_num_threads(threads or max(old, 2))
    try:
        run = lambda: calibrate(merged, base=base, experts=experts, calib_data=one, config=cfg,  # noqa: E731
                                keep_stats=keep_stats, progress=False)
        got, rep_got = run()
        assert direct and (stats._blas("syrk", torch.zeros(1)) is not None) == (threads == 1)
        again, rep_again = run()
        tiny.assert_same_calibration(again, rep_again, got, rep_got)
        monkeypatch.setattr(blockstats, "DIRECT_ROWS", 0.0)
        direct.clear()
        want, rep_want = run()
    finally:
        torch.set_num_threads(old)
    assert not direct
    tiny.assert_same_calibration(got, rep_got, want, rep_want, preview=keep_stats)


def test_pool_spans_only_for_calls_that_can_run_as_one():
    from featcal.streams import BlockCall, pool_spans

    h = torch.zeros(4, 5, 8)
    plain = [BlockCall(h), BlockCall(h[:3])]
    assert pool_spans(plain) == [(0, 4), (4, 7)]
    assert pool_spans(plain[:1]) is None                                   # nothing to pool
    assert pool_spans(plain, max_rows=34) is None                          # 35 rows in all
    assert pool_spans([BlockCall(h), BlockCall(torch.zeros(4, 6, 8))]) is None       # token counts differ
    assert pool_spans([BlockCall(h, mask=torch.ones(4, 5)), BlockCall(h)]) is None   # padding
    pos = torch.zeros(1, 5, 8)
    assert pool_spans([BlockCall(h, kwargs={"pos": pos}), BlockCall(h, kwargs={"pos": pos})]) is None
    assert pool_spans([BlockCall(h, kwargs={"flag": True}), BlockCall(h, kwargs={"flag": False})]) is None
    assert pool_spans([BlockCall(h, kwargs={"flag": None}), BlockCall(h, kwargs={"flag": None})]) == [(0, 4), (4, 8)]
    import numpy as np
    arr = np.zeros((4, 5))
    assert pool_spans([BlockCall(h, kwargs={"a": arr}), BlockCall(h, kwargs={"a": arr})]) is None   # an array
    assert pool_spans([BlockCall(h, args=([1],)), BlockCall(h, args=([2],))]) is None

    class Odd:
        def __eq__(self, other):
            raise TypeError("no comparison")
    assert pool_spans([BlockCall(h, args=(Odd(),)), BlockCall(h, args=(Odd(),))]) is None


@pytest.mark.parametrize("kind, per_task_batches", [("toy", 3), ("hf_clip", 3), ("hf_clip", 1), ("open_clip", 1)])
def test_an_expert_trace_reruns_no_expert_block_and_changes_nothing(kind, per_task_batches):
    """Repeated calibrations of one zoo (another merged model, other hyper-parameters) with an
    ExpertTrace: the second run calls no expert block or stem and gives the very same model
    as a run without it; other expert objects clear the trace."""
    from featcal import ExpertTrace

    base, experts, merged, data = tiny.zoo(kind, n=4 * per_task_batches)
    other = tiny.perturbed(merged, 0.02, 99)
    calls = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for e in experts.values()
               for m in e.modules()]
    trace = ExpertTrace()
    cfg = FeatCalConfig.clip(lam=0.1, rho=1.5, alpha=0.4)
    try:
        calibrate(merged, base=base, experts=experts, calib_data=data, config=FeatCalConfig.clip(),
                  progress=False, expert_trace=trace)
        assert calls
        calls.clear()
        got, rep = calibrate(other, base=base, experts=experts, calib_data=data, config=cfg, progress=False,
                             expert_trace=trace)
        assert calls == []                                  # nothing of the experts ran again
    finally:
        for h in handles:
            h.remove()
    want, rep_want = calibrate(other, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    ref = tiny.all_target_params(want)
    for name, (W, b) in tiny.all_target_params(got).items():
        assert torch.equal(W, ref[name][0]), name
        assert b is None or torch.equal(b, ref[name][1]), name
    assert [m.residual_after for m in rep.modules] == [m.residual_after for m in rep_want.modules]
    copies = {t: copy.deepcopy(e) for t, e in experts.items()}
    assert trace.bind(copies, data, list(copies), trace._key[0]).steps == {} and not trace.stacked

"""The engine's faster paths give the calibration of the plain one: each statistics form,
pooled calls of every task's batches, all tasks reduced as one stack, direct sums of one-batch
tasks, LAPACK's in-place Cholesky and triangular Gram sums, and an expert trace reused from one
run to the next (tiny seeded models). Each path is switched by the ``FastPaths`` passed in."""

import copy

import pytest
import torch

import tiny
from featcal import FastPaths, FeatCalConfig, calibrate

ARCHS = ["toy", "hf_clip", "open_clip"]


def _calibrate(merged, base, experts, data, cfg, fast, keep_stats=False):
    """``calibrate`` along the fast paths ``fast`` (the tests run it twice, with one path off)."""
    return calibrate(
        merged,
        base=base,
        experts=experts,
        calib_data=data,
        config=cfg,
        keep_stats=keep_stats,
        progress=False,
        fast=fast,
    )


def _assert_same_calibration(got, rep, want, rep_want) -> None:
    """Bit-equal calibrated parameters and residuals."""
    ref = tiny.all_target_params(want)
    for name, (W, b) in tiny.all_target_params(got).items():
        assert torch.equal(W, ref[name][0]), name
        assert b is None or torch.equal(b, ref[name][1]), name
    assert [m.residual_after for m in rep.modules] == [m.residual_after for m in rep_want.modules]


def _one_batch_a_task(data):
    return {t: [torch.cat(bs)] for t, bs in data.items()}


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
def test_every_statistics_form_gives_the_same_calibration(kind):
    """The engine picks P, PW or PW+CW per module by cost, and sums for one alpha only unless
    the statistics are kept; forcing each gives the same model and the same report (the
    merged residual from the data equals the one from S)."""
    from featcal.method import solve, stats

    base, experts, merged, data = tiny.zoo(kind)
    runs = {}
    for form in stats.FORMS:
        for keep in (True, False):
            runs[form, keep] = calibrate(
                merged,
                base=base,
                experts=experts,
                calib_data=data,
                config=FeatCalConfig.clip(),
                keep_stats=keep,
                progress=False,
                fast=FastPaths(form=form),
            )
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
        entries = report.preview_state.entries
        seen = [e.system.res.k_mm is not None for e in entries if e.target.kind == "linear"]
        assert sum(seen) >= 4, "the report's residual before should come from the merged outputs seen"
        for e in entries:
            if e.target.kind == "linear":
                direct = solve.linear_residual(e.system, e.ends.W_mer, e.ends.b_mer, 0.3)  # through S W_mer^T
                rec = next(m for m in report.modules if m.block == e.block and m.name == e.target.name)
                assert rec.residual_before == pytest.approx(direct, rel=1e-3, abs=1e-6), (form, e.target.name)


@pytest.mark.parametrize("kind", ARCHS)
def test_pooling_the_calibrating_streams_changes_nothing(kind, monkeypatch):
    """Small runs move every task's calibrating batches through a block in one call; the
    model and the report equal those of one call per batch."""
    import featcal.model.streams as streams

    base, experts, merged, data = tiny.zoo(kind)
    calls = {}
    real = streams.pool_spans
    monkeypatch.setattr("featcal.engine.snapshot.pool_spans", lambda c, m: calls.setdefault(len(c), real(c, m)))

    def run(fast):
        return _calibrate(merged, base, experts, data, FeatCalConfig.clip(), fast)

    pooled, rep_pooled = run(FastPaths())
    # The toy model's blocks get a tensor keyword argument (which might have a batch dimension): never pooled.
    assert (calls[sum(len(b) for b in data.values())] is not None) == (kind != "toy")
    calls.clear()
    single, rep_single = run(FastPaths(pool_rows=0))
    assert calls and all(v is None for v in calls.values())
    tiny.assert_same_calibration(pooled, rep_pooled, single, rep_single)


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
@pytest.mark.parametrize("keep_stats", [False, True])
@pytest.mark.parametrize("form", [None, "P", "PW", "PW+CW"])
def test_reducing_every_task_as_one_stack_changes_nothing(kind, keep_stats, form, monkeypatch):
    """One batch per task, pooled: every task's statistics are reduced as one stack (CLIP
    preset: token weights in the last block, biases, LayerNorms; each statistics form, or
    the cheapest); the model, the report and the kept statistics (a preview) equal those of
    one task at a time."""
    import featcal.engine.snapshot as snapshot

    base, experts, merged, data = tiny.zoo(kind, n_tasks=3)
    one = _one_batch_a_task(data)
    taken = []
    real = snapshot._batchable
    monkeypatch.setattr(snapshot, "_batchable", lambda *a: taken.append(real(*a)) or taken[-1])
    cfg = FeatCalConfig.clip(alpha=0.4)

    def run(fast):
        return _calibrate(merged, base, experts, one, cfg, fast, keep_stats)

    stack, rep_stack = run(FastPaths(form=form))
    assert taken and all(taken)
    taken.clear()
    each, rep_each = run(FastPaths(form=form, stack_max=0))
    assert taken and not any(taken)
    tiny.assert_same_calibration(stack, rep_stack, each, rep_each, preview=keep_stats)


@pytest.mark.parametrize("kind", ["hf_clip", "open_clip"])
@pytest.mark.parametrize("keep_stats", [False, True])
@pytest.mark.parametrize("threads", [1, None], ids=["syrk", "torch"])
def test_direct_sums_of_one_batch_tasks_change_nothing(kind, keep_stats, threads, monkeypatch):
    """Tasks of one batch with few rows for their inputs' widths add their rows' Gram matrix
    straight into the systems (BLAS syrk on one thread): the model, the report and a preview
    equal those of the running Gram sums, and a second run (buffers reused) is the same."""
    from featcal.method import linalg

    base, experts, merged, data = tiny.zoo(kind, n_tasks=3)
    one = {t: [bs[0][:1]] for t, bs in data.items()}  # 5 token rows against widths 32, 64, 96
    direct = []
    real = linalg.add_rows_gram
    monkeypatch.setattr(linalg, "add_rows_gram", lambda *a: direct.append(a[0].shape) or real(*a))
    monkeypatch.setattr("featcal.method.solve.add_rows_gram", linalg.add_rows_gram)
    cfg = FeatCalConfig.clip(alpha=0.4)

    def run(fast):
        return _calibrate(merged, base, experts, one, cfg, fast, keep_stats)

    old = torch.get_num_threads()
    torch.set_num_threads(threads or max(old, 2))
    try:
        got, rep_got = run(FastPaths(stack_max=0))  # task by task
        assert direct and (linalg._blas("syrk", torch.zeros(1)) is not None) == (threads == 1)
        again, rep_again = run(FastPaths(stack_max=0))
        tiny.assert_same_calibration(again, rep_again, got, rep_got)
        direct.clear()
        want, rep_want = run(FastPaths(stack_max=0, direct_rows=0))
    finally:
        torch.set_num_threads(old)
    assert not direct
    tiny.assert_same_calibration(got, rep_got, want, rep_want, preview=keep_stats)


# Every fast path taken wherever it applies, even at the tiny widths (32, 64, 96) of these models:
# LAPACK from width 1, Gram triangles of 8-column blocks; with and without the stack (direct sums
# need a task reduced on its own).
EAGER = {
    "default": FastPaths(),
    "eager": FastPaths(lapack_min_d=1, gram_block=8),
    "eager, task by task": FastPaths(stack_max=0, direct_rows=100.0, lapack_min_d=1, gram_block=8),
}


@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("one_batch", [False, True], ids=["batches", "one batch"])
@pytest.mark.parametrize("paths", list(EAGER))
def test_the_plainest_path_gives_the_calibration_of_the_fast_ones(kind, one_batch, paths):
    """``FastPaths.plainest()`` (one call per batch, task by task, full Gram sums, the shared
    ``P``, torch's Cholesky, nothing kept) against the default and eager fast paths: the same
    model, report and preview."""
    base, experts, merged, data = tiny.zoo(kind, n_tasks=3)
    data = _one_batch_a_task(data) if one_batch else data

    def run(fast):
        return calibrate(
            merged,
            base=base,
            experts=experts,
            calib_data=data,
            config=FeatCalConfig.clip(alpha=0.4),
            keep_stats=True,
            progress=False,
            fast=fast,
        )

    fast, rep_fast = run(EAGER[paths])
    plain, rep_plain = run(FastPaths.plainest())
    tiny.assert_same_calibration(fast, rep_fast, plain, rep_plain, preview=True)


@pytest.mark.parametrize(
    "field, bad, said",
    [
        ("pool_rows", -1, "integer >= 0"),
        ("stack_max", 2.5, "integer >= 0"),
        ("scratch_keep", True, "integer"),
        ("lapack_min_d", 0, "integer >= 1"),
        ("gram_block", -384, "integer >= 1"),
        ("direct_rows", -0.5, "finite number >= 0"),
        ("direct_rows", float("nan"), "finite number"),
        ("direct_rows", float("inf"), "finite number"),
        ("form", "R", "one of"),
    ],
)
def test_fast_paths_reject_invalid_values_by_name(field, bad, said):
    with pytest.raises(ValueError, match=f"FastPaths.{field} must be .*{said}"):
        FastPaths(**{field: bad})


def test_calibrate_rejects_fast_paths_of_another_type():
    base, experts, merged, data = tiny.zoo("toy")
    with pytest.raises(TypeError, match="fast must be a featcal.FastPaths"):
        calibrate(merged, base=base, experts=experts, calib_data=data, progress=False, fast={"pool_rows": 0})


def test_pool_spans_only_for_calls_that_can_run_as_one():
    from featcal.model.streams import BlockCall, pool_spans

    h = torch.zeros(4, 5, 8)
    plain = [BlockCall(h), BlockCall(h[:3])]
    assert pool_spans(plain) == [(0, 4), (4, 7)]  # 35 rows: under the default
    assert pool_spans(plain[:1]) is None  # nothing to pool
    assert pool_spans(plain, max_rows=34) is None  # 35 rows in all
    assert pool_spans([BlockCall(h), BlockCall(torch.zeros(4, 6, 8))]) is None  # token counts differ
    assert pool_spans([BlockCall(h, mask=torch.ones(4, 5)), BlockCall(h)]) is None  # padding
    pos = torch.zeros(1, 5, 8)
    assert pool_spans([BlockCall(h, kwargs={"pos": pos}), BlockCall(h, kwargs={"pos": pos})]) is None
    assert pool_spans([BlockCall(h, kwargs={"flag": True}), BlockCall(h, kwargs={"flag": False})]) is None
    assert pool_spans([BlockCall(h, kwargs={"flag": None}), BlockCall(h, kwargs={"flag": None})]) == [(0, 4), (4, 8)]
    import numpy as np

    arr = np.zeros((4, 5))
    assert pool_spans([BlockCall(h, kwargs={"a": arr}), BlockCall(h, kwargs={"a": arr})]) is None  # an array
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
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for e in experts.values() for m in e.modules()]
    trace = ExpertTrace()
    cfg = FeatCalConfig.clip(lam=0.1, rho=1.5, alpha=0.4)
    try:
        calibrate(
            merged,
            base=base,
            experts=experts,
            calib_data=data,
            config=FeatCalConfig.clip(),
            progress=False,
            expert_trace=trace,
        )
        assert calls
        calls.clear()
        got, rep = calibrate(
            other, base=base, experts=experts, calib_data=data, config=cfg, progress=False, expert_trace=trace
        )
        assert calls == []  # nothing of the experts ran again
    finally:
        for h in handles:
            h.remove()
    want, rep_want = calibrate(other, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    _assert_same_calibration(got, rep, want, rep_want)
    copies = {t: copy.deepcopy(e) for t, e in experts.items()}
    cleared = trace.bind(copies, data, list(copies), trace._key[0])
    assert not cleared.captures and not cleared.streams and not cleared.stacked


@pytest.mark.parametrize("kind", ["toy", "hf_clip"])
def test_an_expert_trace_within_max_bytes_keeps_the_first_blocks_and_changes_nothing(kind):
    """An ExpertTrace with ``max_bytes`` keeps the first blocks' expert work that fits; the next
    run runs the experts' later blocks only (from the kept stream) and gives the very same model
    as a run without a trace."""
    from featcal import ExpertTrace
    from featcal.model.arch import resolve_blocks

    base, experts, merged, data = tiny.zoo(kind, n=4)
    other = tiny.perturbed(merged, 0.02, 99)
    cfg = FeatCalConfig.clip(lam=0.1, rho=1.5, alpha=0.4)
    full = ExpertTrace()
    calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, expert_trace=full)
    trace = ExpertTrace(max_bytes=full.nbytes - 1)  # all but the last block
    calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, expert_trace=trace)
    assert 0 < trace.nbytes < full.nbytes
    blocks_kept = lambda t: len(t.captures) + len(t.stacked)  # noqa: E731 (task by task, or stacked)
    assert 0 < blocks_kept(trace) < blocks_kept(full)
    calls = []
    blocks = [b for e in experts.values() for b in resolve_blocks(e)[1]]
    handles = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in blocks]
    try:
        got, rep = calibrate(
            other, base=base, experts=experts, calib_data=data, config=cfg, progress=False, expert_trace=trace
        )
        traced, calls[:] = len(calls), []
        want, rep_want = calibrate(other, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    finally:
        for h in handles:
            h.remove()
    assert 0 < traced < len(calls)  # the experts' later blocks only
    _assert_same_calibration(got, rep, want, rep_want)


@pytest.mark.parametrize("kind", ["toy", "hf_clip"])
def test_on_block_reports_each_block_and_stops_a_run_cleanly(kind):
    """``on_block`` hears every block in order with the count done; an exception from it stops
    the run between two blocks, leaves ``merged`` as it was, and the expert trace it half
    filled gives the next run the very same model as a run without a trace."""
    from featcal import ExpertTrace
    from featcal.model.arch import resolve_blocks

    base, experts, merged, data = tiny.zoo(kind, n=4)
    n_blocks = len(resolve_blocks(merged)[1])
    cfg = FeatCalConfig.clip(lam=0.1, rho=1.5, alpha=0.4)
    heard = []
    calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False,
        on_block=lambda block, info: heard.append((block, info["done"], info["blocks"], info["seconds"] >= 0)),
    )  # fmt: skip
    assert heard == [(b, b + 1, n_blocks, True) for b in range(n_blocks)]

    class Stop(Exception):
        pass

    def stop_after_first(block, info):
        if info["done"] == 1:
            raise Stop

    before = copy.deepcopy(merged.state_dict())
    trace = ExpertTrace()
    with pytest.raises(Stop):
        calibrate(
            merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False,
            expert_trace=trace, on_block=stop_after_first,
        )  # fmt: skip
    assert all(torch.equal(v, before[k]) for k, v in merged.state_dict().items())
    assert 0 < trace.nbytes
    got, rep = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, expert_trace=trace
    )
    want, rep_want = calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    _assert_same_calibration(got, rep, want, rep_want)


def test_an_expert_trace_takes_dict_batches():
    """Dict batches (``model(**batch)``, as text zoos give) cannot be weakly referenced; the
    trace holds them and still reruns no expert block, with the same result."""
    from featcal import ExpertTrace

    base, experts, merged, data = tiny.zoo("hf_clip", n=8)
    data = {t: [{"pixel_values": x} for x in batches] for t, batches in data.items()}
    calls = []
    handles = [m.register_forward_pre_hook(lambda *_: calls.append(1)) for e in experts.values() for m in e.modules()]
    trace = ExpertTrace()
    try:
        calibrate(merged, base=base, experts=experts, calib_data=data, progress=False, expert_trace=trace)
        calls.clear()
        got, _ = calibrate(merged, base=base, experts=experts, calib_data=data, progress=False, expert_trace=trace)
        assert calls == []
    finally:
        for h in handles:
            h.remove()
    want, _ = calibrate(merged, base=base, experts=experts, calib_data=data, progress=False)
    ref = tiny.all_target_params(want)
    for name, (W, _b) in tiny.all_target_params(got).items():
        assert torch.equal(W, ref[name][0]), name

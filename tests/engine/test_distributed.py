"""Data-parallel calibration (featcal.engine.distributed): 2 and 3 gloo processes on the CPU give
the single process's model, in memory and streamed (resumed on another number of ranks), with
uneven shares (ranks holding no batch of a task); mismatched inputs are refused before any work;
a rank that dies makes the others exit with the message.

Both sides run each batch as its own forward call (``pool_rows=0``), so that the float32 forward
passes are the same calls and only the order of the statistics' sums differs: 1e-6 with float64
statistics, 1e-5 with float32 ones, relative to each tensor's largest entry. With float32
statistics the last block's LayerNorm biases (token-weighted, a 2x2 solve with cancellation) move
by up to 5e-5 between a float32 and a float64 single process; there the ranks' result must be within
twice the single process's float32 distance of the float64 one (both are float32 roundings of
the same sums in other orders: which of the two lands nearer is a coin toss, seen both ways). The default fast
paths (calls pooled differently) are held to 1e-4.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import distrib
import pytest
import torch

import tiny
from featcal import FastPaths, FeatCalConfig, StreamOptions, calibrate, calibrate_checkpoints
from featcal.engine import distributed
from featcal.model.checkpoints import load_token_data, save_token_data

POOL_OFF = FastPaths(pool_rows=0)


def _cases() -> dict:
    """name -> (zoo, config, fast paths, tolerance): tiny HF CLIP with the CLIP preset's token
    weights (4 batches a task: 4/4 on 2 ranks, 2/3/3 on 3), T5 (both stacks in one call) and a
    padded Llama (3 batches a task)."""
    clip = tiny.zoo("hf_clip", n=14)
    t5 = tiny.text_zoo(tiny.tiny_t5, lambda seed: tiny.t5_batches(n=6, batch=2, seed=seed))
    llama = tiny.text_zoo(tiny.tiny_llama, lambda seed: tiny.text_batches(n=6, batch=2, vocab=50, seed=seed))
    f64 = torch.float64
    return {
        "clip64": (clip, FeatCalConfig.clip(stats_dtype=f64), POOL_OFF, 1e-6),
        "clip32": (clip, FeatCalConfig.clip(), POOL_OFF, 1e-5),
        "clip_fast": (clip, FeatCalConfig.clip(stats_dtype=f64), FastPaths(), 1e-4),
        # keep_stats: every rank keeps every system; a preview of another setting from them
        "clip_preview": (clip, FeatCalConfig.clip(stats_dtype=f64), POOL_OFF, 1e-6),
        "t5": (t5, FeatCalConfig.flan_t5(lam=1e-3, stats_dtype=f64), POOL_OFF, 1e-6),
        "llama": (llama, FeatCalConfig.llama("3b", lam=1e-3, stats_dtype=f64), POOL_OFF, 1e-6),
    }


def _run(case, preview: bool = False) -> tuple[dict, list]:
    (base, experts, merged, data), cfg, fast, _ = case
    model, report = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=cfg, fast=fast, progress=False, keep_stats=preview
    )
    if preview:
        model = report.preview(lam=0.5, rho=1.5, alpha=0.7)
    rows = [[m.block, m.name, m.rows, m.residual_before, m.residual_after] for m in report.modules]
    return {k: v.clone() for k, v in model.state_dict().items()}, rows


def _all_cases() -> dict:
    out = {name: _run(case, preview=name.endswith("preview")) for name, case in _cases().items()}
    from diagnostics import drift_table

    base, experts, merged, data = _cases()["clip64"][0]
    table = drift_table(merged, experts, data)  # (its sums added across the ranks the same way)
    out["drift"] = (
        {"values": torch.tensor(table["value"].to_numpy())},
        table[["task", "block", "metric"]].values.tolist(),
    )
    return out


def _in_memory_worker(rank: int) -> dict:
    return _all_cases()


def _max_rel(got: dict, want: dict) -> float:
    return max(
        (
            float((got[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30))
            for k, w in want.items()
            if w.is_floating_point() and w.numel()
        ),
        default=0.0,
    )


@pytest.fixture(scope="module")
def single():
    torch.set_num_threads(1)
    return _all_cases()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_give_the_single_process_model(single, world, tmp_path):
    results = distrib.run_ranks(world, _in_memory_worker, tmp=tmp_path)
    cases = _cases()
    for rank, res in enumerate(results):  # drift_table: every rank holds the whole table
        assert res["drift"][1] == single["drift"][1]
        assert torch.allclose(res["drift"][0]["values"], single["drift"][0]["values"], rtol=1e-5, atol=1e-7), rank
    for name, (want, want_rows) in single.items():
        if name == "drift":
            continue
        merged = cases[name][0][2].state_dict()
        tol = cases[name][3]
        assert _max_rel(want, merged) > 1e-3, name  # the calibration moved the weights
        exact = single["clip64"][0] if name == "clip32" else None  # float32 statistics: their own rounding
        for rank, res in enumerate(results):
            got, rows = res[name]
            for k, w in want.items():
                err = _max_rel({k: got[k]}, {k: w})
                ok = err <= tol or (
                    exact is not None
                    and _max_rel({k: got[k]}, {k: exact[k]}) <= max(2 * _max_rel({k: w}, {k: exact[k]}), tol)
                )
                assert ok, (name, rank, k, err)
            assert [r[:3] for r in rows] == [r[:3] for r in want_rows]  # every module, all tasks' rows
            for a, b in zip(rows, want_rows):
                assert a[3] == pytest.approx(b[3], rel=1e-4, abs=1e-7) and a[4] == pytest.approx(
                    b[4], rel=1e-3, abs=1e-6
                )


def test_shares_are_contiguous_runs_of_all_batches():
    counts = {"a": 4, "b": 1, "c": 3}
    shares = [distributed.share(counts, r, 3) for r in range(3)]
    assert shares == [
        {"a": [0, 1], "b": [], "c": []},
        {"a": [2, 3], "b": [0], "c": []},
        {"a": [], "b": [], "c": [0, 1, 2]},
    ]
    assert distributed.share({"a": 1}, 1, 2) == {"a": [0]} and distributed.share({"a": 1}, 0, 2) == {"a": []}


# ---------------------------------------------------------------------------- streamed, resumed


def _llama_dirs(root):
    base, experts, merged, data = tiny.text_zoo(
        tiny.tiny_llama, lambda seed: tiny.text_batches(n=5, batch=5, vocab=50, seed=seed), n_tasks=3
    )
    base.save_pretrained(root / "base")
    for t, m in experts.items():
        m.save_pretrained(root / t)
    save_token_data(root / "data.safetensors", {t: d[0] for t, d in data.items()})
    return base, experts, merged


STREAM_CFG = FeatCalConfig.llama("3b", lam=1e-3, stats_dtype=torch.float64)


def _stream_worker(rank: int, root: str, out: str, stop_at: int | None) -> list:
    from pathlib import Path

    root = Path(root)

    def stop(block, info):
        if block == stop_at:
            raise KeyboardInterrupt("stopped")

    experts = {t: root / t for t in ("t0", "t1", "t2")}
    kw = dict(calib_data=load_token_data(root / "data.safetensors", batch_size=2), config=STREAM_CFG)
    try:
        report = calibrate_checkpoints(
            root / "base",
            experts,
            merge="task_arithmetic",
            out=out,
            options=StreamOptions(resume=True, on_block=stop, progress=False, fast=POOL_OFF),
            **kw,
        )
    except KeyboardInterrupt:
        return []
    return [m.name for m in report.modules]


@pytest.mark.slow
def test_streamed_run_resumes_on_another_number_of_ranks(tmp_path):
    """3 ranks stop after block 0 (3 batches a task: 3/3/3 of 9); 2 ranks resume it (4/5) to the
    single process's model."""
    from transformers import LlamaForCausalLM

    base, experts, merged = _llama_dirs(tmp_path)
    out = tmp_path / "out"
    distrib.run_ranks(3, _stream_worker, str(tmp_path), str(out), 0, tmp=tmp_path / "a")
    assert not out.exists() and any((tmp_path / ".out.featcal-partial").glob("streams-*-of-3.safetensors"))
    names = distrib.run_ranks(2, _stream_worker, str(tmp_path), str(out), None, tmp=tmp_path / "b")
    data = load_token_data(tmp_path / "data.safetensors", batch_size=2)
    import copy

    from featcal import merge

    merged = copy.deepcopy(base)
    merged.load_state_dict(merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}))
    want, _ = calibrate(
        merged, base=base, experts=experts, calib_data=data, config=STREAM_CFG, fast=POOL_OFF, progress=False
    )
    got = LlamaForCausalLM.from_pretrained(out).state_dict()
    want = {k: v for k, v in want.state_dict().items() if k in got}
    assert _max_rel(got, want) <= 1e-6
    assert _max_rel(want, merged.state_dict()) > 1e-3
    assert names[0] == names[1] and len(names[0]) == 2 * 7  # the report: every block's modules, on each rank


def _swapped_worker(rank: int, root: str, out: str) -> str:
    """Rank 1 is given experts t0 and t1 swapped (the same files, under each other's task)."""
    from pathlib import Path

    root = Path(root)
    names = {"t0": "t1", "t1": "t0", "t2": "t2"} if rank == 1 else {t: t for t in ("t0", "t1", "t2")}
    try:
        calibrate_checkpoints(
            root / "base",
            {t: root / d for t, d in names.items()},
            merge="task_arithmetic",
            out=out,
            calib_data=load_token_data(root / "data.safetensors", batch_size=2),
            config=STREAM_CFG,
            options=StreamOptions(progress=False),
        )
    except ValueError as err:
        return str(err)
    return ""


@pytest.mark.slow
def test_streamed_ranks_given_swapped_experts_refuse_before_any_work(tmp_path):
    """The ranks compare the checkpoints' contents, not their skeletons: a rank given the experts
    of two tasks swapped makes every rank refuse, naming them, and nothing is written."""
    _llama_dirs(tmp_path)
    out = tmp_path / "out"
    errors = distrib.run_ranks(2, _swapped_worker, str(tmp_path), str(out), tmp=tmp_path / "ranks")
    for err in errors:
        assert "differ on rank(s) [1]" in err, errors
        assert "expert 't0' (weights)" in err and "expert 't1' (weights)" in err and "'t2'" not in err
    assert errors[0] == errors[1]
    assert not out.exists() and not (tmp_path / ".out.featcal-partial").exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


# ---------------------------------------------------------------------------- faults


def _fault_worker(rank: int) -> dict:
    (base, experts, merged, data), cfg, fast, _ = _cases()["clip32"]
    out = {}
    try:  # rank 1 asks for another lam: refused on every rank before any work
        calibrate(
            merged,
            base=base,
            experts=experts,
            calib_data=data,
            config=cfg.with_(lam=0.5 if rank else 0.05),
            progress=False,
        )
    except ValueError as err:
        out["mismatch"] = str(err)
    t0 = time.monotonic()
    try:  # rank 1 dies at block 1; the others must fail at their next collective, with the message
        from featcal.engine import dist_systems

        if rank == 1:
            real = dist_systems.DistBlockSystems.finish

            def die(self):
                if self.block == 1:
                    os._exit(3)
                return real(self)

            dist_systems.DistBlockSystems.finish = die
        calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    except distributed.DistributedError as err:
        out["died"] = str(err)
    out["seconds"] = time.monotonic() - t0
    return out


@pytest.mark.slow
def test_mismatched_inputs_are_refused_and_a_dead_rank_stops_the_others(tmp_path):
    results, errors, codes = distrib.run_ranks(2, _fault_worker, tmp=tmp_path, check=False)
    assert codes[1] == 3 and codes[0] == 0, (codes, errors)
    res = results[0]
    assert "config differ on rank(s) [1]" in res["mismatch"]
    assert "another rank stopped or hangs" in res["died"] and "block 1" in res["died"]
    assert res["seconds"] < distrib.COLLECTIVE_TIMEOUT_S / 3  # a dead peer is seen at once, not after the timeout


HANG_S = 600  # how long rank 1 hangs at most: until rank 0 has given up on it


def _hang_worker(rank: int, tmp: str) -> dict:
    (base, experts, merged, data), cfg, fast, _ = _cases()["clip32"]
    from featcal.engine import dist_systems

    if rank == 1:  # rank 1 hangs at block 1 for longer than the process group's timeout
        real = dist_systems.DistBlockSystems.finish

        def hang(self):
            if self.block == 1:
                given_up = Path(tmp) / "rank0.pt"  # rank 0's result, written once it has stopped
                deadline = time.monotonic() + HANG_S
                while not given_up.exists() and time.monotonic() < deadline:
                    time.sleep(0.2)
            return real(self)

        dist_systems.DistBlockSystems.finish = hang
    t0 = time.monotonic()
    out = {}
    try:
        calibrate(merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False)
    except distributed.DistributedError as err:
        out["error"] = str(err)
    out["seconds"] = time.monotonic() - t0
    return out


@pytest.mark.slow
def test_a_hung_rank_stops_the_others_after_the_timeout(tmp_path):
    results, errors, codes = distrib.run_ranks(2, _hang_worker, str(tmp_path), tmp=tmp_path, timeout_s=6, check=False)
    res = results[0]
    assert res is not None and "another rank stopped or hangs" in res.get("error", ""), (codes, errors)
    assert res["seconds"] < HANG_S  # the 6 s timeout stopped it, not the end of rank 1's hang

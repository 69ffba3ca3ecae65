"""Everything to check the first time a GPU is lent, in one command: one markdown table, one JSON.

Parts, in this order (each guarded: a part that fails prints its error in its row and the others
still run; the exit status is 1 when an exactness or official row is over its tolerance or failed):

1. ``exactness``: every architecture featcal calibrates (tiny HF CLIP, open_clip ViT, T5, BERT,
   Llama with left padding; the builders of tests/tiny.py), float32 and bfloat16 models, float64
   statistics, calibrated on ``--device`` (the models there; for float32 also the models on the CPU
   and one block of each on the device at a time, ``calibrate(device=...)``, on the CPU through
   ``device="cpu:0"``, which torch counts as another device) and on the CPU (the
   oracle: the same models and data, float64 statistics): the largest difference of any calibrated
   tensor, relative to that tensor's largest value. Also, for information, the difference to the
   same run with float64 models.
2. ``headline``: the paper's cost setting, a ViT-B/32-shaped HF CLIP (random weights), 8 tasks x
   256 examples at 224 px, batch 16, ``FeatCalConfig.clip()``: one ``calibrate`` after a warm-up,
   its wall time, peak GPU memory (``torch.cuda.max_memory_allocated``) and peak host memory
   (RSS sampled every 2 ms), beside the authors' 53 s and 22.8 GiB host memory (one A800).
3. ``streamed``: ``featcal.calibrate_checkpoints`` on a Llama-3-8B-shaped stack (hidden 4096,
   intermediate 14336, 32 heads, 8 key/value heads; ``--llama-blocks`` blocks, vocabulary 4096,
   bfloat16 checkpoints, 4 experts merged by Task Arithmetic on the fly): seconds and peak memory
   per block, the mean block time times 32 beside llm-compressor's 745 s on one GPU (not the same
   work: a reference point for the order of magnitude).
4. ``app``: a stand-in for the app's slider-to-exact time (the smollm2 micro zoo needs its LoRA
   build and the app's session; not measured here): on a small Llama, a first ``calibrate``
   (keeping the statistics and the experts' trace, as the app does), the preview at another
   lambda, and the exact run at that lambda reusing the trace.
5. ``distributed``: benchmarks/distributed.py's ranks (spawned processes, one torch thread each)
   on a small ViT: 1, 2 and 4 gloo ranks on the CPU, the speed-up over 1; then a 1-rank group on
   ``--device``: NCCL on the one GPU (its set-up and teardown; not a speed-up), gloo on a CPU.

``--quick`` runs the same code at toy sizes (about a minute on a CPU; the test
tests/repo/test_device_check.py runs it with ``--device cpu``). On the CPU the exactness rows
compare the CPU with itself (difference 0): they check the code paths, not a device.

    python3 benchmarks/device_check.py --json out/device_check.json          # cuda when there is one
    python3 benchmarks/device_check.py --quick --device cpu --json /tmp/dc.json
    python3 benchmarks/device_check.py --parts exactness,headline             # some parts only

6. ``official`` (only with ``--official DIR``, a git clone or bare mirror of the FeatCal authors'
   repository): benchmarks/featcal_vs_authors.py on the headline part's models and data (at
   ``--quick`` its toy size): ours and the authors' ``CLIPFeatCalibrator`` at their defaults, each
   in its own process on ``--device``, the largest relative difference of any calibrated parameter
   (fails over 1e-3, the float32 tolerance of the exactness rows), both wall times and peak RSS. A
   DIR that is not their code is refused before anything runs.

    python3 benchmarks/device_check.py --official /path/to/their/featcal.git
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()
sys.path.insert(0, str(C.REPO_ROOT / "tests"))  # tests/tiny.py: the tiny models of every architecture

import torch

PARTS = ("exactness", "headline", "streamed", "app", "distributed")  # "official": with --official only
TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}  # largest relative difference to the CPU oracle
PAPER = "authors: 53 s, 22.8 GiB host (one A800)"
LLM_COMPRESSOR = "llm-compressor: 745 s for Llama-3-8B on one GPU"
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8)
GIB = 2**30


# ------------------------------------------------------------------------------- rows


def row(part: str, case: str, result: str, reference: str = "", ok=None, **numbers) -> dict:
    """One table row; ``numbers`` (floats) go to the JSON as they are. ``ok``: None when the row
    has no pass/fail check."""
    return {"part": part, "case": case, "result": result, "reference": reference, "ok": ok, "numbers": numbers}


def _check(ok) -> str:
    return "" if ok is None else ("pass" if ok else "**FAIL**")


def table(rows: list[dict]) -> str:
    shown = [
        {
            "part": r["part"],
            "case": r["case"],
            "result": r["result"],
            "beside": r["reference"],
            "check": _check(r["ok"]),
        }
        for r in rows
    ]
    return C.markdown_table(shown)


def guarded(part: str, fn, args) -> list[dict]:
    """``fn(args)``'s rows, or one row with the error (and its traceback on stderr)."""
    t0 = time.perf_counter()
    try:
        rows = fn(args)
    except Exception as err:  # noqa: BLE001 - one failing part must not stop the others
        traceback.print_exc()
        rows = [row(part, "error", f"{type(err).__name__}: {err}".replace("|", "/")[:300], ok=False)]
    seconds = time.perf_counter() - t0
    C.release_free_memory()  # what a part (or its failure) left goes before the next part
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for r in rows:
        r["part_seconds"] = seconds
    print(f"[{part}: {seconds:.1f} s]", file=sys.stderr, flush=True)
    return rows


# ------------------------------------------------------------------------ 1. exactness


def arch_zoos() -> dict:
    """``{name: () -> (base, experts, merged, data)}``: every architecture featcal calibrates."""
    import tiny

    return {
        "HF CLIP": lambda: tiny.zoo("hf_clip"),
        "open_clip ViT": lambda: tiny.zoo("open_clip"),
        "T5 (padded)": lambda: tiny.text_zoo(tiny.tiny_t5, lambda seed: tiny.t5_batches(seed=seed)),
        "BERT (padded)": lambda: tiny.text_zoo(tiny.tiny_bert, lambda seed: tiny.text_batches(seed=seed)),
        "Llama (left padded)": lambda: tiny.text_zoo(
            tiny.tiny_llama, lambda seed: tiny.text_batches(seed=seed, vocab=50, left=True)
        ),
    }


def calibrated_on(zoo, device, dtype, one_block: bool = False) -> dict[str, torch.Tensor]:
    """The calibrated state dict (on the CPU, float64) of ``zoo`` cast to ``dtype`` and run on
    ``device`` with float64 statistics: the models and data moved there, or with ``one_block``
    left on the CPU and ``calibrate(device=...)`` (one block of every model there at a time)."""
    from featcal import FeatCalConfig, calibrate
    from featcal.model.streams import to_device

    base, experts, merged, data = zoo
    home = torch.device("cpu" if one_block else device)
    if one_block and torch.device(device) == home:  # "cpu:0" is another device than "cpu": the same path
        device = torch.device("cpu", 0)
    move = lambda m: copy.deepcopy(m).to(device=home, dtype=dtype)  # noqa: E731
    batches = {t: [to_device(b, home, dtype) for b in bs] for t, bs in data.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*token rows|.*fewer than its input width")
        model, _ = calibrate(
            move(merged),
            base=move(base),
            experts={t: move(m) for t, m in experts.items()},
            calib_data=batches,
            config=FeatCalConfig(stats_dtype=torch.float64),
            progress=False,
            device=device,
        )
    C.sync(device)
    return {k: v.detach().to("cpu", torch.float64) for k, v in model.state_dict().items()}


def max_rel_diff(got: dict, want: dict) -> float:
    """The largest ``max|got - want| / max|want|`` over the tensors both hold."""
    worst = 0.0
    for k, w in want.items():
        if k in got and w.is_floating_point() and w.numel():
            worst = max(worst, float((got[k] - w).abs().max() / w.abs().max().clamp_min(1e-30)))
    return worst


# (model dtype, one block at a time): each architecture's ways to the device
WAYS = ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True))


def part_exactness(args) -> list[dict]:
    rows = []
    for name, build in arch_zoos().items():
        zoo = build()
        exact64 = calibrated_on(zoo, "cpu", torch.float64)
        for dtype, one_block in WAYS:
            dname = str(dtype).removeprefix("torch.")
            case = f"{name}, {dname} model" + (", one block at a time on the device" if one_block else "")
            try:
                oracle = calibrated_on(zoo, "cpu", dtype)
                got = calibrated_on(zoo, args.device, dtype, one_block)
            except Exception as err:  # noqa: BLE001 - the row says what failed
                traceback.print_exc()
                rows.append(row("exactness", case, f"{type(err).__name__}: {err}"[:300], ok=False))
                continue
            diff, diff64 = max_rel_diff(got, oracle), max_rel_diff(got, exact64)
            ok = math.isfinite(diff) and diff <= TOLERANCE[dname]
            result = f"max rel diff {diff:.1e} (vs float64 model {diff64:.1e})"
            ref = f"tolerance {TOLERANCE[dname]:g} vs CPU {dname}"
            rows.append(row("exactness", case, result, ref, ok, max_rel_diff=diff, vs_float64_model=diff64))
    return rows


# ------------------------------------------------------------------------- 2. headline


def headline_setting(quick: bool) -> tuple[str, int, int, int]:
    """``(size, experts, examples a task, batch)`` of the headline part (and of ``official``)."""
    return ("tiny", 3, 16, 8) if quick else ("vit-b32", 8, 256, 16)


def part_headline(args) -> list[dict]:
    from featcal import FeatCalConfig

    size, experts, examples, batch = headline_setting(args.quick)
    t0 = time.perf_counter()
    zoo = C.build_zoo(size, experts, examples, batch, device=args.device)
    build_s = time.perf_counter() - t0
    cfg = FeatCalConfig.clip()
    C.calibrate_once(zoo.with_examples(zoo.batch), cfg)  # warm-up: kernels, allocator
    fwd = C.forward_reference(zoo).wall
    host = C.MemProbe("cpu")
    host.start()
    run, model, _ = C.calibrate_once(zoo, cfg, mem_probe=C.MemProbe(args.device))
    host.stop()
    del model
    numbers = dict(seconds=run.seconds, forward_seconds=fwd, host_peak_gib=host.peak / GIB)
    gpu = ""
    if torch.device(args.device).type == "cuda":
        numbers["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        gpu = f"GPU peak {numbers['gpu_peak_gib']:.2f} GiB; "
    case = f"{size} HF CLIP, {experts} tasks x {examples} examples, batch {batch}"
    result = (
        f"calibrate {run.seconds:.2f} s ({run.seconds / fwd:.2f}x one forward); {gpu}"
        f"host peak {host.peak / GIB:.2f} GiB; zoo built in {build_s:.1f} s"
    )
    return [row("headline", case, result, PAPER, None, **numbers)]


# ------------------------------------------------------------------------- 3. streamed


def llama_8b_shape(quick: bool, blocks: int):
    """A LlamaConfig of Llama-3-8B's block shape (``blocks`` blocks, vocabulary 4096); toy widths
    with the same head grouping (4 query heads per key/value head) at ``quick``."""
    from transformers import LlamaConfig

    shape = dict(hidden_size=64, intermediate_size=224, num_attention_heads=8, num_key_value_heads=2)
    shape = shape if quick else LLAMA_8B
    return LlamaConfig(
        vocab_size=4096,
        num_hidden_layers=blocks,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        **shape,
    )


def part_streamed(args) -> list[dict]:
    from streaming_memory import write_llama_zoo

    from featcal import FeatCalConfig, StreamOptions, calibrate_checkpoints
    from featcal.model.checkpoints import load_token_data

    blocks = 2 if args.quick else args.llama_blocks
    n_exp, per_task, seq = (2, 4, 32) if args.quick else (4, 32, 512)
    cfg = llama_8b_shape(args.quick, blocks)
    root = Path(tempfile.mkdtemp(prefix="featcal-device-check-"))
    try:
        t0 = time.perf_counter()
        write_llama_zoo(root, 0, n_exp, dtype=torch.bfloat16, config=cfg, seq=seq, per_task=per_task)
        write_s = time.perf_counter() - t0
        data = load_token_data(root / "data.safetensors", batch_size=8)
        per_block: list[dict] = []
        opts = StreamOptions(device=args.device, progress=False, on_block=lambda b, info: per_block.append(info))
        t0 = time.perf_counter()
        calibrate_checkpoints(
            root / "base",
            {f"task{i}": root / f"task{i}" for i in range(n_exp)},
            merge=("task_arithmetic", {"scale": 0.3}),
            calib_data=data,
            config=FeatCalConfig.llama("8b"),
            out=root / "out",
            options=opts,
        )
        total = time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return [_streamed_row(cfg, n_exp, per_task * seq, per_block, total, write_s)]


def _streamed_row(cfg, n_exp: int, tokens: int, per_block: list[dict], total: float, write_s: float) -> dict:
    secs = [b["wall_seconds"] for b in per_block]
    mean = sum(secs) / len(secs)
    rss = max(b["peak_rss_mb"] for b in per_block) / 1024
    numbers = dict(block_seconds_mean=mean, extrapolated_32_blocks_s=32 * mean, host_peak_gib=rss)
    gpu = ""
    if "peak_gpu_mb" in per_block[0]:
        numbers["gpu_peak_gib"] = max(b["peak_gpu_mb"] for b in per_block) / 1024
        gpu = f"GPU peak {numbers['gpu_peak_gib']:.2f} GiB; "
    case = (
        f"Llama hidden {cfg.hidden_size}/{cfg.intermediate_size}, {cfg.num_attention_heads}/"
        f"{cfg.num_key_value_heads} heads, {len(secs)} blocks, bf16, {n_exp} experts x {tokens} tokens"
    )
    result = (
        f"per block {', '.join(f'{s:.2f}' for s in secs)} s; x32 = {32 * mean:.0f} s; {gpu}"
        f"host peak {rss:.2f} GiB; whole call {total:.1f} s (checkpoints written in {write_s:.0f} s)"
    )
    return row("streamed", case, result, LLM_COMPRESSOR, None, **numbers)


# ------------------------------------------------------------------------------ 4. app


def part_app(args) -> list[dict]:
    import tiny
    from featcal import ExpertTrace, FeatCalConfig, calibrate
    from featcal.model.streams import to_device

    width, layers, length = (32, 2, 8) if args.quick else (512, 4, 128)
    make = lambda seed: tiny.tiny_llama(seed, layers=layers, vocab=1000, hidden=width, intermediate=width * 3)  # noqa: E731
    base, experts, merged, data = tiny.text_zoo(
        make, lambda seed: tiny.text_batches(n=8, batch=4, length=length, vocab=1000, seed=seed), n_tasks=4
    )
    dev = torch.device(args.device)
    base, merged = base.to(dev), merged.to(dev)
    experts = {t: m.to(dev) for t, m in experts.items()}
    data = {t: [to_device(b, dev) for b in bs] for t, bs in data.items()}
    trace = ExpertTrace()
    kw = dict(base=base, experts=experts, calib_data=data, progress=False, expert_trace=trace)
    cfg = FeatCalConfig.llama("3b")
    lam2 = cfg.lam * 10
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*token rows|.*fewer than its input width")
        first = _timed(args.device, lambda: calibrate(merged, config=cfg, keep_stats=True, **kw))
        report = first[0][1]
        preview = _timed(args.device, lambda: report.preview(lam=lam2))
        exact = _timed(args.device, lambda: calibrate(merged, config=dataclasses.replace(cfg, lam=lam2), **kw))
    case = f"stand-in: Llama width {width}, {layers} blocks, 4 tasks x 8 x {length} tokens (not the smollm2 micro zoo)"
    result = (
        f"first calibrate {first[1]:.2f} s; preview at lam x10 {preview[1]:.3f} s; exact at lam x10 {exact[1]:.2f} s"
    )
    numbers = dict(first_seconds=first[1], preview_seconds=preview[1], exact_seconds=exact[1])
    return [row("app", case, result, f"app target: exact within {C.APP_TARGET_S:g} s", None, **numbers)]


def _timed(device, fn):
    C.sync(device)
    t0 = time.perf_counter()
    out = fn()
    C.sync(device)
    return out, time.perf_counter() - t0


# ---------------------------------------------------------------------- 5. distributed


def part_distributed(args) -> list[dict]:
    import distributed as bench

    ranks = (1, 2) if args.quick else (1, 2, 4)
    ns = argparse.Namespace(experts=2 if args.quick else 4, examples=8 if args.quick else 32, batch=4)
    ns.layers = 1 if args.quick else 4
    shape = f"ViT-B/32 width, {ns.layers} blocks, {ns.experts} tasks x {ns.examples} examples"
    rows, one = [], None
    for world in ranks:
        res = bench._launch(world, argparse.Namespace(**vars(ns), device="cpu"), "owner")
        wall = max(r[1] for r in res)
        one = one or wall
        result = f"{wall:.2f} s, speed-up {one / wall:.2f}x over 1 rank"
        rows.append(row("distributed", f"gloo, {world} rank(s), CPU; {shape}", result, "", None, seconds=wall))
    # A 1-rank group on --device: NCCL on the GPU; on a CPU the same code with gloo (its stand-in).
    cuda = torch.device(args.device).type == "cuda"
    res = bench._launch(1, argparse.Namespace(**vars(ns), device="cuda" if cuda else "cpu", group=True), "owner")
    case = f"{'NCCL' if cuda else 'gloo'}, a 1-rank group on {'the GPU' if cuda else 'the CPU'}; {shape}"
    rows.append(
        row("distributed", case, f"{res[0][1]:.2f} s (group set up and torn down)", "", None, seconds=res[0][1])
    )
    return rows


# ------------------------------------------------------------------------- 6. official


def part_official(args) -> list[dict]:
    import featcal_vs_authors as fva

    size, experts, examples, batch = headline_setting(args.quick)
    res = fva.compare(args.official, size, experts, examples, batch, torch.get_num_threads(), args.device)
    worst, (kind, where) = max((d, (k, w)) for k, (d, w) in res["diffs"].items())
    o, t = res["ours"], res["theirs"]
    result = (
        f"largest rel diff {worst:.1e} ({kind}, {where}); calibrate ours {o['seconds']:.2f} s, "
        f"authors' {t['seconds']:.2f} s; peak RSS ours {o['peak_rss_mb']:.0f} MB, authors' "
        f"{t['peak_rss_mb']:.0f} MB; {o['threads']} thread(s)"
    )
    numbers = dict(max_rel_diff=worst, seconds=o["seconds"], authors_seconds=t["seconds"])
    numbers |= dict(peak_rss_mb=o["peak_rss_mb"], authors_peak_rss_mb=t["peak_rss_mb"])
    ok = worst <= fva.TOLERANCE
    ref = f"the authors' code ({args.official}), tolerance {fva.TOLERANCE:g}"
    return [row("official", res["case"], result, ref, ok, **numbers)]


# ------------------------------------------------------------------------------ main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--quick", action="store_true", help="toy sizes: the same code paths in about a minute")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the rows as JSON here")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--llama-blocks", type=int, default=3, help="blocks of the 8B-shaped streamed stack")
    p.add_argument("--official", type=Path, metavar="DIR", help="the FeatCal authors' git repo: adds 'official'")
    args = p.parse_args(argv)
    if args.official is not None:
        import featcal_vs_authors as fva

        problem = fva.authors_problem(args.official)
        if problem:
            p.error(f"--official: {problem}")
        args.parts += "" if "official" in args.parts.split(",") else ",official"
    unknown = set(args.parts.split(",")) - set(PARTS) - ({"official"} if args.official else set())
    if unknown:
        p.error(f"--parts: unknown {', '.join(sorted(unknown))}; choose from {', '.join(PARTS)}")
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False  # the exact run (as the CPU)
    env = C.environment(args.device)
    print(env, flush=True)
    fns = {p: globals()[f"part_{p}"] for p in (*PARTS, "official")}
    rows = [r for part in args.parts.split(",") for r in guarded(part, fns[part], args)]
    print("\n" + table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "quick": args.quick, "rows": rows}, indent=1) + "\n")
    failed = [r for r in rows if r["part"] in ("exactness", "official") and not r["ok"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of the streamed calibration (``featcal.calibrate_checkpoints``) against the
in-memory one (``featcal.calibrate``) and against the models' sizes.

For each size, a Llama-architecture base and ``--experts`` experts (random weights, the experts
seeded perturbations of the base) are saved sharded to a temporary directory; then each run goes
in a fresh process: the streamed one (merging Task Arithmetic on the fly, writing the calibrated
model) and the in-memory one (``from_pretrained`` of every model, ``featcal.merge``,
``featcal.calibrate``). Each child reports its peak resident memory (``getrusage``'s, Linux's
VmHWM) at the end and the interpreter's baseline (the peak after its imports, before any work).

    python benchmarks/streaming_memory.py                       # 50 and 200 MB per model
    python benchmarks/streaming_memory.py --sizes 50,200,800 --threads 2
    python benchmarks/streaming_memory.py --sizes 800 --only streamed
    python benchmarks/streaming_memory.py --sizes 200 --layers 32 --only streamed   # twice the blocks
    python benchmarks/streaming_memory.py --sizes 200 --only streamed --lora 16     # LoRA experts (rank 16)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

LAYERS = 16
VOCAB = 4096
SEQ, PER_TASK = 32, 8  # calibration tokens per example, examples per task
WIDTHS = {50: 256, 200: 512, 800: 1024}  # hidden width per nominal size (MB per model, float32)


def llama_config(width: int, layers: int = LAYERS, vocab: int = VOCAB):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=width * 8 // 3 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=max(1, width // 64),
        num_key_value_heads=max(1, width // 64),
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
    )


def write_llama_zoo(
    root: Path,
    width: int,
    n_experts: int,
    layers: int = LAYERS,
    dtype=torch.float32,
    seed: int = 0,
    lora: int = 0,
    *,
    config=None,
    seq: int = SEQ,
    per_task: int = PER_TASK,
):
    """Base and experts (the base plus seeded noise of 1% of each tensor's scale, or with ``lora``
    PEFT LoRA adapters of that rank on every attention and MLP projection) saved sharded under
    ``root``; the token file of ``n_experts`` tasks (``per_task`` sequences of ``seq`` tokens each).
    ``config`` (a ``LlamaConfig``) replaces ``llama_config(width, layers)``. Returns the bytes of
    one model."""
    from transformers import LlamaForCausalLM

    from featcal.model.checkpoints import save_token_data

    torch.manual_seed(seed)
    config = config or llama_config(width, layers)
    base = LlamaForCausalLM(config).to(dtype).eval()
    base.save_pretrained(root / "base", max_shard_size="100MB")
    sd = base.state_dict()
    if lora:
        write_lora_experts(base, root, n_experts, lora, seed)
    for i in range(0 if lora else n_experts):
        g = torch.Generator().manual_seed(seed + 1 + i)
        noisy = {k: v + 0.01 * v.float().std() * torch.randn(v.shape, generator=g).to(v.dtype) for k, v in sd.items()}
        base.load_state_dict(noisy)
        base.save_pretrained(root / f"task{i}", max_shard_size="100MB")
        del noisy
    g = torch.Generator().manual_seed(seed + 100)
    save_token_data(
        root / "data.safetensors",
        {
            f"task{i}": {"input_ids": torch.randint(0, config.vocab_size, (per_task, seq), generator=g)}
            for i in range(n_experts)
        },
    )
    return sum(v.numel() * v.element_size() for v in sd.values())


def write_lora_experts(base, root: Path, n_experts: int, rank: int, seed: int) -> None:
    """``n_experts`` LoRA adapters of ``base`` (random factors, rank ``rank``) in ``root/task{i}``."""
    import copy

    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i in range(n_experts):
        torch.manual_seed(seed + 1 + i)
        pm = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        pm.save_pretrained(root / f"task{i}")


def child(mode: str, root: Path, n_experts: int, device: str) -> dict:
    """One run in this (fresh) process; the numbers as a dict."""
    from transformers import LlamaForCausalLM  # the baseline includes every import

    from featcal import FeatCalConfig, StreamOptions, calibrate, calibrate_checkpoints, merge
    from featcal.model.checkpoints import load_token_data
    from featcal.util.memory import peak_rss_mb

    baseline = peak_rss_mb()
    tasks = [f"task{i}" for i in range(n_experts)]
    data = load_token_data(root / "data.safetensors", batch_size=PER_TASK)
    cfg = FeatCalConfig.llama("8b")
    t0 = time.perf_counter()
    per_block = []
    if mode == "streamed":
        out = root / "out"
        report = calibrate_checkpoints(
            root / "base",
            {t: root / t for t in tasks},
            merge=("task_arithmetic", {"scale": 0.3}),
            calib_data=data,
            config=cfg,
            out=out,
            options=StreamOptions(device=device, force=True, progress=False, on_block=lambda b, i: per_block.append(i)),
        )
        shutil.rmtree(out)
    else:
        base = LlamaForCausalLM.from_pretrained(root / "base").eval()
        experts = {t: LlamaForCausalLM.from_pretrained(root / t).eval() for t in tasks}
        merged = LlamaForCausalLM.from_pretrained(root / "base").eval()
        merged.load_state_dict(
            merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
        )
        _, report = calibrate(
            merged, base=base, experts=experts, calib_data=data, config=cfg, progress=False, device=device
        )
    seconds = time.perf_counter() - t0
    out = {"mode": mode, "baseline_mb": baseline, "peak_mb": peak_rss_mb(), "seconds": seconds}
    blocks = report.blocks
    out["block_seconds"] = sum(b.stats_seconds + b.solve_seconds + b.advance_seconds for b in blocks) / len(blocks)
    out["block_solve_seconds"] = sum(b.solve_seconds for b in blocks) / len(blocks)
    if per_block:
        out["block_wall_seconds"] = sum(i["wall_seconds"] for i in per_block) / len(per_block)
    if torch.device(device).type == "cuda":
        out["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def run_child(mode: str, root: Path, n_experts: int, device: str, threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, __file__, "--child", mode, "--root", str(root), "--experts", str(n_experts)]
    cmd += ["--device", device, "--threads", str(threads)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="50,200", help=f"MB per model (float32), of {sorted(WIDTHS)}")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--layers", type=int, default=LAYERS, help="blocks per model (the sizes assume 16)")
    p.add_argument("--only", choices=["streamed", "in-memory"], help="run one mode only")
    p.add_argument("--lora", type=int, default=0, help="experts as PEFT LoRA adapters of this rank (streamed only)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tmp", default=None, help="where to write the checkpoints (default: the system's temp)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(child(args.child, Path(args.root), args.experts, args.device)))
        return
    print(C.environment(args.device), flush=True)
    rows = []
    modes = [args.only] if args.only else ["streamed", "in-memory"]
    for size in [int(s) for s in args.sizes.split(",")]:
        root = Path(tempfile.mkdtemp(prefix=f"featcal-stream-{size}-", dir=args.tmp))
        try:
            if args.lora and args.only != "streamed":
                p.error("--lora needs --only streamed (the in-memory run here loads dense experts)")
            model_mb = write_llama_zoo(root, WIDTHS[size], args.experts, layers=args.layers, lora=args.lora) / 2**20
            print(
                f"{size} MB nominal: {model_mb:.0f} MB per model, {args.experts} experts", file=sys.stderr, flush=True
            )
            for mode in modes:
                r = run_child(mode, root, args.experts, args.device, args.threads)
                above = r["peak_mb"] - r["baseline_mb"]
                print(f"  {mode}: {r}", file=sys.stderr, flush=True)
                rows.append(
                    {
                        "model": f"{model_mb:.0f} MB (width {WIDTHS[size]}, {args.layers} blocks)",
                        "run": mode + (f", LoRA r={args.lora} experts" if args.lora else ""),
                        "models' sum": f"{(args.experts + 2) * model_mb:.0f} MB ({args.experts + 2} models)",
                        "baseline": f"{r['baseline_mb']:.0f} MB",
                        "peak RSS": f"{r['peak_mb']:.0f} MB",
                        "peak - baseline": f"{above:.0f} MB = {above / model_mb:.2f} models",
                        "time": f"{r['seconds']:.1f} s",
                        "per block": f"{r['block_seconds']:.2f} s (solve {r['block_solve_seconds']:.2f})",
                    }
                )
        finally:
            shutil.rmtree(root, ignore_errors=True)
    print()
    print(C.markdown_table(rows))


if __name__ == "__main__":
    main()

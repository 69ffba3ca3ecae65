"""The SmolLM2 zoo calibrated streamed from its own checkpoint directories, against in memory.

    python benchmarks/smollm2_streamed.py --out runs/smollm2-streamed [--n-per-task 32]

1. writes ``--n-per-task`` calibration sequences per task (the zoo's ``calib`` split, seeded) as
   ``featcal calibrate --data`` tokens;
2. runs ``featcal calibrate --base ZOO/base --expert T=ZOO/experts/T ... --merge task_arithmetic
   --param scale=0.3 --preset llama-3b --stats-dtype float64 --data ...`` in a child process
   (``--stats-dtype``: float64 by default, as the table and the app) and reads its peak
   resident memory (``getrusage`` of the child);
3. calibrates the same merge in memory (``featcal.calibrate``, the same config and batches) and
   prints the largest relative difference per tensor (``max|a - b| / max|b|``);
4. prints the merged and the calibrated model's greedy replies to one test prompt per task.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's featcal, not an installed one
import torch

from featcal import FeatCalConfig, calibrate
from featcal.model.checkpoints import load_token_data, save_token_data
from featcal.zoo import load_any


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--zoo", default="smollm2")
    ap.add_argument("--out", required=True)
    ap.add_argument("--n-per-task", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument(
        "--stats-dtype", choices=("float32", "float64"), default="float64", help="as the table and the app (float64)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    zoo = load_any(args.zoo, progress=True)
    root = Path(zoo.meta["path"])
    idx = torch.randperm(len(zoo.split(zoo.tasks[0], "calib")[0]), generator=torch.Generator().manual_seed(42))
    rows = {t: zoo.split(t, "calib")[0][idx[: args.n_per_task]] for t in zoo.tasks}
    tokens = out / "tokens.safetensors"
    save_token_data(tokens, {t: r.as_batch() for t, r in rows.items()})

    cmd = [sys.executable, "-m", "featcal", "calibrate", "--base", str(root / "base")]
    for t in zoo.tasks:
        cmd += ["--expert", f"{t}={root / 'experts' / t}"]
    cmd += ["--merge", "task_arithmetic", "--param", "scale=0.3", "--preset", "llama-3b", "--data", str(tokens)]
    cmd += ["--batch-size", str(args.batch_size), "--threads", str(args.threads), "--out", str(out / "calibrated")]
    cmd += ["--stats-dtype", args.stats_dtype, "--force", "-q"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    streamed_s = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024

    from transformers import LlamaForCausalLM

    merged = zoo.merged("task_arithmetic", scale=0.3)
    t0 = time.perf_counter()
    want, _ = calibrate(
        merged,
        base=zoo.base,
        experts=zoo.experts,
        calib_data=load_token_data(tokens, batch_size=args.batch_size),
        config=FeatCalConfig.llama("3b", stats_dtype=getattr(torch, args.stats_dtype)),
        progress=True,
    )
    memory_s = time.perf_counter() - t0
    got = LlamaForCausalLM.from_pretrained(out / "calibrated").eval()
    gs = got.state_dict()
    worst = max(
        (float((gs[k].double() - w.double()).abs().max() / w.double().abs().max().clamp_min(1e-30)), k)
        for k, w in want.state_dict().items()
    )
    model_mb = sum(p.numel() * p.element_size() for p in zoo.base.parameters()) / 2**20
    print(f"- streamed: {streamed_s:.0f} s, peak RSS {peak_mb:.0f} MB (one model: {model_mb:.0f} MB in float32)")
    print(f"- in memory: {memory_s:.0f} s; largest relative difference per tensor {worst[0]:.2e} ({worst[1]})")
    print()
    print("| task | prompt | merged (TA 0.3) | TA 0.3 + FeatCal (llama-3b), streamed |")
    print("|---|---|---|---|")
    for t in zoo.tasks:
        prompt = zoo.examples[t]["test"][0].prompt
        a, b = (zoo.generate(m, [prompt], args.max_new_tokens)[0] for m in (merged, got))
        print(f"| {t} | {_cell(prompt)} | {_cell(a)} | {_cell(b)} |")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


if __name__ == "__main__":
    main()

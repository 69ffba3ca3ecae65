"""What the statistics' precision costs: calibrated weights with float32 statistics (the
default) and with bfloat16 models, against float64 statistics on the float32 model.

For each model size (random HF CLIP zoos, :func:`_common.build_zoo`) and lambda, one
calibration per (model dtype, statistics dtype), compared by ``rel. dist``:
``||theta - theta_ref||_F / ||theta_ref||_F`` over every calibrated parameter, where
``theta_ref`` is the float32 model calibrated with float64 statistics (the spec's solution to
float32 forward passes) and, in the last column, the same model dtype with float64 statistics
(the error the statistics themselves add).

    python benchmarks/precision.py                       # sizes tiny and demo, lam 0.05 and 1e-5
    python benchmarks/precision.py --sizes vit-b32 --layers 2   # ViT-B/32 width, 2 blocks
    python benchmarks/precision.py --low-rank 2,8,64     # low-rank inputs: per-module error vs warning

``--low-rank``: a random Llama (2 blocks of width 64, 3 experts, Task Arithmetic), calibrated on
tokens drawn from only R distinct ids (so every block's inputs have rank <= R); per module the
relative distance of the float32-statistics weights to the float64 ones, and whether
``report.warnings`` names the module with its estimated error (featcal.method.linalg.F32_WARN).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import logging
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

from featcal import FeatCalConfig, calibrate
from featcal.model import arch


def _params(model) -> torch.Tensor:
    """Every calibrated parameter of ``model``, flattened into one float64 vector."""
    _, blks = arch.resolve_blocks(model)
    out = []
    for blk in blks:
        for t in arch.block_targets(blk):
            W, b = arch.get_params(blk, t)
            out += [W.double().reshape(-1)] + ([] if b is None else [b.double().reshape(-1)])
    return torch.cat(out)


def _calibrated(zoo: C.Zoo, model_dtype: torch.dtype, stats_dtype: torch.dtype, lam: float) -> torch.Tensor:
    def cast(m):
        return copy.deepcopy(m).to(model_dtype)

    cfg = FeatCalConfig.clip(lam=lam, stats_dtype=stats_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fewer-rows notes; not the point here
        model, _ = calibrate(
            cast(zoo.merged),
            base=cast(zoo.base),
            experts={t: cast(e) for t, e in zoo.experts.items()},
            calib_data=zoo.data,
            config=cfg,
            progress=False,
        )
    return _params(model)


class _Logged(logging.Handler):
    """The float32 notes featcal.method.solve logs, one per module (report.warnings summarises them)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    @contextlib.contextmanager
    def on(self, active: bool):
        log = logging.getLogger("featcal.method")
        if active:
            log.addHandler(self)
        try:
            yield
        finally:
            log.removeHandler(self)


def _low_rank(ranks: list[int], lams: list[float]) -> list[dict]:
    """Per (rank, lam): the worst module's float32-vs-float64 distance, the modules past 1e-3 and
    past F32_WARN / 3, and how many of those report.warnings names (or counts)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from featcal import merge

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    base = LlamaForCausalLM(cfg).eval()
    experts = {}
    for i in range(3):
        torch.manual_seed(100 + i)
        experts[f"t{i}"] = copy.deepcopy(base)
        with torch.no_grad():
            for p in experts[f"t{i}"].parameters():
                p.add_(0.02 * p.std() * torch.randn_like(p))
    sd = merge("task_arithmetic", base.state_dict(), {t: m.state_dict() for t, m in experts.items()}, scale=0.3)
    merged = copy.deepcopy(base)
    merged.load_state_dict(sd)
    rows = []
    for rank in ranks:
        g = torch.Generator().manual_seed(rank)
        vocab = torch.randperm(256, generator=g)[:rank]
        data = {
            t: [{"input_ids": vocab[torch.randint(0, rank, (8, 16), generator=g)]} for _ in range(2)] for t in experts
        }
        for lam in lams:
            got, logged = {}, _Logged()
            for dt in (torch.float32, torch.float64):
                with warnings.catch_warnings(), logged.on(dt == torch.float32):
                    warnings.simplefilter("ignore")
                    model, report = calibrate(
                        merged,
                        base=base,
                        experts=experts,
                        calib_data=data,
                        progress=False,
                        config=FeatCalConfig.llama("3b", lam=lam, stats_dtype=dt),
                    )
                _, blks = arch.resolve_blocks(model)
                got[dt] = (
                    {
                        f"block {i} {t.name}": arch.get_params(b, t)[0].double()
                        for i, b in enumerate(blks)
                        for t in arch.block_targets(b)
                    },
                    report.warnings,
                )
            err = {k: float((got[torch.float32][0][k] - v).norm() / v.norm()) for k, v in got[torch.float64][0].items()}
            est = {w.split(":")[0]: float(w.split("up to ~")[1].split()[0]) for w in logged.lines if "up to ~" in w}
            redone = {w.split(":")[0] for w in logged.lines if "re-solved in float64" in w}
            off = [k for k, e in err.items() if e > 1e-3]
            rows.append(
                {
                    "input rank": rank,
                    "λ": lam,
                    "modules": len(err),
                    "worst rel. dist (float32 vs float64 stats)": f"{max(err.values()):.1e}",
                    "modules > 1e-3": len(off),
                    "warned: estimate + re-solved": f"{len(est)} + {len(redone)}",
                    "> 1e-3, not warned": sum(k not in est and k not in redone for k in off),
                    "min estimate / measured": f"{min(e / err[k] for k, e in est.items()):.1f}x" if est else "-",
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,demo", help="model sizes of benchmarks/_common.py SIZES")
    ap.add_argument("--lams", default="0.05,1e-5", help="lambdas (CLIP preset otherwise)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--n", type=int, default=32, help="calibration examples per task")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the size's)")
    ap.add_argument("--low-rank", default=None, metavar="R,R", help="only the low-rank-input table, for these ranks")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.low_rank:
        print(C.environment())
        lams = [float(x) for x in args.lams.split(",")]
        print(C.markdown_table(_low_rank([int(r) for r in args.low_rank.split(",")], lams)))
        print(f"\n{time.perf_counter() - t0:.0f} s in all")
        return
    rows = []
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    for size in args.sizes.split(","):
        zoo = C.build_zoo(size, args.experts, args.n, 16, layers=args.layers)
        width = C.SIZES[size]["hidden_size"]
        for lam in (float(x) for x in args.lams.split(",")):
            ref = _calibrated(zoo, f32, f64, lam)
            ref_bf = _calibrated(zoo, bf16, f64, lam)
            for model_dt, stats_dt, same in ((f32, f32, ref), (bf16, f64, ref_bf), (bf16, f32, ref_bf)):
                got = ref_bf if (model_dt, stats_dt) == (bf16, f64) else _calibrated(zoo, model_dt, stats_dt, lam)
                rows.append(
                    {
                        "model": f"{size} ({len(arch.resolve_blocks(zoo.base)[1])} blocks of width {width}, "
                        f"{C.tokens_per_example(size) * args.n} rows/task)",
                        "λ": lam,
                        "model dtype": str(model_dt).removeprefix("torch."),
                        "stats dtype": str(stats_dt).removeprefix("torch."),
                        "rel. dist to float32 model, float64 stats": f"{float((got - ref).norm() / ref.norm()):.1e}",
                        "rel. dist to same model, float64 stats": f"{float((got - same).norm() / same.norm()):.1e}",
                    }
                )
    print(C.environment())
    print(C.markdown_table(rows))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()

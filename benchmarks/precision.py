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
"""

from __future__ import annotations

import argparse
import copy
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,demo", help="model sizes of benchmarks/_common.py SIZES")
    ap.add_argument("--lams", default="0.05,1e-5", help="lambdas (CLIP preset otherwise)")
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--n", type=int, default=32, help="calibration examples per task")
    ap.add_argument("--layers", type=int, default=None, help="blocks (default: the size's)")
    args = ap.parse_args()
    t0 = time.perf_counter()
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

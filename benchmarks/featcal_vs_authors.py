"""Ours (``featcal.calibrate``) against the FeatCal authors' ``CLIPFeatCalibrator`` on the same
HF ``CLIPVisionModel`` zoo and images: the largest difference per kind of calibrated parameter,
each side's wall time and peak RSS.

The authors' code is not vendored: ``--authors DIR`` is a git clone or bare mirror of their
repository; its HEAD is ``git archive``-d into a temporary folder and run there, in a subprocess
with ``PYTHONPATH`` set to its ``src`` alone (their package is also named ``featcal``). Ours runs
in a subprocess too, so that both peak RSS figures are those of a process that loads the saved
models and calibrates once (benchmarks/_featcal_vs_authors_worker.py holds both sides).

The zoo: a random HF CLIP vision tower (``tiny``: the tests' tiny one, 16 px; ``vit-b32``:
ViT-B/32's config at 224 px), experts as seeded perturbations, Task Arithmetic (scale 0.3) as
the merge, N(0, 1) pixels (benchmarks/_common.py ``build_zoo``, as device_check's headline).

The setting: their ``FeatCalConfig()`` defaults (lambda_ratio 0.05, anchor_blend_rho 2.2,
teacher_interp_alpha 0.25, covariance_eps 1e-8, bias and LayerNorm calibrated) are ours
``FeatCalConfig.clip(lam=0.05, rho=2.2, alpha=0.25, eps=1e-8)``: their ``lambda_ratio`` is the
ridge itself (added to the sum of Frobenius-normalised second moments, docs/maths.md 'Linear
weight'), and the CLIP preset's token weights are their ``_token_weights_for_module`` (last
block: non-class tokens at 0.01 except the key and value projections). Statistics in float32 on
both sides (``--ours-stats-dtype float64``: ours in float64, to tell their rounding from ours).

Their code reads ``model.vision_model.embeddings`` (transformers 4's layout); transformers 5 puts
the embeddings on ``CLIPVisionModel`` itself, so their side sees each model through a shim holding
the same modules under ``vision_model`` (the worker's ``VisionModelShim``); nothing else of theirs
is changed but ``prepare_first_layer_inputs``, which reads our saved images instead of datasets.

    python benchmarks/featcal_vs_authors.py --authors /work/.mirror/egangu+featcal/repo --size tiny
    python benchmarks/featcal_vs_authors.py --authors DIR --size vit-b32 --tasks 4 --examples 16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

C.setup_path()

import torch

WORKER = Path(__file__).resolve().parent / "_featcal_vs_authors_worker.py"
THEIR_DEFAULTS = dict(
    lambda_ratio=0.05,
    anchor_blend_rho=2.2,
    teacher_interp_alpha=0.25,
    covariance_eps=1e-8,
    calibrate_bias=True,
    calibrate_layernorm=True,
)
OURS = dict(lam=0.05, rho=2.2, alpha=0.25, eps=1e-8)  # FeatCalConfig.clip(**OURS): the same setting
# Relative to each tensor's largest entry: device_check's float32 tolerance. Float32 rounding in the
# authors' code alone moves the last block's small biases by ~1.3e-4 (with float64 models on both
# sides the two agree to 4e-7: benchmarks/README.md), so 1e-4 would fail on rounding, not maths.
TOLERANCE = 1e-3
NEEDED = {  # file of their HEAD: what this comparison calls in it
    "src/featcal/featcal.py": ("class CLIPFeatCalibrator", "def prepare_first_layer_inputs", "_clip_first_layer_input"),
    "src/featcal/solver.py": ("def merge_layer_parameters_with_featcal_stats",),
}


def authors_problem(path: Path) -> str | None:
    """Why ``path`` is not the FeatCal authors' code as this comparison needs it, or None."""
    what = (
        f"{path} is not the FeatCal authors' code (a git clone or bare mirror of their repository, "
        "github.com/egangu/featcal, whose HEAD holds src/featcal/featcal.py with CLIPFeatCalibrator)"
    )
    if not path.is_dir():
        return f"{what}: no such folder. Fetch it (git clone --mirror <their repository>) and pass its path."
    for name, markers in NEEDED.items():
        got = subprocess.run(["git", "-C", str(path), "show", f"HEAD:{name}"], capture_output=True, text=True)
        if got.returncode != 0:
            return f"{what}: git cannot read HEAD:{name} there ({got.stderr.strip()[:200]})."
        missing = [m for m in markers if m not in got.stdout]
        if missing:
            return f"{what}: HEAD:{name} has no {', '.join(missing)} (their code changed?)."
    return None


def extract_authors(path: Path, into: Path) -> Path:
    """Their HEAD archived into ``into``; returns the folder to put on ``PYTHONPATH``."""
    problem = authors_problem(path)
    if problem:
        raise SystemExit(problem)
    archive = subprocess.run(["git", "-C", str(path), "archive", "HEAD", "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / "src"


def save_zoo(zoo: C.Zoo, workdir: Path, threads: int, device: str, stats_dtype: str = "float32") -> None:
    """The zoo's models as HF folders, its images as one safetensors file, and run.json."""
    from safetensors.torch import save_file
    from transformers.utils import logging

    logging.disable_progress_bar()
    zoo.base.save_pretrained(workdir / "base")
    zoo.merged.save_pretrained(workdir / "merged")
    for task, model in zoo.experts.items():
        model.save_pretrained(workdir / "experts" / task)
    flat = {f"{t}.{i}": x.contiguous() for t, bs in zoo.data.items() for i, x in enumerate(bs)}
    save_file(flat, str(workdir / "images.safetensors"))
    spec = dict(
        tasks=list(zoo.experts),
        batches={t: len(bs) for t, bs in zoo.data.items()},
        threads=threads,
        device=device,
        ours=OURS,
        ours_stats_dtype=stats_dtype,
        theirs=THEIR_DEFAULTS,
    )
    (workdir / "run.json").write_text(json.dumps(spec, indent=1))


def run_side(side: str, workdir: Path, threads: int, pythonpath: Path) -> dict:
    """Run one side's worker; its ``<side>.json`` plus the calibrated state dict."""
    from safetensors.torch import load_file

    env = dict(os.environ, PYTHONPATH=str(pythonpath), OMP_NUM_THREADS=str(threads), TQDM_DISABLE="1")
    env["MKL_NUM_THREADS"] = str(threads)
    proc = subprocess.run([sys.executable, str(WORKER), side, str(workdir)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {side} worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = json.loads((workdir / f"{side}.json").read_text())
    out["state"] = load_file(str(workdir / f"{side}.safetensors"))
    return out


BLOCK_KEY = re.compile(r"\.layers\.(\d+)\.(.+)$")


def diff_by_kind(ours: dict, theirs: dict) -> dict[str, tuple[float, str]]:
    """``{kind: (largest relative difference, where)}``: a kind is a block parameter's name inside
    the block (``self_attn.q_proj.weight``), every other entry is ``outside the blocks``; the
    difference of a tensor is ``max|ours - theirs| / max|theirs|``."""
    if set(ours) != set(theirs):
        raise RuntimeError(f"the state dicts differ in keys: {sorted(set(ours) ^ set(theirs))[:8]}")
    worst: dict[str, tuple[float, str]] = {}
    for key, want in theirs.items():
        if not want.is_floating_point():
            continue
        m = BLOCK_KEY.search(key)
        kind, where = (m.group(2), f"block {m.group(1)}") if m else ("outside the blocks", key)
        d = float((ours[key].double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))
        if kind not in worst or d > worst[kind][0]:
            worst[kind] = (d, where)
    return worst


def compare(
    authors: Path, size: str, tasks: int, examples: int, batch: int, threads: int, device: str, stats: str = "float32"
) -> dict:
    """Build the zoo, run both sides on it (ours with ``stats`` statistics); ``{diffs, ours,
    theirs, load, case}``."""
    torch.set_num_threads(threads)
    load = os.getloadavg()
    zoo = C.build_zoo(size, tasks, examples, batch)
    with tempfile.TemporaryDirectory(prefix="featcal-vs-authors-") as tmp:
        src = extract_authors(authors, Path(tmp))
        workdir = Path(tmp) / "run"
        save_zoo(zoo, workdir, threads, device, stats)
        ours = run_side("ours", workdir, threads, C.REPO_ROOT)
        theirs = run_side("theirs", workdir, threads, src)
    diffs = diff_by_kind(ours.pop("state"), theirs.pop("state"))
    case = f"{size} HF CLIP, {tasks} tasks x {examples} examples, batch {batch}, {device}"
    return dict(case=case, diffs=diffs, ours=ours, theirs=theirs, load=load, threads=threads)


def table(res: dict) -> str:
    """One markdown table: a row per kind of parameter, then time, peak RSS, threads and load."""
    rows = [
        {
            "item": f"`{kind}`",
            "ours": "",
            "authors'": "",
            "largest rel. diff": f"{d:.1e} ({where})" if d else "0 (equal)",
        }
        for kind, (d, where) in sorted(res["diffs"].items())
    ]
    o, t = res["ours"], res["theirs"]
    rows.append({"item": "calibrate wall time", "ours": C.fmt_s(o["seconds"]), "authors'": C.fmt_s(t["seconds"])})
    rss = lambda r: f"{r['peak_rss_mb']:.0f} MB"  # noqa: E731
    rows.append({"item": "peak RSS (the process)", "ours": rss(o), "authors'": rss(t)})
    rows.append({"item": "torch threads", "ours": str(o["threads"]), "authors'": str(t["threads"])})
    rows.append({"item": "load (1, 5, 15 min) at start", "ours": ", ".join(f"{x:.2f}" for x in res["load"])})
    for r in rows:
        r.setdefault("largest rel. diff", "")
        r.setdefault("authors'", "")
    return C.markdown_table(rows)


def largest(res: dict) -> float:
    return max(d for d, _ in res["diffs"].values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--authors", type=Path, required=True, metavar="DIR", help="their git clone or bare mirror")
    ap.add_argument("--size", choices=("tiny", "vit-b32"), default="tiny")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--examples", type=int, default=16, help="images a task")
    ap.add_argument("--batch", type=int, default=16, help="their calibration_batch_size default")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ours-stats-dtype", choices=("float32", "float64"), default="float32", help="a diagnosis")
    args = ap.parse_args(argv)
    problem = authors_problem(args.authors)
    if problem:
        ap.error(problem)
    setting = (args.size, args.tasks, args.examples, args.batch, args.threads, args.device, args.ours_stats_dtype)
    res = compare(args.authors, *setting)
    print(f"{res['case']}; ours {res['ours']['config']}; authors' {res['theirs']['config']}")
    print()
    print(table(res))
    worst = largest(res)
    print(f"\nlargest relative difference {worst:.1e} (tolerance {TOLERANCE:g})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

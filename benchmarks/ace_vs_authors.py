"""Ours (featcal.merge("ace")) against the ACE-Merging authors' code on the same tiny CLIP image
encoder and experts: the largest difference per kind of entry.

    python benchmarks/ace_vs_authors.py --authors /work/authors/ACE-Merging

``--authors``: the authors' repository (github unravel-xu/ACE-Merging): a checkout holding
``src/merge/strategy.py``, ``utils/task_vector.py`` and ``utils/common.py``, or a git directory
(its ``HEAD``'s three files are extracted with ``git archive`` into a temporary directory). Nothing
is vendored. The three are imported from there and run as their pipeline runs them (step 1 and
step 3): ``TaskVector.compute`` (each expert's ``named_parameters`` minus the base's, no exclusion:
their ViT setting), ``MergeStrategy(...).ace_merging()`` at its defaults (``eps`` 0.01, ``k_frac``
0.3) and ``apply_to_model`` with ``scaling_coefficient`` 1.0 (control/config.py). Their
``utils.common`` imports ``transformers`` and ``huggingface_hub`` for functions this does not call:
stubbed if not installed. Their progress lines are swallowed.

The encoder: an open_clip ``VisionTransformer`` (32 px, patch 8: 17 tokens; width 32, 2 blocks, MLP
128, 16-d projection) under ``model.visual`` plus CLIP's ``model.text_projection`` (16 x 16) and
``model.logit_scale``, the parameters their ``ImageEncoder`` keeps; experts: the base plus seeded
noise on every parameter, each task its own standard deviation. Two settings: ``homogeneous``
(every task 0.01: gamma near 0, their plain branch) and ``heterogeneous`` (0.01, 0.03, 0.1, 0.3:
update sizes apart by 30x, gamma above 0.3 on every 2-D entry: trace normalisation and spectral
refinement). Each in float32 (as they run) and in float64 (the models in float64 and torch's
default dtype float64 while their code runs, since it makes its accumulator with ``torch.zeros``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from featcal import merge  # noqa: E402
from featcal.baselines import ace  # noqa: E402

FILES = ("src/merge/strategy.py", "utils/task_vector.py", "utils/common.py")
SETTINGS = {"homogeneous": (0.01, 0.01, 0.01, 0.01), "heterogeneous": (0.01, 0.03, 0.1, 0.3)}
COLUMNS = (
    "setting",
    "precision",
    "entry",
    "heterogeneous / entries",
    "max abs diff",
    "max abs update",
    "rel. Frobenius diff",
)
KINDS = (
    "attn.in_proj_weight",
    "attn.out_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
    "positional_embedding",
    "visual.proj",
    "text_projection",
)


def authors_code(path: Path, into: Path) -> Path:
    """The directory holding the authors' three files: ``path`` itself when it is a checkout, else
    ``git archive HEAD`` of them from the git directory ``path`` unpacked in ``into``."""
    if all((path / f).is_file() for f in FILES):
        return path
    archive = into / "authors.tar"
    subprocess.run(["git", "-C", str(path), "archive", "-o", str(archive), "HEAD", *FILES], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def load_authors(root: Path):
    """``(MergeStrategy, TaskVector, apply_to_model)`` imported from ``root``."""
    for name, attrs in (
        ("transformers", ("AutoTokenizer", "AutoConfig", "GenerationConfig")),
        ("huggingface_hub", ("hf_hub_download",)),
    ):
        try:
            importlib.import_module(name)
        except ImportError:  # their utils.common imports these for functions never called here
            sys.modules[name] = types.SimpleNamespace(**dict.fromkeys(attrs))
    for name in ("src", "src.merge", "src.merge.strategy", "utils", "utils.common", "utils.task_vector"):
        sys.modules.pop(name, None)
    sys.path.insert(0, str(root))
    strategy = importlib.import_module("src.merge.strategy")
    task_vector = importlib.import_module("utils.task_vector")
    common = importlib.import_module("utils.common")
    for module in (strategy, task_vector, common):
        if not Path(module.__file__).resolve().is_relative_to(root.resolve()):
            raise SystemExit(f"{module.__name__} was imported from {module.__file__}, not from {root}.")
    return strategy.MergeStrategy, task_vector.TaskVector, common.apply_to_model


def encoder(seed: int = 0) -> nn.Module:
    """A tiny CLIP image encoder: the parameters of open_clip's CLIP without its text tower."""
    from open_clip.transformer import VisionTransformer

    torch.manual_seed(seed)
    model = nn.Module()
    model.visual = VisionTransformer(
        image_size=32, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=4.0, output_dim=16
    )
    model.text_projection = nn.Parameter(torch.randn(16, 16) / 4)
    model.logit_scale = nn.Parameter(torch.tensor(2.659))
    wrapper = nn.Module()
    wrapper.model = model
    return wrapper.eval()


def experts_of(base: nn.Module, stds, seed: int = 0) -> dict[str, nn.Module]:
    """Expert i: ``base`` plus seeded Gaussian noise of standard deviation ``stds[i]`` everywhere."""
    out = {}
    for i, std in enumerate(stds):
        gen = torch.Generator().manual_seed(100 + seed + i)
        e = copy.deepcopy(base)
        with torch.no_grad():
            for p in e.parameters():
                p.add_(std * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
        out[f"t{i}"] = e
    return out


@torch.no_grad()
def authors_merge(authors, base: nn.Module, experts: dict) -> dict:
    """Their step 1 and step 3 on ``base`` and ``experts``: the merged model's state dict."""
    MergeStrategy, TaskVector, apply_to_model = authors
    tvs = []
    for name, e in experts.items():
        tv = TaskVector()
        tv.compute(base, "base", e, name, None)  # their ViT setting: no parameter excluded
        tvs.append(tv)
    with contextlib.redirect_stdout(io.StringIO()):  # their per-layer progress lines
        merged = MergeStrategy(tvs[0].task_vector_param_dict.keys(), tvs, "cpu").ace_merging()
        model = apply_to_model(merged, copy.deepcopy(base), scaling_coefficient=1.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def kind_of(key: str) -> str:
    return next((k for k in KINDS if key.endswith(k)), "every other entry")


def compare(authors, setting: str, dtype: torch.dtype, tasks: int, seed: int) -> list[str]:
    """The table's rows for one setting and precision."""
    base = encoder(seed).to(dtype)
    experts = experts_of(base, SETTINGS[setting][:tasks], seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # their accumulator: torch.zeros in the default dtype
    try:
        theirs = authors_merge(authors, base, experts)
    finally:
        torch.set_default_dtype(default)
    b = base.state_dict()
    sds = {t: e.state_dict() for t, e in experts.items()}
    ours = merge("ace", b, sds, progress=False)
    groups: dict[str, list[str]] = {}
    for k in b:
        groups.setdefault(kind_of(k), []).append(k)
    rows = []
    for kind, keys in groups.items():
        flagged = sum(
            b[k].dim() == 2
            and kind != "text_projection"
            and ace.heterogeneity(torch.stack([sd[k] - b[k] for sd in sds.values()]).double()) > ace.THRESHOLD
            for k in keys
        )
        diff = max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in keys)
        top = max(float((theirs[k].double() - b[k].double()).abs().max()) for k in keys)
        d2 = sum(float((ours[k].double() - theirs[k].double()).square().sum()) for k in keys)
        t2 = sum(float((theirs[k].double() - b[k].double()).square().sum()) for k in keys)
        rel = (d2 / t2) ** 0.5 if t2 > 0 else 0.0
        precision = str(dtype).removeprefix("torch.")
        rows.append(
            f"| {setting} | {precision} | {kind} | {flagged} / {len(keys)} | {diff:.1e} | {top:.2e} | {rel:.1e} |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--authors", type=Path, required=True, help="a checkout or git directory of unravel-xu/ACE-Merging")
    ap.add_argument("--tasks", type=int, default=4, choices=range(2, 5))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        authors = load_authors(authors_code(args.authors, Path(tmp)))
        print("| " + " | ".join(COLUMNS) + " |")
        print("|---|---|---|---:|---:|---:|---:|")
        for setting in SETTINGS:
            for dtype in (torch.float32, torch.float64):
                print("\n".join(compare(authors, setting, dtype, args.tasks, args.seed)))


if __name__ == "__main__":
    main()

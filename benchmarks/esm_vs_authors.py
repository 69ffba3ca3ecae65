"""Ours (featcal.merge_with_data("esm", recipe="vit")) against the ESM authors' ViT code on the same
tiny open_clip ViT, experts and images: the largest difference per kind of entry.

The authors' code is not vendored: pass the path of a bare git mirror of github
kiddo127/ESM (``--mirror``); the two files this needs, ``ESM-ViT/essential_subspace_decomposition.py``
(the ESD hooks and ``_compute_esd``) and ``ESM-ViT/src/utils/esm_utils.py`` (``esm_merge``), are
``git archive``-d into a temporary folder and imported there. Their imports of the rest of their
package (datasets, checkpoints, heads) are stubbed: the hooks and the merge read none of it.
Their code calls ``.cuda()``; on a machine without a GPU that is made a no-op for the run.

Their hooks run on each expert (the fine-tuned model), ours collects the same inputs through
:func:`featcal.baselines.regmean.block_input_stats`. Expected: the MLP weights (``c_fc``, ``c_proj``:
the same decomposition) and every entry outside the blocks' Linears (TSV, mean) equal to float32
round-off; the attention weights differ by design (theirs: q/k/v decomposed as one packed matrix,
``out_proj`` by TSV; ours: each of the four Linears decomposed, as their RoBERTa code does). With
fewer token rows than a Linear's outputs (``--examples 2``) their SVD basis is padded with identity
columns, which changes the task norms of the ViT recipe: the MLP weights then differ as well.

    python benchmarks/esm_vs_authors.py --mirror /work/.mirror/kiddo127+ESM/repo
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from featcal import merge_with_data  # noqa: E402

FILES = ("ESM-ViT/essential_subspace_decomposition.py", "ESM-ViT/src/utils/esm_utils.py")
STUBS = (
    "src",
    "src.models",
    "src.models.task_vectors",
    "src.utils",
    "src.utils.variables_and_paths",
    "src.models.heads",
    "src.models.modeling",
    "src.datasets",
    "src.datasets.registry",
    "src.datasets.common",
)


def load_authors(mirror: Path, into: Path):
    """``(esd_module, esm_utils_module)`` from the mirror's HEAD, archived into ``into``."""
    tar = into / "esm.tar"
    subprocess.run(["git", "-C", str(mirror), "archive", "-o", str(tar), "HEAD", *FILES], check=True)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    for name in STUBS:  # their package's other modules: never called by the hooks or the merge
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        for attr in ("NonLinearTaskVector", "get_finetuned_path", "get_zeroshot_path", "get_classification_head"):
            setattr(mod, attr, None)
        for attr in ("ImageClassifier", "get_dataset", "get_dataloader", "maybe_dictionarize", "utils"):
            setattr(mod, attr, None)
    out = []
    for f in FILES:
        spec = importlib.util.spec_from_file_location(Path(f).stem, into / f)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out.append(module)
    return out


def zoo(n_tasks: int, examples: int, seed: int = 0):
    """A tiny open_clip ViT (32 px, patch 8: 17 tokens; width 32, MLP 128), ``n_tasks`` experts
    (seeded noise 0.05 on every parameter) and ``examples`` random images a task."""
    from open_clip.transformer import VisionTransformer

    torch.manual_seed(seed)
    base = VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=4.0, output_dim=16)
    base.eval()
    experts = {}
    for i in range(n_tasks):
        gen = torch.Generator().manual_seed(100 + i)
        e = copy.deepcopy(base)
        with torch.no_grad():
            for p in e.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        experts[f"t{i}"] = e
    gen = torch.Generator().manual_seed(7)
    data = {t: [torch.randn(examples, 3, 32, 32, generator=gen)] for t in experts}
    return base, experts, data


@torch.no_grad()
def authors_merge(esd_mod, utils_mod, base, experts, data) -> dict:
    """Their ESD hooks on each expert on its own images, then their ``esm_merge``: base + merged."""
    base_sd = base.state_dict()
    tvs = {
        t: types.SimpleNamespace(vector={k: v - base_sd[k] for k, v in e.state_dict().items()})
        for t, e in experts.items()
    }
    esd = {}
    for t, e in experts.items():
        esd[t], handles, params = {}, [], dict(e.named_parameters())
        for name, module in e.named_modules():
            if name.endswith(".mlp.c_fc") or name.endswith(".mlp.c_proj"):
                hook = esd_mod._make_esd_hook(name, tvs[t].vector[name + ".weight"], esd[t])
            elif name.endswith(".attn"):
                w, b = params[name + ".in_proj_weight"], params[name + ".in_proj_bias"]
                dq, do = tvs[t].vector[name + ".in_proj_weight"], tvs[t].vector[name + ".out_proj.weight"]
                hook = esd_mod._make_attn_esd_hook(name, w, b, dq, do, esd[t])
            else:
                continue
            handles.append(module.register_forward_hook(hook))
        e(data[t][0])
        for h in handles:
            h.remove()
    cfg = types.SimpleNamespace(DATASETS=list(experts), device="cpu")
    with contextlib.redirect_stdout(io.StringIO()):  # their progress lines
        new = utils_mod.esm_merge(tvs, cfg, None, esd)
    return {k: base_sd[k] + new[k] for k in base_sd}


def kind_of(key: str) -> str:
    for part in ("mlp.c_fc.weight", "mlp.c_proj.weight", "attn.in_proj_weight", "attn.out_proj.weight"):
        if part in key:
            return part
    return "every other entry"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mirror", type=Path, default=Path("/work/.mirror/kiddo127+ESM/repo"))
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--examples", type=int, nargs="+", default=[16, 2])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *a, **k: self  # their code moves tensors to the GPU
    with tempfile.TemporaryDirectory() as tmp:
        esd_mod, utils_mod = load_authors(args.mirror, Path(tmp))
    print("| examples a task | token rows | entry | max abs diff | max abs entry | rel. Frobenius diff |")
    print("|---:|---:|---|---:|---:|---:|")
    for n in args.examples:
        base, experts, data = zoo(args.tasks, n)
        theirs = authors_merge(esd_mod, utils_mod, base, experts, data)
        ours = merge_with_data("esm", base=base, experts=experts, calib_data=data, recipe="vit", progress=False)
        ours = ours.state_dict()
        base_sd = base.state_dict()
        groups: dict[str, list] = {}
        for k in base_sd:
            if base_sd[k].is_floating_point():
                groups.setdefault(kind_of(k), []).append(k)
        for kind, keys in groups.items():
            diff = max(float((ours[k] - theirs[k]).abs().max()) for k in keys)
            top = max(float(theirs[k].abs().max()) for k in keys)
            d2 = sum(float((ours[k] - theirs[k]).square().sum()) for k in keys)
            t2 = sum(float((theirs[k] - base_sd[k]).square().sum()) for k in keys)
            rel = (d2 / t2) ** 0.5 if t2 > 0 else 0.0
            print(f"| {n} | {n * 17} | {kind} | {diff:.1e} | {top:.2f} | {rel:.1e} |")


if __name__ == "__main__":
    main()

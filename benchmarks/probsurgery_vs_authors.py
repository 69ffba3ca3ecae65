"""featcal's ProbSurgery against the authors' own module, step by step, on the same tiny tensors.

    python benchmarks/probsurgery_vs_authors.py --authors /work/.mirror/1998v7+ProbSurgery/repo
    python benchmarks/probsurgery_vs_authors.py --authors PATH --steps 200 --hidden 128 --width 64

``--authors``: the authors' repository (github 1998v7/ProbSurgery): a git directory (its ``HEAD``
is extracted with ``git archive`` into a temporary directory; nothing is vendored) or a checkout
holding ``code/src_ours``. Their ``src_ours.merging_model`` is imported from there.

Ours: :func:`featcal.probsurgery` on a tiny random CLIP vision tower with a projection (the
merged model: a seeded perturbation of it; expert i: another), all its defaults but ``steps``,
``rank`` (``--hidden``) and the training examples. Theirs: their ``AlphaWrapper`` (per-task
modules, ``one=False``) built without its ``__init__`` (which merges checkpoints and loads
classification heads from disk): ``torch.nn.Module.__init__`` only, then the three Linears
(``up_proj``, ``linear_mean``, ``linear_var``) set as their ``__init__`` sets them except that
``up_proj`` starts from our ``W_in`` (the same kaiming-uniform law, our seeded draw), the merged
encoder an identity on the merged model's final embeddings (their forward detaches it anyway),
the classification head an identity. Each step runs their ``forward`` (reparameterised sample,
``KL_reg``) on the minibatch our run drew, and their training step's loss, ``L1Loss(revised,
expert features) + KL_weight * kl``, with Adam over their ``collect_trainable_params()``. Their
noise is ``torch.randn_like`` on the global generator; it is seeded with our noise seed
(``seed + 1``), so both draw the same ``eps``.

Prints the largest difference per step of the losses, of the parameters at the end, and of the
corrected embeddings at inference (ours: the task's model; theirs: ``get_surgery_feature``).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tarfile
import tempfile
from argparse import Namespace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from benchmarks._common import _perturbed  # noqa: E402
from featcal import ProbSurgeryOptions, probsurgery  # noqa: E402
from featcal.baselines.examples import ExamplePool  # noqa: E402
from featcal.baselines.trained.probsurgery import ProbSurgeryAdapter  # noqa: E402


def authors_code(path: Path, into: Path) -> Path:
    """The directory holding the authors' ``src_ours`` (their ``code/``): ``path`` itself when it
    is a checkout, else ``git archive HEAD code`` of the git directory ``path`` unpacked in ``into``."""
    if (path / "code" / "src_ours").is_dir():
        return path / "code"
    archive = into / "authors.tar"
    subprocess.run(["git", "-C", str(path), "archive", "-o", str(archive), "HEAD", "code"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    if not (into / "code" / "src_ours").is_dir():
        raise SystemExit(f"{path}: no code/src_ours in its HEAD; pass the ProbSurgery repository.")
    return into / "code"


def tiny_models(width: int, seed: int):
    """A random CLIP vision tower (2 blocks of ``width``, a ``width``-d projection), the merged
    model and expert i as seeded perturbations of it."""
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    cfg = CLIPVisionConfig(
        image_size=16,
        patch_size=8,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=width,
    )
    base = CLIPVisionModelWithProjection(cfg).eval()
    return _perturbed(base, 0.02, seed + 1), _perturbed(base, 0.05, seed + 2)


def their_wrapper(merging_model, W_in: torch.Tensor) -> nn.Module:
    """Their ``AlphaWrapper`` for one task ``"t"``, built as the module docstring says."""
    d = W_in.shape[1]
    wrapper = merging_model.AlphaWrapper.__new__(merging_model.AlphaWrapper)
    nn.Module.__init__(wrapper)
    wrapper.args, wrapper.exam_datasets = Namespace(one=False), ["t"]
    wrapper.model, wrapper.non_linear_func = nn.Identity(), nn.ReLU()
    up = nn.Linear(d, W_in.shape[0], bias=False)
    with torch.no_grad():
        up.weight.copy_(W_in)
    mean, var = nn.Linear(W_in.shape[0], d, bias=False), nn.Linear(W_in.shape[0], d, bias=False)
    nn.init.zeros_(mean.weight), nn.init.zeros_(var.weight)
    wrapper.add_module("feature_mapping_to_head_up_proj_t", up)
    wrapper.add_module("feature_mapping_to_head_mean_proj_t", mean)
    wrapper.add_module("feature_mapping_to_head_var_proj_t", var)
    wrapper.add_module("classifier_t", nn.Identity())
    return wrapper


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--authors", required=True, type=Path, help="the ProbSurgery repository (git dir or checkout)")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--hidden", type=int, default=128, help="h (the authors' --hidden_layer)")
    ap.add_argument("--width", type=int, default=32, help="the tiny tower's width and embedding width")
    ap.add_argument("--examples", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    merged, expert = tiny_models(args.width, args.seed)
    x = torch.randn(args.examples, 3, 16, 16, generator=torch.Generator().manual_seed(args.seed + 3))
    opts = ProbSurgeryOptions(steps=args.steps, rank=args.hidden, seed=args.seed, progress=False)
    cal = probsurgery(merged, {"t": expert}, {"t": [x]}, opts)
    ours = cal.modules["t"]["embedding"]

    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(authors_code(args.authors, Path(tmp))))
        import src_ours.merging_model as merging_model

        with torch.no_grad():
            z = torch.cat([merged(pixel_values=b).image_embeds for b in x.split(opts.batch)])
            t = torch.cat([expert(pixel_values=b).image_embeds for b in x.split(opts.batch)])
        start = ProbSurgeryAdapter(z.shape[1], args.hidden, torch.Generator().manual_seed(args.seed))
        theirs = their_wrapper(merging_model, start.W_in.detach())
        optimizer = torch.optim.Adam(
            theirs.collect_trainable_params(), lr=opts.lr, betas=(0.9, 0.999), weight_decay=0.0
        )
        draws = ExamplePool([x]).draws(opts.batch, torch.Generator().manual_seed(args.seed))
        torch.manual_seed(args.seed + 1)  # their eps: torch.randn_like on the global generator
        losses = []
        for _ in range(args.steps):
            _, idx = next(draws)
            _, revised, _, kl = theirs(z[idx], "t")
            loss = torch.nn.L1Loss()(revised, t[idx]) + opts.kl_weight * kl
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        with torch.no_grad():
            their_eval = theirs.get_surgery_feature(z, "t")
            our_eval = cal.for_task("t")(pixel_values=x).image_embeds

    ours_losses = cal.runs["t"].losses
    pairs = {"W_in": "up_proj", "W_mu": "mean_proj", "W_s": "var_proj"}
    param_diff = {
        k: float((getattr(ours, k) - getattr(theirs, f"feature_mapping_to_head_{v}_t").weight).abs().max())
        for k, v in pairs.items()
    }
    loss_diff = max(abs(a - b) for a, b in zip(ours_losses, losses))
    print(
        f"torch {torch.__version__}; {args.steps} steps, h {args.hidden}, d {z.shape[1]}, batch {opts.batch}, "
        f"{args.examples} examples, lr {opts.lr:g}, KL weight {opts.kl_weight:g}"
    )
    print(
        f"loss: first {ours_losses[0]:.6f} (theirs {losses[0]:.6f}), last {ours_losses[-1]:.6f} "
        f"(theirs {losses[-1]:.6f}); largest difference over the steps {loss_diff:.3g}"
    )
    for k, v in param_diff.items():
        print(
            f"{k} ({pairs[k]}) after {args.steps} steps: largest difference {v:.3g}, "
            f"largest entry {float(getattr(ours, k).abs().max()):.3g}"
        )
    inference = float((our_eval - their_eval).abs().max())
    print(f"inference (z - mu): largest difference {inference:.3g}, largest entry {float(our_eval.abs().max()):.3g}")
    if not math.isfinite(loss_diff):
        raise SystemExit("a loss was not finite")


if __name__ == "__main__":
    main()

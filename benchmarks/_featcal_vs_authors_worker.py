"""One side of benchmarks/featcal_vs_authors.py, in its own process: ``ours`` or ``theirs``.

    python benchmarks/_featcal_vs_authors_worker.py ours|theirs WORKDIR

Both load the same saved models (``WORKDIR/base``, ``merged``, ``experts/<task>``: Hugging Face
``CLIPVisionModel`` folders) and images (``WORKDIR/images.safetensors``, ``<task>.<batch>``),
calibrate once with the setting of ``WORKDIR/run.json``, and write the calibrated state dict
(``<side>.safetensors``) and ``<side>.json`` (wall time of the calibration, peak RSS, threads).

``theirs`` runs the FeatCal authors' ``CLIPFeatCalibrator`` from ``PYTHONPATH`` (their package is
also named ``featcal``: this process must never import ours, so the parent sets ``PYTHONPATH`` to
their ``src`` alone). Their ``prepare_first_layer_inputs`` reads Hugging Face datasets by task
name; it is replaced here by one that feeds the saved images, batch by batch, through their own
``_clip_first_layer_input``. Peak RSS is read with our ``featcal/util/memory.py`` loaded as a
file (standard library only), not as part of our package.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]


def _memory_module():
    """Our featcal/util/memory.py as a stand-alone module (no ``featcal`` package import)."""
    spec = importlib.util.spec_from_file_location("featcal_memory_file", REPO_ROOT / "featcal/util/memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_inputs(workdir: Path):
    """``(spec, base, merged, experts, images)`` as the parent saved them."""
    from safetensors.torch import load_file
    from transformers import CLIPVisionModel

    spec = json.loads((workdir / "run.json").read_text())
    load = lambda p: CLIPVisionModel.from_pretrained(str(p), dtype=torch.float32).eval()  # noqa: E731
    experts = {t: load(workdir / "experts" / t) for t in spec["tasks"]}
    flat = load_file(str(workdir / "images.safetensors"))
    images = {t: [flat[f"{t}.{i}"] for i in range(spec["batches"][t])] for t in spec["tasks"]}
    return spec, load(workdir / "base"), load(workdir / "merged"), experts, images


def run_ours(spec, base, merged, experts, images):
    """Our ``featcal.calibrate`` with the CLIP preset at the authors' defaults."""
    sys.path.insert(0, str(REPO_ROOT))
    from featcal import FeatCalConfig, calibrate

    ours = spec["ours"]
    dtype = getattr(torch, spec.get("ours_stats_dtype", "float32"))
    cfg = FeatCalConfig.clip(lam=ours["lam"], rho=ours["rho"], alpha=ours["alpha"], eps=ours["eps"], stats_dtype=dtype)
    dev = torch.device(spec["device"])
    t0 = time.perf_counter()
    on = None if dev.type == "cpu" else dev  # on a GPU one block at a time, as theirs moves layers
    model, _ = calibrate(merged, base=base, experts=experts, calib_data=images, config=cfg, progress=False, device=on)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return model, time.perf_counter() - t0, repr(cfg)


class VisionModelShim(torch.nn.Module):
    """A ``CLIPVisionModel`` seen as transformers 4 laid it out: their code reads
    ``model.vision_model.embeddings`` (and ``.pre_layrnorm``, ``.encoder.layers``); transformers 5
    puts those on the ``CLIPVisionModel`` itself. The same modules, not copies."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.vision_model = model if not hasattr(model, "vision_model") else model.vision_model


def run_theirs(spec, base, merged, experts, images):
    """The authors' ``CLIPFeatCalibrator.calibrate`` at their ``FeatCalConfig()`` defaults, fed
    the saved images through their ``_clip_first_layer_input``."""
    import featcal
    from featcal import featcal as authors

    if Path(featcal.__file__).resolve().is_relative_to(REPO_ROOT):
        raise SystemExit(f"imported our featcal ({featcal.__file__}), not the authors': check PYTHONPATH")
    cfg = authors.FeatCalConfig()
    got = {k: getattr(cfg, k) for k in spec["theirs"]}
    if got != spec["theirs"]:
        raise SystemExit(f"the authors' FeatCalConfig defaults changed: {got}, expected {spec['theirs']}")
    dev = torch.device(spec["device"])

    @torch.no_grad()
    def prepare_first_layer_inputs(self, *, merged_model, expert_models, tasks):
        student, expert = {}, {}
        merged_model.to(self.device).eval()
        for task in tasks:
            model = expert_models[task].to(self.device).eval()
            batches = [x.to(self.device) for x in images[task]]
            student[task] = [authors._clip_first_layer_input(merged_model, x).detach().cpu() for x in batches]
            expert[task] = [authors._clip_first_layer_input(model, x).detach().cpu() for x in batches]
            model.to("cpu")
        return student, expert

    authors.CLIPFeatCalibrator.prepare_first_layer_inputs = prepare_first_layer_inputs
    calibrator = authors.CLIPFeatCalibrator(cfg, processor=None, device=dev)
    wrap = VisionModelShim
    t0 = time.perf_counter()
    model = calibrator.calibrate(
        merged_model=wrap(merged),
        base_model=wrap(base),
        expert_models={t: wrap(m) for t, m in experts.items()},
        tasks=spec["tasks"],
    ).vision_model
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return model, time.perf_counter() - t0, repr(cfg)


def main(side: str, workdir: Path) -> None:
    from safetensors.torch import save_file

    spec, base, merged, experts, images = load_inputs(workdir)
    torch.set_num_threads(spec["threads"])
    run = {"ours": run_ours, "theirs": run_theirs}[side]
    with torch.no_grad():
        model, seconds, config = run(spec, base, merged, experts, images)
    sd = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    save_file(sd, str(workdir / f"{side}.safetensors"))
    out = dict(seconds=seconds, peak_rss_mb=_memory_module().peak_rss_mb(), threads=torch.get_num_threads())
    (workdir / f"{side}.json").write_text(json.dumps({**out, "config": config}))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("ours", "theirs"):
        raise SystemExit(__doc__)
    main(sys.argv[1], Path(sys.argv[2]))

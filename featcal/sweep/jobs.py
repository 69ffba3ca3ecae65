"""The jobs of a sweep (:mod:`featcal.sweep.search`) and where they run.

- scoring on validation data: :func:`val_scores` (accuracy, or ``-KL(expert || model)``);
- two jobs, each a pure function of one shipped :class:`Work` bundle and its item:
  :func:`preview_job` (a batch of points, re-solved from the kept statistics) and
  :func:`exact_job` (one forward-order FeatCal run);
- two runners with one ``map``: :class:`Local` (this process, in order) and
  :class:`RayRunner` (Ray tasks, one CPU each, the bundle shipped once with
  ``ray.put``; results gathered in submission order), on a Ray started here or on an
  existing cluster (``address``: ``"auto"`` or ``HOST:PORT``, featcal's code shipped to it). The same job functions on
  the same inputs in the same order give the same results on both.
"""

from __future__ import annotations

import copy
import math
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import nn

from featcal.config import FeatCalConfig, Setting
from featcal.engine.preview import Preview
from featcal.engine.run import calibrate
from featcal.model import arch
from featcal.util.metrics import kl_rows
from featcal.util.progress import bar

Point = tuple[float, float, float]  # (lam, rho, alpha)
Logits = Callable[[nn.Module, str, torch.Tensor], torch.Tensor]
ValData = Mapping[str, tuple[torch.Tensor, torch.Tensor | None]]


# ------------------------------------------------------------------ scoring


def model_logits(model: nn.Module, task: str, x: torch.Tensor) -> torch.Tensor:
    """Default ``logits``: the model's own output (one head for every task)."""
    return model(x)


@dataclass
class HeadLogits:
    """``logits(model, task, x)`` through frozen per-task heads (a zoo's ``features`` + ``heads``),
    small enough to ship to Ray workers without the zoo's data."""

    features: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    heads: Mapping[str, nn.Linear]

    def __call__(self, model: nn.Module, task: str, x: torch.Tensor) -> torch.Tensor:
        head = self.heads[task]
        x = x.to(next(model.parameters()).device)
        return head(self.features(model, x).to(device=head.weight.device, dtype=head.weight.dtype))


@torch.no_grad()
def all_logits(model: nn.Module, logits: Logits, task: str, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    model.eval()
    return torch.cat([logits(model, task, xb).cpu() for xb in x.split(batch_size)])  # (n, classes)


def val_scores(
    model: nn.Module,
    val: ValData,
    logits: Logits,
    kind: str,
    ref: Mapping[str, torch.Tensor] | None,
    batch_size: int = 256,
) -> dict[str, float]:
    """Per-task score (higher is better): accuracy in percent, or ``-KL(expert || model)``."""
    out = {}
    for task, (x, y) in val.items():
        z = all_logits(model, logits, task, x, batch_size)
        if kind == "accuracy":
            out[task] = 100.0 * float((z.argmax(-1).cpu() == y).double().mean())
        else:
            out[task] = -float(kl_rows(ref[task], z).mean())
    return out


# ------------------------------------------------------------------ jobs (run here or as Ray tasks)


@dataclass
class Work:
    """Everything a job needs; shipped once to Ray's object store."""

    merged: nn.Module
    base: nn.Module
    experts: Mapping[str, nn.Module]
    calib_data: Mapping[str, list]
    val: ValData
    logits: Logits
    kind: str
    ref: Mapping[str, torch.Tensor] | None
    config: FeatCalConfig
    preview: Preview
    batch_size: int


def preview_job(work: Work, points: Sequence[Point]) -> list[dict[str, float]]:
    model = copy.deepcopy(work.preview.template)
    out = []
    for lam, rho, alpha in points:
        work.preview.load_into(model, Setting(lam, rho, alpha))
        out.append(val_scores(model, work.val, work.logits, work.kind, work.ref, work.batch_size))
    return out


def config_of(work: Work, at: Point | FeatCalConfig) -> FeatCalConfig:
    """The exact run's config at ``at``: a point ``(lam, rho, alpha)`` of the anchor's config, or a
    config of its own (a per-block schedule)."""
    if isinstance(at, FeatCalConfig):
        return at
    lam, rho, alpha = at
    return work.config.with_(lam=lam, rho=rho, alpha=alpha)


def exact_job(work: Work, at: Point | FeatCalConfig) -> dict:
    """One exact run at ``at`` (:func:`config_of`); a run that diverges (NaN/Inf, e.g. a tiny lam) scores NaN."""
    config = config_of(work, at)
    t0 = time.perf_counter()
    try:
        model, _ = calibrate(
            work.merged,
            base=work.base,
            experts=work.experts,
            calib_data=work.calib_data,
            config=config,
            progress=False,
        )
    except FloatingPointError as err:
        where = f"lam={config.lam:g}, rho={config.rho:g}, alpha={config.alpha:g}"
        where += f", schedule {config.to_dict()['schedule']}" if config.schedule else ""
        warnings.warn(f"exact run at {where} failed: {err}", stacklevel=2)
        return {"scores": {t: math.nan for t in work.val}, "rel_dist": math.nan, "seconds": time.perf_counter() - t0}
    seconds = time.perf_counter() - t0
    return {
        "scores": val_scores(model, work.val, work.logits, work.kind, work.ref, work.batch_size),
        "rel_dist": preview_distance(work.preview, config, model),
        "seconds": seconds,
    }


@torch.no_grad()
def preview_distance(preview: Preview, at: Point | FeatCalConfig, exact: nn.Module) -> float:
    """``||theta_preview - theta_exact||_F / ||theta_exact||_F`` over every calibrated parameter,
    the preview at ``at``: a point ``(lam, rho, alpha)`` or a config (its schedule too)."""
    blks = arch.all_blocks(exact, preview.blocks_path)
    num = den = 0.0
    for blk, t, W, b in preview.params(at if isinstance(at, FeatCalConfig) else Setting(*at)):
        for p, e in zip((W, b), arch.get_params(blks[blk], t)):
            if p is not None and e is not None:
                num += float((p.double() - e.double()).pow(2).sum())
                den += float(e.double().pow(2).sum())
    return math.sqrt(num / max(den, 1e-300))


class Local:
    """Runs jobs one after another in this process."""

    def __init__(self, work: Work, progress: bool = False):
        self.work, self.slots, self.progress = work, 1, progress

    def map(self, fn, items: Sequence, desc: str = "") -> list:
        out = []
        with bar(total=len(items), desc=desc, unit="job", show=self.progress) as b:
            for it in items:
                out.append(fn(self.work, it))
                b.update()
        return out

    def close(self) -> None:
        pass


class RayRunner:
    """Runs jobs as Ray tasks (one CPU each); results come back in submission order."""

    def __init__(self, work: Work, num_cpus: int | None, progress: bool = False, address: str | None = None):
        import ray

        self.ray, self.progress = ray, progress
        self.started = not ray.is_initialized()
        if self.started and address is not None:  # an existing cluster: its CPUs, our code shipped
            if num_cpus is not None:
                raise ValueError("num_cpus is for a Ray started here; a cluster at ray_address has its own CPUs.")
            ray.init(address=address, log_to_driver=False, runtime_env={"py_modules": [_package_dir()]})
        elif self.started:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        self.slots = max(1, int(ray.available_resources().get("CPU", 1)))
        self.ref = ray.put(work)
        self._remote = {}

    def map(self, fn, items: Sequence, desc: str = "") -> list:
        remote = self._remote.setdefault(fn, self.ray.remote(num_cpus=1)(fn))
        refs = [remote.remote(self.ref, it) for it in items]
        pending = list(refs)
        with bar(total=len(refs), desc=desc, unit="job", show=self.progress) as b:
            while pending:
                done, pending = self.ray.wait(pending, num_returns=1)
                b.update(len(done))
        return self.ray.get(refs)

    def close(self) -> None:
        del self.ref
        if self.started:
            self.ray.shutdown()


def _package_dir() -> str:
    """featcal's package directory (shipped to a Ray cluster's workers: the same code runs there)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # featcal/sweep/jobs.py -> featcal/


def runner(work: Work, use_ray: bool | str, num_cpus: int | None, progress: bool = False):
    """Where the jobs run: ``use_ray`` False (this process), True (Ray started here, or the one
    already initialised) or a cluster's address (``"auto"``, ``HOST:PORT``, ``ray://HOST:PORT``)."""
    if use_ray:
        try:
            return RayRunner(work, num_cpus, progress, use_ray if isinstance(use_ray, str) else None)
        except ImportError:
            warnings.warn(
                "ray=True but Ray is not installed (pip install 'featcal[tune]'); running in one process.", stacklevel=3
            )
    return Local(work, progress)


def chunks(points: Sequence[Point], n: int) -> list[list[Point]]:
    """Contiguous, order-keeping chunks (one per worker)."""
    n = max(1, min(n, len(points)))
    size = math.ceil(len(points) / n) if points else 1
    return [list(points[i : i + size]) for i in range(0, len(points), size)]

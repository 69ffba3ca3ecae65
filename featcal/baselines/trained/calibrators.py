"""Trained post-merging calibrators: task-specific modules added to a merged model and trained
to pull its features toward each expert's. featcal implements them to compare FeatCal with
(FeatCal adds no module and trains nothing).

- :func:`escal` (Error-Subspace Calibration): a bridge ``h <- h + U_w A U_r^T h`` after every
  block, with fixed bases from the merging errors and only ``A`` (``r x r``) trained (MSE).
- Representation Surgery and SurgeryV2 (:mod:`featcal.baselines.trained.surgery`):
  ``z <- z - W_up ReLU(W_down z)`` on the final embedding (and after every block: SurgeryV2).

Each returns a :class:`TaskCalibrated`, whose ``for_task(task)`` is the merged model with that
task's modules inside its blocks (so ``featcal.evaluate`` and the diagnostics run on it), with
its added parameters, its training time and its measured inference overhead. Unlike the Surgery
papers (trained on unlabeled test data), training uses only the calibration data given. The
models given are never changed.

Usage::

    cal = featcal.escal(merged, experts, zoo.calib_data(64), featcal.ESCalOptions(rank=64, epochs=200, device="cpu"))
    featcal.evaluate(cal.for_task("digits"), zoo, tasks=["digits"])
    cal.added_parameters, cal.training_seconds, cal.measure_overhead(batch)
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from featcal.baselines.trained.modules import Bridge, error_bases, escal_weights, frozen, insert
from featcal.baselines.trained.training import TOKENS, Schedule, TaskRun, TrainOptions, block_weights, train_task
from featcal.model.arch import resolve_blocks
from featcal.model.modes import eval_mode
from featcal.model.streams import call_model, device_of, to_device
from featcal.model.validate import check_same_params, check_tasks
from featcal.util.options import option

LAST_READ = ("write", "own_qkv")


@dataclass
class TaskCalibrated:
    """A merged model plus trained task-specific modules: what a calibrator returns.

    Attributes:
        method: ``escal``, ``surgery`` or ``surgery_v2``.
        merged: the calibrator's own copy of the merged model (on the training device).
        blocks: the dotted path of the model's blocks.
        modules: ``{task: {block index: module}}``; a module acts on that block's output (the
            key ``"embedding"``: on the output of the submodule ``embedding`` names).
        runs: ``{task: TaskRun}``: the loss at every step and the training seconds.
        settings: the hyper-parameters used.
        inference_overhead: the last :meth:`measure_overhead` result (None before).
    """

    method: str
    merged: nn.Module
    blocks: str
    modules: dict[str, dict[int, nn.Module]]
    runs: dict[str, TaskRun]
    settings: dict[str, Any]
    inference_overhead: dict[str, float] | None = field(default=None)
    embedding: str | None = None  # the submodule whose output the "embedding" module acts on

    @property
    def tasks(self) -> list[str]:
        return list(self.modules)

    def for_task(self, task: str) -> nn.Module:
        """A new model: the merged model with ``task``'s modules after their blocks (as buffers,
        so its parameters are the merged model's, under the same names)."""
        if task not in self.modules:
            raise KeyError(f"no modules for task {task!r}; this {self.method} calibration has {self.tasks}.")
        model = copy.deepcopy(self.merged)
        _, blks = resolve_blocks(model, self.blocks)
        for l, module in self.modules[task].items():
            host = blks[l] if l != "embedding" else (model.get_submodule(self.embedding) if self.embedding else model)
            insert(host, frozen(copy.deepcopy(module)))
        return model.eval()

    @property
    def added_parameters(self) -> dict[str, Any]:
        """Numbers added per task (``trained``: optimised; ``stored``: trained plus fixed bases),
        their totals over tasks, and ``stored_fraction``: one task's stored numbers over the
        merged model's parameters."""
        per_task = {
            t: {
                "trained": sum(p.numel() for m in mods.values() for p in m.parameters()),
                "stored": sum(p.numel() for m in mods.values() for p in (*m.parameters(), *m.buffers())),
            }
            for t, mods in self.modules.items()
        }
        n_model = sum(p.numel() for p in self.merged.parameters())
        stored = [v["stored"] for v in per_task.values()]
        return {
            "per_task": per_task,
            "trained": sum(v["trained"] for v in per_task.values()),
            "stored": sum(stored),
            "stored_fraction": max(stored) / n_model,
        }

    @property
    def training_seconds(self) -> float:
        """Wall-clock seconds of training, all tasks (the experts' targets included)."""
        return sum(r.seconds for r in self.runs.values())

    @torch.no_grad()
    def measure_overhead(self, batch: Any, task: str | None = None, repeats: int = 5) -> dict[str, float]:
        """Time one forward pass on ``batch`` without and with ``task``'s modules (default: the
        first task): medians of ``repeats`` calls each, the two models taking turns, after one
        warm-up call each. Returns (and keeps as :attr:`inference_overhead`) ``seconds_merged``,
        ``seconds_calibrated`` and ``overhead`` (their ratio minus 1)."""
        with_mods = self.for_task(task or self.tasks[0])
        seconds = forward_seconds({"seconds_merged": self.merged, "seconds_calibrated": with_mods}, batch, repeats)
        seconds["overhead"] = seconds["seconds_calibrated"] / seconds["seconds_merged"] - 1.0
        self.inference_overhead = seconds
        return seconds


@torch.no_grad()
def forward_seconds(models: Mapping[str, nn.Module], batch: Any, repeats: int = 5) -> dict[str, float]:
    """``{name: seconds}``: the median of ``repeats`` forward passes of each model on ``batch``
    (moved to the first model's device), after one warm-up call each, the models taking turns so
    that a change in the machine's load hits all of them; each model in eval mode meanwhile."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}.")
    batch = to_device(batch, device_of(next(iter(models.values()))))
    times: dict[str, list[float]] = {name: [] for name in models}
    with eval_mode(*models.values()):
        for model in models.values():
            call_model(model, batch)
        for _ in range(repeats):
            for name, model in models.items():
                times[name].append(_timed(model, batch))
    return {name: statistics.median(ts) for name, ts in times.items()}


def _timed(model: nn.Module, batch: Any) -> float:
    sync = torch.cuda.synchronize if device_of(model).type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    call_model(model, batch)
    sync()
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- ESCal


@dataclass(frozen=True)
class ESCalOptions(TrainOptions):
    """ESCal's options (:func:`escal`): the training's (:class:`TrainOptions`) with ESCal's
    defaults (rank 128, lr 3e-3), its length in ``epochs`` and where the paper is silent,
    featcal's choices (each an option):

    - ``last_read``: the last block has no block l+1; ``"write"`` (default) reads it through
      its own write basis (the bridge maps the error subspace into itself), ``"own_qkv"``
      through the last block's own q/k/v error.
    - ``block_weights``: the loss weight of each block's MSE (default: equal weights; given
      weights are normalised to sum 1).
    - ``lr``: 3e-3 (Adam; of 1e-3, 3e-3 and 1e-2, the best on the demo zoo's val split for two
      tasks at 100 epochs). ``tokens``: ``"all"`` (every non-padding token) or ``"cls"``.

    ``rank`` is capped by the model's width. ``epochs``: passes over each task's examples,
    counted whatever the batching (minibatches of ``batch`` drawn from the pooled examples; when
    the batches cannot be pooled, padding masks of several lengths, one step per given batch).
    docs/maths.md ("ESCal") sets these choices beside the paper's. ``qkv`` / ``mlp_out`` name
    the projections (target names of :func:`featcal.model.arch.block_targets`) when the
    architecture is not in :data:`featcal.baselines.trained.modules.ESCAL_TABLE` (HF CLIP,
    open_clip, Llama, BERT).
    """

    LENGTH = "epochs"

    rank: int = option(128, "rank r of each bridge (capped by the model's width)")
    lr: float = option(3e-3, "Adam's learning rate")
    epochs: int = option(200, "passes over each task's examples")
    block_weights: Sequence[float] | None = option(None, "loss weight of each block (default: equal)")
    last_read: str = option("write", "how the last block's bridge reads", choices=LAST_READ)
    qkv: tuple[str, ...] | None = option(None, "the q/k/v projections' names, for architectures featcal does not know")
    mlp_out: str | None = option(None, "the MLP output projection's name, for architectures featcal does not know")
    tokens: str = option("all", "the tokens the loss reads: every non-padding one, or the first", choices=TOKENS)


def escal(
    merged: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    options: ESCalOptions = ESCalOptions(),
) -> TaskCalibrated:
    """ESCal: per task and block l, a bridge ``h <- h + U_w A U_r^T h`` on the block's output.

    ``U_r``: top-r right singular vectors of block l+1's stacked q/k/v merging error (expert i
    minus merged); ``U_w``: top-r left singular vectors of block l's MLP output projection
    error; both fixed. Only ``A`` (``r x r``, zero at the start) is trained, with Adam, to match
    expert i's block outputs (MSE) on ``calib_data``. Adds ``L r^2`` trained and
    ``L r^2 + 2 L d r`` stored numbers per task. ``options``: :class:`ESCalOptions` (the
    rank, the epochs, featcal's choices where the paper is silent).
    """
    opts = options
    qkv, mlp_out = opts.qkv, opts.mlp_out
    path, blks = checked_models(merged, experts, calib_data, opts.blocks)
    r = min([opts.rank] + [min(w.shape) for b in blks for w in escal_weights(b, qkv, mlp_out)])

    def make(task: str, model: nn.Module) -> dict[int, nn.Module]:
        dev = device_of(model)
        merged_w = [escal_weights(b, qkv, mlp_out) for b in resolve_blocks(model, path)[1]]
        _, eblks = resolve_blocks(experts[task], path)
        expert_w = [tuple(w.to(dev) for w in escal_weights(b, qkv, mlp_out)) for b in eblks]
        mods = {}
        for l in range(len(blks)):
            read = l + 1 if l + 1 < len(blks) else l
            U_r, U_w = error_bases(expert_w[read][0], merged_w[read][0], expert_w[l][1], merged_w[l][1], r)
            if l + 1 == len(blks) and opts.last_read == "write":
                U_r = U_w
            mods[l] = Bridge(U_r.float(), U_w.float())
        return mods

    return _run("escal", merged, experts, calib_data, path, make, dataclasses.replace(opts, rank=r))


# ----------------------------------------------------------------------------- shared plumbing


def checked_models(merged, experts, calib_data, blocks) -> tuple[str, nn.ModuleList]:
    """The tasks and models a trained calibrator is given, checked; ``(path, blocks)``."""
    check_tasks(experts, calib_data)
    for t, expert in experts.items():
        check_same_params(merged, expert, f"expert {t!r}")
    return resolve_blocks(merged, blocks)


def _run(method, merged, experts, calib_data, path, make, opts: ESCalOptions):
    """Train each task's modules (``make(task, model)``) on a private copy of the merged model
    (frozen), for ``opts.epochs`` epochs (MSE on ``opts.tokens``)."""
    model = opts.training_copy(merged)
    modules, runs = {}, {}
    for task in experts:
        mods = make(task, model)
        weighted = block_weights(opts.block_weights, sorted(mods))
        sched = Schedule(opts.epochs, opts.lr, opts.batch, opts.seed, "mse", opts.tokens, weighted)
        desc = f"{method} {task}"
        runs[task] = train_task(model, path, experts[task], calib_data[task], mods, sched, desc, opts.progress)
        modules[task] = mods
    steps = {t: r.steps for t, r in runs.items()}
    settings = dict(opts.settings(), last_read=opts.last_read, steps=steps, tokens=opts.tokens)
    settings["device"] = str(device_of(model))
    return TaskCalibrated(method, model, path, modules, runs, settings)

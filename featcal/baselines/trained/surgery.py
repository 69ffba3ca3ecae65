"""Representation Surgery and SurgeryV2 as their authors define them.

Both add, per task, modules ``z <- z - W_up ReLU(W_down z)`` (rank 16, no bias; ``W_down``
kaiming-uniform with a = sqrt(5), i.e. uniform in +-1/sqrt(d); ``W_up`` zero, so training starts
at the merged model) and train them with Adam (lr 1e-3, betas (0.9, 0.999), no weight decay) on
minibatches of 16 of the task's unlabeled inputs, 1000 steps per task (FusionBench's
``surgery_steps: 1000``; the authors' scripts: 500 iterations of 2 steps). The merged model and
the experts stay frozen; expert i's features are the targets.

- :func:`surgery` (Yang et al., ICML 2024): one module on the model's **final embedding** (CLIP:
  the class token after the last LayerNorm and the projection, 512-d on ViT-B/32: 2 x 512 x 16
  numbers per task); loss: the L1 distance to expert i's final embedding.
- :func:`surgery_v2` (Yang et al., 2024): one module after **every block**, on every token, and
  one on the final embedding (ViT-B/32: 2 L d r + 2 d_out r = 311,296 per task); loss: the sum
  over blocks of the L1 distance between the **token means** of the corrected merged hidden state
  and expert i's, plus the final embedding's L1.

Where the final embedding is (:func:`final_embedding`, the rule for models without a projection):

1. a projection: HF ``visual_projection`` / ``text_projection``, open_clip's ``proj`` (the
   model's own output): its output, one vector per example;
2. HF CLIP towers without one: ``post_layernorm`` (the pooled class token the heads read); a
   BERT-style ``...ForSequenceClassification``: its ``pooler`` (what its classifier reads);
3. a decoder with a final norm (Llama's ``norm``, GPT-2's ``ln_f``): the last hidden state of
   every token (the LM head reads every position), L1 over the non-padding tokens;
4. otherwise (BERT-style encoders read by mean pooling): the last block's output, the module on
   every token, the loss on the masked token mean (the sentence embedding); here the last
   block's module is the final one (SurgeryV2 adds no second module there).

``embedding=`` names the submodule whose output is the embedding instead (e.g. ``"pooler"`` for a
model read through BERT's pooler) and ``pool=`` how its output is compared (``example``,
``mean``, ``tokens``). Unlike the papers (unlabeled test inputs), training reads only the
calibration data given.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from featcal.baselines.examples import ExamplePool, take
from featcal.baselines.trained.calibrators import TaskCalibrated, checked_models
from featcal.baselines.trained.modules import ATTR, SurgeryAdapter, insert
from featcal.baselines.trained.training import TaskRun, TrainOptions
from featcal.model.arch import resolve_blocks
from featcal.model.modes import eval_mode
from featcal.model.streams import call_model, device_of
from featcal.util.options import option
from featcal.util.progress import bar

POOLS = ("auto", "example", "mean", "tokens")
PROJECTIONS = ("visual_projection", "text_projection")
FINAL_NORMS = ("model.norm", "norm", "transformer.ln_f", "ln_f", "model.final_layernorm")


@dataclass(frozen=True)
class Embedding:
    """Where the final embedding is: the submodule ``path`` whose output it is (``""``: the model's
    own output), how its output is compared (``pool``), and whether it is the last block."""

    path: str
    pool: str
    is_last_block: bool = False


def final_embedding(model: nn.Module, blocks_path: str, embedding: str | None = None, pool: str = "auto") -> Embedding:
    """The final embedding of ``model`` by the module docstring's rule (or ``embedding``)."""
    if pool not in POOLS:
        raise ValueError(f"pool={pool!r}; choose one of {POOLS}.")
    last = f"{blocks_path}.{len(resolve_blocks(model, blocks_path)[1]) - 1}"
    if embedding is not None:
        try:
            model.get_submodule(embedding)
        except AttributeError:
            raise ValueError(f"embedding={embedding!r}: {type(model).__name__} has no such submodule.") from None
        return Embedding(embedding, "example" if pool == "auto" else pool, embedding == last)
    found = _rule(model)
    if found is None:
        found = (last, "mean")
    path, auto_pool = found
    return Embedding(path, auto_pool if pool == "auto" else pool, path == last)


def _rule(model: nn.Module) -> tuple[str, str] | None:
    modules = dict(model.named_modules())
    for name in PROJECTIONS:
        if isinstance(modules.get(name), nn.Linear):
            return name, "example"
    if isinstance(getattr(model, "proj", None), nn.Parameter) and hasattr(model, "ln_post"):
        return "", "example"  # open_clip's VisionTransformer projects itself
    post = [n for n in modules if n == "post_layernorm" or n.endswith(".post_layernorm")]
    if post:
        return post[0], "example"
    pooler = [n for n, m in modules.items() if n.split(".")[-1] == "pooler" and m is not None]
    if pooler and hasattr(model, "classifier"):
        return pooler[0], "example"  # BERT-style ...ForSequenceClassification: its head reads the pooler
    for name in FINAL_NORMS:
        if name in modules:
            return name, "tokens"
    return None


def _mask(batch) -> torch.Tensor | None:
    return batch.get("attention_mask") if isinstance(batch, Mapping) else None


def token_mean(h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``(B, T, d) -> (B, d)``: the mean over tokens (padding left out); ``(B, d)`` unchanged."""
    if h.dim() == 2:
        return h
    if mask is None:
        return h.mean(1)
    w = mask.to(h.device, h.dtype).unsqueeze(-1)
    return (h * w).sum(1) / w.sum(1).clamp_min(1.0)


class _Capture:
    """Forward hooks keeping the first output of the given submodules."""

    def __init__(self, model: nn.Module, paths: Mapping[object, str]):
        self.out: dict = {}
        self.handles = []
        for key, path in paths.items():
            mod = model.get_submodule(path) if path else model

            def hook(_m, _args, output, key=key):
                self.out[key] = output[0] if isinstance(output, (tuple, list)) else output

            self.handles.append(mod.register_forward_hook(hook))

    def close(self):
        for h in self.handles:
            h.remove()


def _sites(path: str, n_blocks: int, block_modules: bool, emb: Embedding) -> dict:
    """``{key: submodule path}`` the loss reads: every block (SurgeryV2) and the embedding."""
    sites = {l: f"{path}.{l}" for l in range(n_blocks)} if block_modules else {}
    if not emb.is_last_block or not block_modules:
        sites["embedding"] = emb.path
    return sites


def _is_final(key, emb: Embedding, n_blocks: int) -> bool:
    return key == "embedding" or (emb.is_last_block and key == n_blocks - 1)


def compared(key, h: torch.Tensor, emb: Embedding, n_blocks: int, mask) -> torch.Tensor:
    """What the loss compares at site ``key``, one row per example: a block's token mean; the
    final embedding's token mean (``mean``), itself (``example``) or every token (``tokens``:
    ``(B, T, d)``, the padding left out in :func:`_loss_to`)."""
    if _is_final(key, emb, n_blocks) and emb.pool != "mean":
        return h
    return token_mean(h, mask)


def _loss_to(out: dict, target: dict, emb: Embedding, n_blocks: int, mask) -> torch.Tensor:
    """The unweighted sum of the L1 terms between ``out`` (the sites' outputs) and ``target``
    (expert i's, already :func:`compared`)."""
    loss = 0.0
    for key, h in out.items():
        z, t = compared(key, h, emb, n_blocks, mask), target[key]
        if _is_final(key, emb, n_blocks) and emb.pool == "tokens" and mask is not None and z.dim() == 3:
            keep = mask.to(z.device).bool()
            z, t = z[keep], t[keep]
        loss = loss + F.l1_loss(z.float(), t.float())
    return loss


def _loss(out: dict, target: dict, emb: Embedding, n_blocks: int, mask) -> torch.Tensor:
    """The unweighted sum of the L1 terms: each block's token means, the final embedding's."""
    target = {k: compared(k, v, emb, n_blocks, mask) for k, v in target.items()}
    return _loss_to(out, target, emb, n_blocks, mask)


@torch.no_grad()
def site_outputs(model: nn.Module, unit, sites: Mapping, batch: int, reduce=None) -> dict:
    """``{site: output}`` of ``model`` on ``unit`` (a batch), run in chunks of ``batch``
    examples; ``reduce(key, h, mask)`` maps each chunk's output (default: kept as it is)."""
    cap, parts = _Capture(model, sites), {k: [] for k in sites}
    try:
        with eval_mode(model):
            for xb in ExamplePool([unit]).in_order(batch):
                call_model(model, _to(xb, device_of(model)))
                for k, h in cap.out.items():
                    parts[k].append(h if reduce is None else reduce(k, h, _mask(xb)))
    finally:
        cap.close()
    return {k: torch.cat(v) for k, v in parts.items()}


def _rows(x, idx):
    return x if idx is None else (take(x, idx) if isinstance(x, Mapping) else x[idx])


def plain(module: nn.Module, z: torch.Tensor, mask) -> tuple[torch.Tensor, float]:
    """A module's output in training, and no penalty: Surgery's and SurgeryV2's (the module as
    at inference). ProbSurgery's samples instead and adds its KL term
    (:func:`featcal.baselines.trained.probsurgery.sampled_output`)."""
    return module(z), 0.0


def _train(model, path, emb, expert, batches, modules, opts: TrainOptions, desc: str, train_out=plain) -> TaskRun:
    """Adam on ``modules`` (``{block: module, "embedding": module}``), inserted into ``model``
    (a private copy), for ``opts.length`` steps. Expert i's features are computed once (the
    targets, frozen); with modules after the blocks (SurgeryV2), each step runs the model on one
    minibatch; with only the final module (Surgery), the merged model's final embeddings are
    computed once too, and each step runs the module alone (the same steps: nothing before the
    module changes), through ``train_out(module, z, mask) -> (output, penalty)``: the loss is
    the L1 terms plus the penalties (only with the final module alone)."""
    start = time.perf_counter()
    n_blocks = len(resolve_blocks(model, path)[1])
    block_mods = any(k != "embedding" for k in modules)
    if block_mods and train_out is not plain:
        raise ValueError(f"{desc}: a training output other than the module's own needs the final module alone.")
    sites = _sites(path, n_blocks, block_mods, emb)
    pool = ExamplePool(batches)
    units = [_to(u, device_of(expert)) for u in pool.units]
    dev = device_of(model)

    def reduce(k, h, mask):
        return compared(k, h, emb, n_blocks, mask).to(dev)

    targets = [site_outputs(expert, u, sites, opts.batch, reduce) for u in units]
    units = [_to(u, dev) for u in units]
    inputs = None if block_mods else [site_outputs(model, u, sites, opts.batch) for u in units]
    place(model, path, emb, modules)
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=opts.lr, betas=(0.9, 0.999), weight_decay=0.0)
    draws = pool.draws(opts.batch, torch.Generator().manual_seed(opts.seed))
    mine = _Capture(model, sites) if block_mods else None
    losses = []
    try:
        with eval_mode(model):
            for _ in bar(range(opts.length), desc=desc, unit="step", show=opts.progress):
                j, idx = next(draws)
                xb = _rows(units[j], idx)
                penalty = 0.0
                if block_mods:
                    call_model(model, xb)
                    out = mine.out
                else:
                    outs = {k: train_out(modules[k], _rows(h, idx), _mask(xb)) for k, h in inputs[j].items()}
                    out = {k: o for k, (o, _) in outs.items()}
                    penalty = sum(p for _, p in outs.values())
                target = {k: _rows(v, idx) for k, v in targets[j].items()}
                loss = _loss_to(out, target, emb, n_blocks, _mask(xb)) + penalty
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{desc}: the loss became {losses[-1]}; lower lr (now {opts.lr:g}).")
    finally:
        if mine is not None:
            mine.close()
        unplace(model, path, emb, modules)
    return TaskRun(losses, time.perf_counter() - start)


def _to(batch, device):
    if torch.is_tensor(batch):
        return batch.to(device)
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def place(model: nn.Module, path: str, emb: Embedding, modules: Mapping) -> None:
    """Insert ``modules`` into ``model`` (in place): each block's after its block, the
    embedding's after the embedding's submodule (:func:`featcal.baselines.trained.modules.insert`)."""
    for key, mod in modules.items():
        insert(_host(model, path, emb, key), mod)


def unplace(model: nn.Module, path: str, emb: Embedding, modules: Mapping) -> None:
    """Undo :func:`place` (the training copy serves the next task; the modules keep their values)."""
    for key in modules:
        host = _host(model, path, emb, key)
        delattr(host, ATTR)
        host.__class__ = host.__class__.__bases__[1]  # (_Calibrated, the block's own class)


def _host(model: nn.Module, path: str, emb: Embedding, key) -> nn.Module:
    if key == "embedding":
        return model.get_submodule(emb.path) if emb.path else model
    return resolve_blocks(model, path)[1][key]


@torch.no_grad()
def _widths(model: nn.Module, path: str, emb: Embedding, batch) -> tuple[int, int]:
    """``(d, d_out)``: the blocks' hidden width and the final embedding's, read from one call."""
    n = len(resolve_blocks(model, path)[1])
    cap = _Capture(model, {"block": f"{path}.{n - 1}", "embedding": emb.path})
    try:
        with eval_mode(model):
            call_model(model, _to(take(batch, torch.arange(1)), device_of(model)))
    finally:
        cap.close()
    return int(cap.out["block"].shape[-1]), int(cap.out["embedding"].shape[-1])


# ----------------------------------------------------------------------------- the two methods


@dataclass(frozen=True)
class SurgeryOptions(TrainOptions):
    """Surgery's and SurgeryV2's options (:func:`surgery`, :func:`surgery_v2`): the training's
    (:class:`TrainOptions`) with the authors' defaults (rank 16, Adam at lr 1e-3, minibatches of
    16, 1000 ``steps`` per task), and where the final embedding is (``embedding``: a submodule
    instead of the module docstring's rule; ``pool``: how its output is compared)."""

    steps: int = option(1000, "Adam steps per task")
    embedding: str | None = option(None, "the submodule whose output is the final embedding (default: the rule)")
    pool: str = option("auto", "how the final embedding is compared", choices=POOLS)


def surgery(
    merged: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    options: SurgeryOptions = SurgeryOptions(),
) -> TaskCalibrated:
    """Representation Surgery: per task, one module on the final embedding, L1 to expert i's
    (module docstring). Adds ``2 d_out r`` numbers per task."""
    return run_tasks("surgery", merged, experts, calib_data, options, _adapters(False))


def surgery_v2(
    merged: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    options: SurgeryOptions = SurgeryOptions(),
) -> TaskCalibrated:
    """SurgeryV2: per task, a module after every block (every token) and one on the final
    embedding; loss: the L1 of the token means at every block plus the final embedding's
    (module docstring). Adds ``2 L d r + 2 d_out r`` numbers per task."""
    return run_tasks("surgery_v2", merged, experts, calib_data, options, _adapters(True))


def surgery_modules(
    d: int, d_out: int, n_blocks: int, per_block: bool, emb: Embedding, rank: int, gen, device=None
) -> dict:
    """One task's fresh modules: ``{block: module}`` (SurgeryV2) and ``{"embedding": module}``
    (none separate when the embedding is the last block's output and every block has one)."""
    mods: dict = {l: SurgeryAdapter(d, rank, gen, device=device) for l in range(n_blocks)} if per_block else {}
    if not (per_block and emb.is_last_block):
        mods["embedding"] = SurgeryAdapter(d_out, rank, gen, device=device)
    return mods


def _adapters(per_block: bool):
    """``make(d, d_out, n_blocks, emb, opts, gen, device)``: one task's fresh Surgery modules."""

    def make(d, d_out, n_blocks, emb, opts, gen, device):
        return surgery_modules(d, d_out, n_blocks, per_block, emb, opts.rank, gen, device)

    return make


def run_tasks(method, merged, experts, calib_data, opts: SurgeryOptions, make, train_out=plain):
    """Train each task's fresh modules (``make(d, d_out, n_blocks, emb, opts, gen, device)``,
    ``gen`` seeded with ``opts.seed``) on a private copy of the merged model (frozen), for
    ``opts.steps`` steps, each through ``train_out`` (:func:`_train`)."""
    path, _ = checked_models(merged, experts, calib_data, opts.blocks)
    model = opts.training_copy(merged)
    n_blocks = len(resolve_blocks(model, path)[1])
    emb = final_embedding(model, path, opts.embedding, opts.pool)
    d, d_out = _widths(model, path, emb, calib_data[next(iter(experts))][0])
    gen = torch.Generator().manual_seed(opts.seed)
    modules, runs = {}, {}
    for task, expert in experts.items():
        if device_of(expert) != device_of(model):
            expert = copy.deepcopy(expert).to(device_of(model))
        mods = make(d, d_out, n_blocks, emb, opts, gen, device_of(model))
        desc = f"{method} {task}"
        runs[task] = _train(model, path, emb, expert, calib_data[task], mods, opts, desc, train_out)
        modules[task] = mods
    settings = dict(opts.settings(), embedding=emb.path, pool=emb.pool)
    settings["device"] = str(device_of(model))
    return TaskCalibrated(method, model, path, modules, runs, settings, embedding=emb.path)

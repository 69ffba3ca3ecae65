"""What the app asks of featcal and diagnostics, without Streamlit: the calibration, its
preview, and the scores and drift tables the pages draw.

Each function is one call into the library (or a small reshaping of its tables),
so that :mod:`app.state` only caches and the pages only draw. Testable on its own.
The zoo itself (loading, building, describing) is :mod:`app.zoos`.

The helpers marked *belongs in ...* are small pure functions the library does not
offer yet; they live here until it does.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn

from featcal import FeatCalConfig

LIVE_TEST = 50  # test examples per task scored live (the first ones of the split)
LIVE_TEST_LM = 16  # on a language-model zoo, where each is a forward pass of the whole LM over its prompt
DIAG_N = 16  # held-out examples per task the drift and cosines are measured on
# What the app keeps of the experts' work (their held-out streams for the drift, the expert trace
# of the exact runs) may take, each, this share of the memory available when it is made, at most
# KEEP_CAP bytes: the models themselves stay in memory beside them.
KEEP_SHARE = 0.25
KEEP_CAP = 6 << 30


def keep_budget(share: float = KEEP_SHARE, cap: int = KEEP_CAP) -> int:
    """Bytes one kept store of the experts' work may take: ``share`` of the memory available
    now (psutil's ``available``: free plus reclaimable), at most ``cap``."""
    import psutil

    return int(min(cap, share * psutil.virtual_memory().available))


# ----------------------------------------------------------------------------- featcal


def calibrate(merged: nn.Module, zoo, data: dict, config: FeatCalConfig, trace=None, on_block=None):
    """The exact forward-order FeatCal of ``merged`` under ``config``, keeping the statistics
    a preview re-solves; ``trace``: :func:`expert_trace` of ``data`` (the experts' part kept
    from run to run); ``on_block``: :func:`featcal.calibrate`'s."""
    from featcal import calibrate as featcal_calibrate

    return featcal_calibrate(
        merged,
        base=zoo.base,
        experts=zoo.experts,
        calib_data=data,
        config=config,
        keep_stats=True,
        progress=False,
        expert_trace=trace,
        on_block=on_block,
    )


def expert_trace(budget: int | None = None):
    """An empty :class:`featcal.ExpertTrace` for repeated calibrations on one zoo and data,
    keeping at most ``budget`` bytes (default :func:`keep_budget`): every block's expert work
    when it fits, else the first blocks' (the later ones run again on every call)."""
    from featcal import ExpertTrace

    return ExpertTrace(max_bytes=keep_budget() if budget is None else budget)


def _stream_size(zoo, data: dict) -> float:
    """Bytes the experts' streams on ``data`` take at every block of every stack (one
    expert's stem runs on the first batch give each stack's bytes per example)."""
    from featcal.model.arch import resolve_stacks
    from featcal.model.streams import catch_block_inputs
    from featcal.model.validate import batch_len

    task = zoo.tasks[0]
    expert = zoo.experts[task]
    first = data[task][0]
    examples = sum(batch_len(b) for batches in data.values() for b in batches)
    total = 0.0
    for _, blocks in resolve_stacks(expert):  # an encoder-decoder: the encoder's, then the decoder's
        h = catch_block_inputs(expert, blocks[0], first).hidden
        per_example = h.numel() * h.element_size() / max(batch_len(first), 1)
        total += per_example * examples * (len(blocks) + 1)
    return total


def prepare_preview(preview) -> None:
    """A preview's one-off eigendecompositions, each Linear's statistics freed once decomposed
    (both at once would nearly double what a run keeps: gigabytes on a language model), and
    the freed heap handed back to the OS (:func:`featcal.util.memory.trim_heap`)."""
    from featcal.util.memory import trim_heap

    preview.prepare(compact=True)
    trim_heap()


@torch.no_grad()
def load_preview(scratch: nn.Module, calibrated: nn.Module, report, config: FeatCalConfig) -> nn.Module:
    """Write the preview for ``config``'s (lam, rho, alpha) from ``report``'s kept statistics
    into ``scratch`` (a model of the same architecture), in place; the statistics fix every
    other setting."""
    scratch.load_state_dict(calibrated.state_dict())
    report.preview_state.load_into(scratch, config.setting)
    return scratch.eval()


# ----------------------------------------------------------------------------- diagnostics


def live_test(zoo) -> int:
    """Test examples per task the live view scores: :data:`LIVE_TEST`, :data:`LIVE_TEST_LM` on a
    language-model zoo (:class:`featcal.zoo.score.lm.LMZoo`), whose scores would otherwise take most of
    the time from a slider change to the exact result."""
    from featcal.zoo.score.lm import LMZoo

    return LIVE_TEST_LM if isinstance(zoo, LMZoo) else LIVE_TEST


def scores(
    model: nn.Module, zoo, data: dict, max_per_task: int | None, side: "ExpertSide | None" = None
) -> dict[str, pd.DataFrame]:
    """Output drift on the test split's first ``max_per_task`` examples, expert cosine of the
    features the heads read on ``data``, task-vector cosine (see :mod:`diagnostics`).

    With ``side`` (the experts' own outputs, :func:`expert_side`, computed once per zoo) the
    experts are not run again (:func:`output_scores`, :func:`cosine_scores`: the app runs the
    two on two threads); the tables are the same as diagnostics' own."""
    from diagnostics import expert_cosine, output_drift, task_vector_cosine

    if side is not None:
        return {**output_scores(model, zoo, side), "expert_cosine": cosine_scores(model, zoo, data, side)}
    out = output_drift(model, zoo, split="test", max_per_task=max_per_task)
    cos = expert_cosine(model, zoo.experts, data, features_fn=features_on_device(zoo))
    return {"output": out, "expert_cosine": cos, "task_vector": task_vector_cosine(model, zoo.base, zoo.experts)}


@dataclass
class ExpertSide:
    """The experts' outputs on the live subsets: constant for a zoo, so computed once.

    *Belongs in diagnostics*: ``output_drift`` / ``expert_cosine`` taking the experts'
    precomputed logits / features would make this class and the two functions below
    unnecessary (they rebuild those tables from :func:`diagnostics.kl_rows` and friends).
    """

    max_per_task: int | None
    logits: dict[str, torch.Tensor]  # task -> (n, C) expert logits on the test subset
    features: dict[str, list[torch.Tensor]]  # task -> expert features (B, d) per batch of data


@torch.no_grad()
def expert_side(zoo, data: dict, max_per_task: int | None, batch_size: int = 256) -> ExpertSide:
    feats = features_on_device(zoo)
    logits, features = {}, {}
    for task, expert in zoo.experts.items():
        expert.eval()
        x, _ = zoo.split(task, "test")
        logits[task] = torch.cat([zoo.logits(expert, task, xb).cpu() for xb in x[:max_per_task].split(batch_size)])
        features[task] = [feats(expert, b).cpu() for b in data[task]]
    return ExpertSide(max_per_task, logits, features)


@torch.no_grad()
def output_scores(model: nn.Module, zoo, side: ExpertSide, batch_size: int = 256) -> dict[str, pd.DataFrame]:
    """``{"output": diagnostics.output_drift's table from the experts' cached logits,
    "task_vector": diagnostics.task_vector_cosine}``."""
    from diagnostics import task_vector_cosine
    from diagnostics.output import kl_rows, top1_agreement

    model.eval()
    rows = []
    for task in zoo.tasks:
        x, y = zoo.split(task, "test")
        x, y = x[: side.max_per_task], (None if y is None else y[: side.max_per_task])
        lm = torch.cat([zoo.logits(model, task, xb).cpu() for xb in x.split(batch_size)])  # (n, C)
        le = side.logits[task]  # (n, C)
        n = len(x)
        rows += [
            (task, -1, "kl", _mean(kl_rows(le, lm))),
            (task, -1, "agreement", _mean(top1_agreement(le, lm), 100.0)),
        ]
        if y is not None:
            rows += [
                (task, -1, "accuracy", _mean(lm.argmax(-1) == y, 100.0)),
                (task, -1, "expert_accuracy", _mean(le.argmax(-1) == y, 100.0)),
            ]
        rows.append((task, -1, "examples", float(n)))
    return {
        "output": pd.DataFrame(rows, columns=["task", "block", "metric", "value"]),
        "task_vector": task_vector_cosine(model, zoo.base, zoo.experts),
    }


def _mean(values: torch.Tensor, scale: float = 1.0) -> float:
    """``scale`` times the mean of ``values`` (NaN for none), in double precision."""
    return scale * float(values.double().mean()) if len(values) else float("nan")


@torch.no_grad()
def cosine_scores(model: nn.Module, zoo, data: dict, side: ExpertSide) -> pd.DataFrame:
    """:func:`diagnostics.expert_cosine`'s table from the experts' cached features."""
    feats = features_on_device(zoo)
    model.eval()
    return _cosine_frame({task: [feats(model, b).cpu() for b in batches] for task, batches in data.items()}, side)


@torch.no_grad()
def cosine_scores_and_streams(model: nn.Module, zoo, data: dict, side: ExpertSide):
    """``(cosine_scores' table, the model's streams on data)``: the streams kept while its
    features are read (:func:`diagnostics.streams_while`), for :func:`drift`'s ``own``."""
    from diagnostics import streams_while

    feats = features_on_device(zoo)
    results, own = streams_while(model, data, lambda m, b: feats(m, b).cpu())
    return _cosine_frame(results, side), own


def _cosine_frame(features: dict[str, list[torch.Tensor]], side: ExpertSide) -> pd.DataFrame:
    from diagnostics.similarity import cosine_rows

    frames = []
    for task, per_batch in features.items():
        f_mod = torch.cat(per_batch)  # (n, d)
        f_exp = torch.cat(side.features[task])  # (n, d)
        cos = cosine_rows(f_mod.reshape(len(f_mod), -1), f_exp.reshape(len(f_exp), -1))
        frames.append(
            pd.DataFrame(
                {"task": task, "block": -1, "example": range(len(cos)), "metric": "expert_cosine", "value": cos.numpy()}
            )
        )
    return pd.concat(frames, ignore_index=True)


def features_on_device(zoo):
    """``zoo.features`` with the batch moved to the model's device first (a zoo's reader
    expects it there; the data stays on the CPU). *Belongs in diagnostics*:
    ``expert_cosine`` could move batches as :func:`diagnostics.default_features` does."""
    from featcal.model.streams import device_of, to_device

    return lambda model, batch: zoo.features(model, to_device(batch, device_of(model)))


def drift(model: nn.Module, zoo, data: dict, cache=None, own=None) -> pd.DataFrame:
    """:func:`diagnostics.drift_table` (no CKA); ``cache``: :func:`expert_streams` of ``data``;
    ``own``: the model's streams on ``data`` (:func:`cosine_scores_and_streams`)."""
    from diagnostics import drift_table

    return drift_table(model, zoo.experts, data, cka=False, expert_cache=cache, model_cache=own)


@torch.no_grad()
def expert_streams(zoo, data: dict, budget: int | None = None):
    """The experts' streams on ``data`` at every block (:func:`diagnostics.expert_streams`),
    so that each drift table runs two block calls in three; None when they would take more
    than ``budget`` bytes (default :func:`keep_budget`; estimated from one stem output before
    anything else runs)."""
    from diagnostics import expert_streams as streams

    if _stream_size(zoo, data) > (keep_budget() if budget is None else budget):
        return None
    return streams(zoo.experts, data)


def task_summary(scores: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per task: accuracy, expert_accuracy, kl, agreement, expert_cosine (mean over
    examples), task_vector_cosine (whole model). *Belongs in diagnostics* (a tidy-to-wide
    ``summary_frame`` next to :func:`diagnostics.summarize`)."""
    out = scores["output"].groupby(["task", "metric"])["value"].mean().unstack("metric")
    cos = scores["expert_cosine"].groupby("task")["value"].mean().rename("expert_cosine")
    tv = scores["task_vector"]
    tv = tv[(tv.metric == "task_vector_cosine") & (tv.block == -1)].set_index("task")["value"]
    frame = out.join(cos).join(tv.rename("task_vector_cosine"))
    order = list(dict.fromkeys(scores["output"].task))
    return frame.loc[order]


def accuracy_frame(named: dict[str, pd.DataFrame], expert_from: str | None = None, expert_at: int = 1) -> pd.DataFrame:
    """Tidy ``task, model, accuracy`` from ``{model name: output_drift table}`` (in that order);
    the experts' own accuracy, read from ``expert_from``'s table (``expert_accuracy``), comes
    in as model ``expert`` at position ``expert_at``."""
    tables = [(name, out[out.metric == "accuracy"]) for name, out in named.items()]
    if expert_from is not None:
        src = named[expert_from]
        tables.insert(expert_at, ("expert", src[src.metric == "expert_accuracy"]))
    frames = [pd.DataFrame({"task": t.task.values, "model": name, "accuracy": t.value.values}) for name, t in tables]
    return pd.concat(frames, ignore_index=True)


def _plain(value: float) -> float | None:
    """A float for JSON: rounded to 6 digits, None for NaN."""
    value = float(value)
    return None if value != value else round(value, 6)


def scores_summary(named: dict[str, dict[str, pd.DataFrame]], scored_on: str) -> dict:
    """For a report: per model (``{name: scores}``, :func:`scores`), the mean and per-task
    accuracy, KL, top-1 agreement, expert and task-vector cosines; ``scored_on`` says which
    examples (the live subset or the full split)."""
    out: dict = {"scored_on": scored_on}
    for name, sc in named.items():
        summary = task_summary(sc)
        out[name] = {
            "mean": {col: _plain(summary[col].mean()) for col in summary.columns},
            "per_task": {t: {col: _plain(v) for col, v in row.items()} for t, row in summary.iterrows()},
        }
    return out


def drift_summary(named: dict[str, pd.DataFrame], examples: int) -> dict:
    """For a report: per model (``{name: drift table}``), per block the mean over tasks of the
    relative drift, local mismatch and propagation and the expert cosine, and the squared
    drift's share from local mismatch; ``examples`` held-out examples per task."""
    metrics = ("drift_rel", "mismatch_rel", "propagation_rel", "drift_sq_mismatch_share", "expert_cosine")
    out: dict = {"held_out_examples_per_task": examples, "mean_over_tasks_per_block": {}}
    for name, df in named.items():
        sel = df[df.metric.isin(metrics) & (df.block >= 0)]
        wide = sel.groupby(["block", "metric"])["value"].mean().unstack("metric")
        out["mean_over_tasks_per_block"][name] = {
            int(b): {m: _plain(v) for m, v in row.items()} for b, row in wide.iterrows()
        }
    return out

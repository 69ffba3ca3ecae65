"""Sweeps over FeatCal's (lam, rho, alpha) and automatic selection on a validation split.

One exact run at the anchor setting (by default the paper's CLIP setting) keeps
its statistics; every point of the sweep is then scored as a *preview*
(:mod:`featcal.engine.preview`: a re-solve from the anchor's features, seconds for a
whole grid); the best ``n_confirm`` previews are re-run exactly, and the best
exact run wins. Ties go to the anchor, then to the better preview, so the
paper's setting is kept unless the validation data say otherwise. With
``search="per_block"`` the previews are a per-block schedule's, searched by TPE
(:mod:`featcal.sweep.perblock`), confirmed and chosen the same way.

Scores are computed on *validation* data only, higher is better:

- ``accuracy``: mean over tasks of top-1 accuracy (percent), when labels exist;
- ``kl``: minus the mean over tasks of ``KL(expert_i || model)`` of the class
  probabilities (nats), when they do not.

:func:`tune` takes explicit data (it cannot see a test split); :func:`tune_zoo`
passes a zoo's ``calib`` and ``val`` splits only. :func:`holdout_report` is the
one place that reads ``test``, after the choice is made.

Every point is an independent job. With ``ray=True`` (or an existing cluster's address,
``ray="auto"`` or ``ray="HOST:PORT"``) the preview batches and the exact confirmations are Ray
tasks (models and data shipped once with ``ray.put``); otherwise they run in this process. Both
paths run the same job functions on the same inputs in the same order, so they return the same table.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Mapping

from torch import nn

from featcal.config import RANGES, FeatCalConfig
from featcal.engine.run import calibrate
from featcal.sweep.jobs import (
    HeadLogits,
    Logits,
    Point,
    ValData,
    Work,
    all_logits,
    chunks,
    exact_job,
    model_logits,
    preview_distance,
    preview_job,
    runner,
    val_scores,
)
from featcal.sweep.space import SCORES, SEARCHES, Grid, TuneConfig, tune_options
from featcal.util.memory import trim_heap

__all__ = ["Grid", "TuneConfig", "TuneResult", "tune", "tune_options", "tune_zoo", "holdout_report", "HeadLogits"]
__all__ += ["preview_distance", "SCORES", "SEARCHES"]
if TYPE_CHECKING:
    import pandas as pd

# ------------------------------------------------------------------ the search


def _key(p: Point) -> Point:
    return tuple(float(f"{v:.6g}") for v in p)


def _neighbours(p: Point, step: Point) -> list[Point]:
    """Axis neighbours: lam times/divided by ``10**step[0]``, rho and alpha plus/minus their step."""
    lam, rho, alpha = p
    f = 10.0 ** step[0]
    return [
        (lam * f, rho, alpha),
        (lam / f, rho, alpha),
        (lam, rho + step[1], alpha),
        (lam, rho - step[1], alpha),
        (lam, rho, alpha + step[2]),
        (lam, rho, alpha - step[2]),
    ]


def _searchable(p: Point) -> bool:
    """Whether a refined point can run: lam > 0, every value one :data:`featcal.config.RANGES` accepts."""
    return p[0] > 0 and all(RANGES[name].admits(v) for name, v in zip(("lam", "rho", "alpha"), p))


def _initial_step(grid: Grid) -> Point:
    """Half the median spacing of each axis (lam in decades); 0.5 / 0.1 for a single-value axis."""

    def half_gap(v, default):
        v = sorted(set(v))
        return 0.5 * sorted(b - a for a, b in zip(v, v[1:]))[(len(v) - 2) // 2] if len(v) > 1 else default

    return (half_gap([math.log10(x) for x in grid.lam], 0.5), half_gap(grid.rho, 0.5), half_gap(grid.alpha, 0.1))


@dataclass
class TuneResult:
    """The outcome of :func:`tune`.

    Attributes:
        best: the chosen setting: ``lam``, ``rho``, ``alpha``, its exact validation
            ``score``, the anchor's ``anchor_score``, and ``point`` (its row in ``table``).
        table: one row per point tried, in the order tried: ``point``, ``stage``
            (anchor/grid/refine), ``lam``, ``rho``, ``alpha``, ``preview`` and ``exact``
            validation scores (``exact`` NaN where not confirmed), ``preview_rank``,
            ``confirmed``, ``rel_dist`` (preview vs exact weights), ``seconds`` (exact run),
            and per-task ``preview/<task>``, ``exact/<task>``.
        score: ``accuracy`` (percent) or ``kl`` (the column holds ``-KL``).
        config: the anchor's FeatCal config; ``best_config()`` swaps in the best setting.
        tune: the search options.
        meta: free-form facts (the zoo wrapper records its merge and data choices).
    """

    best: dict
    table: "pd.DataFrame"
    score: str
    config: FeatCalConfig
    tune: TuneConfig
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def best_config(self) -> FeatCalConfig:
        b = self.best
        return self.config.with_(lam=b["lam"], rho=b["rho"], alpha=b["alpha"], schedule=b.get("schedule") or ())

    def to_dict(self) -> dict:
        return {
            "best": dict(self.best),
            "score": self.score,
            "config": self.config.to_dict(),
            "tune": {**asdict(self.tune), "grid": asdict(self.tune.grid)},
            "seconds": self.seconds,
            "meta": dict(self.meta),
        }


def _resolve_score(kind: str, val: ValData) -> str:
    has_labels = all(y is not None for _, y in val.values())
    if kind == "auto":
        return "accuracy" if has_labels else "kl"
    if kind == "accuracy" and not has_labels:
        raise ValueError("score='accuracy' needs labels in every val_data entry; use score='kl'.")
    return kind


def _finite(v: float) -> float:
    """``v``, or ``-inf`` for NaN (a failed or diverged point ranks last)."""
    return v if math.isfinite(v) else -math.inf


def _by_preview(r: dict) -> tuple:
    """Sort key: better preview first, then the order tried."""
    return (-_finite(r["preview"]), r["point"])


def _row(point_id: int, stage: str, p: Point, scores: dict[str, float]) -> dict:
    return {
        "point": point_id,
        "stage": stage,
        "lam": p[0],
        "rho": p[1],
        "alpha": p[2],
        "preview": sum(scores.values()) / len(scores),
        **{f"preview/{t}": s for t, s in scores.items()},
    }


def tune(
    merged: nn.Module,
    base: nn.Module,
    experts: Mapping[str, nn.Module],
    calib_data: Mapping[str, list],
    val_data: ValData,
    *,
    logits: Logits | None = None,
    config: FeatCalConfig | None = None,
    options: TuneConfig | None = None,
    progress: bool = False,
    **option_fields,
) -> TuneResult:
    """Choose FeatCal's (lam, rho, alpha) on validation data.

    Args:
        merged, base, experts, calib_data: as for :func:`featcal.calibrate`.
        val_data: ``{task: (x, y)}``, disjoint from the calibration and test data;
            ``y`` may be ``None`` (then the score is the KL to the experts).
        logits: ``logits(model, task, x) -> (n, classes)``; default ``model(x)``.
        config: the anchor setting and every switch (default ``FeatCalConfig.clip()``).
        options: how to search and score (:class:`TuneConfig`); any of its fields may also be
            given as a keyword (``grid=``, ``search=``, ``n_confirm=``, ...), replacing ``options``'.
        progress: progress bars over the preview batches and the exact runs.
    """
    cfg = config or FeatCalConfig.clip()
    opts = tune_options(options, **option_fields)
    kind = _resolve_score(opts.score, val_data)
    t_start = time.perf_counter()
    # 1. The anchor: one exact run that keeps its statistics, and the references.
    work, rows = _anchor(merged, base, experts, calib_data, val_data, logits or model_logits, kind, cfg, opts)
    run = runner(work, opts.ray, opts.num_cpus, progress)
    try:
        # 2. Preview every grid point (then refine around the best, if adaptive), or per-block schedules.
        if opts.search == "per_block":  # TPE, one trial after another, in this process
            from featcal.sweep.perblock import per_block_search

            per_block_search(work, rows, opts, progress)
        else:
            _preview_search(run, rows, opts)
        # 3. Confirm the best previews exactly (the anchor's exact score is its run).
        order = sorted(rows, key=_by_preview)
        for rank, r in enumerate(order):
            r["preview_rank"] = rank
        confirm = [r for r in order if r["stage"] != "anchor"][: opts.n_confirm]
        exact = run.map(exact_job, [_config_of(cfg, r) for r in confirm], "exact runs")
    finally:
        run.close()
    for r, e in zip(confirm, exact):
        r.update(
            exact=sum(e["scores"].values()) / len(e["scores"]),
            rel_dist=e["rel_dist"],
            seconds=e["seconds"],
            **{f"exact/{t}": s for t, s in e["scores"].items()},
        )
    # 4. The best exact run; ties to the anchor, then to the better preview.
    best = max([rows[0]] + confirm, key=lambda r: (_finite(r["exact"]), -r["preview_rank"] if r is not rows[0] else 1))
    best = {"lam": best["lam"], "rho": best["rho"], "alpha": best["alpha"], "schedule": best.get("schedule", {})} | {
        "score": best["exact"],
        "anchor_score": rows[0]["exact"],
        "point": best["point"],
        "stage": best["stage"],
    }
    return TuneResult(
        best=best,
        table=_frame(rows, list(val_data)),
        score=kind,
        config=cfg,
        tune=opts,
        seconds=time.perf_counter() - t_start,
    )


def _config_of(cfg: FeatCalConfig, row: dict) -> FeatCalConfig:
    """The config of a row of the table: its setting and its per-block schedule (if any)."""
    return cfg.with_(lam=row["lam"], rho=row["rho"], alpha=row["alpha"], schedule=row.get("schedule") or ())


def _anchor(merged, base, experts, calib_data, val_data, logits, kind, cfg, opts) -> tuple[Work, list[dict]]:
    """The anchor's exact run (statistics kept for the previews), the experts' reference
    outputs where the score needs them, and the table's first row (the anchor, scored exactly)."""
    t0 = time.perf_counter()
    model, report = calibrate(
        merged, base=base, experts=experts, calib_data=calib_data, config=cfg, keep_stats=True, progress=False
    )
    anchor_seconds = time.perf_counter() - t0
    report.preview_state.prepare(compact=True)  # only previews read the statistics from now on
    trim_heap()
    ref = (
        None
        if kind == "accuracy"
        else {t: all_logits(experts[t], logits, t, x, opts.batch_size) for t, (x, _) in val_data.items()}
    )
    work = Work(
        merged, base, experts, calib_data, val_data, logits, kind, ref, cfg, report.preview_state, opts.batch_size
    )
    scores = val_scores(model, val_data, logits, kind, ref, opts.batch_size)
    row = _row(0, "anchor", (cfg.lam, cfg.rho, cfg.alpha), scores)
    row.update(
        exact=row["preview"], rel_dist=0.0, seconds=anchor_seconds, **{f"exact/{t}": s for t, s in scores.items()}
    )
    return work, [row]


def _preview_search(run, rows: list[dict], opts: TuneConfig) -> None:
    """Preview the grid's points, then (``search="adaptive"``) ``opts.rounds`` rounds of the axis
    neighbours of the ``opts.top_k`` best, each round halving the step; one row per new point."""
    seen = {_key((r["lam"], r["rho"], r["alpha"])) for r in rows}

    def preview(points: list[Point], stage: str) -> None:
        points = [p for p in dict.fromkeys(_key(p) for p in points) if p not in seen]
        seen.update(points)
        # Points are independent: any chunking gives the same scores; >= 16 chunks for the bar.
        batches = chunks(points, max(run.slots, 16))
        scores = [s for chunk in run.map(preview_job, batches, f"previews ({stage})") for s in chunk]
        rows.extend(_row(len(rows), stage, p, s) for p, s in zip(points, scores))

    preview(opts.grid.points(), "grid")
    step = _initial_step(opts.grid)
    for _ in range(opts.rounds if opts.search == "adaptive" else 0):
        top = sorted(rows, key=_by_preview)[: opts.top_k]
        cand = [q for r in top for q in _neighbours((r["lam"], r["rho"], r["alpha"]), step)]
        preview([q for q in cand if _searchable(q)], "refine")
        step = tuple(s / 2 for s in step)


def _frame(rows: list[dict], tasks: list[str]) -> "pd.DataFrame":
    import pandas as pd

    cols = (
        ["point", "stage", "lam", "rho", "alpha", "preview", "exact", "preview_rank", "rel_dist", "seconds"]
        + [f"preview/{t}" for t in tasks]
        + [f"exact/{t}" for t in tasks]
    )
    extra = [c for c in dict.fromkeys(k for r in rows for k in r) if c not in cols + ["schedule"]]  # per_block's groups
    df = pd.DataFrame(rows).reindex(columns=cols[:5] + extra + cols[5:])
    df.insert(df.columns.get_loc("preview_rank") + 1, "confirmed", df["exact"].notna())
    return df


# ------------------------------------------------------------------ zoo level


def tune_zoo(
    zoo,
    *,
    method: str = "task_arithmetic",
    merge_params: Mapping | None = None,
    n_calib: int = 256,
    seed: int = 42,
    calib_batch: int = 16,
    val_per_task: int | None = None,
    config: FeatCalConfig | None = None,
    options: TuneConfig | None = None,
    progress: bool = False,
    **option_fields,
) -> TuneResult:
    """:func:`tune` on a :class:`~featcal.zoo.core.Zoo`: merge with ``method``, calibrate on
    ``n_calib`` examples per task of the ``calib`` split (seeded), score on the ``val``
    split (the first ``val_per_task`` examples, default all). The ``test`` split is never read.
    ``config``, ``options`` and the options' fields as keywords: as for :func:`tune`."""
    merge_params = dict(merge_params or {})
    merged = zoo.merged(method, **merge_params)
    calib = zoo.calib_data(n_calib, seed=seed, batch_size=calib_batch, split="calib")
    val = {}
    for task in zoo.tasks:
        x, y = zoo.split(task, "val")
        val[task] = (x[:val_per_task], y[:val_per_task]) if val_per_task else (x, y)
    logits = HeadLogits(zoo.features, zoo.heads) if zoo.heads else zoo.logits  # an LLM zoo: its own view
    result = tune(
        merged,
        zoo.base,
        zoo.experts,
        calib,
        val,
        logits=logits,
        config=config,
        options=options,
        progress=progress,
        **option_fields,
    )
    result.meta.update(
        zoo=zoo.name,
        zoo_sha256=zoo.meta.get("content_sha256"),
        method=method,
        merge_params=merge_params,
        n_calib=n_calib,
        seed=seed,
        calib_batch=calib_batch,
        val_per_task=val_per_task,
    )
    return result


def holdout_report(zoo, result: TuneResult, split: str = "test") -> "pd.DataFrame":
    """Accuracy (percent) on ``split`` of the merged model, the anchor setting and the tuned
    setting, re-run exactly with the calibration data of ``result.meta``: one row per model
    (``model``, ``setting``), one column per task and ``avg``. ``test`` is read only here,
    after the choice is made."""
    import pandas as pd

    from featcal.zoo.core import evaluate

    m = result.meta
    merged = zoo.merged(m["method"], **m["merge_params"])
    calib = zoo.calib_data(m["n_calib"], seed=m["seed"], batch_size=m["calib_batch"], split="calib")
    models = {m["method"]: (merged, "")}
    for name, cfg in (("featcal (anchor)", result.config), ("featcal (tuned)", result.best_config())):
        model, _ = calibrate(merged, base=zoo.base, experts=zoo.experts, calib_data=calib, config=cfg, progress=False)
        sched = "".join(f"; block {b}: " + ", ".join(f"{k}={v:.3g}" for k, v in vals) for b, vals in cfg.schedule)
        models[name] = (model, f"lam={cfg.lam:.4g}, rho={cfg.rho:.4g}, alpha={cfg.alpha:.4g}{sched}")
    rows = []
    for name, (model, setting) in models.items():
        acc = evaluate(model, zoo, split=split)
        rows.append({"model": name, "setting": setting, **acc, "avg": sum(acc.values()) / len(acc)})
    return pd.DataFrame(rows)

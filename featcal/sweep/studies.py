"""The paper's studies on a zoo, as tidy tables.

- :func:`sample_efficiency`: FeatCal on a merged model with n calibration
  examples per task, n in ``budgets`` (paper: 4 .. 256), for several seeds of the
  calibration draw; the plain mergers (Task Arithmetic, averaging, TIES) as
  baselines.
- :func:`robustness`: FeatCal with *corrupted* calibration images
  (:mod:`featcal.sweep.corrupt`), evaluated on the clean test split.

Both return one row per (method, setting, seed, task) with the test accuracy in
percent; :func:`summarize` reduces them to mean and std over seeds of the
task-average accuracy. Baselines use no calibration data: each is evaluated
once and its rows repeated on every (n, seed) (or corruption) cell, so every
cell of the design has a row for every method.

Mergers are named as in :data:`featcal.MERGERS` and run with their own
default parameters unless given others (``{"ties": {"density": 0.1}}``).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd

from featcal.baselines.registry import MERGERS
from featcal.config import FeatCalConfig
from featcal.engine.run import calibrate
from featcal.sweep import corrupt
from featcal.util.progress import bar
from featcal.zoo.core import GIVEN, Zoo, evaluate

BUDGETS = (4, 8, 16, 32, 64, 128, 256)
BASELINES = ("task_arithmetic", "average", "ties")  # the mergers sample_efficiency compares by default
CORRUPTIONS = tuple(corrupt.CORRUPTIONS)  # robustness studies every corruption by default
COLUMNS = ["method", "merger", "featcal", "n", "seed", "corruption", "severity", "task", "accuracy"]


def featcal_name(merger: str) -> str:
    return f"{merger}+featcal"


def _rows(acc: Mapping[str, float], **cell) -> list[dict]:
    return [{**cell, "task": t, "accuracy": a} for t, a in acc.items()]


def _mergers(mergers: Mapping[str, dict] | Sequence[str] | None) -> dict[str, dict]:
    """``{name: parameters}`` from names (their default parameters) or a mapping, each checked
    against :data:`featcal.MERGERS` (or ``given``: a zoo's own merged model)."""
    if isinstance(mergers, Mapping):
        out = {name: dict(params) for name, params in mergers.items()}
    else:
        out = {name: {} for name in (BASELINES if mergers is None else mergers)}
    unknown = [m for m in out if m not in MERGERS and m != GIVEN]
    if unknown:
        raise ValueError(f"unknown merger(s) {unknown}; choose from {sorted(MERGERS)} (or {GIVEN!r}).")
    return out


def _baselines(zoo: Zoo, mergers: Mapping[str, dict], split: str, max_per_task: int | None) -> dict:
    """``{merger: (merged model, {task: acc})}``."""
    out = {}
    for name, params in mergers.items():
        model = zoo.merged(name, **params)
        out[name] = (model, evaluate(model, zoo, split=split, max_per_task=max_per_task))
    return out


def sample_efficiency(
    zoo: Zoo,
    *,
    budgets: Sequence[int] = BUDGETS,
    seeds: Sequence[int] = (0, 1, 2),
    mergers: Mapping[str, dict] | Sequence[str] | None = None,
    calibrate_on: Sequence[str] = ("task_arithmetic",),
    config: FeatCalConfig | None = None,
    calib_batch: int = 16,
    split: str = "test",
    max_per_task: int | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """Test accuracy against the calibration budget.

    For every merger in ``calibrate_on`` (each must be in ``mergers``: names, or
    ``{name: parameters}``; default :data:`BASELINES`), every n in ``budgets`` and
    every seed: FeatCal (``config``, default the paper's CLIP setting) on ``n``
    examples per task drawn from the ``calib`` split with that seed. Columns:
    :data:`COLUMNS` (``corruption`` ``"none"``, ``severity`` 0).
    """
    cfg = config or FeatCalConfig.clip()
    mergers = _mergers(mergers)
    missing = [m for m in calibrate_on if m not in mergers]
    if missing:
        raise ValueError(f"calibrate_on names {missing}, which are not among the mergers {sorted(mergers)}.")
    base = _baselines(zoo, mergers, split, max_per_task)
    rows: list[dict] = []
    cells = [(n, s) for n in budgets for s in seeds]
    for n, seed in bar(cells, desc="sample efficiency", show=progress):
        data = zoo.calib_data(n, seed=seed, batch_size=calib_batch, split="calib")
        common = dict(n=n, seed=seed, corruption="none", severity=0.0)
        for name, (merged, acc) in base.items():
            rows += _rows(acc, method=name, merger=name, featcal=False, **common)
        for name in calibrate_on:
            model, _ = calibrate(
                base[name][0], base=zoo.base, experts=zoo.experts, calib_data=data, config=cfg, progress=False
            )
            acc = evaluate(model, zoo, split=split, max_per_task=max_per_task)
            rows += _rows(acc, method=featcal_name(name), merger=name, featcal=True, **common)
    return pd.DataFrame(rows, columns=COLUMNS)


def robustness(
    zoo: Zoo,
    *,
    corruptions: Sequence[str] = CORRUPTIONS,
    severities: Sequence[float] = (1, 3, 5),
    n_calib: int = 256,
    seeds: Sequence[int] = (0,),
    merger: str = "task_arithmetic",
    merge_params: Mapping | None = None,
    config: FeatCalConfig | None = None,
    calib_batch: int = 16,
    split: str = "test",
    max_per_task: int | None = None,
    progress: bool = False,
) -> pd.DataFrame:
    """FeatCal with corrupted calibration images, evaluated on the clean ``split``.

    Both the calibrating model and the experts see the same corrupted images (the
    calibration set itself is corrupted). Rows: the merger alone, FeatCal on clean
    data (``corruption`` ``"none"``, ``severity`` 0) and FeatCal for every
    (corruption, severity, seed). Columns: :data:`COLUMNS` (``n`` = ``n_calib``).
    ``merge_params`` default to the merger's own defaults.
    """
    cfg = config or FeatCalConfig.clip()
    params = _mergers({merger: dict(merge_params or {})})[merger]
    merged = zoo.merged(merger, **params)
    pix = zoo.meta.get("pixels", {"mean": 0.5, "std": 0.5})
    rows: list[dict] = []
    plain = evaluate(merged, zoo, split=split, max_per_task=max_per_task)
    cells = [("none", 0.0)] + [(c, float(s)) for c in corruptions for s in severities]
    for seed in seeds:
        clean = zoo.calib_data(n_calib, seed=seed, batch_size=calib_batch, split="calib")
        for kind, sev in bar(cells, desc=f"robustness (seed {seed})", show=progress):
            cell = dict(n=n_calib, seed=seed, corruption=kind, severity=sev)
            rows += _rows(plain, method=merger, merger=merger, featcal=False, **cell)
            data = (
                clean
                if kind == "none"
                else {
                    t: [
                        corrupt.corrupt(
                            b, kind, sev, seed=seed * 100_000 + 1000 * k + i, mean=pix["mean"], std=pix["std"]
                        )
                        for i, b in enumerate(batches)
                    ]
                    for k, (t, batches) in enumerate(clean.items())
                }
            )
            model, _ = calibrate(
                merged, base=zoo.base, experts=zoo.experts, calib_data=data, config=cfg, progress=False
            )
            acc = evaluate(model, zoo, split=split, max_per_task=max_per_task)
            rows += _rows(acc, method=featcal_name(merger), merger=merger, featcal=True, **cell)
    return pd.DataFrame(rows, columns=COLUMNS)


def summarize(df: pd.DataFrame, by: Sequence[str] = ("method", "n")) -> pd.DataFrame:
    """Mean and std over seeds of the task-average accuracy, per ``by`` group:
    columns ``*by, mean, std, seeds`` (std 0 for a single seed)."""
    by = list(by)
    per_seed = df.groupby(by + ["seed"], sort=False, dropna=False)["accuracy"].mean().reset_index()
    out = per_seed.groupby(by, sort=False, dropna=False)["accuracy"].agg(["mean", "std", "count"]).reset_index()
    return out.rename(columns={"count": "seeds"}).fillna({"std": 0.0})

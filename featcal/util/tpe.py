"""Bayesian optimisation of a few numbers per group of blocks, shared by the searches that need it:
FeatCal's per-block tuner (:mod:`featcal.sweep.perblock`) and BMM's outer loop
(:mod:`featcal.baselines.bmm_search`).

- :func:`block_groups` cuts the blocks into runs of consecutive blocks (one setting each) and
  :func:`group_name` names a run in a table's columns;
- :func:`tpe_maximise` runs optuna's TPE sampler (seeded) over a search space, starting from a
  known point told as a finished trial, one call of the objective per trial.

optuna is imported where it runs, so that importing this module costs nothing.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

from featcal.util.progress import bar


def block_groups(blocks: list[int], groups: int | None) -> list[tuple[int, ...]]:
    """``blocks`` (in order) cut into ``groups`` runs of consecutive blocks, as even as possible
    (the first ones one block longer); None, or as many groups as blocks or more: one block each."""
    n = len(blocks)
    k = n if groups is None else max(1, min(groups, n))
    sizes = [n // k + (i < n % k) for i in range(k)]
    starts = [sum(sizes[:i]) for i in range(k)]
    return [tuple(blocks[a : a + size]) for a, size in zip(starts, sizes)]


def group_name(group: tuple[int, ...]) -> str:
    """``"3"`` for one block, ``"0-3"`` for blocks 0 to 3: a group's name in the table's columns."""
    return str(group[0]) if len(group) == 1 else f"{group[0]}-{group[-1]}"


def tpe_maximise(
    dists: Mapping,
    objective: Callable[[dict], float],
    trials: int,
    seed: int,
    start: tuple[dict, float] | None = None,
    progress: bool = False,
    desc: str = "trials",
) -> list[tuple[dict, float]]:
    """``trials`` TPE trials (optuna's sampler, seeded by ``seed``) maximising ``objective(params)``
    over ``dists`` (``{name: optuna distribution}``): ``[(params, score), ...]`` in the order tried.
    ``start``: ``(params, score)`` of a point already scored, told first as a finished trial (left
    out where it lies outside the space or its score is not finite), so that the search starts from
    it. A trial whose score is not finite is told as failed (TPE leaves it out; it is still listed)."""
    import optuna

    said = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # not a line per trial; given back below
    try:
        study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
        if start is not None and _inside(start[0], dists) and math.isfinite(start[1]):
            study.add_trial(optuna.trial.create_trial(params=start[0], distributions=dict(dists), value=start[1]))
        out = []
        for _ in bar(range(trials), desc=desc, unit="trial", show=progress):
            trial = study.ask(dict(dists))
            score = float(objective(trial.params))
            if math.isfinite(score):
                study.tell(trial, score)
            else:  # a diverged trial: TPE leaves it out, the caller ranks it last
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
            out.append((dict(trial.params), score))
        return out
    finally:
        optuna.logging.set_verbosity(said)


def _inside(params: Mapping, dists: Mapping) -> bool:
    """Whether ``params`` names every dimension of ``dists`` with a value inside its bounds."""
    return set(params) == set(dists) and all(dists[k].low <= v <= dists[k].high for k, v in params.items())

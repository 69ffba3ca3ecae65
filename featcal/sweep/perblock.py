"""FeatCal tuned per block (beyond the paper, which uses one setting for every block):
``tune(..., search="per_block")`` searches a schedule of ``lam`` and ``alpha`` per block
(``FeatCalConfig.schedule``; ``rho`` stays the anchor's), or per group of consecutive blocks
(``groups=K``: fewer numbers, so each trial says more), on the validation split.

The search is Bayesian optimisation: optuna's TPE sampler (seeded, ``TuneConfig.seed``;
:func:`featcal.util.tpe.tpe_maximise`, which BMM's outer loop shares) over each group's
``log10(lam)``, within :data:`LAM_DECADES` decades of the anchor's lam, and ``alpha``, both inside
the ranges of :data:`featcal.config.RANGES` (what the app's sliders span). Each trial is one instant
preview of its schedule from the anchor's kept statistics (:class:`featcal.engine.preview.Preview`,
which reads each block's setting from ``FeatCalConfig.setting_at`` as the exact run does), scored on
the validation split exactly as :func:`featcal.sweep.search.tune` scores a grid point. TPE starts
from the anchor itself (its exact score, told as a finished trial). :func:`featcal.sweep.search.tune`
then confirms the best previews by exact runs and keeps the anchor unless one beats it.
"""

from __future__ import annotations

import copy
import math

from featcal.config import RANGES
from featcal.sweep.jobs import Work, val_scores
from featcal.sweep.space import TuneConfig
from featcal.util.tpe import block_groups, group_name, tpe_maximise

# How far (decades) a group's lam may go from the anchor's: the grid's default span (0.005 to 1
# around 0.05) and more, without the float32 rounding trouble of lam near 1e-6.
LAM_DECADES = 2.0


def space(groups: list[tuple[int, ...]], lam0: float) -> dict:
    """TPE's search space: each group's ``log10(lam)`` within :data:`LAM_DECADES` of ``lam0``'s
    (the anchor's; the whole slider range without one) and ``alpha``, inside their slider ranges."""
    from optuna.distributions import FloatDistribution

    lam, alpha = RANGES["lam"], RANGES["alpha"]
    low, high = math.log10(lam.low), math.log10(lam.high)
    if lam0 > 0:
        low, high = max(low, math.log10(lam0) - LAM_DECADES), min(high, math.log10(lam0) + LAM_DECADES)
    out = {}
    for g in map(group_name, groups):
        out[f"log10_lam/{g}"] = FloatDistribution(low, high)
        out[f"alpha/{g}"] = FloatDistribution(alpha.low, alpha.high)
    return out


def schedule_of(params: dict, groups: list[tuple[int, ...]]) -> dict[int, dict[str, float]]:
    """A trial's parameters as a schedule: every block of a group at the group's ``lam`` and ``alpha``."""
    out = {}
    for group in groups:
        g = group_name(group)
        for block in group:
            out[block] = {"lam": 10.0 ** params[f"log10_lam/{g}"], "alpha": params[f"alpha/{g}"]}
    return out


def _anchor_params(groups, anchor: dict) -> dict:
    """The anchor (the global setting in every group) as a point of the space: TPE's first, finished
    trial, at its exact score (left out where the preset lies outside the space, e.g. lam = 0)."""
    params = {}
    for g in map(group_name, groups):
        params[f"log10_lam/{g}"] = math.log10(anchor["lam"]) if anchor["lam"] > 0 else -math.inf
        params[f"alpha/{g}"] = anchor["alpha"]
    return params


def per_block_search(work: Work, rows: list[dict], opts: TuneConfig, progress: bool = False) -> None:
    """Step 2 of :func:`featcal.sweep.search.tune` for ``search="per_block"``: ``opts.trials`` TPE
    trials after the anchor (``rows[0]``), each one preview of a schedule scored on validation
    data; one row per trial (its schedule, each group's ``lam/<blocks>`` and ``alpha/<blocks>``,
    the preview's scores), the anchor's row given its groups' values too."""
    blocks = sorted({kept.block for kept in work.preview.entries})
    groups = block_groups(blocks, opts.groups)
    anchor = rows[0]
    dists = space(groups, anchor["lam"])
    anchor.update({f"{k}/{group_name(g)}": anchor[k] for g in groups for k in ("lam", "alpha")})
    model = copy.deepcopy(work.preview.template)

    def objective(params: dict) -> float:
        schedule = schedule_of(params, groups)
        work.preview.load_into(model, work.config.with_(schedule=schedule))
        scores = val_scores(model, work.val, work.logits, work.kind, work.ref, work.batch_size)
        score = sum(scores.values()) / len(scores)
        row = {k: anchor[k] for k in ("lam", "rho", "alpha")} | {"point": len(rows), "stage": "tpe"}
        row |= {f"lam/{group_name(g)}": schedule[g[0]]["lam"] for g in groups}
        row |= {f"alpha/{group_name(g)}": schedule[g[0]]["alpha"] for g in groups}
        row |= {"schedule": schedule, "preview": score, **{f"preview/{t}": s for t, s in scores.items()}}
        rows.append(row)
        return score

    start = (_anchor_params(groups, anchor), anchor["exact"])
    tpe_maximise(dists, objective, opts.trials, opts.seed, start, progress, desc="per-block trials")

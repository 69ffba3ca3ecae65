""":func:`diagnostics.drift_table` under a process group (:mod:`featcal.engine.distributed`): each
rank runs its share of every task's batches (the same split as the calibration's), keeps each
(task, block)'s sums, and the sums are added across the ranks before any metric divides by a
count. Every rank then holds the whole table. Until then every (task, block)'s sums are kept
(with ``cka``: three ``d x d`` float64 Gram sums each)."""

from __future__ import annotations

from typing import Mapping

import torch

from featcal.engine.distributed import Dist, share


def my_share(group: Dist, data: Mapping[str, list], *caches):
    """This rank's batches of every task, and the caches' streams of those batches."""
    mine = share({t: len(b) for t, b in data.items()}, group.rank, group.size)
    data = {t: [data[t][i] for i in idx] for t, idx in mine.items()}
    out = []
    for cache in caches:
        if cache is not None:  # (a shallow copy of the cache, its streams of this rank's batches)
            cache = type(cache)(cache.blocks, {t: [[c[i] for i in mine[t]] for c in cache.calls[t]] for t in mine})
        out.append(cache)
    return (data, *out)


def add_across_ranks(group: Dist, kept: dict[str, list], sums_type) -> dict[str, list]:
    """Every task's per-block sums (``kept[task]``, empty on a rank with no batch of it: zeros
    of ``sums_type`` then) added across the ranks, in place where a rank has them."""
    shapes = {t: (len(s), s[0].sums.device, _width(s[0])) for t, s in kept.items() if s}
    seen = {}
    for part in group.gather_objects({t: (n, d) for t, (n, _, d) in shapes.items()}, "comparing the drift sums"):
        seen |= part
    device = group.device
    for t, sums in kept.items():
        n, d = seen[t]
        if not sums:
            sums += [sums_type.zeros(d or 1, device, d is not None) for _ in range(n)]
        for l, acc in enumerate(sums):
            counts = torch.tensor([acc.rows, acc.examples, acc.cka.n if acc.cka else 0], dtype=torch.float64)
            tensors = [acc.sums, acc.cos_sum, counts]
            if acc.cka is not None:
                tensors += [acc.cka.sx, acc.cka.sy, acc.cka.xx, acc.cka.yy, acc.cka.xy]
            group.sum_to(tensors, None, f"adding task {t!r}'s drift sums at block {l}")
            acc.rows, acc.examples = int(counts[0]), int(counts[1])
            if acc.cka is not None:
                acc.cka.n = int(counts[2])
    return kept


def _width(acc) -> int | None:
    return None if acc.cka is None else acc.cka.sx.shape[-1]

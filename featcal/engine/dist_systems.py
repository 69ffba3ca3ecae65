"""One block's systems when the ranks of a process group share the batches (:mod:`featcal.engine.distributed`).

:class:`DistBlockSystems` is the engine's :class:`~featcal.engine.blockstats.BlockSystems` with the
tasks' sums added across the ranks first: each rank keeps the running sums of every task of the
block (:class:`~featcal.engine.blockstats.BlockStats`, from its own batches; empty ones for a task it
holds no batch of), and once all are done, every task's sums of each input group are added onto
the group's owner. The owner alone then builds the group's systems, exactly as one process
would from all the tokens: ``s_i``, the means and the token weights' normalisation are computed
from the summed ``C_i``, ``w_i``, ``s_i``... never per rank. :func:`share_solutions` then hands
the owners' solved parameters and report lines to every rank.

What is added (per task and input group, in the stats dtype; scalars in float64): the row
weights' sum and count, ``sum xs``, ``sum xe``, the Gram matrix ``C`` (its upper block triangle,
as accumulated), the cross moment ``P`` where the group keeps one, and each module's sums
(``PW``, ``CW``, ``T`` of size ``d x o`` and the scalars of its residual), or a norm's two sums.
A task's one-batch "direct" sums (its rows, not their Gram matrix) are not used: rows cannot be
added across ranks.
"""

from __future__ import annotations

from dataclasses import fields

import torch

from featcal.engine.blockstats import BlockStats, BlockSystems
from featcal.engine.distributed import Dist, traffic
from featcal.engine.report import ModuleRecord
from featcal.engine.state import Run
from featcal.method import stats
from featcal.model import arch

MODULE_FIELDS = [f.name for f in fields(stats.ModuleSums)]


def describe(acc: BlockStats) -> list[tuple]:
    """The shape of a task's sums, for a rank that holds no batch of it: per input group, in
    the order the engine made them, ``(key, names, d, has_P, {name: {field: shape}})``."""
    out = []
    for key, g in acc.groups.items():
        names = [name for name, k in acc.key_of.items() if k == key]
        has_p = isinstance(g, stats.LinearSums) and g.P is not None
        mods = {}
        for name in names:
            ms = acc.module.get(name)
            if ms is not None:
                mods[name] = {f: tuple(getattr(ms, f).shape) for f in MODULE_FIELDS if getattr(ms, f) is not None}
        out.append((key, names, g.s.shape[-1] if isinstance(g, stats.LinearSums) else g.z.shape[-1], has_p, mods))
    return out


def fill_empty(acc: BlockStats, desc: list[tuple], run: Run) -> None:
    """Give ``acc`` (a task this rank holds no batch of) zero sums of the shapes in ``desc``."""
    dt, device = run.cfg.stats_dtype, run.device
    for key, names, d, has_p, mods in desc:
        if key[2] == arch.LAYERNORM:
            acc.groups[key] = stats.NormSums.zeros(d, dt, device)
        else:
            acc.groups[key] = stats.LinearSums.zeros(d, dt, device, cross=has_p, kernels=run.kernels)
        for name in names:
            acc.key_of[name] = key
        for name, shapes in mods.items():
            # (d, o) sums live in the weight layout: the transpose of a contiguous (o, d)
            z = {f: torch.zeros(s[::-1], dtype=dt, device=device) for f, s in shapes.items()}
            acc.module[name] = stats.ModuleSums(**{f: x.T if x.dim() == 2 else x for f, x in z.items()})


def _rows_tensor(g, device) -> torch.Tensor:
    return torch.tensor(float(g.rows), dtype=torch.float64, device=device)


def group_tensors(acc: BlockStats, key) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The tensors of one input group's sums (and of its modules' sums), in a fixed order, and
    a float64 tensor for its row count (to add with them and write back)."""
    g = acc.groups[key]
    rows = _rows_tensor(g, g.w.device)
    if isinstance(g, stats.NormSums):
        return [g.w, g.z, g.zz], rows
    if g.Z is not None:
        raise ValueError("featcal.dist_systems: direct sums (a batch's rows) cannot be added across ranks.")
    out = [g.w, g.s, g.e, g.C] + ([g.P] if g.P is not None else [])
    for name, k in acc.key_of.items():
        if k == key and name in acc.module:
            ms = acc.module[name]
            out += [getattr(ms, f) for f in MODULE_FIELDS if getattr(ms, f) is not None]
    return out, rows


def owners_by_cost(desc: list[tuple], size: int) -> dict[tuple, int]:
    """Each input group's owner: the largest solves first, each to the least loaded rank (ties:
    the lowest rank). A group's cost is its factorisation and solves, ``d^3 / 3 + d^2 o``."""
    cost = {}
    for key, names, d, _, mods in desc:
        o = sum(_out_width(s) for s in mods.values())
        cost[key] = d**3 / 3 + d * d * o if key[2] == arch.LINEAR else d
    load = [0.0] * size
    out = {}
    for key in sorted(cost, key=lambda k: -cost[k]):
        r = min(range(size), key=lambda i: (load[i], i))
        out[key] = r
        load[r] += cost[key]
    return out


def _out_width(shapes: dict) -> int:
    """A module's output width from its sums' shapes (``(d, o)`` ones), else 1."""
    two = [s for s in shapes.values() if len(s) == 2]
    return two[0][1] if two else 1


class DistBlockSystems(BlockSystems):
    """:class:`BlockSystems` whose tasks' sums are added across the ranks before any system is
    built (see the module docstring). ``local_rows``: ``{task: rows of this rank's batches}``."""

    direct_ok = False  # one-batch direct sums keep rows, which cannot be added across ranks

    def __init__(self, run: Run, block: int, targets, local_rows: dict[str, int]):
        super().__init__(run, block, targets)
        dist = run.dist
        self.dist, self.all_targets = dist, list(targets)
        self.pending: list[tuple[BlockStats, dict, str]] = []
        counts = torch.tensor(list(local_rows.values()), dtype=torch.float64)
        traffic.other_bytes += dist.sum_to([counts], None, f"block {block}: adding the tasks' row counts")
        # every rank picks the same statistics form from the task's whole row count
        self.rows = {t: int(n) for t, n in zip(local_rows, counts.tolist())}

    def task_rows(self, task: str, rows: int) -> int:
        return self.rows[task]

    def add(self, acc: BlockStats, expert_params: dict, task: str) -> None:
        self.pending.append((acc, expert_params, task))  # added across ranks in finish()

    def _structure(self) -> dict[str, list[tuple]]:
        """``{task: the shape of its sums}`` from the ranks holding batches of it, checked to
        agree (the forms may differ from task to task: they follow each task's row count)."""
        mine = {task: describe(acc) for acc, _, task in self.pending if acc.groups}
        seen: dict[str, list] = {}
        for part in self.dist.gather_objects(mine, f"block {self.block}: comparing the sums' shapes"):
            for task, desc in part.items():
                seen.setdefault(task, []).append(desc)
        tasks = [task for _, _, task in self.pending]
        if any(task not in seen or any(d != seen[task][0] for d in seen[task]) for task in tasks):
            raise ValueError(f"block {self.block}: the ranks' statistics differ in shape; their models differ.")
        return {task: seen[task][0] for task in tasks}

    def finish(self) -> dict:
        dist = self.dist
        descs = self._structure()
        desc = next(iter(descs.values()))  # the input groups: the same for every task
        everywhere = dist.solve == "everywhere"
        owners = {key: None for key, *_ in desc} if everywhere else owners_by_cost(desc, dist.size)
        dist.owners = {name: (0 if owners[key] is None else owners[key]) for key, names, *_ in desc for name in names}
        mine = {name for name, r in dist.owners.items() if everywhere or r == dist.rank}
        self.targets = [t for t in self.all_targets if t.name in mine]
        self.norm_parts = {t.name: [] for t in self.targets if t.kind == arch.LAYERNORM}
        for acc, expert_params, task in self.pending:
            if not acc.groups:
                fill_empty(acc, descs[task], self.run)
            for key, *_ in descs[task]:
                tensors, rows = group_tensors(acc, key)
                what = f"block {self.block}: adding task {task!r}'s statistics"
                traffic.stats_bytes += dist.sum_to(tensors + [rows], owners[key], what)
                acc.groups[key].rows = int(round(float(rows)))
            if self.targets:
                super().add(acc, expert_params, task)
            else:
                acc.release()
        self.pending = []
        return super().finish()


def share_solutions(dist: Dist, report, blk, targets, first_record: int) -> None:
    """After the owners solved their modules of ``blk``: every module's new parameters copied
    from its owner to every rank, and the block's report lines (from ``first_record`` on) made
    the same on every rank, in the targets' order."""
    by_owner: dict[int, list] = {}
    for t in targets:
        by_owner.setdefault(dist.owners.get(t.name, 0), []).append(t)
    for owner, ts in sorted(by_owner.items()):
        params = [p for t in ts for p in arch.get_params(blk, t) if p is not None]
        sent = dist.broadcast(params, owner, f"sending the parameters solved on rank {owner}")
        traffic.weight_bytes += sent if dist.rank == owner else 0
    traffic.blocks += 1
    if dist.solve == "everywhere":
        return
    mine = report.modules[first_record:]
    everyone = dist.gather_objects([vars(m) for m in mine], "gathering the block's report")
    records = {r["name"]: ModuleRecord(**r) for part in everyone for r in part}
    report.modules[first_record:] = [records[t.name] for t in targets if t.name in records]

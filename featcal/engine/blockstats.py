"""One block's statistics and systems, for the engine (:mod:`featcal.engine.run`).

:class:`BlockStats` reduces the captures of one block's calls (the still-merged block on the
calibrating stream, expert i's block on its own) into running sums, per task or for every
task at once (a leading task axis); :class:`BlockSystems` adds each task's terms into every
target's system (:mod:`featcal.method.solve`) and checks them.
"""

from __future__ import annotations

from typing import Any

import torch

from featcal.engine.state import Run, Stack
from featcal.method import solve, stats
from featcal.model import arch
from featcal.model.capture import Captured, target_site


def token_weights(
    x: torch.Tensor, weighted: bool, other: float, mask: torch.Tensor | None, dtype: torch.dtype, lead: int = 0
) -> torch.Tensor | None:
    """Per-row weights ``(rows,)`` for an input ``(B, T, d)``/``(B, d)`` (``lead`` leading
    task axes kept); ``None`` = all ones. ``mask`` is the padding mask of the tokens this
    input reads; one that does not fit them is an error, never skipped or applied by chance."""
    has_tokens = x.dim() - lead == 3
    use_mask = mask is not None and has_tokens
    if use_mask and tuple(mask.shape) != tuple(x.shape[lead : lead + 2]):
        raise ValueError(
            f"the padding mask has shape {tuple(mask.shape)} but the input it masks is "
            f"{tuple(x.shape[lead:])}; the mask must be (batch, tokens) of the tokens this input reads "
            "(a decoder's rows: decoder_attention_mask; its cross-attention keys/values: attention_mask)."
        )
    if not (weighted and has_tokens) and not use_mask:
        return None
    w = torch.ones(x.shape[:-1], dtype=dtype, device=x.device)  # (B, T)
    if weighted and has_tokens:
        w[..., 1:] = other
    if use_mask:
        w = w * mask.to(device=x.device, dtype=dtype)
    return w.reshape(*x.shape[:lead], -1)


def output_usable(dtype: torch.dtype) -> bool:
    """Whether a module's captured output may stand for ``W x`` (output less bias): only in
    float32 or wider. A float16/bfloat16 output was rounded to 8-11 bits, and its bias
    subtracted in that precision (biases came out about 8% off in bfloat16); ``W_i x`` is then
    computed from the captured input in the statistics' dtype instead."""
    return torch.finfo(dtype).bits >= 32 if dtype.is_floating_point else False


def kept_rows(x: torch.Tensor, mask: torch.Tensor | None, lead: int = 0) -> torch.Tensor | None:
    """The rows ``(rows,)`` of an input ``(B, T, d)`` that are not padding (``mask != 0``), or None
    when every row is kept (no mask, a mask of another shape, all ones, or ``lead`` task axes,
    which are never masked). Padded rows are dropped before any product, not weighted by 0: a
    NaN or Inf in a padded token would survive ``* 0``."""
    if mask is None or lead or x.dim() != 3 or tuple(mask.shape) != tuple(x.shape[:2]):
        return None
    keep = mask.reshape(-1).to(x.device) != 0  # (B*T,)
    return None if bool(keep.all()) else keep


def canonical_sites(targets: list[arch.Target], cs: Captured, ce: Captured) -> dict[str, str]:
    """Map each target's site to the first site that saw the very same input tensors, so
    modules sharing an input (q/k/v projections) share one set of statistics."""
    canon: dict[str, str] = {}
    seen: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    for t in targets:
        site = target_site(t)
        xs, xe = cs.inputs[site], ce.inputs[site]
        hit = next((k for a, b, k in seen if a is xs and b is xe), None)
        if hit is None:
            seen.append((xs, xe, site))
            hit = site
        canon[site] = hit
    return canon


class BlockStats:
    """Running statistics of every target of ``block`` for one task (or, with ``lead=1``,
    for every task at once: captures, expert parameters and sums with a leading task axis).

    Targets that read the very same input tensors (q/k/v projections) and share a
    token weighting share one :class:`~featcal.method.stats.LinearSums`; each group keeps
    its cross moment in one exact form (``run.fast.form``, by default the cheapest for its
    widths and the task's row count, :func:`featcal.method.stats.cheapest_form`), each module its
    own :class:`~featcal.method.stats.ModuleSums`. A task of one batch (``one_batch``) with few rows
    for an input's width (``run.fast.direct_rows``) keeps that input's rows instead of their
    Gram matrix (direct sums, :mod:`featcal.method.stats`). The big buffers come from
    ``run.kernels`` (:meth:`release` hands them back).
    """

    def __init__(
        self,
        run: Run,
        stack: Stack,
        block: int,
        targets: list[arch.Target],
        expert_params: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
        merged_params: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
        rows: int,
        lead: int = 0,
        one_batch: bool = False,
    ):
        self.run = run
        self.lead = lead
        self.one_batch = one_batch  # the task is one batch: direct sums where they pay
        self.targets = targets
        self.expert_params = expert_params
        self.merged_params = merged_params
        self.rows = rows
        self.alpha = run.alpha_only(stack.offset + block)  # None: sums for any alpha
        tw = run.cfg.token_weights  # "the last block": of the stack
        self.weighted = {t.name: tw is not None and tw.applies(block, stack.n_blocks, t.name) for t in targets}
        self.other = tw.other if tw is not None else 1.0
        self.groups: dict[tuple, stats.LinearSums | stats.NormSums] = {}
        self.form: dict[tuple, str] = {}
        self.module: dict[str, stats.ModuleSums] = {}
        self.key_of: dict[str, tuple] = {}

    def _output(
        self, t: arch.Target, cap: Captured, params, x: torch.Tensor, keep: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``W x`` (rows, o) from the module's captured output less its bias (None if not seen,
        or seen in half precision: :func:`output_usable`), on the rows ``keep`` (None: all)."""
        y = cap.outputs.get(t.owner) if t.rows is None else None
        if y is None or not output_usable(y.dtype):
            return None
        y = stats.as_rows(y, x.dtype, self.lead)
        y = y if keep is None else y[keep]
        b = params[1]
        return y if b is None else y - b.to(x.dtype).unsqueeze(-2)

    def _start(self, key: tuple, ts: list[arch.Target], d: int, lead: tuple[int, ...], device) -> None:
        """The empty sums of a group of Linear targets, in the form they will be kept."""
        fast, alpha = self.run.fast, self.alpha
        outs = [self.expert_params[t.name][0].shape[-2] for t in ts]
        low = not output_usable(self.expert_params[ts[0].name][0].dtype)  # outputs not used: W_i xe computed
        unseen = len(ts) if low else sum(t.rows is not None for t in ts)
        self.form[key] = fast.form or stats.cheapest_form(d, outs, self.rows, unseen, fixed_alpha=alpha is not None)
        direct = self.one_batch and not self.lead and self.rows <= fast.direct_rows * d
        self.groups[key] = stats.LinearSums.zeros(
            d, self.run.cfg.stats_dtype, device, self.form[key] == "P", lead, direct, self.run.kernels
        )

    def add(self, cs: Captured, ce: Captured, mask) -> None:
        """Reduce one call's captures; ``mask``: None, the padding mask of every input, or
        a function of an input site giving that input's mask (:meth:`BlockCall.mask_for`)."""
        dt = self.run.cfg.stats_dtype
        canon = canonical_sites(self.targets, cs, ce)
        members: dict[tuple, list[arch.Target]] = {}
        for t in self.targets:
            key = (canon[target_site(t)], self.weighted[t.name], t.kind, t.ln_eps, t.centred)
            members.setdefault(key, []).append(t)
            self.key_of[t.name] = key
        for key, ts in members.items():
            site, weighted, kind, ln_eps, centred = key
            xs_raw = cs.inputs[site]
            lead = xs_raw.shape[: self.lead]
            m = mask(site) if callable(mask) else mask
            m = None if m is None else m.to(xs_raw.device)
            w = token_weights(xs_raw, weighted, self.other, m, dt, self.lead)
            xs = stats.as_rows(xs_raw, dt, self.lead)  # (rows, d)
            keep = kept_rows(xs_raw, m, self.lead)
            if keep is not None:  # padding out before any product (kept_rows)
                xs, w = xs[keep], None if w is None else w[keep]
            d = xs.shape[-1]
            if kind == arch.LAYERNORM:
                acc = self.groups.get(key) or stats.NormSums.zeros(d, dt, xs.device, lead)
                self.groups[key] = stats.accumulate_norm(acc, xs, w, ln_eps, centred)
                continue
            xe = stats.as_rows(ce.inputs[site], dt, self.lead)  # (rows, d)
            xe = xe if keep is None else xe[keep]
            if key not in self.groups:
                self._start(key, ts, d, lead, xs.device)
            stats.accumulate_linear(self.groups[key], xs, xe, w)
            for t in ts:
                W_i = self.expert_params[t.name][0]
                ye = self._output(t, ce, self.expert_params[t.name], xe, keep)
                ye = xe @ W_i.to(dt).mT if ye is None else ye  # (rows, o)
                ym = self._output(t, cs, self.merged_params[t.name], xs, keep)
                ms = self.module.get(t.name) or stats.ModuleSums(torch.zeros((), dtype=dt, device=xs.device))
                self.module[t.name] = stats.accumulate_module(ms, self.form[key], xs, ye, w, W_i, ym, self.alpha)

    def release(self) -> None:
        """Hand the big buffers back to the scratch (the sums are done with)."""
        for g in self.groups.values():
            if isinstance(g, stats.LinearSums):
                self.run.kernels.give(g.buffers())
        self.groups = {}

    def group(self, t: arch.Target):
        return self.groups[self.key_of[t.name]]

    def linear_moments(self, t: arch.Target) -> stats.LinearMoments:
        return stats.linear_moments(self.group(t), self.expert_params[t.name][0], self.module[t.name])


def check_finite_system(sysm, block: int, name: str) -> None:
    """A NaN or Inf in any row of any task reaches the system's diagonal and sums (``S``'s
    diagonal, ``m_s``, and through the expert's features ``vb``; a LayerNorm's moments):
    checking those is exact and costs O(d) once per module, not per task."""
    if isinstance(sysm, solve.LinearSystem):
        tensors = [sysm.S.diagonal(), sysm.m_s, sysm.vb]
    else:
        tensors = [sysm.e, sysm.m]
    if not bool(torch.isfinite(torch.cat([t.reshape(-1) for t in tensors])).all()):
        raise FloatingPointError(
            f"block {block}, module {name!r}: its input features hold NaN or Inf values "
            "(check the model's weights and the calibration data)."
        )


class BlockSystems:
    """Each target's system of ``block``, built from the tasks' statistics as they come
    (one task's, or every task's at once with a leading task axis)."""

    direct_ok = True  # one-batch tasks may keep their rows instead of a Gram matrix (direct sums)

    def __init__(self, run: Run, block: int, targets):
        self.run, self.block, self.targets = run, block, targets
        self.systems: dict[str, Any] = {}
        self.norm_parts: dict[str, list] = {t.name: [] for t in targets if t.kind == arch.LAYERNORM}
        self.shared_S: dict[tuple, str] = {}  # group -> the target whose system owns its S

    def task_rows(self, task: str, rows: int) -> int:
        """The row count of ``task`` the statistics' form is chosen from (here: this process's)."""
        return rows

    def add(self, acc: BlockStats, expert_params: dict, task: str) -> None:
        """Add one task's terms (every task's, with a leading task axis) into every target's
        system, and hand the statistics' buffers back to the scratch."""
        run = self.run
        dt, device = run.cfg.stats_dtype, run.device
        lead = acc.lead
        kernels = None if run.keep is not None else run.kernels  # systems kept for a preview: new S
        for t in self.targets:
            W_i, b_i = expert_params[t.name]
            if t.kind == arch.LINEAR:
                mom = acc.linear_moments(t)
                d = mom.s.shape[-1]
                if mom.rows < d:
                    run.notes.thin_task(task, mom.rows, t.name, self.block, d)
                if t.name not in self.systems:
                    owner = self.shared_S.setdefault(acc.key_of[t.name], t.name)
                    S = self.systems[owner].S if owner != t.name else None
                    self.systems[t.name] = solve.LinearSystem.zeros(
                        d, W_i.shape[-2], dt, device, S=S, alpha=acc.alpha, kernels=kernels
                    )
                solve.add_task(
                    self.systems[t.name], mom, W_i.to(device), None if b_i is None else b_i.to(device), run.cfg.eps
                )
            else:
                e, m = stats.norm_moments(acc.group(t))
                parts = (e, m, W_i.to(device, dt), None if b_i is None else b_i.to(device, dt))
                self.norm_parts[t.name].append(tuple(x if lead or x is None else x[None] for x in parts))  # (tasks, d)
        acc.release()  # the sums are in the systems now

    def finish(self) -> dict:
        for name, parts in self.norm_parts.items():
            e, m, g, bb = zip(*parts)
            self.systems[name] = solve.NormSystem(
                torch.cat(e), torch.cat(m), torch.cat(g), None if bb[0] is None else torch.cat(bb)
            )
        for t in self.targets:
            check_finite_system(self.systems[t.name], self.block, t.name)
        return self.systems

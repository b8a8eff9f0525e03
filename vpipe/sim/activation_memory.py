"""Each rank's peak activation bytes over its program order, from what a stage's passes
allocate and free: how much memory a schedule's order needs, with no simulation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from vpipe.ir import Schedule
from vpipe.ir.flat import flatten
from vpipe.sim.model_costs import ModelCostError

__all__ = ["activation_peaks"]


def activation_peaks(
    schedule: Schedule, alloc: Sequence[float], freed_by_i: Sequence[float], flat: Any = None
) -> list[float]:
    """Each rank's peak activation bytes over its program order: a stage's F allocates
    ``alloc[stage]``, its I frees ``freed_by_i[stage]``, its W the rest, a full backward B
    all of it (:class:`vpipe.schedules.adaptive.MemoryModel`'s accounting). ``flat``: the
    schedule's :func:`vpipe.ir.flat.flatten`, when the caller keeps it."""
    fl = flat if flat is not None else flatten(schedule)
    a, fi = np.asarray(alloc, float), np.asarray(freed_by_i, float)
    if len(a) != schedule.n_stages or len(fi) != schedule.n_stages:
        raise ModelCostError(f"activation peaks need one figure per stage ({schedule.n_stages}"
                             f"), got {len(a)} allocated and {len(fi)} freed")  # fmt: skip
    table = np.concatenate([a, -a, -fi, fi - a])  # F, B, I, W (the flat kind codes 0-3)
    delta = table[fl.part_index]
    P, n = schedule.n_ranks, len(delta)
    if n and n % P == 0 and np.all(np.bincount(fl.p_rank, minlength=P) == n // P):  # alike
        tops = np.cumsum(delta.reshape(P, n // P), axis=1).max(axis=1).tolist()
    else:
        bounds = np.searchsorted(fl.p_rank, np.arange(P + 1)).tolist()
        tops = [np.cumsum(delta[lo:hi]).max() if hi > lo else 0.0
                for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]  # fmt: skip
    return [max(t, 0.0) for t in tops]

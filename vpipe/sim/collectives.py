"""Data-parallel gradient reductions on top of a simulated pipeline step.

With N replicas every stage's gradients are all-reduced across its N copies. The replicas run
the same program, so one replica's simulated timeline says when each stage's gradients are
complete: the end of the action after which the stage has no W or B left
(:func:`vpipe.ir.reduction.gradient_points`, the runtime's rule). From there its buckets are
reduced, in order, on the rank's one collective stream, which overlaps compute: a reduction
starts when its stage is ready and the stream is free, and takes :meth:`CollectiveCost.all_reduce`
(a ring: 2(N-1) steps of ``latency``, plus 2(N-1)/N of the bytes over ``bandwidth``). The
step ends when the pipeline and the last reduction have ended. Exposed reduction time is what
the step grew by; the rest of the reductions ran hidden under compute.

``within_backward``: frameworks that reduce each bucket as soon as autograd has filled it
(Megatron-LM's ``--overlap-grad-reduce``, DDP, FSDP) start a stage's reductions inside its
last backward pass: its buckets, in the order the backward fills them, are taken to fill
evenly over that action's span, bucket ``b`` of ``n`` ready ``(b + 1) / n`` of the way through.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vpipe.errors import VpipeError
from vpipe.ir import Schedule
from vpipe.ir.flat import flatten

__all__ = [
    "CollectiveCost",
    "DPStep",
    "Reduction",
    "bucket_sizes",
    "gradient_spans",
    "simulate_reductions",
]

COMPUTE_CODES = 4  # simulator kind codes 0-3 are F, B, I, W


class CollectiveError(VpipeError, ValueError):
    """A collective cost or gradient size that makes no sense; the message names it."""


@dataclass(frozen=True)
class CollectiveCost:
    """One all-reduce across ``group`` replicas: ``latency`` per ring step (time units),
    ``bandwidth`` in bytes per time unit, ``launch`` a fixed cost per reduction (posting it,
    the copy into its flat bucket)."""

    group: int = 1
    bandwidth: float = math.inf
    latency: float = 0.0
    launch: float = 0.0

    def __post_init__(self) -> None:
        if self.group < 1:
            raise CollectiveError(f"dp group size must be >= 1, got {self.group}")
        for name in ("bandwidth", "latency", "launch"):
            v = getattr(self, name)
            if not v >= 0 or (name == "bandwidth" and v == 0):
                raise CollectiveError(f"collective {name} must be positive, got {v}")

    def all_reduce(self, nbytes: float) -> float:
        """Time of a ring all-reduce of ``nbytes`` (0 for a group of one)."""
        n = self.group
        if n == 1:
            return 0.0
        return self.launch + 2 * (n - 1) * self.latency + 2 * (n - 1) / n * nbytes / self.bandwidth


def bucket_sizes(nbytes: float, bucket_bytes: float) -> list[float]:
    """A stage's ``nbytes`` of gradients cut into buckets of ``bucket_bytes`` (the last one
    the remainder)."""
    if bucket_bytes <= 0:
        raise CollectiveError(f"bucket size must be positive, got {bucket_bytes}")
    full, rest = divmod(nbytes, bucket_bytes)
    return [float(bucket_bytes)] * int(full) + ([float(rest)] if rest > 0 else [])


@dataclass(frozen=True)
class Reduction:
    """One bucket's all-reduce on its rank's collective stream."""

    rank: int
    stage: int
    bucket: int
    nbytes: float
    ready: float  # its stage's gradients complete
    start: float
    end: float


@dataclass(frozen=True)
class DPStep:
    """A simulated pipeline step with its reductions."""

    pipeline_end: float  # the pipeline's makespan, without the reductions
    reductions: list[Reduction] = field(default_factory=list)

    @property
    def step_end(self) -> float:
        return max([self.pipeline_end, *(r.end for r in self.reductions)])

    @property
    def exposed(self) -> float:
        """What the reductions added to the step."""
        return self.step_end - self.pipeline_end

    def busy(self, rank: int) -> float:
        return sum(r.end - r.start for r in self.reductions if r.rank == rank)

    @property
    def hidden(self) -> float:
        """Reduction time under compute, on the rank whose reductions end the step (the most
        hidden of all ranks when none exceeds the pipeline)."""
        if not self.reductions:
            return 0.0
        last = max(self.reductions, key=lambda r: r.end)
        if last.end > self.pipeline_end:
            return self.busy(last.rank) - self.exposed
        return max(self.busy(r) for r in {x.rank for x in self.reductions})

    @property
    def dp_share(self) -> float:
        """Exposed reduction time as a share of the step."""
        return self.exposed / self.step_end if self.step_end > 0 else 0.0


def gradient_spans(
    schedule: Schedule, columns: Mapping[str, Sequence], rows: list | None = None
) -> dict[tuple[int, int], tuple[float, float]]:
    """(rank, stage) -> (start, end) of the action that completes the stage's gradients (its
    end: when they are complete) in a simulated timeline (:attr:`vpipe.sim.SimResult.columns`
    of ``schedule``); ``rows``: the schedule's :func:`gradient_rows`, when the caller keeps
    them."""
    rank, kind = np.asarray(columns["rank"]), np.asarray(columns["kind"])
    compute = kind < COMPUTE_CODES
    # each rank's compute rows in order (an overlap action's parts are rows of their own)
    by_rank = np.argsort(rank[compute], kind="stable")
    starts_all, ends_all = (np.asarray(columns[k])[compute][by_rank] for k in ("start", "end"))
    lo = np.searchsorted(rank[compute][by_rank], np.arange(schedule.n_ranks + 1))
    out = {}
    for r, points in enumerate(rows if rows is not None else gradient_rows(schedule)):
        for first, n, stages in points:
            a, b = lo[r] + first, lo[r] + first + n
            span = (float(starts_all[a:b].min()), float(ends_all[a:b].max()))
            for s in stages:
                out[r, s] = span
    return out


def gradient_rows(schedule: Schedule, flat: Any = None) -> list[list[tuple[int, int, list[int]]]]:
    """Per rank, each gradient point as (its action's first compute row, the action's rows,
    the stages whose gradients it completes): what :func:`gradient_spans` reads off a timeline
    (a plan that times one schedule under many costs keeps them). The rule is
    :func:`vpipe.ir.reduction.gradient_points`', read off the schedule's flat columns
    (``flat``: its :func:`vpipe.ir.flat.flatten`, when the caller keeps it)."""
    fl = flat if flat is not None else flatten(schedule)
    n_ops = len(fl.o_rank)
    first = np.searchsorted(fl.p_op, np.arange(n_ops)).tolist()  # each op's first part
    parts = np.bincount(fl.p_op, minlength=n_ops).tolist()
    part_lo = np.searchsorted(fl.p_rank, np.arange(schedule.n_ranks + 1)).tolist()
    # per stage, the last op of its rank that runs its W or B
    own = (fl.p_kind == 1) | (fl.p_kind == 3)
    own &= fl.place[fl.p_stage] == fl.p_rank
    last = np.full(schedule.n_stages, -1, np.int64)
    np.maximum.at(last, fl.p_stage[own], fl.p_op[own])
    last_l, o_lo = last.tolist(), fl.o_lo.tolist()
    out = []
    for r in range(schedule.n_ranks):
        points: dict[int, list[int]] = {}
        for st in sorted(schedule.stages_of(r)):  # no W or B: the rank's last action
            points.setdefault(last_l[st] if last_l[st] >= 0 else o_lo[r + 1] - 1, []).append(st)
        out.append([(first[op] - part_lo[r], parts[op], sorted(stages))
                    for op, stages in points.items()])  # fmt: skip
    return out


def simulate_reductions(
    schedule: Schedule,
    columns: Mapping[str, Sequence],
    makespan: float,
    cost: CollectiveCost,
    stage_buckets: Mapping[int, Sequence[float]],
    rows: list | None = None,
    within_backward: bool = False,
) -> DPStep:
    """The reductions of one step whose pipeline timeline is ``columns`` (see the module
    docstring); ``stage_buckets`` gives each stage's bucket sizes in bytes, in the order its
    backward fills them."""
    missing = sorted(set(range(schedule.n_stages)) - set(stage_buckets))
    if missing:
        raise CollectiveError(f"no gradient bytes for stage {missing[0]}")
    spans = gradient_spans(schedule, columns, rows)
    out = []
    for r in range(schedule.n_ranks):
        free = 0.0
        mine = sorted((end, start, s) for (rr, s), (start, end) in spans.items() if rr == r)
        for end, start, s in mine:
            n = len(stage_buckets[s])
            for b, nbytes in enumerate(stage_buckets[s]):
                t = start + (b + 1) / n * (end - start) if within_backward else end
                begin = max(t, free)
                free = begin + cost.all_reduce(nbytes)
                out.append(Reduction(r, s, b, nbytes, t, begin, free))
    return DPStep(makespan, out)

"""Cost-adaptive list scheduling: each rank, whenever it is free, picks its next action from
what is ready under the given per-stage costs and memory limit.

A rule (:class:`Rule`) decides between a ready input gradient (I), a ready forward (F) and an
owed weight gradient (W):

- ``backward_first``: a ready I goes before a ready F (else F first, the warm-up style);
- forwards are admitted while the rank's memory stays within ``cap``: a microbatch new to the
  rank is admitted only if its whole footprint there (all its stages on the rank) still fits
  next to what the microbatches already in flight will allocate, so a rank never fills its
  memory with work it cannot finish (no deadlock for any cap of at least one footprint);
- ``guard``: a forward is not started when a known I arrives within ``guard`` of the
  forward's time, so the I chain (the critical path) is not held up by a forward;
- W's fill the gaps: an owed W runs when nothing is ready and it ends before the next known
  arrival (or that time is unknown and ``w_blind``), or when memory holds a forward back;
- ``depth``: among ready forwards the deepest stage first (finishes microbatches sooner,
  frees memory sooner) rather than the oldest microbatch first.

:func:`list_schedule` runs one rule under one cap and returns the timed programs;
:mod:`vpipe.schedules.adaptive` searches rules and caps.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vpipe.errors import ScheduleError
from vpipe.ir import Action, Kind
from vpipe.schedules._common import F, I, W
from vpipe.schedules.problem import Problem, Timed

__all__ = ["Rule", "list_schedule", "warmup"]

_EPS = 1e-9


@dataclass(frozen=True)
class Rule:
    """One priority rule (see the module docstring)."""

    backward_first: bool = True
    guard: float = 0.0
    w_blind: bool = True
    depth: bool = True
    w_over: float = 0.0


def list_schedule(
    problem: Problem, rule: Rule, cap: float, in_flight: Sequence[int] | None = None
) -> Timed:
    """The programs ``rule`` builds when each rank holds at most ``cap`` of memory and, when
    given, rank r starts at most ``in_flight[r]`` microbatches before its first input gradient
    (a warm-up, as :func:`warmup` estimates from the costs); a ScheduleError when
    ``cap`` is below a rank's one-microbatch footprint."""
    p, n, m_count = problem.n_ranks, problem.n_stages, problem.microbatches
    stages = [problem.stages_of(r) for r in range(p)]
    first = [st[0] for st in stages]
    foot = [problem.footprint(r) for r in range(p)]
    warm = (
        [cap] * p
        if in_flight is None
        else [min(cap, k * x) for k, x in zip(in_flight, foot, strict=True)]
    )
    caps = list(warm)  # the warm-up's bound until the rank's first I, then ``cap``
    for r in range(p):
        if foot[r] > caps[r] + _EPS:
            raise ScheduleError(
                f"rank {r}: memory cap {cap:g} is below one microbatch's footprint {foot[r]:g}"
            )
    f, b, w, alloc = problem.f, problem.b, problem.w, problem.alloc
    place = problem.placement
    down = [problem.link(s, s + 1) for s in range(n - 1)]
    up = [0.0] + [problem.link(s, s - 1) for s in range(1, n)]
    arrive: dict[tuple[int, int, int], float] = {}  # (0 F / 1 I, stage, mb) -> input time
    nf = [0] * n  # next forward microbatch per stage
    ni = [0] * n  # next input gradient per stage
    owed: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
    live = [0.0] * p
    reserve = [0.0] * p  # memory the admitted microbatches will still allocate
    peaks = [0.0] * p
    busy = [0.0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    t_start: list[list[float]] = [[] for _ in range(p)]
    t_end: list[list[float]] = [[] for _ in range(p)]
    remaining = [3 * m_count * len(st) for st in stages]
    heap = [(0.0, r) for r in range(p)]
    sleeping = [False] * p

    def post(key: tuple[int, int, int], when: float) -> None:
        arrive[key] = when
        r = place[key[1]]
        if sleeping[r]:
            sleeping[r] = False
            heapq.heappush(heap, (max(when, busy[r]), r))

    while heap:
        t, r = heapq.heappop(heap)
        if t < busy[r] - _EPS or remaining[r] == 0:
            continue
        t = max(t, busy[r])
        ready_i = ready_f = None
        next_at = None  # earliest known future arrival of a next F or I
        urgent = None  # the same, leaving out stage 0's I's (no other rank waits on them)
        held = False
        for s in stages[r]:
            m = ni[s]
            if m < nf[s]:
                at = arrive.get((1, s, m))
                if at is not None:
                    if at <= t + _EPS:
                        if ready_i is None or (m, s) < ready_i:
                            ready_i = (m, s)
                    else:
                        if next_at is None or at < next_at:
                            next_at = at
                        if s > 0 and (urgent is None or at < urgent):
                            urgent = at
            m = nf[s]
            if m < m_count:
                at = 0.0 if s == 0 else arrive.get((0, s, m))
                if at is None:
                    continue
                if s == first[r] and live[r] + reserve[r] + foot[r] > caps[r] + _EPS:
                    held = True
                    continue
                if at <= t + _EPS:
                    key = (-s, m) if rule.depth else (m, -s)
                    if ready_f is None or key < ready_f[0]:
                        ready_f = (key, s)
                else:
                    if next_at is None or at < next_at:
                        next_at = at
                    if urgent is None or at < urgent:
                        urgent = at
        action = None
        if ready_i is not None and rule.backward_first:
            action = I(ready_i[1], ready_i[0])
        elif ready_f is not None:
            s = ready_f[1]
            if not (rule.guard and ready_i is None and next_at is not None
                    and next_at < t + rule.guard * f[s] and _i_due(arrive, ni, nf, stages[r],
                                                                  next_at)):  # fmt: skip
                action = F(s, nf[s])
        if action is None and ready_i is not None:
            action = I(ready_i[1], ready_i[0])
        if action is None and owed[r]:
            ws = owed[r][0][0]
            if (
                held
                or (urgent is None and rule.w_blind)
                or (urgent is not None and t + w[ws] * (1 - rule.w_over) <= urgent + _EPS)
            ):
                s, m = owed[r].popleft()
                action = W(s, m)
            elif next_at is None and not any(nf[s] < m_count or ni[s] < m_count for s in stages[r]):
                s, m = owed[r].popleft()
                action = W(s, m)
        if action is None:
            if next_at is not None:
                heapq.heappush(heap, (next_at, r))
            sleeping[r] = True
            continue
        s, m = action.stage, action.microbatch
        if action.kind is Kind.F:
            end = t + f[s]
            nf[s] += 1
            if s == first[r]:
                reserve[r] += foot[r] - alloc[s]
            else:
                reserve[r] -= alloc[s]
            live[r] += alloc[s]
            if s + 1 < n:
                post((0, s + 1, m), end + down[s])
            else:
                post((1, s, m), end)
        elif action.kind is Kind.I:
            caps[r] = cap
            end = t + b[s]
            ni[s] += 1
            live[r] -= problem.freed_by_i[s]
            owed[r].append((s, m))
            if s > 0:
                post((1, s - 1, m), end + up[s])
        else:
            end = t + w[s]
            live[r] -= alloc[s] - problem.freed_by_i[s]
        peaks[r] = max(peaks[r], live[r])
        out[r].append(action)
        t_start[r].append(t)
        t_end[r].append(end)
        busy[r] = end
        remaining[r] -= 1
        sleeping[r] = False
        heapq.heappush(heap, (end, r))
    stuck = [r for r in range(p) if remaining[r]]
    if stuck:
        raise ScheduleError(f"ranks {stuck} stall under memory cap {cap:g}")
    return Timed(out, t_start, t_end, peaks)


def _i_due(arrive: dict, ni: list[int], nf: list[int], stages: list[int], when: float) -> bool:
    """Whether the arrival at ``when`` is an input gradient's (the guard protects only I's)."""
    return any(
        ni[s] < nf[s] and abs(arrive.get((1, s, ni[s]), -1.0) - when) <= _EPS for s in stages
    )


def warmup(problem: Problem) -> list[int]:
    """Per rank, how many microbatches it can start before the first one's input gradient
    comes back: one plus the forwards of its first stage that fit in the idle time of that
    round trip (microbatch 0 alone in the pipeline, under the problem's costs)."""
    n = problem.n_stages
    f_end = [0.0] * n
    t = 0.0
    for s in range(n):
        if s:
            t += problem.link(s - 1, s)
        t += problem.f[s]
        f_end[s] = t
    i_at = [0.0] * n  # when I of stage s has its input
    i_at[n - 1] = t
    for s in range(n - 1, 0, -1):
        i_at[s - 1] = i_at[s] + problem.b[s] + problem.link(s, s - 1)
    out = []
    for r in range(problem.n_ranks):
        st = problem.stages_of(r)
        s0 = st[0]
        own = sum(problem.f[s] + problem.b[s] for s in st[1:])
        idle = max(i_at[s0] - f_end[s0] - own, 0.0)
        out.append(
            1 + int(idle / problem.f[s0] + _EPS) if problem.f[s0] > 0 else problem.microbatches
        )
    return out

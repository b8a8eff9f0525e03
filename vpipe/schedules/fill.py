"""List scheduling of planned F/I orders with weight gradients as fillers, under a memory cap.

:func:`fill` times the ranks' programs as they would run (each action as soon as its rank is
free and its input is there), deciding where every W goes: a rank runs its next planned F or
I once that action's input has arrived (an F only while fewer than ``cap`` stage-activations
are live on the rank), and otherwise the oldest weight gradient it still owes if that W ends
before the input is due (or the cap holds the F back, or the input's time is not known yet),
so W's fill the gaps left by the pipeline instead of delaying the I chain. A stage-activation
is live from its F until its W. A message arrives ``hop`` after its producer ends, as in the
simulator when the receive is posted early enough: the program order replayed by
:func:`vpipe.sim.simulate` under the same costs gives the same times with no communication
cost or a large ``recv_lookahead``; with the default lookahead of 1, a receive posted late can
make the simulated step longer.

With ``cap >= fi_peak(orders)`` (:func:`vpipe.schedules.blocks.fi_peak`) this never stalls:
a rank whose next F is held back by the cap and that owes no W holds fewer live activations
than the plan itself at that point.

Orders that already contain their W's (or full backwards B) are complete programs: they are
timed as they are, every action in its place, with no cap (how :mod:`vpipe.schedules.auto`
weighs a fixed family against the filled blocks).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vpipe.errors import ScheduleError
from vpipe.ir import Action, Kind
from vpipe.schedules._common import W

__all__ = ["Filled", "fill"]


@dataclass(frozen=True)
class Filled:
    """The programs :func:`fill` built, with their makespan and each rank's peak live
    stage-activations."""

    actions: list[list[Action]]
    makespan: float
    peaks: list[int]


def fill(
    placement: Mapping[int, int],
    orders: Sequence[Sequence[Action]],
    cap: int,
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    hop: Sequence[float] = (),
) -> Filled:
    """Interleave W's into each rank's F/I ``orders``, or time complete programs (see the
    module docstring).

    ``f``, ``b``, ``w``: per-stage times of F, I and W; ``hop[s]``: time of a message across
    the boundary between stages s and s+1 when they are on different ranks (zero when
    omitted). Raises ScheduleError when a rank stalls (``cap`` below what the orders need).
    """
    n_stages = len(placement)
    ranks = len(orders)
    complete = any(a.kind in (Kind.W, Kind.B) for acts in orders for a in acts)
    if complete:
        cap = sum(map(len, orders))
    hops = list(hop) or [0.0] * max(n_stages - 1, 0)
    ready: dict[tuple[Kind, int, int], float] = {}  # (kind, stage, mb) -> input arrival
    waiting: dict[tuple[Kind, int, int], int] = {}  # input not produced yet -> rank
    pos = [0] * ranks
    owed: list[deque[Action]] = [deque() for _ in range(ranks)]
    live = [0] * ranks
    peaks = [0] * ranks
    out: list[list[Action]] = [[] for _ in range(ranks)]
    heap = [(0.0, r) for r in range(ranks)]
    makespan = 0.0

    def arrive(key: tuple[Kind, int, int], when: float) -> None:
        ready[key] = when
        r = waiting.pop(key, None)
        if r is not None:
            heapq.heappush(heap, (when, r))

    def hand(src: int, dst: int, end: float) -> float:
        """When output of stage ``src`` ending at ``end`` is at stage ``dst``."""
        if placement[src] == placement[dst]:
            return end
        return end + hops[min(src, dst)]

    while heap:
        t, r = heapq.heappop(heap)
        acts = orders[r]
        nxt = acts[pos[r]] if pos[r] < len(acts) else None
        key = None
        if nxt is not None:
            kind = Kind.I if nxt.kind is Kind.B else nxt.kind
            key = (kind, nxt.stage, nxt.microbatch)
            if kind is Kind.F and nxt.stage == 0 or kind is Kind.W:
                ready.setdefault(key, 0.0)  # a W's I ran before it on this rank
        at = ready.get(key) if key is not None else None
        held = nxt is not None and nxt.kind is Kind.F and live[r] >= cap
        if at is not None and at <= t and not held:
            pos[r] += 1
            s, m = nxt.stage, nxt.microbatch
            if nxt.kind is Kind.F:
                end = t + f[s]
                live[r] += 1
                peaks[r] = max(peaks[r], live[r])
                if s + 1 < n_stages:
                    arrive((Kind.F, s + 1, m), hand(s, s + 1, end))
                else:
                    arrive((Kind.I, s, m), end)
            elif nxt.kind is Kind.W:
                end = t + w[s]
                live[r] -= 1
            else:
                end = t + b[s]
                if nxt.kind is Kind.B:
                    end += w[s]
                    live[r] -= 1
                elif not complete:
                    owed[r].append(W(s, m))
                if s > 0:
                    arrive((Kind.I, s - 1, m), hand(s, s - 1, end))
            action = nxt
        elif owed[r] and (held or at is None or at >= t + w[owed[r][0].stage]):
            action = owed[r].popleft()
            end = t + w[action.stage]
            live[r] -= 1
        elif nxt is None:
            continue  # this rank is done
        elif at is None:
            waiting[key] = r
            continue
        elif at > t:
            heapq.heappush(heap, (at, r))
            continue
        else:
            raise ScheduleError(
                f"rank {r}: memory cap {cap} stalls {nxt} (the plan needs a larger cap)"
            )
        out[r].append(action)
        makespan = max(makespan, end)
        heapq.heappush(heap, (end, r))
    stuck = [r for r in range(ranks) if pos[r] < len(orders[r])]
    if stuck:
        raise ScheduleError(f"ranks {stuck} never got the inputs their plans wait for")
    return Filled(out, makespan, peaks)

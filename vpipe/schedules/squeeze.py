"""Squeezing a building block's start-up and drain (the controllable-memory paper's idea, our
own implementation): a block repeats one microbatch's pattern every period, so the first and
last microbatches leave slots empty that the steady state fills; moving each F and I of those
phases to the earliest free slot of its rank after its inputs shortens the step without
raising the rank's memory above the block's own peak.

:func:`squeeze` returns each rank's F/I order after squeezing; the weight gradients are then
placed by :func:`vpipe.schedules.fill.fill` under the real costs, as for any block.
"""

from __future__ import annotations

from collections.abc import Mapping

from vpipe.ir import Action
from vpipe.schedules._common import F, I
from vpipe.schedules.blocks import Block

__all__ = ["squeeze"]


def squeeze(block: Block, placement: Mapping[int, int], microbatches: int) -> list[list[Action]]:
    """Each rank's F and I actions in slot order after squeezing ``block``'s start-up (until
    microbatch 0's last input gradient) and drain (after the last forward)."""
    n, m_count = len(placement), microbatches
    ranks = max(placement.values()) + 1
    f0, i0 = block.slots()
    slot: dict[tuple[int, int, int], int] = {}  # (0 F / 1 I, stage, mb) -> slot
    for s in range(n):
        for m in range(m_count):
            slot[0, s, m] = f0[s] + m * block.period
            slot[1, s, m] = i0[s] + m * block.period
    taken = [set() for _ in range(ranks)]
    for (_, s, _), t in slot.items():
        taken[placement[s]].add(t)
    cap = max(_peak(slot, placement, r) for r in range(ranks))
    end_startup = slot[1, 0, 0]
    start_drain = slot[0, n - 1, m_count - 1]
    for key in sorted(slot, key=slot.get):
        t = slot[key]
        if end_startup < t <= start_drain:
            continue
        kind, s, m = key
        r = placement[s]
        ready = max(_after(key, slot, n), -1) + 1
        for cand in range(ready, t):
            if cand in taken[r]:
                continue
            slot[key] = cand
            if _peak(slot, placement, r) <= cap:
                taken[r].discard(t)
                taken[r].add(cand)
                break
            slot[key] = t
    rows: list[list[tuple[int, int, int, int]]] = [[] for _ in range(ranks)]
    for (kind, s, m), t in slot.items():
        rows[placement[s]].append((t, kind, s, m))
    return [[F(s, m) if k == 0 else I(s, m) for _, k, s, m in sorted(row)] for row in rows]


def _after(key: tuple[int, int, int], slot: dict, n: int) -> int:
    """The latest slot this action must follow: its input's and the previous microbatch's
    action of the same kind and stage."""
    kind, s, m = key
    deps = []
    if kind == 0 and s > 0:
        deps.append(slot[0, s - 1, m])
    if kind == 1:
        deps.append(slot[0, s, m] if s == n - 1 else slot[1, s + 1, m])
    if m > 0:
        deps.append(slot[kind, s, m - 1])
    return max(deps, default=-1)


def _peak(slot: dict, placement: Mapping[int, int], rank: int) -> int:
    """Most stage-activations ``rank`` holds in slot order with each W right after its I."""
    events = sorted((t, kind) for (kind, s, _), t in slot.items() if placement[s] == rank)
    live = peak = 0
    for _, kind in events:
        live += 1 if kind == 0 else -1
        peak = max(peak, live)
    return peak

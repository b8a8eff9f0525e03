"""Building blocks (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024): the
planned slots of one microbatch's forwards and input gradients, repeated every ``period``.

A :class:`Block` fixes, along the chain of stages 0..S-1, the offset between consecutive
forwards (``f_offsets[s]``: from F of stage s to F of stage s+1), the ``gap`` from the last
stage's F to its I, and the offset between consecutive input gradients (``i_offsets[s]``: from
I of stage s+1 to I of stage s). Microbatch m's actions are planned ``m * period`` later than
microbatch 0's. Sorting each rank's planned actions gives its F/I order (:func:`plan`); the
weight gradients are left to :func:`vpipe.schedules.fill.fill`, which runs them in the gaps.

A stage's activation is live from its F to its W, so a rank's memory grows with the offsets:
summed over a V rank's two stages the planned lifetime is about
``(S-2) * sigma + turns + 2 * gap`` where ``sigma`` is an F offset plus the matching I offset
(the same for both chunks keeps memory balanced across ranks), i.e. about
``(S-2) * sigma / period`` live stage-activations. ``sigma = 2`` (every offset 1) is the least
memory, ``sigma = 6`` fills every gap (zero bubble).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vpipe.ir import Action, Kind
from vpipe.schedules._common import F, I

__all__ = ["Block", "fi_peak", "loop_block", "plan", "v_block"]


@dataclass(frozen=True)
class Block:
    """Planned slots of one microbatch (see the module docstring); all offsets >= 1."""

    f_offsets: tuple[int, ...]
    gap: int
    i_offsets: tuple[int, ...]
    period: int

    def slots(self) -> tuple[list[int], list[int]]:
        """Planned start slot of F and of I for every stage, microbatch 0."""
        n = len(self.f_offsets) + 1
        f = [0] * n
        for s in range(1, n):
            f[s] = f[s - 1] + self.f_offsets[s - 1]
        i = [0] * n
        i[n - 1] = f[n - 1] + self.gap
        for s in range(n - 2, -1, -1):
            i[s] = i[s + 1] + self.i_offsets[s]
        return f, i


def v_block(
    ranks: int,
    *,
    down: int,
    up: int,
    turn: int,
    gap: int,
    back_up: int,
    back_turn: int,
    back_down: int,
    period: int = 6,
) -> Block:
    """A block on the V placement's 2P stages: F offsets ``down`` within chunk 0 (stages
    0..P-1), ``turn`` from stage P-1 to P (both on the last rank), ``up`` within chunk 1; I
    offsets ``back_up`` within chunk 1 (2P-1 down to P), ``back_turn`` from P to P-1,
    ``back_down`` within chunk 0. Memory is balanced across ranks when
    ``down + back_down == up + back_up``."""
    p = ranks
    f = (down,) * (p - 1) + (turn,) + (up,) * (p - 1)
    i = (back_down,) * (p - 1) + (back_turn,) + (back_up,) * (p - 1)
    return Block(f, gap, i, period)


def loop_block(ranks: int, *, forward: int, backward: int, gap: int, period: int = 3) -> Block:
    """A block on P stages, one per rank (loop placement): F offsets ``forward``, I offsets
    ``backward``."""
    return Block((forward,) * (ranks - 1), gap, (backward,) * (ranks - 1), period)


def plan(block: Block, placement: Mapping[int, int], microbatches: int) -> list[list[Action]]:
    """Each rank's F and I actions in planned order: by slot, then F before I, then stage,
    then microbatch. Every dependency (F of stage s before F of s+1, the last F before the
    last I, I of s+1 before I of s) has a later slot, so the orders never deadlock."""
    f_slot, i_slot = block.slots()
    ranks = max(placement.values()) + 1
    keyed: list[list[tuple[int, int, int, int]]] = [[] for _ in range(ranks)]
    for s, r in placement.items():
        row = keyed[r]
        for m in range(microbatches):
            row.append((f_slot[s] + m * block.period, 0, s, m))
            row.append((i_slot[s] + m * block.period, 1, s, m))
    out = []
    for row in keyed:
        row.sort()
        out.append([F(s, m) if k == 0 else I(s, m) for _, k, s, m in row])
    return out


def fi_peak(orders: Sequence[Sequence[Action]]) -> int:
    """The most stage-activations a rank holds in these F/I orders if each W ran right after
    its I: the least memory cap under which :func:`vpipe.schedules.fill.fill` can follow
    them."""
    peak = 0
    for acts in orders:
        live = 0
        for a in acts:
            live += 1 if a.kind is Kind.F else -1
            peak = max(peak, live)
    return peak

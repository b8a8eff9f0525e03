"""Controllable-memory families built from building blocks (Qi et al., NeurIPS 2024, and the
zero-bubble paper's ZB-H2): V-Min and V-Half on the V placement, ZB-H2 on the loop placement.

Each is a :class:`~vpipe.schedules.blocks.Block` (which fixes every rank's F/I order and so its
memory) whose weight gradients :func:`~vpipe.schedules.fill.fill` places in the gaps at unit
costs (f = b = w = 1, no communication), under a memory cap. Memory is counted as in the
simulator: a stage's activation of one microbatch is live from its F to its W. A V stage is
half a 1F1B stage, so ``c`` live V stage-activations are ``c/2`` of 1F1B's (whose rank 0 holds
P); the closed forms below are checked exactly against the simulator in the tests.
"""

from __future__ import annotations

from vpipe.ir import Schedule, loop_placement, v_placement
from vpipe.schedules._common import build, check_counts, resolve_stages_per_rank
from vpipe.schedules.blocks import Block, fi_peak, loop_block, plan, v_block
from vpipe.schedules.fill import fill

__all__ = ["v_half", "v_min", "zb_h2"]

_V = "V placement: rank r holds stages r and 2P-1-r"
_LOOP = "loop placement: stage s on rank s"


def _from_block(
    name: str, ranks: int, microbatches: int, placement: dict[int, int], block: Block, cap: int
) -> Schedule:
    orders = plan(block, placement, microbatches)
    cap = max(cap, fi_peak(orders))
    unit = [1.0] * len(placement)
    filled = fill(placement, orders, cap, unit, unit, unit)
    spr = len(placement) // ranks
    return build(name, ranks, microbatches, placement, filled.actions, stages_per_rank=spr, cap=cap)


def v_min(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """V-Min: the V placement's least-memory building block, every offset 1.

    Shape: microbatch m's forwards are planned one slot apart down the V (stage s at slot
    s + 6m) and its input gradients one slot apart back up, with a gap of 1 between the last F
    and the first I; both turns at the last rank take 3 slots when 3 divides P (1 otherwise:
    the least bubble, found by searching offsets up to 6). Each rank runs its F's and I's in
    planned order and its W's whenever its next F or I is not ready (or the memory cap
    holds its next F back).
    Memory: the largest rank peak is min(2M, 2*floor((P+4)/3)) V stage-activations, i.e.
    floor((P+4)/3) 1F1B stages: about a third of 1F1B's P (ZB-V's is P).
    Bubble with f = b = w = 1 and no communication: makespan 6M + 4P - 5 for every M >= 1
    (P >= 2; 6M at P = 1), i.e. each rank idles 4P - 5 of the step (ZB-V: P - 1; 1F1B on P
    full stages: 6(P - 1) in the same units), since one microbatch crosses all 2P stages and
    back with few others in flight.
    Constraints: exactly 2 stages per rank; any P >= 1, any M >= 1.
    """
    name = "v-min"
    p, m = check_counts(name, ranks, microbatches)
    resolve_stages_per_rank(name, stages_per_rank, default=2, fixed=_V)
    turn = 3 if p % 3 == 0 else 1
    block = v_block(
        p, down=1, up=1, turn=turn, gap=1, back_up=1, back_turn=turn, back_down=1
    )
    return _from_block(name, p, m, v_placement(p), block, 2 * ((p + 4) // 3))


def v_half(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """V-Half: the V placement's half-memory building block, forward and backward offsets
    summing to 3 (half of ZB-V's 6) on both chunks.

    Shape: microbatch m's forwards are planned 1 slot apart down chunk 0 and 2 apart up
    chunk 1, its input gradients 1 apart back down chunk 1 and 2 apart up chunk 0 (period 6,
    gap 1); both turns at the last rank take 1 slot for odd P and 4 for even P (the least
    bubble, found by searching offsets up to 6). Each rank runs its F's and I's in planned
    order and its W's in the gaps (or when the memory cap holds its next F back).
    Memory: the largest rank peak is min(2M, P + 2) V stage-activations, i.e. (P + 2)/2
    1F1B stages: about half of 1F1B's P (every rank's once M > P).
    Bubble with f = b = w = 1 and no communication: makespan 6M + max(3P - 5, 4P - 3 - 2M)
    for P >= 3 (3P - 5 idle per rank once M >= (P + 2)/2: between V-Min's 4P - 5 and ZB-V's
    P - 1); 6M + max(2, 5 - 2M) at P = 2 and 6M at P = 1.
    Constraints: exactly 2 stages per rank; any P >= 1, any M >= 1.
    """
    name = "v-half"
    p, m = check_counts(name, ranks, microbatches)
    resolve_stages_per_rank(name, stages_per_rank, default=2, fixed=_V)
    turn = 1 if p % 2 else 4
    block = v_block(
        p, down=1, up=2, turn=turn, gap=1, back_up=1, back_turn=turn, back_down=2
    )
    return _from_block(name, p, m, v_placement(p), block, p + 2)


def zb_h2(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """ZB-H2 (zero-bubble paper): one stage per rank, loop placement, more warm-up forwards
    than ZB-H1 so that the W's fill the drain.

    Shape: a block with forwards 1 slot apart and input gradients 5 apart (period 3, gap 1):
    for M >= 2P - 1, rank r warms up with 2P-1-2r forwards, runs 2r (I, F) pairs whose W's
    wait, then (I, W, F) triples while forwards remain, and drains its I's with the owed W's
    in the gaps.
    Memory: min(M, 2P - 1) microbatches in flight on every rank (1F1B and ZB-H1: P).
    Bubble with f = b = w = 1 and no communication: makespan 3M + P - 1 + max(0, P - M);
    for M >= 2P - 1 each rank is busy from its first to its last action (skew-excluding
    bubble exactly 0), the only idle time being the (P - 1)f start-up/drain skew.
    Constraints: exactly 1 stage per rank; any P >= 1, any M >= 1.
    """
    name = "zb-h2"
    p, m = check_counts(name, ranks, microbatches)
    resolve_stages_per_rank(
        name, stages_per_rank, default=1, fixed=_LOOP, hint="use zb-h1 for several stages per rank"
    )
    block = loop_block(p, forward=1, backward=5, gap=1)
    return _from_block(name, p, m, loop_placement(p, p), block, 2 * p - 1)

"""Loop placement with v stages per rank (stage s on rank s mod P): interleaved 1F1B,
looped BFS and the interleaved zero-bubble family (zb-h1)."""

from __future__ import annotations

from collections import deque

from vpipe.ir import Action, Schedule, loop_placement
from vpipe.schedules._common import B, F, I, W, build, check_counts, resolve_stages_per_rank


def rounds(ranks: int, microbatches: int) -> list[range]:
    """Split microbatches 0..M-1 into consecutive rounds of as-equal-as-possible size.

    There are max(1, M // P) rounds, so every round has between P and 2P-1 microbatches when
    M >= P (one round of M when M < P). A rank runs a whole round through one local stage
    before moving to its next stage; a round of at least P microbatches keeps the rank busy
    until the round's first microbatch comes back around the ring, which is all the
    interleaved shape needs. So M need not be a multiple of P (Megatron's and older torch's
    limit): only rounds of at least P matter. Rounds of P with a short last round are not
    enough: with the 1F1B alternation below they can even deadlock (v=3, P=4, M=5 as 4+1).
    """
    n = max(1, microbatches // ranks)
    base, extra = divmod(microbatches, n)
    out, lo = [], 0
    for k in range(n):
        size = base + (1 if k < extra else 0)
        out.append(range(lo, lo + size))
        lo += size
    return out


def _orders(
    ranks: int, microbatches: int, v: int, rank: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]], int]:
    """(stage, microbatch) forward and backward orders of one rank, and the first round's size.

    Forwards go round by round, local stages ascending; backwards round by round, local
    stages descending.
    """
    fwd: list[tuple[int, int]] = []
    bwd: list[tuple[int, int]] = []
    rs = rounds(ranks, microbatches)
    for mbs in rs:
        for c in range(v):
            fwd += [(c * ranks + rank, i) for i in mbs]
        for c in reversed(range(v)):
            bwd += [(c * ranks + rank, i) for i in mbs]
    return fwd, bwd, len(rs[0])


def _one_f_one_b_order(
    ranks: int, microbatches: int, v: int, rank: int, warmup_factor: int, split: bool
) -> list[Action]:
    """One rank's interleaved 1F1B program: warm-up forwards, then one forward and one
    backward alternately, then the remaining backwards.

    With ``split`` each backward is an I and its W is deferred: rank r keeps its first r W's
    back (issuing one W per steady-state pair after that) and runs the rest as the pipeline
    drains, so the I chain toward rank 0 is never delayed by weight gradients while the
    drain's idle slots are filled with W's.
    """
    fwd, bwd, first_round = _orders(ranks, microbatches, v, rank)
    n = len(fwd)
    warmup = min(n, (v - 1) * first_round + warmup_factor * (ranks - 1 - rank))
    acts = [F(s, i) for s, i in fwd[:warmup]]
    pending: deque[Action] = deque()

    def backward(k: int, drain: bool) -> None:
        s, i = bwd[k]
        if not split:
            acts.append(B(s, i))
            return
        acts.append(I(s, i))
        pending.append(W(s, i))
        if drain or k >= rank:
            acts.append(pending.popleft())

    for k in range(n - warmup):
        s, i = fwd[warmup + k]
        acts.append(F(s, i))
        backward(k, drain=False)
    for k in range(n - warmup, n):
        backward(k, drain=True)
    acts.extend(pending)
    return acts


def interleaved_1f1b(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """Interleaved 1F1B (Megatron's virtual pipeline): v stages per rank (default 2), loop
    placement, full backwards.

    Shape: microbatches are split into rounds (see :func:`rounds`); each rank runs a round
    through its stages in ascending order for forwards and descending order for backwards.
    Rank r warms up with (v-1)*g + 2(P-1-r) forwards (g the first round's size, the factor 2
    as in Megatron to leave slack for communication), then alternates F and B. With zero comm
    and M >= P the bubble time is (P-1)(F+B)/v where F, B are a rank's whole per-microbatch
    share (per-stage times are that divided by v): v times smaller than 1F1B's.
    Constraints: any P >= 1, M >= 1, v >= 1 (v = 1 is exactly 1F1B). M need not be a
    multiple of P; M < P works with a larger bubble (one round of M < P microbatches).
    Cost: more live activations than 1F1B, growing with v and the round size.
    """
    name = "interleaved-1f1b"
    p, m = check_counts(name, ranks, microbatches)
    v = resolve_stages_per_rank(name, stages_per_rank, default=2)
    factor = 2 if v > 1 else 1
    actions = [_one_f_one_b_order(p, m, v, r, factor, split=False) for r in range(p)]
    return build(name, p, m, loop_placement(p, p * v), actions, stages_per_rank=v)


def zb_h1(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """Zero-bubble H1 with split backward (I then a deferred W), loop placement, v stages per
    rank (default 1).

    v = 1 is ZB-H1 of the zero-bubble paper: 1F1B's warm-up of P-1-r forwards and F/I
    alternation, with rank r deferring its first r weight gradients to the drain, where they
    fill the idle slots that 1F1B leaves. Every rank then has P microbatches in flight (F run,
    W not yet), 1F1B's peak on rank 0. With zero comm, M >= P and w <= min(f, b) the bubble
    time per rank is (P-1)(f+b-w) (b the input-gradient time), a third of 1F1B's at
    f = b = w. v > 1 is the interleaved zero-bubble variant (torch's InterleavedZeroBubble
    shape): interleaved 1F1B's rounds with warm-up (v-1)*g + (P-1-r), I/W split and the same
    deferral; its bubble is (P-1)(f+b-w) in per-stage times, i.e. (P-1)(F+B-W)/v in a rank's
    per-microbatch totals. The warm-up uses P-1-r where interleaved-1f1b uses 2(P-1-r): fewer
    live activations (P=4, M=8, v=2: 8 instead of 11) but less slack when communication
    takes time. Constraints: any P >= 1, M >= 1 (M < P adds bubble), v >= 1.
    """
    name = "zb-h1"
    p, m = check_counts(name, ranks, microbatches)
    v = resolve_stages_per_rank(name, stages_per_rank, default=1)
    actions = [_one_f_one_b_order(p, m, v, r, 1, split=True) for r in range(p)]
    return build(name, p, m, loop_placement(p, p * v), actions, stages_per_rank=v)


def looped_bfs(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """Looped BFS (breadth-first pipeline): v stages per rank (default 2), loop placement;
    each rank runs all M forwards of its first stage, then of its next, ..., then all
    backwards stage by stage in descending order.

    Shape and why: GPipe per local stage; stage s+P's forwards start after stage s's on the
    same rank, which with M >= P keeps every rank busy across the stage switch. Bubble with
    zero comm and M >= P: (P-1)(F+B)/v in a rank's totals, like interleaved 1F1B, but every
    rank holds v*M live activations at the turn. Constraints: any P >= 1, M >= 1, v >= 1
    (v = 1 is GPipe).
    """
    name = "looped-bfs"
    p, m = check_counts(name, ranks, microbatches)
    v = resolve_stages_per_rank(name, stages_per_rank, default=2)
    actions = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        acts = [F(s, i) for s in stages for i in range(m)]
        acts += [B(s, i) for s in reversed(stages) for i in range(m)]
        actions.append(acts)
    return build(name, p, m, loop_placement(p, p * v), actions, stages_per_rank=v)

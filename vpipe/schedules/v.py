"""V placement (rank r holds stages r and 2P-1-r; the loss stage 2P-1 is on rank 0): ZB-V and
DualPipeV. The last rank holds the adjacent stages P-1 and P, handed over locally."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from vpipe.ir import Action, Schedule, v_placement
from vpipe.schedules._common import (
    B,
    F,
    I,
    W,
    build,
    check_counts,
    keep_microbatches,
    overlap_fb,
    resolve_stages_per_rank,
)

_V = "V placement: rank r holds stages r and 2P-1-r"


class _Counters:
    """Per-chunk next-microbatch counters of one rank (chunk 0 = stage r, chunk 1 = 2P-1-r),
    plus the FIFO of deferred weight gradients."""

    def __init__(self, ranks: int, rank: int) -> None:
        self.stage = (rank, 2 * ranks - 1 - rank)
        self.f = [0, 0]
        self.b = [0, 0]
        self.deferred: deque[Action] = deque()

    def fwd(self, chunk: int) -> Action:
        self.f[chunk] += 1
        return F(self.stage[chunk], self.f[chunk] - 1)

    def bwd(self, chunk: int) -> Action:
        """A full backward."""
        self.b[chunk] += 1
        return B(self.stage[chunk], self.b[chunk] - 1)

    def inp(self, chunk: int) -> Action:
        """An input-gradient backward whose W is queued."""
        self.b[chunk] += 1
        mb = self.b[chunk] - 1
        self.deferred.append(W(self.stage[chunk], mb))
        return I(self.stage[chunk], mb)

    def weight(self, chunk: int | None = None) -> Action:
        """The oldest deferred W (of ``chunk`` when given)."""
        if chunk is None:
            return self.deferred.popleft()
        for k, a in enumerate(self.deferred):
            if a.stage == self.stage[chunk]:
                del self.deferred[k]
                return a
        raise AssertionError("no deferred W for this chunk")  # generator bug, not user input


def _v_schedule(
    name: str,
    rank_program: Callable[[int, int, int], list[Action]],
    ranks: int,
    microbatches: int,
    stages_per_rank: int | None,
) -> Schedule:
    """A V-placement family whose full shape needs 2P-1 microbatches: build it for
    max(M, 2P-1) and drop the microbatches beyond M (still valid, with more bubble)."""
    p, m = check_counts(name, ranks, microbatches)
    resolve_stages_per_rank(name, stages_per_rank, default=2, fixed=_V)
    n = max(m, 2 * p - 1)
    actions = [rank_program(p, n, r) for r in range(p)]
    if n > m:
        actions = [keep_microbatches(acts, m) for acts in actions]
    return build(name, p, m, v_placement(p), actions, stages_per_rank=2)


def _zbv_rank(ranks: int, n: int, rank: int) -> list[Action]:
    c = _Counters(ranks, rank)
    acts: list[Action] = []
    acts += [c.fwd(0) for _ in range(2 * (ranks - rank) - 1)]
    for _ in range(rank):
        acts += [c.fwd(1), c.fwd(0)]
    for _ in range(ranks - rank):
        acts += [c.fwd(1), c.inp(1), c.weight(1)]
    while c.f[1] < c.f[0] or c.f[0] < n:
        if c.f[0] < n:
            acts.append(c.fwd(0))
        acts += [c.inp(0), c.weight(0), c.fwd(1), c.inp(1), c.weight(1)]
    for _ in range(rank):
        acts += [c.inp(0), c.inp(1)]
    for _ in range(ranks - rank):
        acts += [c.inp(0), c.weight(0)]
    acts += [c.weight(1) for a in list(c.deferred) if a.stage == c.stage[1]]
    acts += [c.weight(0) for _ in range(len(c.deferred))]
    return acts


def zbv(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """ZB-V (zero-bubble paper, section 6): V placement, two stages per rank, every backward
    split into I and W.

    Shape on rank r (chunk 0 = stage r, chunk 1 = stage 2P-1-r): 2(P-r)-1 forwards of chunk
    0; r pairs (F chunk 1, F chunk 0); P-r triples (F, I, W of chunk 1); steady state
    (F0, I0, W0, F1, I1, W1); drain with r pairs (I0, I1) whose W's wait, P-r pairs (I0, W0),
    then the waiting W's. Every rank holds at most 2P live stage-activations (each V stage is
    half a 1F1B stage, so that is 1F1B's rank-0 memory), balanced across ranks.
    With zero comm, f = b = w and M >= 2P-1 each rank is busy without a gap from its first to
    its last action (skew-excluding bubble exactly 0); the whole step is 6Mf + (P-1)f, the
    only idle time being the (P-1)f start-up/drain skew (rank r starts r forwards late).
    Constraints: exactly 2 stages per rank; any P >= 1 (P = 1: stages 0 and 1 on rank 0,
    handed over locally); any M >= 1: the shape needs 2P-1 microbatches, so for fewer it is
    built for 2P-1 and the missing microbatches are dropped (still valid, with more bubble).
    """
    return _v_schedule("zbv", _zbv_rank, ranks, microbatches, stages_per_rank)


def _dualpipev_rank(ranks: int, n: int, rank: int) -> list[Action]:
    c = _Counters(ranks, rank)
    last = rank == ranks - 1
    acts: list[Action] = []
    # 1: forwards of chunk 0 only
    acts += [c.fwd(0) for _ in range(2 * (ranks - rank - 1))]
    # 2: F0 F1 pairs
    for _ in range(rank + 1):
        acts += [c.fwd(0), c.fwd(1)]
    # 3: I1 W F1 (zero-bubble split while the first backwards arrive)
    for _ in range(ranks - rank - 1):
        acts += [c.inp(1), c.weight(), c.fwd(1)]
    # 4: steady state, forward of one chunk overlapped with the backward of the other
    for k in range(n - 2 * ranks + rank + 1):
        if k == 0 and last:
            acts += [c.fwd(0), c.bwd(1)]  # not overlapped, as in DualPipeV
        else:
            f = c.fwd(0)
            acts.append(overlap_fb(f, c.bwd(1)))
        f = c.fwd(1)
        acts.append(overlap_fb(f, c.bwd(0)))
    # 5: B1 then (F1; B0)
    for _ in range(ranks - rank - 1):
        acts.append(c.bwd(1))
        f = c.fwd(1)
        acts.append(overlap_fb(f, c.bwd(0)))
    # 6: B1 B0 pairs; from the middle on, split (W deferred)
    split = False
    half = (rank + 1) // 2
    for k in range(rank + 1):
        if k == half and rank % 2 == 1:
            split = True
        acts.append(c.inp(1) if split else c.bwd(1))
        if k == half and rank % 2 == 0:
            split = True
        acts.append(c.inp(0) if split else c.bwd(0))
    # 7: W then I0
    for _ in range(ranks - rank - 1):
        acts += [c.weight(), c.inp(0)]
    # 8: the remaining W's
    acts += [c.weight() for _ in range(len(c.deferred))]
    return acts


def dualpipev(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe folded onto P ranks): V placement, two stages per rank,
    the steady state as compound ``(F;B)OVERLAP_F_B`` actions pairing one chunk's forward with
    the other chunk's full backward, so a runtime can overlap one's communication with the
    other's compute.

    Shape on rank r (chunk 0 = stage r, chunk 1 = stage 2P-1-r), DualPipeV's eight phases:
    2(P-r-1) forwards of chunk 0; r+1 pairs (F0, F1); P-r-1 triples (I1, W, F1); M-2P+r+1
    steady pairs ((F0;B1), (F1;B0)), except that the last rank runs its first F0 and B1 one
    after the other, not overlapped, as DualPipeV does to shorten the bubble; P-r-1
    pairs (B1, (F1;B0)); r+1 pairs (B1, B0) whose second half split I/W; P-r-1 pairs (W, I0);
    the remaining W's (the W queue is first-in first-out).
    With zero comm, f = b, w <= b and M >= 2P-1 the per-rank bubble is DualPipe's
    (P-1)(F&B + B - 3W) with F&B the overlap's time (f+b+w here, as the simulator runs the
    parts one after another), B = b+w and W = w: 2(P-1)f at f = b = w. Peak live
    activations for M >= 2P: 2P+1 stage-units on every rank (ZB-V's 2P plus one, because an
    overlap's forward allocates before its backward frees).
    Constraints: exactly 2 stages per rank; any P >= 1; any M >= 1: rank 0 runs 2P-1 forwards
    of stage 0 before its first backward, so the shape needs M >= 2P-1; for fewer it is built
    for 2P-1 and the missing microbatches are dropped (valid, more bubble).
    """
    return _v_schedule("dualpipev", _dualpipev_rank, ranks, microbatches, stages_per_rank)

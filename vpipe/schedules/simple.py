"""GPipe and 1F1B: one stage per rank, loop placement (stage s on rank s)."""

from __future__ import annotations

from vpipe.ir import Schedule, loop_placement
from vpipe.schedules._common import B, F, build, check_counts, resolve_stages_per_rank

_ONE_STAGE = "loop placement: stage s on rank s"
_MORE = "use looped-bfs or interleaved-1f1b for several stages per rank"


def gpipe(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """GPipe: every rank runs all M forwards, then all M full backwards (B), in microbatch order.

    Shape: rank r is idle for r forward slots at the start and r backward slots at the end;
    with f = b = w = 1 and zero comm the bubble ratio is (P-1)/(M+P-1) on every rank.
    Constraints: any P >= 1, any M >= 1, one stage per rank. Memory: all M activations live at
    the F -> B turn on every rank, which is why 1F1B exists.
    """
    name = "gpipe"
    p, m = check_counts(name, ranks, microbatches)
    resolve_stages_per_rank(name, stages_per_rank, default=1, fixed=_ONE_STAGE, hint=_MORE)
    actions = [[F(r, i) for i in range(m)] + [B(r, i) for i in range(m)] for r in range(p)]
    return build(name, p, m, loop_placement(p, p), actions, stages_per_rank=1)


def one_f_one_b(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """1F1B (PipeDream-flush): rank r warms up with min(P-1-r, M) forwards, then alternates one
    forward and one full backward, then drains the remaining backwards.

    Shape and why: the warm-up is exactly the number of microbatches in flight downstream of
    rank r, so the first backward arrives just as the warm-up ends. Bubble ratio equals
    GPipe's, (P-1)/(M+P-1) with f = b = w = 1, but rank r holds at most min(P-r, M) live
    activations instead of M. Constraints: any P >= 1, any M >= 1 (M < P simply degenerates
    to GPipe's order), one stage per rank.
    """
    name = "1f1b"
    p, m = check_counts(name, ranks, microbatches)
    resolve_stages_per_rank(name, stages_per_rank, default=1, fixed=_ONE_STAGE, hint=_MORE)
    actions = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [F(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [F(r, warmup + i), B(r, i)]
        acts += [B(r, i) for i in range(m - warmup, m)]
        actions.append(acts)
    return build(name, p, m, loop_placement(p, p), actions, stages_per_rank=1)

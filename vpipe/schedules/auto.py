"""``auto``: the fastest schedule under a cost model and a memory limit.

:func:`auto_schedule` tries building blocks from the least-memory one (every offset 1, as
V-Min) to the zero-bubble one (forward and backward offsets summing to 6, as ZB-V/ZB-H2),
fills each with :func:`~vpipe.schedules.fill.fill` under the given per-stage costs at the
memory cap the limit allows, weighs the fixed families of the same placement (ZB-V, V-Half,
V-Min; 1F1B, ZB-H1, ZB-H2) timed as they are, and keeps the fastest whose peak fits. When
the limit is below what every one of them needs, the least-memory block is stretched (a
longer period, fewer microbatches in flight) until it fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from vpipe.errors import ScheduleError
from vpipe.ir import Action, Schedule, loop_placement, v_placement
from vpipe.schedules._common import build, check_counts, resolve_stages_per_rank
from vpipe.schedules.blocks import Block, fi_peak, loop_block, plan, v_block
from vpipe.schedules.controllable import v_half, v_min, zb_h2
from vpipe.schedules.fill import Filled, fill
from vpipe.schedules.interleaved import zb_h1
from vpipe.schedules.simple import one_f_one_b
from vpipe.schedules.v import zbv

__all__ = ["StageCosts", "auto", "auto_schedule"]

# (down, up, back_up, back_down): forward offsets down chunk 0 and up chunk 1, backward
# offsets back down chunk 1 and up chunk 0; each pair sums to the same sigma (2, 3, 4, 6).
_V_OFFSETS = ((1, 1, 1, 1), (1, 2, 1, 2), (1, 3, 1, 3), (1, 5, 1, 5), (2, 4, 2, 4))
_V_TURNS = (1, 3, 4)
# (forward, backward) offsets on the loop placement: sigma 2, 3, 4, 6.
_LOOP_OFFSETS = ((1, 1), (1, 2), (1, 3), (1, 5), (2, 4), (3, 3))
# Fixed families weighed too, timed as they are (each is one candidate).
_FIXED = {"v": (zbv, v_half, v_min), "loop": (one_f_one_b, zb_h1, zb_h2)}


class StageCosts(Protocol):
    """What auto needs of a cost model (:class:`vpipe.sim.CostModel` has it): per-stage F, I
    and W times, and the time of a message across each stage boundary."""

    def stage_times(self, n_stages: int) -> tuple[Sequence[float], ...]: ...

    def boundary_costs(self, n_stages: int) -> Sequence[float]: ...


def _blocks(placement: str, ranks: int, period: int) -> list[Block]:
    if placement == "v":
        return [
            v_block(
                ranks, down=d, up=u, turn=t, gap=1, back_up=bu, back_turn=t, back_down=bd,
                period=period,
            )
            for d, u, bu, bd in _V_OFFSETS
            for t in _V_TURNS
        ]
    return [loop_block(ranks, forward=f, backward=b, gap=1, period=period) for f, b in _LOOP_OFFSETS]


def auto_schedule(
    ranks: int,
    microbatches: int,
    costs: StageCosts,
    memory_limit: float,
    placement: str = "v",
) -> Schedule:
    """The fastest building-block schedule under ``costs`` whose every rank holds at most
    ``memory_limit`` live activations, counted in 1F1B stages (one microbatch's activations
    of 1/P of the model; 1F1B's rank 0 holds P, ZB-V's ranks P, V-Min's about P/3).

    ``placement``: ``"v"`` (2 stages per rank, V placement) or ``"loop"`` (1 stage per rank).
    Candidates: every block of the module's grid (forward/backward offset pairs summing to 2,
    3, 4 or 6; turns 1, 3 or 4 on the V) at the largest memory cap the limit allows and at its
    own least cap, each filled with W's under ``costs`` (per-stage f, b, w; messages across
    boundaries as ``costs.boundary_costs``), and the fixed families (ZB-V, V-Half, V-Min;
    1F1B, ZB-H1, ZB-H2) as they are; ties go to the lower peak. So with no communication cost
    it is never slower than any of those families whose peak fits the limit. Makespans are
    :func:`~vpipe.schedules.fill.fill`'s, equal to the simulator's with no communication cost
    (with some, receives posted late in the lowered program can add to the simulated time,
    see :mod:`vpipe.schedules.fill`).
    A limit below one microbatch's own footprint (2 V stages, 1 loop stage) is refused.
    """
    name = "auto"
    p, m = check_counts(name, ranks, microbatches)
    if placement not in ("v", "loop"):
        raise ScheduleError(f"{name}: placement must be 'v' or 'loop', got {placement!r}")
    spr = 2 if placement == "v" else 1
    place = v_placement(p) if placement == "v" else loop_placement(p, p)
    if (
        isinstance(memory_limit, bool)
        or not isinstance(memory_limit, (int, float))
        or math.isnan(memory_limit)
    ):
        raise ScheduleError(f"{name}: memory_limit must be a number, got {memory_limit!r}")
    cap = math.floor(memory_limit * spr + 1e-9) if math.isfinite(memory_limit) else 2 * p * m
    if cap < spr:
        raise ScheduleError(
            f"{name}: memory limit {memory_limit} is below one microbatch's activations on a "
            f"rank ({spr}/{spr} of a 1F1B stage); use at least 1"
        )
    n = len(place)
    f, b, w = (list(map(float, x)) for x in costs.stage_times(n))
    times = (f, b, w, list(map(float, costs.boundary_costs(n))))
    period = 3 * spr
    fixed = [(s.name, s.actions, None) for s in (g(p, m) for g in _FIXED[placement])]
    found = _fastest(_plans(_blocks(placement, p, period), place, m, cap) + fixed, place, cap, times)
    while found is None:  # stretch the least-memory block until one microbatch fits
        period += 1
        found = _fastest(_plans(_blocks(placement, p, period)[:1], place, m, cap), place, cap, times)
    filled, source, c = found
    return build(
        name, p, m, place, filled.actions, stages_per_rank=spr, source=source, cap=c,
        memory_limit=memory_limit,
    )


Candidate = tuple[object, list[list[Action]], int | None]  # (block or family, orders, cap)
Times = tuple[list[float], list[float], list[float], list[float]]  # f, b, w, hop


def _plans(blocks: list[Block], place: dict[int, int], m: int, cap: int) -> list[Candidate]:
    """(block, F/I orders, cap) for every block at its own least cap and at ``cap``."""
    out = []
    for block in blocks:
        orders = plan(block, place, m)
        need = fi_peak(orders)
        out += [(block, orders, c) for c in sorted({need, cap}) if need <= c <= cap]
    return out


def _fastest(
    candidates: list[Candidate], place: dict[int, int], cap: int, times: Times
) -> tuple[Filled, object, int | None] | None:
    """The candidate with the least (makespan, peak), first listed on ties, among those whose
    peak fits ``cap`` (a complete program, whose cap is None, is timed as it is); None when
    none fits."""
    best, found = None, None
    for k, (source, orders, c) in enumerate(candidates):
        filled = fill(place, orders, cap if c is None else c, *times)
        key = (filled.makespan, max(filled.peaks), k)
        if max(filled.peaks) <= cap and (best is None or key < best):
            best, found = key, (filled, source, c)
    return found


def auto(ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
    """The catalogue's ``auto`` row: :func:`auto_schedule` on the V placement with unit costs
    (f = b = w = 1, no communication) and a memory limit of 2P 1F1B stage-activations (twice
    1F1B's peak). Shape, memory and bubble are those of the block it picks; with this
    generous limit it is never slower than ZB-V at unit costs.
    Constraints: exactly 2 stages per rank; any P >= 1, any M >= 1.
    """
    p, m = check_counts("auto", ranks, microbatches)
    resolve_stages_per_rank(
        "auto", stages_per_rank, default=2, fixed="V placement: rank r holds stages r and 2P-1-r"
    )
    return auto_schedule(p, m, _UnitCosts(), 2 * p)


class _UnitCosts:
    """f = b = w = 1 on every stage, free messages."""

    def stage_times(self, n_stages: int) -> tuple[list[float], ...]:
        return [1.0] * n_stages, [1.0] * n_stages, [1.0] * n_stages

    def boundary_costs(self, n_stages: int) -> list[float]:
        return [0.0] * max(n_stages - 1, 0)

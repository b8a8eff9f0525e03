"""``auto``: the best schedule under a cost model, a memory limit and an objective.

:func:`auto_schedule` weighs three kinds of candidates, each timed as it would run under the
given per-stage costs: the cost-adaptive list scheduler (:mod:`vpipe.schedules.adaptive`),
building blocks from the least-memory one (every offset 1, as V-Min) to the zero-bubble one
(offsets summing to 6, as ZB-V/ZB-H2) filled with W's by :func:`~vpipe.schedules.fill.fill`,
and the fixed families of the same placement as they are; it keeps the best by the objective
(makespan or longest rank span) whose peak fits the limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

from vpipe.errors import ScheduleError
from vpipe.ir import Action, Schedule, loop_placement, v_placement
from vpipe.schedules._common import build, check_counts, resolve_stages_per_rank
from vpipe.schedules.adaptive import WORK_BUDGET, MemoryModel, make_problem, search
from vpipe.schedules.blocks import Block, fi_peak, loop_block, plan, v_block
from vpipe.schedules.controllable import v_half, v_min, zb_h2
from vpipe.schedules.fill import fill
from vpipe.schedules.interleaved import interleaved_1f1b, zb_h1
from vpipe.schedules.problem import check_objective, time_programs
from vpipe.schedules.simple import one_f_one_b
from vpipe.schedules.squeeze import squeeze
from vpipe.schedules.v import zbv

__all__ = [
    "FAMILY_MEMORY",
    "PLACEMENTS",
    "UNIT_COSTS",
    "MemoryModel",
    "StageCosts",
    "adapted",
    "auto",
    "auto_schedule",
    "catalogue_adapted",
]

PLACEMENTS = ("loop", "v", "interleaved")
# actions the building-block candidates may fill in all (skipped above: the list scheduler
# covers large pipelines on its own)
BLOCK_BUDGET = 200_000
# the catalogue row's search: small, since every sweep and runtime test builds it
CATALOGUE_BUDGET = 20_000

# (down, up, back_up, back_down): forward offsets down chunk 0 and up chunk 1, backward
# offsets back down chunk 1 and up chunk 0; each pair sums to the same sigma (2, 3, 4, 6).
_V_OFFSETS = (
    (1, 1, 1, 1), (1, 2, 1, 2), (2, 1, 2, 1), (1, 3, 1, 3), (1, 5, 1, 5), (2, 4, 2, 4),
)  # fmt: skip
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


class _UnitCosts:
    """f = b = w = 1 on every stage, free messages."""

    def stage_times(self, n_stages: int) -> tuple[list[float], ...]:
        return [1.0] * n_stages, [1.0] * n_stages, [1.0] * n_stages

    def boundary_costs(self, n_stages: int) -> list[float]:
        return [0.0] * max(n_stages - 1, 0)


UNIT_COSTS = _UnitCosts()


def _blocks(placement: str, ranks: int, period: int) -> list[Block]:
    if placement == "v":
        return [
            v_block(
                ranks,
                down=d,
                up=u,
                turn=t,
                gap=1,
                back_up=bu,
                back_turn=t,
                back_down=bd,
                period=period,
            )
            for d, u, bu, bd in _V_OFFSETS
            for t in _V_TURNS
        ]
    return [
        loop_block(ranks, forward=f, backward=b, gap=1, period=period) for f, b in _LOOP_OFFSETS
    ]


def auto_schedule(
    ranks: int,
    microbatches: int,
    costs: StageCosts,
    memory_limit: float,
    placement: str = "v",
    *,
    objective: str = "makespan",
    memory: MemoryModel | None = None,
    stages_per_rank: int | None = None,
    search_budget: int = WORK_BUDGET,
    exact: bool = False,
    time_limit: float = 60.0,
    workers: int = 2,
    fixed_families: bool = True,
    name: str = "auto",
) -> Schedule:
    """The best schedule under ``costs`` whose every rank's activation memory stays within
    ``memory_limit``, by ``objective`` (``"makespan"`` or ``"span"``, see
    :mod:`vpipe.schedules.problem`; ties go to the lower peak).

    ``memory``: per-stage bytes allocated by F and freed by I (:class:`MemoryModel`), the
    limit in the same measure; by default the strict count in 1F1B stages (one microbatch's
    activations of 1/P of the model, held from F to W: 1F1B's rank 0 holds P, ZB-V's ranks P,
    V-Min's about P/3).
    ``placement``: ``"v"`` (2 stages per rank), ``"loop"`` (1 stage per rank) or
    ``"interleaved"`` (``stages_per_rank`` stages per rank, stage s on rank s mod P; default
    2). ``search_budget``: actions the list scheduler's search may schedule (its time).
    Candidates, each timed as it would run (messages across boundaries cost
    ``costs.boundary_costs``): the cost-adaptive list scheduler
    (:mod:`vpipe.schedules.adaptive`: several priority rules, warm-ups derived from the costs,
    W's in the bubbles, forwards admitted only within the limit); every building block of the
    module's grid (V and loop placements) filled with W's at the largest cap the limit allows
    and at its own least cap; and the fixed families of the placement (ZB-V, V-Half, V-Min;
    1F1B, ZB-H1, ZB-H2; interleaved 1F1B and ZB-H1) as they are. So it is never worse than
    any of those families whose peak fits the limit. A limit below one microbatch's own
    footprint on a rank is refused, naming the smallest feasible limit.
    ``exact``: then hand the best of them to the constraint solver as its starting point
    (:mod:`vpipe.schedules.exact`, OR-Tools, ``time_limit`` seconds on ``workers`` threads)
    and return its best schedule; ``meta["exact"]`` has its status, objective, proven lower
    bound and gap. ``fixed_families=False`` leaves the fixed families out (a caller that
    weighs them itself, as a cluster plan does).
    """
    p, m = check_counts(name, ranks, microbatches)
    objective = check_objective(objective)
    if placement not in PLACEMENTS:
        raise ScheduleError(
            f"{name}: placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}"
        )
    if (
        isinstance(memory_limit, bool)
        or not isinstance(memory_limit, (int, float))
        or math.isnan(memory_limit)
    ):
        raise ScheduleError(f"{name}: memory_limit must be a number, got {memory_limit!r}")
    spr = {"v": 2, "loop": 1}.get(placement) or resolve_stages_per_rank(
        name, stages_per_rank, default=2
    )
    if placement == "v":
        place = v_placement(p)
    else:
        place = loop_placement(p, p * spr)
    n = len(place)
    model = memory or MemoryModel.strict(p, n)
    if len(model.alloc) != n:
        raise ScheduleError(f"{name}: the memory model has {len(model.alloc)} stages, not {n}")
    f, b, w = (list(map(float, x)) for x in costs.stage_times(n))
    times = (f, b, w, list(map(float, costs.boundary_costs(n))))
    problem = make_problem(place, m, times, model, float(memory_limit))
    found = search(problem, objective, search_budget)  # refuses a limit nothing fits
    cands: list[tuple[object, list[list[Action]], int | None]] = []
    if placement in _FIXED:
        unit = min(model.alloc)
        cap = math.floor(memory_limit / unit + 1e-9) if math.isfinite(memory_limit) else 2 * n * m
        if 6 * m * n * len(_blocks(placement, p, 3 * spr)) <= BLOCK_BUDGET:
            for block, orders, c in _plans(_blocks(placement, p, 3 * spr), place, m, cap):
                filled = fill(place, orders, c, *times)
                cands.append((block, filled.actions, c))
            if placement == "v":
                cands += _squeezed(place, m, cap, times)
        fixed = [g(p, m) for g in _FIXED[placement]] if fixed_families else []
    else:
        fixed = []
        for g in (interleaved_1f1b, zb_h1) if fixed_families else ():
            try:
                fixed.append(g(p, m, spr))
            except ScheduleError:
                continue
    cands += [(s.name, s.actions, None) for s in fixed]
    best = ((found.timed.objective(objective), max(found.timed.peaks), -1),
            found.describe(), found.timed.actions, None, found.timed)  # fmt: skip
    for k, (source, actions, c) in enumerate(cands):
        timed = time_programs(problem, actions)
        peak = max(timed.peaks)
        if peak > problem.limit + 1e-9:
            continue
        key = (timed.objective(objective), peak, k)
        if key < best[0]:
            best = (key, source, actions, c, timed)
    _, source, actions, c, timed = best
    extra = {}
    if exact:
        from vpipe.schedules.exact import solve

        answer = solve(problem, objective, timed, time_limit=time_limit, workers=workers)
        if answer.timed is not timed:
            source, actions, c, timed = "exact", answer.timed.actions, None, answer.timed
        extra["exact"] = answer.to_dict()
    return build(
        name, p, m, place, actions, stages_per_rank=spr, source=source, cap=c,
        memory_limit=memory_limit, objective=objective,
        objective_value=timed.objective(objective), peak=max(timed.peaks), **extra,
    )  # fmt: skip


Candidate = tuple[object, list[list[Action]], int | None]  # (block or family, orders, cap)


def _plans(blocks: list[Block], place: dict[int, int], m: int, cap: int) -> list[Candidate]:
    """(block, F/I orders, cap) for every block at its own least cap and at ``cap``."""
    out = []
    for block in blocks:
        orders = plan(block, place, m)
        need = fi_peak(orders)
        out += [(block, orders, c) for c in sorted({need, cap}) if need <= c <= cap]
    return out


def controllable_blocks(ranks: int) -> dict[str, Block]:
    """V-Half's and V-Min's slot patterns as the controllable-memory paper lays them out
    (V-Half: forwards 2 slots apart down chunk 0 and 1 up chunk 1, input gradients 2 apart back
    up chunk 1 and 1 down chunk 0, a longer gap for even P; V-Min: every offset 1, a longer gap
    when 3 divides P)."""
    p = ranks
    half_gap = 4 if p % 2 == 0 else 1
    min_gap = 3 if p % 3 == 0 else 1
    return {
        "v-half": v_block(
            p, down=2, up=1, turn=1, gap=half_gap, back_up=2, back_turn=2, back_down=1
        ),
        "v-min": v_block(p, down=1, up=1, turn=1, gap=min_gap, back_up=1, back_turn=1, back_down=1),
    }


def _squeezed(
    place: dict[int, int], m: int, cap: int, times: tuple
) -> list[tuple[object, list[list[Action]], int | None]]:
    """V-Half and V-Min squeezed (:mod:`vpipe.schedules.squeeze`): their programs with W's in
    the free slots, and their F/I orders with W's filled under the costs at their own least
    cap and at ``cap``."""
    p = max(place.values()) + 1
    out: list[tuple[object, list[list[Action]], int | None]] = []
    for name, block in controllable_blocks(p).items():
        orders, programs = squeeze(block, place, m)
        out.append((f"{name} squeezed", programs, None))
        need = fi_peak(orders)
        for c in sorted({need, cap}):
            if need <= c <= cap:
                out.append(
                    (f"{name} squeezed, W by cost", fill(place, orders, c, *times).actions, c)
                )
    return out


# Memory of the controllable-memory families in 1F1B stage-activations (strict count) for P
# ranks: half and a third of 1F1B's, as the controllable-memory paper's V-Half and V-Min hold
# them (P+2 or P+1 and 2*floor((P+4)/3) V stages).
FAMILY_MEMORY = {"v-half": lambda p: float((p + 2) // 2), "v-min": lambda p: float((p + 4) // 3)}
_V = "V placement: rank r holds stages r and 2P-1-r"


def adapted(
    family: str,
    ranks: int,
    microbatches: int,
    costs: StageCosts,
    objective: str = "span",
    search_budget: int = WORK_BUDGET,
    stages_per_rank: int | None = None,
) -> Schedule:
    """``"v-half"`` or ``"v-min"`` adapted to ``costs`` (per stage), named so:
    :func:`auto_schedule` on the V placement at the family's memory
    (:data:`FAMILY_MEMORY`), whose candidates include the family's block-built and squeezed
    patterns with W's placed in their free slots or by the costs, so it is never worse than
    the block-built family (which for V-Half at odd P holds half a 1F1B stage more, P+2 V
    stages, and is then left out)."""
    if family not in FAMILY_MEMORY:
        raise ScheduleError(f"adapted: family must be 'v-half' or 'v-min', got {family!r}")
    p, m = check_counts(family, ranks, microbatches)
    resolve_stages_per_rank(family, stages_per_rank, default=2, fixed=_V)
    return auto_schedule(
        p, m, costs, FAMILY_MEMORY[family](p), "v", objective=objective,
        search_budget=search_budget, name=family,
    )  # fmt: skip


def catalogue_adapted(family: str) -> Callable[..., Schedule]:
    """The catalogue's generator of ``family`` (``"v-half"`` or ``"v-min"``):
    ``generate(ranks, microbatches, stages_per_rank=None, costs=UNIT_COSTS)`` is
    :func:`adapted` to ``costs`` (per stage; default f = b = w = 1, free messages), objective
    span, at the family's memory (:data:`FAMILY_MEMORY`), with the catalogue's search budget.
    Constraints: exactly 2 stages per rank; any P >= 1, any M >= 1."""
    if family not in FAMILY_MEMORY:
        raise ScheduleError(f"adapted: family must be 'v-half' or 'v-min', got {family!r}")
    return partial(_adapted_for_catalogue, family)


def _adapted_for_catalogue(
    family: str, ranks: int, microbatches: int, stages_per_rank: int | None = None,
    costs: StageCosts = UNIT_COSTS,
) -> Schedule:  # fmt: skip
    return adapted(family, ranks, microbatches, costs, "span", CATALOGUE_BUDGET, stages_per_rank)


def auto(
    ranks: int, microbatches: int, stages_per_rank: int | None = None,
    costs: StageCosts = UNIT_COSTS,
) -> Schedule:  # fmt: skip
    """The catalogue's ``auto`` row: :func:`auto_schedule` on the V placement for ``costs``
    (per stage; default f = b = w = 1, free messages) and a memory limit of 2P 1F1B
    stage-activations (twice 1F1B's peak), objective makespan. Shape, memory and bubble are
    those of the candidate it picks; with this generous limit it is never slower than ZB-V.
    Constraints: exactly 2 stages per rank; any P >= 1, any M >= 1.
    """
    p, m = check_counts("auto", ranks, microbatches)
    resolve_stages_per_rank("auto", stages_per_rank, default=2, fixed=_V)
    return auto_schedule(p, m, costs, 2 * p, search_budget=CATALOGUE_BUDGET)

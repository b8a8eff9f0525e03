"""``vpipe plan``'s cost-adapted rows: ``auto`` run under the plan's own costs, memory budget
and objective (the catalogue's ``auto`` row is built for a fixed limit, so the plan schedules it
afresh for every placement and microbatch count), and the other cost-adapted families
(``v-half``, ``v-min``: their own memory) built for the plan's costs.
"""

from __future__ import annotations

from typing import Any

from vpipe.errors import ScheduleError
from vpipe.ir import Schedule

__all__ = ["PLACEMENTS", "adapted_for_plan", "auto_for_plan"]

# (placement, stages per rank) the plan tries for auto
PLACEMENTS = (("loop", 1), ("v", 2), ("interleaved", 4))
# actions auto's search may schedule per candidate: the plan weighs many of them
PLAN_BUDGET = 15_000


def auto_for_plan(
    costs: Any, ranks: int, microbatches: int, rows: float, placement: str, spr: int,
    budget: Any, objective: str,
) -> Schedule:  # fmt: skip
    """``auto`` on ``placement`` for microbatches of ``rows`` rows under the plan's costs
    (``costs.cost_model(schedule, rows)``) within ``budget`` (units: 1F1B stages, the strict
    count; bytes: the cost model's activation bytes per stage)."""
    from vpipe.schedules.adaptive import MemoryModel
    from vpipe.schedules.auto import auto_schedule

    cm = _stage_costs(costs, ranks, microbatches, rows, placement, spr)
    memory = None
    if not budget.units:
        alloc = cm.stage_activation_bytes(ranks * (2 if placement == "v" else spr))
        if alloc is None or not alloc.any():
            raise ScheduleError("a budget in bytes needs activation bytes per stage")
        memory = MemoryModel.from_bytes(alloc)
    return auto_schedule(
        ranks, microbatches, cm, budget.value, placement, objective=objective, memory=memory,
        stages_per_rank=spr if placement == "interleaved" else None, search_budget=PLAN_BUDGET,
    )  # fmt: skip


def adapted_for_plan(
    costs: Any, family: Any, ranks: int, microbatches: int, rows: float, spr: int
) -> Schedule:
    """A cost-adapted catalogue ``family`` (:class:`vpipe.schedules.catalogue.Family`, e.g.
    v-half) built for the plan's costs of microbatches of ``rows`` rows, at its own memory."""
    from vpipe.schedules import make_schedule

    placement = "interleaved" if family.placement == "loop" and spr > 1 else family.placement
    cm = _stage_costs(costs, ranks, microbatches, rows, placement, spr)
    return make_schedule(family.name, ranks, microbatches, spr, costs=cm)


def _stage_costs(
    costs: Any, ranks: int, microbatches: int, rows: float, placement: str, spr: int
) -> Any:
    """The plan's per-stage cost model for a schedule of ``placement`` (a cheap fixed family of
    that shape stands in for the schedule not built yet)."""
    from vpipe.schedules import make_schedule

    shape = {"loop": "1f1b", "v": "zbv", "interleaved": "interleaved-1f1b"}[placement]
    template = make_schedule(shape, ranks, microbatches, spr if placement != "v" else None)
    return costs.cost_model(template, rows)

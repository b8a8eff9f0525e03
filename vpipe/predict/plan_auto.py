"""``vpipe plan``'s ``auto`` rows: the cost-adaptive scheduler run under the plan's own costs,
memory budget and objective (the catalogue's ``auto`` row is built for unit costs and a fixed
limit, so the plan schedules it afresh for every placement and microbatch count).
"""

from __future__ import annotations

from typing import Any

from vpipe.errors import ScheduleError
from vpipe.ir import Schedule

__all__ = ["PLACEMENTS", "auto_for_plan"]

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
    from vpipe.schedules import make_schedule
    from vpipe.schedules.adaptive import MemoryModel
    from vpipe.schedules.auto import auto_schedule

    shape = {"loop": "1f1b", "v": "zbv", "interleaved": "interleaved-1f1b"}[placement]
    template = make_schedule(shape, ranks, microbatches, spr if placement != "v" else None)
    cm = costs.cost_model(template, rows)
    memory = None
    if not budget.units:
        alloc = cm.stage_activation_bytes(template.n_stages)
        if alloc is None or not alloc.any():
            raise ScheduleError("a budget in bytes needs activation bytes per stage")
        memory = MemoryModel.from_bytes(alloc)
    return auto_schedule(
        ranks, microbatches, cm, budget.value, placement, objective=objective, memory=memory,
        stages_per_rank=spr if placement == "interleaved" else None, search_budget=PLAN_BUDGET,
    )  # fmt: skip

"""Several schedules simulated on the same model and the same work, side by side
(``vpipe compare``).

Every schedule splits one model into ranks x V stages, so a stage costs 1/V of a rank's share
(costs ``unit="rank"``, the convention of cost strings) and the figures compare like with like
whatever each family's stages per rank. The simulator is imported only when rows are computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vpipe.errors import VpipeError
from vpipe.schedules import catalogue
from vpipe.schedules.load import make_named

if TYPE_CHECKING:
    from vpipe.sim.cost_model import CostModel

__all__ = ["COMPARE_NOTE", "REFERENCE_SCHEDULE", "compare_rows"]

REFERENCE_SCHEDULE = catalogue.baseline()
COMPARE_NOTE = (
    "one model split into ranks x V stages: a stage costs the given f, b, w divided by V, and "
    "peak act counts activations in activation units, one rank's share of the model (stage "
    "activations / V)"
)


def compare_rows(
    names: Sequence[str],
    ranks: int,
    microbatches: int,
    costs: CostModel,
    stages_per_rank: int | None = None,
) -> list[dict[str, Any]]:
    """One row per schedule, all for the same model and the same work (see COMPARE_NOTE); a
    schedule that cannot run at this size gets an ``error`` instead of figures. Rows carry
    ``relative_step_time`` against REFERENCE_SCHEDULE when it is among them and runs. The
    cost-adapted families (auto, v-half, v-min) are scheduled for ``costs``."""
    from vpipe.sim.cost_model import CostModelError
    from vpipe.sim.simulator import simulate

    if costs.unit != "rank":
        raise CostModelError(
            "compare splits one model into ranks x V stages, so its costs are per rank's share "
            "(unit=rank): per-stage costs of a schedule with V stages per rank are V times "
            f"smaller (f={costs.f:g} per stage at V=2 is f={2 * costs.f:g} per rank)"
        )
    rows: list[dict[str, Any]] = []
    for name in names:
        row: dict[str, Any] = {"schedule": name}
        try:
            schedule = make_named(name, ranks, microbatches, stages_per_rank, costs)
            v = schedule.stages_per_rank
            result = simulate(schedule, costs)  # each stage 1/V of the rank's share
        except VpipeError as e:
            row["error"] = str(e)
            rows.append(row)
            continue
        row.update(
            stages=f"{ranks}x{v} {schedule.style}",
            stages_per_rank=v,
            makespan=float(result.makespan),
            bubble_ratio=float(result.bubble_ratio),
            bubble_ratio_excl_skew=float(result.bubble_ratio_excl_skew),
            peak_stage_activations=[int(x) for x in result.peak_stage_activations],
            peak_activation_units_max=max(result.peak_activation_units),
            peak_activation_units_min=min(result.peak_activation_units),
            comm_ops=[int(x) for x in result.comm_ops],
            comm_ops_total=int(sum(result.comm_ops)),
        )
        rows.append(row)
    ref = next((r for r in rows if r["schedule"] == REFERENCE_SCHEDULE and "error" not in r), None)
    for row in rows:
        if ref is not None and "error" not in row and ref["makespan"] > 0:
            row["relative_step_time"] = row["makespan"] / ref["makespan"]
    return rows

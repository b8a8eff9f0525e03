"""The schedule IR and its passes: actions and schedules (:mod:`.schedule`), the flat columnar
form (:mod:`.flat`), the one replay of a lowered program's semantics (:mod:`.engine`),
validation (:mod:`.validation`), lowering that inserts communication (:mod:`.lowering`) and
message bundling (:mod:`.bundling`). Nothing here imports torch or pandas.

A new pass is one module here taking and returning a :class:`Schedule`.
"""

from vpipe.ir.schedule import (
    BACKWARD_KINDS,
    COMM_KINDS,
    COMPUTE_KINDS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    actions_from_strings,
    format_action,
    loop_placement,
    make_placement,
    overlap,
    parse_action,
    placement_style,
    schedule_from_rows,
    v_placement,
)

__all__ = [
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "COMPUTE_KINDS",
    "COMM_KINDS",
    "BACKWARD_KINDS",
    "overlap",
    "parse_action",
    "format_action",
    "loop_placement",
    "v_placement",
    "make_placement",
    "placement_style",
    "schedule_from_rows",
    "actions_from_strings",
]

"""vpipe: trace-driven benchmarking of pipeline-parallel schedules, with a compact runtime.

The public API is this module's names: the IR (``Action``, ``Kind``, ``Schedule``,
``parse_action``, ``format_action``), ``make_schedule`` and ``schedule_names``, ``lower``,
``validate``, ``simulate`` with ``CostModel`` and ``SimResult``, and the runtime's ``Pipeline``.
Imports are lazy so that the schedule IR, passes and simulator work without importing torch.
The layers, lowest first: ``ir`` -> ``schedules`` -> ``sim`` | ``models`` | ``runtime`` |
``baselines`` -> ``metrics`` -> ``trace`` -> ``predict`` -> ``report`` -> ``sweep`` ->
``commands`` (docs/design.md).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from vpipe import compat
from vpipe.ir import Action, Kind, Schedule, ScheduleError, format_action, parse_action

__version__ = "0.1.0"

_LAZY = {
    "make_schedule": "vpipe.schedules",
    "schedule_names": "vpipe.schedules",
    "lower": "vpipe.ir.lowering",
    "validate": "vpipe.ir.validation",
    "simulate": "vpipe.sim",
    "CostModel": "vpipe.sim",
    "SimResult": "vpipe.sim",
    "Pipeline": "vpipe.runtime",
}

compat.install()  # old module paths (vpipe.passes, vpipe.harness, ...) keep working

__all__ = ["Action", "Kind", "Schedule", "ScheduleError", "format_action", "parse_action", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vpipe' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value

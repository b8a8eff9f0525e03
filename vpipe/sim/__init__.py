"""The simulator: a lowered program replayed under a cost model (:mod:`.cost_model`:
per-stage compute, per-action overheads, the link), giving the same event table as a measured
run (:mod:`.simulator`), and every schedule side by side (:mod:`.compare`). No torch, no pandas.

A new cost term is one field of :class:`CostModel` and its use in the engine's timing
(:mod:`vpipe.ir.engine`) or in :func:`simulate`'s per-action overheads.
"""

from vpipe.sim.cost_model import CostModel, CostModelError, parse_numbers
from vpipe.sim.simulator import SimResult, simulate

__all__ = ["CostModel", "CostModelError", "SimResult", "parse_numbers", "simulate"]

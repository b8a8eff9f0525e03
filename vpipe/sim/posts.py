"""Where a lowered program's SEND/RECV actions sit and which of them post an operation: what
the cost model's per-action overheads are charged on (:func:`vpipe.sim.simulator.simulate`),
and how many operations a step posts (:func:`posted_operations`, what a measured per-message
cost is divided by: :func:`vpipe.predict.calibrate.with_comm_threads`)."""

from __future__ import annotations

import numpy as np

from vpipe.ir import Schedule
from vpipe.ir.bundling import bundle_leaders, next_ops, posting_rows
from vpipe.ir.flat import Flat, flatten
from vpipe.ir.lowering import CommPlan, plan_comm

__all__ = ["comm_rows", "posted_operations"]


def comm_rows(fl: Flat, plan: CommPlan | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per SEND/RECV action: its rank, the compute op it precedes, and 1 where it posts an
    operation (0 for a bundle's followers). ``plan``: the communication a compute-only
    schedule is lowered with (None for a lowered one)."""
    if fl.lowered:  # each SEND/RECV precedes the next op of its rank
        return fl.c_rank, next_ops(fl), posting_rows(fl)
    # as lower() would place them: SENDs after their op, RECVs before their slot
    n_ops = len(fl.o_rank)
    c_rank = np.concatenate([fl.o_rank[plan.send_op], plan.dst])
    nxt = np.concatenate([plan.send_op + 1, fl.o_lo[plan.dst] + plan.slot])
    # the batch of each SEND, then each RECV; the plan keeps per-peer FIFO order, so every
    # group is a bundle the runtime forms
    batch = c_rank * (n_ops + 1) + nxt
    lead = bundle_leaders(batch[: len(plan.e)], batch[len(plan.e) :]).astype(float)
    return c_rank, nxt, np.concatenate([lead, lead])


def posted_operations(schedule: Schedule, recv_lookahead: int = 1) -> int:
    """Operations the runtime posts in one step of ``schedule``, over all ranks (a bundle of
    messages posts one): what the cost model's ``post`` is charged per. A compute-only
    schedule is counted as lowered with ``recv_lookahead``."""
    fl = flatten(schedule)
    plan = None if fl.lowered else plan_comm(fl, recv_lookahead)
    return int(comm_rows(fl, plan)[2].sum())

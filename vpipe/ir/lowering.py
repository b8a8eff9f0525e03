"""Lowering of pipeline schedules: insert the SEND/RECV actions a compute-only schedule needs.

Lowering places each SEND right after its producer (after the whole compound for an overlap
action) and each RECV ``recv_lookahead`` compute actions before its consumer (default 1: the
transfer overlaps the preceding compute action while few receive buffers are outstanding),
moved earlier where needed so that every peer's receives are posted in the order its sends
are. The result is deadlock-free under the execution semantics of :mod:`vpipe.ir.engine`.

:func:`validate` (from :mod:`vpipe.ir.validation`) is re-exported here: ``from vpipe.ir.lowering import
lower, validate``. Both are vectorised with numpy.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, repeat

import numpy as np

from vpipe.ir.flat import Flat, decode_messages, flatten, message_count, where
from vpipe.ir.schedule import Action, Kind, Schedule, ScheduleError
from vpipe.ir.validation import check_flat, validate

__all__ = ["lower", "validate", "CommPlan", "materialize", "plan_comm", "slot_keys"]

_new = tuple.__new__


@dataclass
class CommPlan:
    """Where :func:`lower` puts each message's SEND and RECV.

    Per message (``e``, message ids): sending op (global op id; the SEND follows it, after
    earlier sends of the same op in part order), receiving rank and compute index ``slot``
    (the RECV goes just before that compute action of the rank), and ``recv_op``, the op the
    RECV follows (-1: start of program). ``order`` sorts the RECVs of one slot.
    """

    e: np.ndarray
    send_op: np.ndarray
    send_sub: np.ndarray
    dst: np.ndarray
    slot: np.ndarray
    recv_op: np.ndarray
    order: np.ndarray


def plan_comm(fl: Flat, recv_lookahead: int = 1) -> CommPlan:
    """Place the communication of a compute-only, statically valid flat schedule."""
    s = fl.schedule
    P, M, NB = s.n_ranks, s.n_microbatches, s.n_stages - 1
    e_in, e_out = fl.part_messages
    has = e_out >= 0
    e = e_out[has]  # in send order: rank-major, program order, part order
    send_op, send_sub = fl.p_op[has], fl.p_sub[has]
    src = fl.p_rank[has]
    consumer = np.zeros(message_count(s), np.int64)
    hin = e_in >= 0
    consumer[e_in[hin]] = fl.p_op[hin]
    cons = consumer[e]
    d, b, _ = decode_messages(e, NB, M)
    dst = np.where(d == 0, fl.place[np.minimum(b + 1, NB)], fl.place[b])
    lo = fl.o_lo
    want = np.maximum(cons - lo[dst] - recv_lookahead, 0)
    # FIFO: within a channel (stable: send order), a RECV may not come after a later one.
    ch = src * P + dst
    order = np.argsort(ch, kind="stable")
    big = int(want.max()) + 1 if len(want) else 1
    v = want[order] + ch[order] * big
    slot_sorted = np.minimum.accumulate(v[::-1])[::-1] - ch[order] * big
    slot = np.empty_like(want)
    slot[order] = slot_sorted
    rank_in_channel = np.empty_like(want)
    rank_in_channel[order] = np.arange(len(order))
    recv_op = np.where(slot > 0, lo[dst] + slot - 1, -1)
    return CommPlan(e, send_op, send_sub, dst, slot, recv_op, rank_in_channel)


def lower(schedule: Schedule, *, check: bool = True, recv_lookahead: int = 1) -> Schedule:
    """Insert SEND/RECV actions for every cross-rank edge of a compute-only schedule.

    SENDs go right after their producer; each RECV goes ``recv_lookahead`` compute actions
    before its consumer (0: right before it), earlier where per-peer FIFO order needs it. No
    communication is inserted between stages on the same rank. With ``check`` the input is
    validated first, so the result is valid (deadlock-free under :mod:`vpipe.ir.engine`'s
    semantics).
    """
    if recv_lookahead < 0:
        raise ScheduleError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    fl = flatten(schedule)
    if fl.lowered:
        r, i = int(fl.c_rank[0]), int(fl.c_pos[0])
        raise ScheduleError(f"{where(r, i, schedule.actions[r][i])}: schedule is already lowered")
    if check:
        check_flat(fl)
    plan = plan_comm(fl, recv_lookahead)
    return schedule.replace_actions(materialize(fl, plan))


def materialize(fl: Flat, plan: CommPlan) -> list[list[Action]]:
    """Per-rank lowered action lists: original compute actions plus the plan's SEND/RECVs."""
    s = fl.schedule
    M, NB = s.n_microbatches, s.n_stages - 1
    by_channel = np.argsort(plan.order)  # RECVs in channel order, so a stable sort keeps it
    d, b, m = decode_messages(plan.e, NB, M)
    dr, br, mr = d[by_channel], b[by_channel], m[by_channel]
    n = len(plan.e)
    # Sort key: rank, then the slot key; ties keep the concatenation order (sends in part
    # order, receives in channel order).
    op_key, send_key, recv_key = slot_keys(fl, plan)
    rank = np.concatenate([fl.o_rank, fl.o_rank[plan.send_op], plan.dst[by_channel]])
    local = np.concatenate([op_key, send_key, recv_key[by_channel]])
    width = 3 * int(np.diff(fl.o_lo).max(initial=0)) + 3
    order = np.argsort(rank * width + local, kind="stable").tolist()
    with _gc_paused():
        objs = list(chain.from_iterable(s.actions))  # compute-only: every action is an op
        kinds = np.array([Kind.SEND_F, Kind.SEND_B, Kind.RECV_F, Kind.RECV_B], dtype=object)
        objs += map(
            _new,
            repeat(Action, n),
            zip((b + d).tolist(), kinds[d].tolist(), m.tolist(), repeat((), n), strict=True),
        )
        objs += map(
            _new,
            repeat(Action, n),
            zip(
                (br + 1 - dr).tolist(),
                kinds[2 + dr].tolist(),
                mr.tolist(),
                repeat((), n),
                strict=True,
            ),
        )
        flat_sorted = [objs[k] for k in order]
        bounds = np.searchsorted(rank[order], np.arange(s.n_ranks + 1)).tolist()
        return [flat_sorted[bounds[r] : bounds[r + 1]] for r in range(s.n_ranks)]


def slot_keys(fl: Flat, plan: CommPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Program order of the lowered actions within their rank: 3 * compute index + 0 for a
    RECV (posted before that compute action), 1 for the compute action, 2 for a SEND (after
    it). Per op, per planned SEND and per planned RECV (plan order)."""
    op_key = 3 * (np.arange(len(fl.o_rank)) - fl.o_lo[fl.o_rank]) + 1
    return op_key, op_key[plan.send_op] + 1, 3 * plan.slot


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while allocating many small acyclic tuples (it would otherwise
    rescan the whole heap repeatedly)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

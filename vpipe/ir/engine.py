"""The replay engine: when each compute part of a program starts and ends, and when each
message arrives. Validation's deadlock check, the simulator and calibration all use it.

Execution semantics of a lowered program
----------------------------------------
The replay, the simulator (:mod:`vpipe.sim.simulator`) and the runtime all assume:

* Each rank runs its action list in order, one action at a time.
* ``SEND`` posts an asynchronous send (``isend``) and returns at once; it never blocks. The
  runtime completes all outstanding sends at the end of the step.
* ``RECV`` posts an asynchronous receive (``irecv``) and returns at once; it never blocks.
* A compute action (``F``, ``B``, ``I``, ``W``) first waits for the receive that feeds it,
  which was posted earlier on the same rank, then runs. Tensors between stages on the same
  rank are handed over locally.
* An ``OVERLAP_F_B`` compound runs its parts one after another, each part waiting for its own
  input just before it runs (so there can be a wait between parts). The compound's SENDs and
  the RECVs after it come after the whole compound, so they are posted at its end.
* Matching: between two ranks, per direction, the k-th SEND the sender posts matches the k-th
  RECV the receiver posts (per-peer FIFO: point-to-point ops with one tag match in posting
  order).
* Posted operations progress independently of each other, as gloo's isend/irecv do. NCCL
  runs a process group's point-to-point ops on one stream, where an early receive would hold
  up later sends; vpipe's runtime therefore posts on one process group per direction between
  two ranks there (:mod:`vpipe.runtime.comm`), a FIFO channel as the next rule assumes.
* A message's transfer starts once both its SEND and its RECV are posted and takes the time
  :class:`LinkModel` gives it, plus its ``handshake`` when the RECV is posted after the SEND
  (a rendezvous transport: gloo's TCP pairs write a payload only once the sender has heard
  that the receive is posted; a late receive costs a notification and a wake-up of the
  sender's I/O thread).

So a rank can only be stuck at a compute part whose input's matching SEND is never posted,
and posting a receive early can never block. A compute-only schedule is replayed as if each
output were sent right after its producer (with receives implicit), or with the receive
points lowering would choose.

The replay is one tight loop over compute parts (no allocation per part); everything around
it is vectorised with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

import numpy as np

from vpipe.ir.flat import (
    Flat,
    comm_messages,
    decode_messages,
    message_count,
    recv_action,
    where,
)
from vpipe.ir.schedule import ScheduleError

__all__ = ["LinkModel", "Program", "Timing", "compile_program", "message_arrivals", "replay"]


@dataclass(frozen=True)
class LinkModel:
    """How long a message takes once both its SEND and its RECV are posted.

    A message over the boundary between stages b and b+1 (either direction) takes
    ``latency + boundary_bytes[b] / bandwidth``, and ``handshake`` more when its RECV is
    posted after its SEND (see the module docstring). Links are not shared: every transfer
    runs on its own, so transfers never queue behind each other.
    """

    latency: np.ndarray | float = 0.0  # per boundary, or one for all
    bandwidth: float = math.inf
    boundary_bytes: np.ndarray | float = 0.0
    handshake: float = 0.0

    def boundary_costs(self) -> np.ndarray:
        """Time of one message over each boundary."""
        return self.latency + np.asarray(self.boundary_bytes, float) / self.bandwidth

    def message_costs(self, prog: Program) -> np.ndarray:
        """Time of each message of ``prog``, per message id."""
        s = prog.flat.schedule
        per_boundary = np.broadcast_to(self.boundary_costs(), s.n_stages - 1)
        return np.tile(np.repeat(per_boundary, s.n_microbatches), 2)


@dataclass
class Program:
    """Compute parts and messages of a schedule, the input of :func:`replay`.

    Per message id (see :mod:`vpipe.ir.flat`): it is sent when op ``send_op[e]`` ends and its
    receive is posted when op ``recv_op[e]`` ends (-1: at time 0, or no such message). Each
    compute part waits for message ``wait[part]`` (-1: none). ``lowered``: the messages have
    explicit SEND/RECV points (given, or planned), which is how a deadlock is reported.
    ``order``: the parts in an order where each comes after its rank's previous part and the
    part that sends its input, kept by the first :func:`replay` (it holds for any costs), so
    that replaying the program again is one pass over the parts.
    """

    flat: Flat
    send_op: np.ndarray
    recv_op: np.ndarray
    lowered: bool
    order: np.ndarray | None = None

    @property
    def wait(self) -> np.ndarray:
        return self.flat.part_messages[0]


def compile_program(
    fl: Flat, planned_recvs: tuple[np.ndarray, np.ndarray] | None = None
) -> Program:
    """Build the replay program of a (statically valid) flat schedule.

    Lowered schedules take send/receive points from their SEND/RECV actions; compute-only
    ones send right after the producer and post receives either as ``planned_recvs`` says
    (message ids, and the op each RECV follows: -1 for the start of the program) or, without
    a plan, implicitly.
    """
    n_msg = message_count(fl.schedule)
    send_op = np.full(n_msg, -1, np.int64)
    recv_op = np.full(n_msg, -1, np.int64)
    if fl.lowered:
        e, send, _ = comm_messages(fl)
        okey = fl.o_rank << 32 | fl.o_pos
        prev = np.searchsorted(okey, fl.c_rank << 32 | fl.c_pos) - 1
        prev = np.where((prev >= 0) & (fl.o_rank[np.maximum(prev, 0)] == fl.c_rank), prev, -1)
        send_op[e[send]] = prev[send]
        recv_op[e[~send]] = prev[~send]
    else:
        e_out = fl.part_messages[1]
        has = e_out >= 0
        send_op[e_out[has]] = fl.p_op[has]
        if planned_recvs is not None:
            recv_op[planned_recvs[0]] = planned_recvs[1]
    return Program(fl, send_op, recv_op, fl.lowered or planned_recvs is not None)


@dataclass
class Timing:
    """Outcome of :func:`replay`: per compute part ``start`` and ``end``; per op (compute
    action) ``op_start`` (its first part's start) and ``op_end`` (its last part's end); per
    message id ``arrive`` (NaN for ids no message uses)."""

    start: np.ndarray
    end: np.ndarray
    op_start: np.ndarray
    op_end: np.ndarray
    arrive: np.ndarray


def message_arrivals(
    prog: Program, op_end: np.ndarray, cost: np.ndarray, handshake: float = 0.0
) -> np.ndarray:
    """Arrival of each message: ``max(end[send_op], end[recv_op]) + cost``, a transfer
    starting once both ends are posted, plus ``handshake`` when the receive was posted after
    the send (a receive posted at time 0 when ``recv_op`` is -1; NaN for unused ids, whose
    ``send_op`` is -1)."""
    sent = np.append(op_end, np.nan)[prog.send_op]
    posted = np.append(op_end, 0.0)[prog.recv_op]
    return np.maximum(sent, posted) + cost + np.where(posted > sent, handshake, 0.0)


def replay(
    prog: Program,
    durations: np.ndarray | list[float] | None = None,
    links: LinkModel | None = None,
    lead: np.ndarray | list[float] | None = None,
) -> Timing:
    """Run a compiled program under the module's execution semantics.

    ``durations`` is per compute part (zero when omitted); ``links`` gives the message times
    (free when omitted); ``lead`` is per part the time its rank spends before it, on work that
    is neither computing nor waiting (posting the SENDs and RECVs before it, the runtime's own
    work between actions; zero when omitted). A part starts at the later of its rank's
    previous end plus its lead and its input's arrival (:func:`message_arrivals`). Raises
    ScheduleError naming where every stuck rank waits when the program deadlocks.
    """
    fl = prog.flat
    P = fl.schedule.n_ranks
    n_parts = len(fl.p_op)
    dur = np.zeros(n_parts) if durations is None else np.asarray(durations, float)
    lead_a = np.zeros(n_parts) if lead is None else np.asarray(lead, float)
    links = links or LinkModel()
    cost = links.message_costs(prog)
    handshake = float(links.handshake)
    # Per part: the part whose end posts its input's SEND and (when the message takes time;
    # otherwise the rank is past it anyway) the one whose end posts its RECV, -1 for none;
    # and the transfer time. Messages are posted at an op's end, i.e. its last part's end.
    first_part, last_part = _op_parts(fl)
    wait = prog.wait
    has = wait >= 0
    so, ro, c = np.full(n_parts, -1), np.full(n_parts, -1), np.zeros(n_parts)
    if has.any():
        e = wait[has]
        so[has] = last_part[prog.send_op[e]]
        c[has] = cost[e]
        r_op = np.where((cost[e] > 0) | (handshake > 0), prog.recv_op[e], -1)
        ro[has] = np.where(r_op >= 0, last_part[r_op], -1)
    rank_lo = np.searchsorted(fl.p_rank, np.arange(P + 1))
    if prog.order is None:
        end, prog.order = _replay_by_rank(prog, rank_lo, (so, ro, c, dur, lead_a), handshake)
    else:
        end = _replay_in_order(prog.order, rank_lo, (so, ro, c, dur, lead_a), handshake)
    end_a = np.array(end)
    op_end = end_a[last_part]
    arrive = message_arrivals(prog, op_end, cost, handshake)
    # Start of each part, as the loop had it: its rank's previous end (0 for a rank's first
    # part) plus its lead, or its input's arrival when later. (The arrival counts the RECV's
    # post even where the loop skips it; that post lies before the part on its rank, so it
    # never decides.)
    start = np.zeros(n_parts)
    start[1:] = end_a[:-1]
    start[rank_lo[:-1][rank_lo[:-1] < n_parts]] = 0.0
    start += lead_a
    start[has] = np.maximum(start[has], arrive[wait[has]])
    return Timing(start, end_a, start[first_part], op_end, arrive)


def _replay_by_rank(prog: Program, rank_lo: np.ndarray, cols: tuple,
                    handshake: float) -> tuple[list[float], np.ndarray]:  # fmt: skip
    """:func:`replay`'s loop: each rank runs its parts until one waits for a part not yet
    ended, then the next ready rank runs. Per part: the part that posts its input's SEND and
    the one that posts its RECV (-1: none), the transfer, its duration and its lead (``cols``).
    Returns each part's end and the order the parts ran in."""
    P = len(rank_lo) - 1
    n_parts = int(rank_lo[-1])
    lo = rank_lo.tolist()
    cols = tuple(x.tolist() for x in cols)
    # zip reuses its result tuple while the loop unpacks it: no allocation per part.
    iters = [
        zip(range(lo[r], lo[r + 1]), *(x[lo[r] : lo[r + 1]] for x in cols), strict=True)
        for r in range(P)
    ]
    end = [-1.0] * n_parts
    ran: list[int] = []
    waiter = [-1] * n_parts
    extra_waiters: dict[int, list[int]] = {}
    pending: list[tuple | None] = [None] * P
    clocks = [0.0] * P
    nxt = lo[:-1]  # per rank: its next part
    ready = list(range(P - 1, -1, -1))
    while ready:
        r = ready.pop()
        t = clocks[r]
        row = pending[r]
        pending[r] = None
        for i, s_part, r_part, transfer, d, ld in (
            iters[r] if row is None else chain((row,), iters[r])
        ):
            if s_part >= 0:
                s = end[s_part]
                if s < 0:  # not sent yet: park this rank until that part ends
                    pending[r] = (i, s_part, r_part, transfer, d, ld)
                    if waiter[s_part] >= 0:
                        extra_waiters.setdefault(s_part, []).append(r)
                    else:
                        waiter[s_part] = r
                    break
                t += ld
                if r_part >= 0 and end[r_part] > s:
                    s = end[r_part] + handshake
                s += transfer
                if s > t:
                    t = s
            else:
                t += ld
            t += d
            end[i] = t
            if waiter[i] >= 0:
                ready.append(waiter[i])
                waiter[i] = -1
                if extra_waiters:
                    ready.extend(extra_waiters.pop(i, ()))
        clocks[r] = t
        stop = lo[r + 1] if pending[r] is None else pending[r][0]
        ran.extend(range(nxt[r], stop))  # the parts this turn ran, in order
        nxt[r] = stop
    stuck = [r for r in range(P) if pending[r] is not None]
    if stuck:
        raise ScheduleError(_deadlock_message(prog, [pending[r][0] for r in stuck], stuck))
    return end, np.array(ran, np.int64)


def _replay_in_order(order: np.ndarray, rank_lo: np.ndarray, cols: tuple,
                     handshake: float) -> list[float]:  # fmt: skip
    """:func:`_replay_by_rank`'s ends, computed in a known ``order`` (each part after its
    rank's previous one and its input's sender): one pass, the same arithmetic per part."""
    n_parts = int(rank_lo[-1])
    prev = np.arange(-1, n_parts - 1)
    prev[rank_lo[:-1][rank_lo[:-1] < n_parts]] = -1  # a rank's first part starts at 0
    cols = [x[order].tolist() for x in (prev, *cols)]
    end = [0.0] * (n_parts + 1)  # end[-1]: 0.0, where every rank starts
    for i, p, s_part, r_part, transfer, d, ld in zip(order.tolist(), *cols, strict=True):
        t = end[p] + ld
        if s_part >= 0:
            s = end[s_part]
            if r_part >= 0 and end[r_part] > s:
                s = end[r_part] + handshake
            s += transfer
            if s > t:
                t = s
        end[i] = t + d
    end.pop()
    return end


def _op_parts(fl: Flat) -> tuple[np.ndarray, np.ndarray]:
    """Per op: its first and its last part (parts of one op are adjacent, in op order)."""
    n = len(fl.p_op)
    if n == len(fl.o_rank):  # no overlap actions
        ids = np.arange(n)
        return ids, ids
    starts = np.flatnonzero(np.diff(fl.p_op)) + 1
    return np.concatenate([[0], starts]), np.concatenate([starts - 1, [n - 1]])


def _deadlock_message(prog: Program, parts: list[int], stuck: list[int]) -> str:
    """Where each stuck rank waits (the first six), and for which message."""
    fl = prog.flat
    s = fl.schedule
    M, NB = s.n_microbatches, s.n_stages - 1
    out = []
    for r, part in zip(stuck[:6], parts, strict=False):
        i = int(fl.o_pos[fl.p_op[part]])
        d, b, m = (int(x) for x in decode_messages(int(prog.wait[part]), NB, M))
        src = s.placement[b] if d == 0 else s.placement[b + 1]
        if prog.lowered:
            what = f"{recv_action(d, b, m)} from rank {src}"
        else:
            prod = f"{b}F{m}" if d == 0 else f"the backward of stage {b + 1} microbatch {m}"
            what = f"{prod} on rank {src}"
        out.append(f"{where(r, i, s.actions[r][i])} waits for {what}")
    more = f"; and {len(stuck) - 6} more stuck ranks" if len(stuck) > 6 else ""
    return "deadlock: " + "; ".join(out) + more

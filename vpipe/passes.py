"""Lowering (communication insertion) and validation of pipeline schedules.

Execution semantics of a lowered program
----------------------------------------
:func:`validate`'s deadlock replay, the simulator (:mod:`vpipe.sim`) and the runtime all assume:

* Each rank runs its action list in order, one action at a time.
* ``SEND`` posts an asynchronous send (``isend``) and returns at once; it never blocks. The
  runtime completes all outstanding sends at the end of the step.
* ``RECV`` posts an asynchronous receive (``irecv``) and returns at once; it never blocks.
* A compute action (``F``, ``B``, ``I``, ``W``, or an ``OVERLAP_F_B`` compound, whose parts run
  one after another) first waits for the receives that feed it, which were posted earlier on
  the same rank, then runs. Tensors between stages on the same rank are handed over locally.
* Matching: between two ranks, per direction, the k-th SEND the sender posts matches the k-th
  RECV the receiver posts (per-peer FIFO: point-to-point ops with one tag match in posting
  order).
* Posted operations progress independently of each other, as gloo's isend/irecv do. On a
  backend that serialises point-to-point ops on one stream (NCCL) an early receive could hold
  up later sends, so such a runtime needs separate streams for sends and receives; this is
  not modelled here.

So a rank can only be stuck at a compute action whose input's matching SEND is never posted,
and posting a receive early can never block. A compute-only schedule is replayed as if each
output were sent right after its producer.

Lowering places each SEND right after its producer (after the whole compound for an overlap
action) and each RECV ``recv_lookahead`` compute actions before its consumer (default 1: the
transfer overlaps the preceding compute action while few receive buffers are outstanding),
moved earlier where needed so that every peer's receives are posted in the order its sends
are.

The static checks and the lowering are vectorised with numpy (a plain-Python pass runs only
to name the first problem once the vectorised verdict says "invalid"); the deadlock replay is
one tight loop over compute actions, shared with the simulator.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain, repeat
from operator import index

import numpy as np

from vpipe.flat import (
    KIND_CODE,
    PART_BITS,
    Flat,
    comm_messages,
    decode_messages,
    flatten,
    message_count,
    recv_action,
    send_action,
    where,
)
from vpipe.ir import Action, Kind, Schedule, ScheduleError, format_action

__all__ = [
    "lower",
    "validate",
    "CommPlan",
    "Program",
    "check_static",
    "compile_program",
    "materialize",
    "plan_comm",
    "replay",
    "slot_keys",
]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SF, _RF, _SB, _RB = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_OV = Kind.OVERLAP_F_B
_new = tuple.__new__

# ---------------------------------------------------------------------------------------------
# Static checks: a vectorised verdict, and a plain-Python pass that finds and names the problem


def _static_ok(fl: Flat) -> bool:
    """True when every static rule holds (all but deadlock freedom). Vectorised."""
    if not fl.sane:
        return False
    s = fl.schedule
    S, M, P = s.n_stages, s.n_microbatches, s.n_ranks
    NB, SM = S - 1, S * M
    place = fl.place
    st, k, m, r = fl.p_stage, fl.p_kind, fl.p_mb, fl.p_rank
    if len(st) and (st.min() < 0 or st.max() >= S or m.min() < 0 or m.max() >= M):
        return False
    if (place[st] != r).any():
        return False
    idx = st * M + m
    key = fl.p_pos << PART_BITS | fl.p_sub
    isf, isw, isi = k == 0, k == 3, k == 2
    isb = (k == 1) | isi
    if not (np.bincount(idx[isf], minlength=SM) == 1).all():
        return False
    if not (np.bincount(idx[isb], minlength=SM) == 1).all():
        return False
    has_i = np.zeros(SM, bool)
    has_i[idx[isi]] = True
    if not (np.bincount(idx[isw], minlength=SM) == has_i).all():
        return False
    fkey, bkey, wkey = (np.empty(SM, np.int64) for _ in range(3))
    fkey[idx[isf]], bkey[idx[isb]], wkey[idx[isw]] = key[isf], key[isb], key[isw]
    if (bkey < fkey).any() or (wkey[has_i] < bkey[has_i]).any():
        return False
    local = place[1:] == place[:-1]
    f2, b2 = fkey.reshape(S, M), bkey.reshape(S, M)
    if (f2[1:][local] < f2[:-1][local]).any() or (b2[:-1][local] < b2[1:][local]).any():
        return False
    if not fl.lowered:
        return True
    cs, cm, cr = fl.c_stage, fl.c_mb, fl.c_rank
    if cs.min() < 0 or cs.max() >= S or cm.min() < 0 or cm.max() >= M:
        return False
    e, send, nb = comm_messages(fl)
    if nb.min() < 0 or nb.max() >= S or (place[cs] != cr).any() or (place[nb] == cr).any():
        return False
    cross = np.repeat(np.tile(place[1:] != place[:-1], 2), M)
    n_msg = 2 * NB * M
    if not (np.bincount(e[send], minlength=n_msg) == cross).all():
        return False
    if not (np.bincount(e[~send], minlength=n_msg) == cross).all():
        return False
    skey, rkey = np.zeros(n_msg, np.int64), np.zeros(n_msg, np.int64)
    skey[e[send]] = fl.c_pos[send] << PART_BITS
    rkey[e[~send]] = fl.c_pos[~send] << PART_BITS
    ids = np.flatnonzero(cross)
    d, b, mm = decode_messages(ids, NB, M)
    prod = np.where(d == 0, fkey[b * M + mm], bkey[(b + 1) * M + mm])
    cons = np.where(d == 0, fkey[(b + 1) * M + mm], bkey[b * M + mm])
    if (skey[ids] < prod).any() or (rkey[ids] > cons).any():
        return False
    # Per-peer FIFO: group by channel (stable, so program order within it) and compare.
    ch_s = cr[send] * P + place[nb[send]]
    ch_r = place[nb[~send]] * P + cr[~send]
    es = e[send][np.argsort(ch_s, kind="stable")]
    er = e[~send][np.argsort(ch_r, kind="stable")]
    return bool((es == er).all())


def _explain(s: Schedule, place: list[int]) -> None:
    """Find and raise the first static problem, naming rank, position and action. Plain
    Python and slow, used only once the vectorised check has failed."""
    P, S, M = s.n_ranks, s.n_stages, s.n_microbatches
    NB = S - 1
    n = S * M
    fk, bk, wk = [-1] * n, [-1] * n, [-1] * n
    is_i = bytearray(n)
    sk = [-1] * (2 * NB * M)
    rk = [-1] * len(sk)
    chan_send: dict[int, list[int]] = {}
    chan_recv: dict[int, list[int]] = {}
    lowered = False
    for r, acts in enumerate(s.actions):
        for i, a in enumerate(acts):
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {r}, position {i}: not an action: {a!r}")
            k = a[1]
            code = KIND_CODE.get(id(k), -1)
            if code in (0, 1, 2, 3, 8):
                parts = a[3] if k is _OV else (a,)
                if k is _OV and not 1 < len(parts) < (1 << PART_BITS):
                    raise ScheduleError(f"{where(r, i, a)}: overlap needs 2..63 parts")
                for pi, p in enumerate(parts):
                    _explain_compute(r, i, a, pi, p, S, M, place, fk, bk, wk, is_i)
            elif code >= 4:
                lowered = True
                e, peer = _explain_comm(r, i, a, S, M, place)
                is_send = k is _SF or k is _SB
                seen, what = (sk, "send") if is_send else (rk, "receive")
                if seen[e] >= 0:
                    raise ScheduleError(
                        f"{where(r, i, a)}: duplicate {what} (also at position "
                        f"{seen[e] >> PART_BITS})"
                    )
                seen[e] = i << PART_BITS
                if is_send:
                    chan_send.setdefault(r * P + peer, []).append(e)
                else:
                    chan_recv.setdefault(peer * P + r, []).append(e)
            else:
                raise ScheduleError(f"{where(r, i, a)}: unknown action kind {k!r}")
    _explain_complete(s, place, fk, bk, wk, is_i)
    if lowered:
        _explain_comm_edges(s, place, fk, bk, sk, rk, chan_send, chan_recv)


def _ints(r: int, i: int, a: Action, p: Action) -> tuple[int, Kind, int]:
    """(stage, kind, microbatch) of an action, whose indices must be integers."""
    try:
        return index(p[0]), p[1], index(p[2])
    except TypeError:
        raise ScheduleError(
            f"{where(r, i, a)}: stage and microbatch must be integers, got {p[0]!r}, {p[2]!r}"
        ) from None


def _check_range(r: int, i: int, a: Action, s: int, m: int, S: int, M: int) -> None:
    if not 0 <= s < S:
        raise ScheduleError(f"{where(r, i, a)}: stage {s} out of range 0..{S - 1}")
    if not 0 <= m < M:
        raise ScheduleError(f"{where(r, i, a)}: microbatch {m} out of range 0..{M - 1}")


def _explain_compute(r, i, a, pi, p, S, M, place, fk, bk, wk, is_i) -> None:
    if not isinstance(p, Action) or KIND_CODE.get(id(p[1]), -1) not in (0, 1, 2, 3):
        raise ScheduleError(f"{where(r, i, a)}: part {pi} is not an F, B, I or W action")
    s, pk, m = _ints(r, i, a, p)
    _check_range(r, i, a, s, m, S, M)
    if place[s] != r:
        raise ScheduleError(
            f"{where(r, i, a)}: runs stage {s}, which lives on rank {place[s]} "
            "(a stage lives on one rank)"
        )
    key = i << PART_BITS | pi
    idx = s * M + m
    if pk is _F:
        if fk[idx] >= 0:
            raise ScheduleError(
                f"{where(r, i, a)}: duplicate forward {format_action(p)} "
                f"(also at position {fk[idx] >> PART_BITS})"
            )
        fk[idx] = key
    elif pk is _W:
        if wk[idx] >= 0:
            raise ScheduleError(
                f"{where(r, i, a)}: duplicate weight gradient {format_action(p)} "
                f"(also at position {wk[idx] >> PART_BITS})"
            )
        wk[idx] = key
    else:
        if bk[idx] >= 0:
            other = format_action(Action(s, _I if is_i[idx] else _B, m))
            raise ScheduleError(
                f"{where(r, i, a)}: duplicate backward for stage {s} microbatch {m} "
                f"({other} already at position {bk[idx] >> PART_BITS})"
            )
        bk[idx] = key
        is_i[idx] = pk is _I


def _explain_comm(r: int, i: int, a: Action, S: int, M: int, place: list[int]):
    """(message id, peer rank) of a SEND/RECV action; raises when it is illegal here."""
    s, k, m = _ints(r, i, a, a)
    up = k is _SF or k is _RB
    b, nb, d = (s, s + 1, 0 if k is _SF else 1) if up else (s - 1, s - 1, 0 if k is _RF else 1)
    _check_range(r, i, a, s, m, S, M)
    if place[s] != r:
        raise ScheduleError(
            f"{where(r, i, a)}: stage {s} lives on rank {place[s]}, so its communication "
            "belongs there"
        )
    if not 0 <= nb < S:
        raise ScheduleError(f"{where(r, i, a)}: stage {s} has no neighbour stage {nb}")
    if place[nb] == r:
        raise ScheduleError(
            f"{where(r, i, a)}: stages {s} and {nb} are both on rank {r}: no communication "
            "between same-rank stages (the tensor is handed over locally)"
        )
    return (d * (S - 1) + b) * M + m, place[nb]


def _at(acts: list[list[Action]], key: int, r: int) -> str:
    """:func:`~vpipe.flat.where` of the action an ordering key (position << PART_BITS | part) names."""
    i = key >> PART_BITS
    return where(r, i, acts[r][i])


def _explain_complete(s: Schedule, place, fk, bk, wk, is_i) -> None:
    S, M = s.n_stages, s.n_microbatches
    acts = s.actions

    for st in range(S):
        r = place[st]
        local_prev = st > 0 and place[st - 1] == r
        local_next = st < S - 1 and place[st + 1] == r
        for m in range(M):
            idx = st * M + m
            f, b, w = fk[idx], bk[idx], wk[idx]
            if f < 0:
                raise ScheduleError(
                    f"rank {r}: missing action {st}F{m} (stage {st} is on rank {r})"
                )
            if b < 0:
                what = "W without its I" if w >= 0 else "no backward (B, or I and W)"
                raise ScheduleError(
                    f"rank {r}: stage {st} microbatch {m} has {what}: expected {st}B{m} or "
                    f"{st}I{m} followed by {st}W{m}"
                )
            if b < f:
                raise ScheduleError(f"{_at(acts, b, r)}: backward runs before its forward {st}F{m}")
            if is_i[idx]:
                if w < 0:
                    raise ScheduleError(
                        f"{_at(acts, b, r)}: input gradient without a later {st}W{m}"
                    )
                if w < b:
                    raise ScheduleError(f"{_at(acts, w, r)}: weight gradient runs before {st}I{m}")
            elif w >= 0:
                raise ScheduleError(
                    f"{_at(acts, w, r)}: {st}W{m} after a full backward {st}B{m} "
                    "(use I and W instead)"
                )
            if local_prev and fk[idx - M] > f:
                raise ScheduleError(
                    f"{_at(acts, f, r)}: needs {st - 1}F{m}'s output, which runs later on the same "
                    f"rank ({_at(acts, fk[idx - M], r)})"
                )
            if local_next and bk[idx + M] > b:
                raise ScheduleError(
                    f"{_at(acts, b, r)}: needs the gradient from stage {st + 1}, whose backward "
                    f"runs later on the same rank ({_at(acts, bk[idx + M], r)})"
                )


def _explain_comm_edges(s: Schedule, place, fk, bk, sk, rk, chan_send, chan_recv) -> None:
    S, M, P = s.n_stages, s.n_microbatches, s.n_ranks
    NB = S - 1
    acts = s.actions

    for b in range(NB):
        ra, rb = place[b], place[b + 1]
        if ra == rb:
            continue
        for d in (0, 1):
            src, dst = (ra, rb) if d == 0 else (rb, ra)
            prod_stage, cons_stage = (b, b + 1) if d == 0 else (b + 1, b)
            keys = fk if d == 0 else bk
            for m in range(M):
                e = (d * NB + b) * M + m
                prod, cons = keys[prod_stage * M + m], keys[cons_stage * M + m]
                if sk[e] < 0:
                    send = format_action(send_action(d, b, m))
                    raise ScheduleError(
                        f"{_at(acts, prod, src)}: no {send} sends its output to rank {dst}"
                    )
                if rk[e] < 0:
                    recv = format_action(recv_action(d, b, m))
                    raise ScheduleError(
                        f"{_at(acts, cons, dst)}: no {recv} receives its input from rank {src}"
                    )
                if sk[e] < prod:
                    raise ScheduleError(f"{_at(acts, sk[e], src)}: send runs before its producer")
                if rk[e] > cons:
                    raise ScheduleError(
                        f"{_at(acts, rk[e], dst)}: receive is posted after its consumer"
                    )
    # Every message now has one SEND and one RECV, so each channel carries the same set of
    # messages both ways and only their order can differ.
    for ch, sends in chan_send.items():
        recvs = chan_recv[ch]
        if sends == recvs:
            continue
        src, dst = divmod(ch, P)
        k = next(k for k, (es, er) in enumerate(zip(sends, recvs, strict=True)) if es != er)
        es, er = sends[k], recvs[k]
        d, rest = divmod(er, NB * M)
        expects = format_action(send_action(d, *divmod(rest, M)))
        raise ScheduleError(
            f"per-peer FIFO order broken between rank {src} and rank {dst}: send #{k} "
            f"({_at(acts, sk[es], src)}) is matched by receive #{k} ({_at(acts, rk[er], dst)}), "
            f"which expects {expects}"
        )


def check_static(fl: Flat) -> None:
    """Raise ScheduleError naming the first static problem, if any."""
    if not _static_ok(fl):
        _explain(fl.schedule, fl.place.tolist())
        raise ScheduleError("invalid schedule")  # pragma: no cover - the two checks agree


# ---------------------------------------------------------------------------------------------
# Compiled program and replay


@dataclass
class Program:
    """Compute ops and messages of a schedule, the input of :func:`replay`.

    Message ids: ``(direction * (n_stages - 1) + boundary) * n_microbatches + microbatch``;
    direction 0 carries F(boundary)'s output to stage boundary+1, direction 1 carries the input
    gradient of stage boundary+1 to stage boundary. ``wait[op]`` is the message an op waits
    for (-1: none; <= -2: several, ``multi[-2 - wait]``). A message is sent when op
    ``send_op[e]`` ends and its receive is posted when ``recv_op[e]`` ends (-1: at time 0).
    """

    flat: Flat
    wait: np.ndarray
    multi: list[tuple[int, ...]]
    send_op: np.ndarray
    recv_op: np.ndarray
    lowered: bool

    @property
    def n_messages(self) -> int:
        s = self.flat.schedule
        return 2 * (s.n_stages - 1) * s.n_microbatches


def compile_program(fl: Flat, plan: CommPlan | None = None) -> Program:
    """Build the replay program of a (statically valid) flat schedule.

    Lowered schedules take send/receive points from their SEND/RECV actions; compute-only
    ones either from ``plan`` (the placement :func:`lower` would choose) or, without a plan,
    as sent right after the producer with receives implicit.
    """
    s = fl.schedule
    n_ops = len(fl.o_rank)
    n_msg = message_count(s)
    e_in, e_out = fl.part_messages
    waits = np.full(n_ops, -1, np.int64)
    has = e_in >= 0
    ops_in, e_sel = fl.p_op[has], e_in[has]
    multi: list[tuple[int, ...]] = []
    if len(ops_in) and (np.diff(ops_in) == 0).any():
        groups: dict[int, list[int]] = {}
        for op, e in zip(ops_in.tolist(), e_sel.tolist(), strict=True):
            groups.setdefault(op, []).append(e)
        for op, es in groups.items():
            if len(es) == 1:
                waits[op] = es[0]
            else:
                waits[op] = -2 - len(multi)
                multi.append(tuple(es))
    else:
        waits[ops_in] = e_sel
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
        has = e_out >= 0
        send_op[e_out[has]] = fl.p_op[has]
        if plan is not None:
            recv_op[plan.e] = plan.recv_op
    return Program(fl, waits, multi, send_op, recv_op, fl.lowered or plan is not None)


def replay(
    prog: Program,
    durations: list[float] | None = None,
    message_cost: np.ndarray | list[float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Run a compiled program under the module's execution semantics.

    Returns per-op start and end times. ``durations`` is per op (zero when omitted),
    ``message_cost`` per message id (zero when omitted); a transfer starts when both its SEND
    and its RECV are posted, so message e arrives at ``max(end[send_op[e]], end[recv_op[e]])
    + message_cost[e]`` and an op starts at the later of its rank's previous end and its
    inputs' arrivals. Raises ScheduleError naming where every stuck rank waits when the
    program deadlocks.
    """
    fl = prog.flat
    P = fl.schedule.n_ranks
    n_ops = len(fl.o_rank)
    dur = durations if durations is not None else [0.0] * n_ops
    cost = np.asarray(message_cost if message_cost is not None else [], float)
    if not len(cost):
        cost = np.zeros(prog.n_messages)
    # Per op: the op whose end sends its input (-1: no remote input, -2: several, see
    # ``several``), the op after which that input's RECV is posted (-1: at 0), the cost.
    wait = prog.wait
    one = wait >= 0
    e1 = np.where(one, wait, 0)
    n_msg = len(prog.send_op)
    w_so = np.where(one, prog.send_op[e1] if n_msg else -1, np.where(wait == -1, -1, -2))
    w_c = np.where(one, cost[e1] if n_msg else 0.0, 0.0)
    # A receive is posted by the end of the previous op, so its post time only matters when
    # the transfer takes time.
    w_ro = np.where(one & (w_c > 0), prog.recv_op[e1] if n_msg else -1, -1)
    several = {
        i: [(int(prog.send_op[x]), int(prog.recv_op[x]), float(cost[x])) for x in prog.multi[k]]
        for i, k in ((i, -2 - int(wait[i])) for i in np.flatnonzero(wait < -1).tolist())
    }
    lo = fl.o_lo.tolist()
    cols = (w_so.tolist(), w_ro.tolist(), w_c.tolist(), dur)
    # zip reuses its result tuple while the loop unpacks it: no allocation per op.
    iters = [
        zip(range(lo[r], lo[r + 1]), *(c[lo[r] : lo[r + 1]] for c in cols), strict=True)
        for r in range(P)
    ]
    end = [-1.0] * n_ops
    waiter = [-1] * n_ops
    extra_waiters: dict[int, list[int]] = {}
    pending: list[tuple | None] = [None] * P
    clocks = [0.0] * P
    ready = list(range(P - 1, -1, -1))
    while ready:
        r = ready.pop()
        t = clocks[r]
        row = pending[r]
        pending[r] = None
        for i, so, ro, c, d in iters[r] if row is None else chain((row,), iters[r]):
            if so >= 0:
                s = end[so]
                if s < 0:
                    pending[r] = (i, so, ro, c, d)
                    if waiter[so] >= 0:
                        extra_waiters.setdefault(so, []).append(r)
                    else:
                        waiter[so] = r
                    break
                if ro >= 0 and end[ro] > s:
                    s = end[ro]
                s += c
                if s > t:
                    t = s
            elif so == -2:
                missing = next((xs for xs, _, _ in several[i] if end[xs] < 0), -1)
                if missing >= 0:
                    pending[r] = (i, so, ro, c, d)
                    if waiter[missing] >= 0:
                        extra_waiters.setdefault(missing, []).append(r)
                    else:
                        waiter[missing] = r
                    break
                for xs, xr, xc in several[i]:
                    s = end[xs]
                    if xr >= 0 and end[xr] > s:
                        s = end[xr]
                    s += xc
                    if s > t:
                        t = s
            t += d
            end[i] = t
            if waiter[i] >= 0:
                ready.append(waiter[i])
                waiter[i] = -1
                if extra_waiters:
                    ready.extend(extra_waiters.pop(i, ()))
        clocks[r] = t
    stuck = [r for r in range(P) if pending[r] is not None]
    if stuck:
        raise ScheduleError(_deadlock_message(prog, [pending[r][0] for r in stuck], end, stuck))
    # Start times, with the loop's arithmetic: max(previous end on the rank, arrivals).
    end_a = np.array(end)
    start = np.zeros(n_ops)
    start[1:] = end_a[:-1]
    start[fl.o_lo[:-1][fl.o_lo[:-1] < n_ops]] = 0.0
    if one.any():
        so, ro = w_so[one], w_ro[one]
        arr = end_a[so]
        has_ro = ro >= 0
        arr[has_ro] = np.maximum(arr[has_ro], end_a[ro[has_ro]])
        start[one] = np.maximum(start[one], arr + w_c[one])
    for i, ins in several.items():
        for xs, xr, xc in ins:
            s = max(end[xs], end[xr]) if xr >= 0 else end[xs]
            start[i] = max(start[i], s + xc)
    return start, end_a


def _deadlock_message(prog: Program, ops: list[int], end: list[float], stuck: list[int]) -> str:
    s = prog.flat.schedule
    M, NB = s.n_microbatches, s.n_stages - 1
    parts = []
    for r, op in zip(stuck[:6], ops, strict=False):
        i = int(prog.flat.o_pos[op])
        e = int(prog.wait[op])
        if e < -1:  # several inputs: name the first that never arrives
            e = next(x for x in prog.multi[-2 - e] if end[prog.send_op[x]] < 0)
        d, rest = divmod(e, NB * M)
        b, m = divmod(rest, M)
        src = s.placement[b] if d == 0 else s.placement[b + 1]
        if prog.lowered:
            what = f"{format_action(recv_action(d, b, m))} from rank {src}"
        else:
            prod = f"{b}F{m}" if d == 0 else f"the backward of stage {b + 1} microbatch {m}"
            what = f"{prod} on rank {src}"
        parts.append(f"{where(r, i, s.actions[r][i])} waits for {what}")
    more = f"; and {len(stuck) - 6} more stuck ranks" if len(stuck) > 6 else ""
    return "deadlock: " + "; ".join(parts) + more


def validate(schedule: Schedule) -> None:
    """Check a compute-only or lowered schedule; raise ScheduleError naming rank, position and
    action of the first problem (for a deadlock, where every stuck rank waits)."""
    fl = flatten(schedule)
    check_static(fl)
    replay(compile_program(fl))


# ---------------------------------------------------------------------------------------------
# Lowering


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
    n_msg = 2 * NB * M
    e_in, e_out = fl.part_messages
    has = e_out >= 0
    e = e_out[has]  # in send order: rank-major, program order, part order
    send_op, send_sub = fl.p_op[has], fl.p_sub[has]
    src = fl.p_rank[has]
    consumer = np.zeros(n_msg, np.int64)
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
    validated first, so the result is valid (deadlock-free under the module's semantics).
    """
    if recv_lookahead < 0:
        raise ScheduleError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    fl = flatten(schedule)
    if fl.lowered:
        r, i = int(fl.c_rank[0]), int(fl.c_pos[0])
        raise ScheduleError(f"{where(r, i, schedule.actions[r][i])}: schedule is already lowered")
    if check:
        check_static(fl)
        replay(compile_program(fl))
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
        kinds = np.array([_SF, _SB, _RF, _RB], dtype=object)
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

"""Validation of pipeline schedules: static rules, then deadlock freedom by replay.

The static rules (every F, B/I and W once, on its stage's rank, in a legal order; for a lowered
program, one SEND and one RECV per cross-rank message, each on the right side of its compute
action, in per-peer FIFO order) are checked vectorised with numpy; a plain-Python pass runs
only to name the first problem once the vectorised verdict says "invalid". Deadlock freedom
is decided by replaying the program (:func:`vpipe.ir.engine.replay`) under the execution
semantics :mod:`vpipe.ir.engine` describes.
"""

from __future__ import annotations

from operator import index

import numpy as np

from vpipe.ir.engine import compile_program, replay
from vpipe.ir.flat import (
    KIND_CODE,
    PART_BITS,
    Flat,
    comm_messages,
    decode_messages,
    flatten,
    recv_action,
    send_action,
    where,
)
from vpipe.ir.schedule import Action, Kind, Schedule, ScheduleError, format_action

__all__ = ["check_flat", "check_static", "validate"]

_F, _B, _I, _W = Kind.F, Kind.B, Kind.I, Kind.W
_SF, _RF, _SB, _RB = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
_OV = Kind.OVERLAP_F_B


def validate(schedule: Schedule) -> None:
    """Check a compute-only or lowered schedule; raise ScheduleError naming rank, position and
    action of the first problem (for a deadlock, where every stuck rank waits)."""
    check_flat(flatten(schedule))


def check_flat(fl: Flat) -> None:
    """:func:`validate` on a flattened schedule: static rules, then a deadlock-free replay."""
    check_static(fl)
    replay(compile_program(fl))


def check_static(fl: Flat) -> None:
    """Raise ScheduleError naming the first static problem, if any."""
    if not _static_ok(fl):
        _explain(fl.schedule, fl.place.tolist())
        raise ScheduleError("invalid schedule")  # pragma: no cover - the two checks agree


# ---------------------------------------------------------------------------------------------
# The static rules: a vectorised verdict, and a plain-Python pass that finds and names the
# first problem


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
    """:func:`~vpipe.ir.flat.where` of the action an ordering key (position << PART_BITS | part) names."""
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

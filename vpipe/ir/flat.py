"""A schedule as flat numpy columns, and the ids of the messages between its stages.

Validation, lowering, the replay engine and the simulator all work on this representation:
one row per compute part, per compute action ("op") and per SEND/RECV, rank-major in program
order, with integer kind codes.

Message ids: ``(direction * (n_stages - 1) + boundary) * n_microbatches + microbatch``.
Boundary b lies between stages b and b + 1; direction 0 carries F(b)'s output to stage b + 1,
direction 1 carries the input gradient of stage b + 1 to stage b. Only boundaries between two
ranks carry messages (same-rank stages hand tensors over locally), so some ids are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from operator import index, itemgetter

import numpy as np

from vpipe.ir.schedule import Action, Kind, Schedule, ScheduleError, format_action

__all__ = [
    "KIND_CODE",
    "KIND_ORDER",
    "PART_BITS",
    "Flat",
    "comm_messages",
    "decode_messages",
    "flatten",
    "message_count",
    "recv_action",
    "send_action",
    "where",
]

# Kind codes: compute 0-3, comm 4-7, overlap 8. Looked up by identity (fast, no Enum hash).
KIND_ORDER = (
    Kind.F,
    Kind.B,
    Kind.I,
    Kind.W,
    Kind.SEND_F,
    Kind.RECV_F,
    Kind.SEND_B,
    Kind.RECV_B,
    Kind.OVERLAP_F_B,
)
KIND_CODE = {id(k): c for c, k in enumerate(KIND_ORDER)}
PART_BITS = 6  # ordering key of a part = position << 6 | part index (compounds: < 64 parts)

_new = tuple.__new__
_get0, _get1, _get2 = itemgetter(0), itemgetter(1), itemgetter(2)


@dataclass
class Flat:
    """A schedule as numpy columns, rank-major in program order.

    ``place[stage]``: the stage's rank (from the checked header). ``p_*``: one row per compute
    part (an overlap action contributes one row per part), ``o_*``: one row per compute action
    ("op"), ``c_*``: one row per SEND/RECV action. Kind codes follow :data:`KIND_ORDER` (comm
    rows use 4-7). ``o_lo[r]:o_lo[r+1]`` are rank r's ops.
    """

    schedule: Schedule
    place: np.ndarray
    p_rank: np.ndarray
    p_pos: np.ndarray
    p_sub: np.ndarray
    p_stage: np.ndarray
    p_kind: np.ndarray
    p_mb: np.ndarray
    p_op: np.ndarray
    o_rank: np.ndarray
    o_pos: np.ndarray
    o_lo: np.ndarray
    c_rank: np.ndarray
    c_pos: np.ndarray
    c_stage: np.ndarray
    c_kind: np.ndarray
    c_mb: np.ndarray
    sane: bool  # False when a row could not be read (unknown kind, bad overlap): explain path

    @property
    def lowered(self) -> bool:
        return len(self.c_rank) > 0

    @cached_property
    def part_index(self) -> np.ndarray:
        """Per compute part, ``kind * n_stages + stage``: where its figure sits in a (kind,
        stage) table flattened kind-major (what a cost or memory model looks up per part)."""
        return self.p_kind * self.schedule.n_stages + self.p_stage

    @cached_property
    def part_messages(self) -> tuple[np.ndarray, np.ndarray]:
        """Per compute part: the message id it waits on and the one it sends (-1: none, e.g.
        a W, an end stage or a same-rank neighbour)."""
        s = self.schedule
        M, NB = s.n_microbatches, s.n_stages - 1
        st, k = self.p_stage, self.p_kind
        if NB == 0:
            none = np.full(len(st), -1, np.int64)
            return none, none
        # cross[b + 1]: boundary b spans two ranks.
        cross = np.zeros(NB + 2, bool)
        cross[1:-1] = self.place[1:] != self.place[:-1]
        fwd = k == 0
        moves = k < 3  # F, B and I take and pass on a tensor; W does neither
        b_in, b_out = np.where(fwd, st - 1, st), np.where(fwd, st, st - 1)
        base = np.where(fwd, 0, NB * M) + self.p_mb
        e_in = np.where(moves & cross[b_in + 1], base + b_in * M, -1)
        e_out = np.where(moves & cross[b_out + 1], base + b_out * M, -1)
        return e_in, e_out


def _header(s: Schedule) -> list[int]:
    """The placement as a list, once the header (sizes, action lists, placement) is sane."""
    if s.n_ranks < 1 or s.n_stages < 1 or s.n_microbatches < 1:
        raise ScheduleError(
            f"schedule needs at least one rank, stage and microbatch, got ranks={s.n_ranks}, "
            f"stages={s.n_stages}, microbatches={s.n_microbatches}"
        )
    if len(s.actions) != s.n_ranks:
        raise ScheduleError(f"schedule has {len(s.actions)} action lists for {s.n_ranks} ranks")
    if set(s.placement) != set(range(s.n_stages)):
        extra = sorted(set(s.placement) - set(range(s.n_stages)))
        missing = sorted(set(range(s.n_stages)) - set(s.placement))
        raise ScheduleError(
            f"placement must map every stage 0..{s.n_stages - 1} to a rank "
            f"(missing {missing[:5]}, unexpected {extra[:5]})"
        )
    for st, r in s.placement.items():
        if not (isinstance(r, (int, np.integer)) and 0 <= r < s.n_ranks):
            raise ScheduleError(
                f"placement puts stage {st} on rank {r}, outside 0..{s.n_ranks - 1}"
            )
    return [int(s.placement[k]) for k in range(s.n_stages)]


def flatten(schedule: Schedule) -> Flat:
    """Columns of a schedule (header checked; rows not yet validated)."""
    place = np.array(_header(schedule), np.int64)
    i64 = np.int64
    sizes = [len(acts) for acts in schedule.actions]
    n = sum(sizes)
    everything = list(chain.from_iterable(schedule.actions))
    rank = np.repeat(np.arange(len(sizes), dtype=i64), sizes)
    pos = np.arange(n, dtype=i64) - np.repeat(np.cumsum([0, *sizes[:-1]]), sizes)
    sane = True
    try:
        kind = np.fromiter(map(KIND_CODE.__getitem__, map(id, map(_get1, everything))), np.int8, n)
        stage = np.fromiter(map(index, map(_get0, everything)), i64, n)
        mb = np.fromiter(map(index, map(_get2, everything)), i64, n)
    except (KeyError, ValueError, TypeError, IndexError):
        sane = False
        rank = pos = stage = kind = mb = np.zeros(0, i64)
    is_comm = (kind >= 4) & (kind < 8)
    is_op = ~is_comm
    o_rank, o_pos = rank[is_op], pos[is_op]
    plain = kind[is_op] < 4
    sub = np.zeros(len(o_rank), i64)
    p = (o_rank, o_pos, sub, stage[is_op], kind[is_op].astype(i64), mb[is_op])
    op_ids = np.arange(len(o_rank), dtype=i64)
    if not plain.all():
        extra = []
        try:
            for op in np.flatnonzero(~plain).tolist():
                r, i = int(o_rank[op]), int(o_pos[op])
                parts = schedule.actions[r][i][3]
                sane = sane and 1 < len(parts) < (1 << PART_BITS)
                for j, q in enumerate(parts):
                    c = KIND_CODE.get(id(q[1]), 8)
                    sane = sane and c < 4
                    extra.append((r, i, j, index(q[0]), c, index(q[2]), op))
        except (IndexError, TypeError, ValueError):
            sane = False
        if sane:
            cols = [
                np.concatenate([x[plain], np.array(e, i64)])
                for x, e in zip(p, list(zip(*extra, strict=True))[:6], strict=True)
            ]
            ops = np.concatenate([op_ids[plain], np.array([e[6] for e in extra], i64)])
            order = np.lexsort((cols[2], cols[1], cols[0]))
            p = tuple(c[order] for c in cols)
            op_ids = ops[order]
    o_lo = np.searchsorted(o_rank, np.arange(schedule.n_ranks + 1))
    return Flat(
        schedule,
        place,
        *p,
        op_ids,
        o_rank,
        o_pos,
        o_lo,
        rank[is_comm],
        pos[is_comm],
        stage[is_comm],
        kind[is_comm].astype(i64) - 4,
        mb[is_comm],
        sane,
    )


# ---------------------------------------------------------------------------------------------
# Messages


def message_count(s: Schedule) -> int:
    """Size of the message-id space (used and unused ids)."""
    return 2 * (s.n_stages - 1) * s.n_microbatches


def comm_messages(fl: Flat) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per SEND/RECV row: message id, whether it is a send, and the neighbour stage it talks
    to (the message id is meaningful only once that neighbour is in range)."""
    s = fl.schedule
    M, NB = s.n_microbatches, s.n_stages - 1
    cs, ck = fl.c_stage, fl.c_kind
    up = (ck == 0) | (ck == 3)  # SEND_F / RECV_B talk to stage + 1
    nb = np.where(up, cs + 1, cs - 1)
    e = ((ck >= 2) * NB + np.minimum(cs, nb)) * M + fl.c_mb
    return e, (ck == 0) | (ck == 2), nb


def decode_messages(e: np.ndarray, NB: int, M: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(direction, boundary, microbatch) of message ids, for ``NB`` boundaries and ``M``
    microbatches (scalars work too)."""
    q, m = np.divmod(e, M)
    d, b = np.divmod(q, NB)
    return d, b, m


def recv_action(d: int, b: int, m: int) -> Action:
    """The RECV of message (direction d, boundary b, microbatch m)."""
    if d == 0:
        return _new(Action, (b + 1, Kind.RECV_F, m, ()))
    return _new(Action, (b, Kind.RECV_B, m, ()))


def send_action(d: int, b: int, m: int) -> Action:
    """The SEND of message (direction d, boundary b, microbatch m)."""
    if d == 0:
        return _new(Action, (b, Kind.SEND_F, m, ()))
    return _new(Action, (b + 1, Kind.SEND_B, m, ()))


def where(r: int, i: int, a: Action) -> str:
    """``rank r, position i, action A``: how every error names the action it is about."""
    try:
        text = format_action(a)
    except (AttributeError, TypeError):
        text = repr(a)
    return f"rank {r}, position {i}, action {text}"

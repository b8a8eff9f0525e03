"""Message bundling: which SENDs (and their RECVs) of a lowered program travel as one message.

A rank posts its communication in batches (the SEND/RECV actions between two compute actions).
When one batch on rank p sends several messages to rank q, and q receives all of them in one
batch too, the runtime packs them into one buffer and posts one send and one receive instead
of several: on gloo every posted operation costs a syscall and a wake-up of the peer's
transport thread, which on a loaded host dominates small messages. Messages between two ranks
are matched in posting order (FIFO), so a bundle takes the place of its messages in that order
on both sides; a group whose order differs between sender and receiver (a program that is not
FIFO-consistent) is left unbundled.
"""

from __future__ import annotations

import numpy as np

from vpipe.ir.flat import Flat, comm_messages, flatten, message_count
from vpipe.ir.schedule import Action, Schedule, ScheduleError

__all__ = ["bundle_leaders", "comm_bundles", "next_ops", "posting_rows"]


def next_ops(fl: Flat) -> np.ndarray:
    """Per SEND/RECV row of a lowered flat schedule: the global index of the compute action
    after it on its rank (the next rank's first, past the rank's last). Rows sharing it on a
    rank form one batch."""
    return np.searchsorted(fl.o_rank << 32 | fl.o_pos, fl.c_rank << 32 | fl.c_pos)


def _groups(send_batch: np.ndarray, recv_batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per message, its bundle (the messages sharing both batches) as a group id, and the
    index of each group's first message."""
    key = np.stack([np.asarray(send_batch), np.asarray(recv_batch)], axis=1)
    if len(key) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    _, first, group = np.unique(key, axis=0, return_index=True, return_inverse=True)
    return group.reshape(-1), first


def bundle_leaders(send_batch: np.ndarray, recv_batch: np.ndarray) -> np.ndarray:
    """Per message, given the batch of its SEND and of its RECV (ids unique across ranks):
    whether it is the first of its bundle, the one whose operation is posted. A message
    travelling alone leads its own bundle."""
    lead = np.zeros(len(send_batch), bool)
    lead[_groups(send_batch, recv_batch)[1]] = True
    return lead


def _bundled_rows(fl: Flat) -> list[tuple[np.ndarray, np.ndarray]]:
    """(SEND rows, RECV rows), each in program order, of every bundle of two or more messages
    that is posted in the same order on both sides."""
    if not fl.lowered:  # nothing to bundle, unless it crosses ranks unlowered
        if (fl.part_messages[1] >= 0).any():
            raise ScheduleError("bundling needs a lowered schedule (with SEND/RECV actions)")
        return []
    e, is_send, _ = comm_messages(fl)
    batch = fl.c_rank * (len(fl.o_rank) + 1) + next_ops(fl)
    n = message_count(fl.schedule)
    send_row = np.full(n, -1, np.int64)
    recv_row = np.full(n, -1, np.int64)
    rows = np.arange(len(e))
    send_row[e[is_send]] = rows[is_send]
    recv_row[e[~is_send]] = rows[~is_send]
    both = np.flatnonzero((send_row >= 0) & (recv_row >= 0))
    group, _ = _groups(batch[send_row[both]], batch[recv_row[both]])
    out = []
    for g in np.flatnonzero(np.bincount(group) >= 2):
        msgs = both[group == g]
        sends = send_row[msgs][np.argsort(fl.c_pos[send_row[msgs]], kind="stable")]
        recvs = recv_row[msgs][np.argsort(fl.c_pos[recv_row[msgs]], kind="stable")]
        if np.array_equal(e[sends], e[recvs]):  # else not FIFO-consistent: keep them apart
            out.append((sends, recvs))
    return out


def posting_rows(fl: Flat) -> np.ndarray:
    """Per SEND/RECV row of a lowered flat schedule: 1 where it posts an operation, 0 where
    its message travels in an earlier row's bundle."""
    posts = np.ones(len(fl.c_rank))
    for side in (r for pair in _bundled_rows(fl) for r in pair):
        posts[side[1:]] = 0.0
    return posts


def comm_bundles(schedule: Schedule) -> list[list[tuple[Action, ...]]]:
    """Per rank, its bundles: tuples of two or more SEND actions (on the sender) or RECV
    actions (on the receiver), in program order, that travel as one message."""
    fl = flatten(schedule)
    out: list[list[tuple[Action, ...]]] = [[] for _ in range(schedule.n_ranks)]
    for pair in _bundled_rows(fl):
        for side in pair:
            r = int(fl.c_rank[side[0]])
            out[r].append(tuple(schedule.actions[r][int(i)] for i in fl.c_pos[side]))
    return out

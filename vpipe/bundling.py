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

from vpipe.flat import comm_messages, flatten, message_count
from vpipe.ir import Action, Schedule, ScheduleError

__all__ = ["bundle_leaders", "comm_bundles", "posting_weights"]


def bundle_leaders(send_batch: np.ndarray, recv_batch: np.ndarray) -> np.ndarray:
    """Per message, given the batch of its SEND and of its RECV: whether it is the first of
    its bundle (the messages sharing both batches), the one whose operation is posted. A
    message travelling alone leads its own bundle."""
    key = np.stack([np.asarray(send_batch), np.asarray(recv_batch)], axis=1)
    lead = np.zeros(len(key), bool)
    if len(key):
        lead[np.unique(key, axis=0, return_index=True)[1]] = True
    return lead


def posting_weights(schedule: Schedule) -> list[list[int]]:
    """Per rank and action of a lowered schedule: 1 for a SEND/RECV that posts an operation,
    0 for a bundled one whose message travels in another's (and for compute actions)."""
    weights = [[int(a.is_comm) for a in acts] for acts in schedule.actions]
    for r, per_rank in enumerate(comm_bundles(schedule)):
        index = {a: i for i, a in enumerate(schedule.actions[r])}
        for bundle in per_rank:
            for a in bundle[1:]:
                weights[r][index[a]] = 0
    return weights


def comm_bundles(schedule: Schedule) -> list[list[tuple[Action, ...]]]:
    """Per rank, its bundles: tuples of two or more SEND actions (on the sender) or RECV
    actions (on the receiver), in program order, that travel as one message."""
    fl = flatten(schedule)
    P = schedule.n_ranks
    out: list[list[tuple[Action, ...]]] = [[] for _ in range(P)]
    if not fl.lowered:  # nothing to bundle, unless it crosses ranks unlowered
        if (fl.part_messages[1] >= 0).any():
            raise ScheduleError("comm_bundles needs a lowered schedule (with SEND/RECV actions)")
        return out
    e, is_send, _ = comm_messages(fl)
    # A row's batch: the index of the compute action after it (or past its rank's last one),
    # made unique across ranks.
    nxt = np.searchsorted(fl.o_rank << 32 | fl.o_pos, fl.c_rank << 32 | fl.c_pos)
    batch = fl.c_rank * (len(fl.o_rank) + 1) + nxt
    n = message_count(schedule)
    send_row = np.full(n, -1, np.int64)
    recv_row = np.full(n, -1, np.int64)
    rows = np.arange(len(e))
    send_row[e[is_send]] = rows[is_send]
    recv_row[e[~is_send]] = rows[~is_send]
    both = np.flatnonzero((send_row >= 0) & (recv_row >= 0))
    if len(both) == 0:
        return out
    key = np.stack([batch[send_row[both]], batch[recv_row[both]]], axis=1)
    _, group, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    group = group.reshape(-1)
    for g in np.flatnonzero(counts >= 2):
        msgs = both[group == g]
        sends = send_row[msgs][np.argsort(fl.c_pos[send_row[msgs]], kind="stable")]
        recvs = recv_row[msgs][np.argsort(fl.c_pos[recv_row[msgs]], kind="stable")]
        if not np.array_equal(e[sends], e[recvs]):
            continue  # not posted in the same order on both sides: keep them apart
        for side in (sends, recvs):
            r = int(fl.c_rank[side[0]])
            out[r].append(tuple(schedule.actions[r][int(i)] for i in fl.c_pos[side]))
    return out

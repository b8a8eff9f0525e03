"""Ranks whose clocks disagree: traces of a job that spans hosts.

Kineto stamps events with the host's wall clock, so the ranks of a job on several hosts
disagree by their clocks' offset (NTP keeps it to tenths of a millisecond to milliseconds).
Per-rank figures do not depend on it (a rank's window, busy time, bubble and waits are read on
its own clock, and the step time is the longest window), but everything that compares two
ranks does: the link model's latency (a receive's wait against its send), the replay and the
timelines.

Every message bounds the offset, since it cannot be consumed before it was sent: for a message
from rank a to rank b, ``o_b - o_a <= consumer_start_b - send_start_a`` (``o_r``: what rank r's
clock reads ahead of a common one; the consumer is the F, B or I that takes the message).
Messages each way between two ranks bound ``o_b - o_a`` from both sides. On one host the
offset is 0 and lies inside every such interval, and nothing changes. Where 0 lies outside a
pair's interval by more than :data:`TOLERANCE_NS`, the clocks differ by at least that much: the pair's offset is taken as the
middle of its interval (what NTP assumes: equally fast both ways), the ranks are shifted along
the pairs from the lowest rank, and a note says by how much. An offset smaller than the
messages' transit cannot be seen and is left, and so are bounds that no offset satisfies
(messages seemingly consumed before they were sent both ways: the send rows do not mark when
the messages left, as where one span posts a batch of them).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

__all__ = ["TOLERANCE_NS", "align_clocks", "message_delays", "rank_offsets"]

_KEYS = ["step", "stage", "microbatch"]
# Clocks found apart by less than this are left as they are: below what NTP promises between
# hosts and what a message takes, and above Kineto's microsecond stamps and the few
# microseconds by which traces laid out on a made-up clock break causality.
TOLERANCE_NS = 100_000
_TIME_COLUMNS = ("start_ns", "end_ns", "launch_start_ns", "launch_end_ns")


def message_delays(events: pd.DataFrame) -> pd.DataFrame:
    """One row per message between two ranks: its sender ``src``, receiver ``dst`` and ``d_ns``,
    when it was surely there on the receiver's clock (the end of a wait for it, else its
    consumer's start) less the send's start on the sender's."""
    kind = events["kind"].astype(str)
    cols = ["rank", *_KEYS, "start_ns"]
    sends = events.loc[kind.isin(["SEND_F", "SEND_B"]), cols].assign(k=kind)
    # a forward's output feeds the next stage's F; an input gradient, the previous stage's B or I
    sends["stage"] = np.where(sends["k"] == "SEND_F", sends["stage"] + 1, sends["stage"] - 1)
    sends["want"] = np.where(sends["k"] == "SEND_F", "F", "B")
    comp = events.loc[kind.isin(["F", "B", "I"]), cols].assign(want=kind.replace({"I": "B"}))
    # a wait for the message ends once it arrived: an earlier bound than the consumer's start
    recv = events["name"].astype(str).str.extract(r"RECV_([FB])")[0]
    waits = events.loc[(kind == "WAIT") & recv.notna(), ["rank", *_KEYS, "end_ns"]]
    waits = waits.rename(columns={"end_ns": "start_ns"}).assign(want=recv)
    first = pd.concat([comp, waits]).groupby([*_KEYS, "want"], as_index=False).agg(
        dst=("rank", "first"), consumed=("start_ns", "min")
    )
    m = sends.merge(first, on=[*_KEYS, "want"], how="inner")
    m = m[m["rank"] != m["dst"]]
    return pd.DataFrame(
        {"src": m["rank"].to_numpy(), "dst": m["dst"].to_numpy(),
         "d_ns": (m["consumed"] - m["start_ns"]).to_numpy()}
    )  # fmt: skip


def rank_offsets(delays: pd.DataFrame) -> dict[int, int]:
    """Per rank, what its clock reads ahead of the lowest rank's (nanoseconds), where the
    messages prove the clocks differ (see the module docstring); {} where they do not."""
    if delays.empty:
        return {}
    bound = delays.groupby(["src", "dst"])["d_ns"].min()  # o_dst - o_src <= bound
    pairs: dict[tuple[int, int], float] = {}
    for (a, b), hi in bound.items():
        if a > b:
            continue
        lo = -bound.get((b, a), np.inf)  # from b -> a: o_a - o_b <= bound[b, a]
        if lo - TOLERANCE_NS <= 0 <= hi + TOLERANCE_NS or lo > hi + TOLERANCE_NS:
            pairs[(a, b)] = 0.0  # consistent; or no offset explains them (sends not marked)
        else:
            pairs[(a, b)] = (lo + hi) / 2 if np.isfinite(lo) else hi
    for (b, a), hi in bound.items():  # pairs with messages only from the higher rank
        if b > a and (a, b) not in pairs:
            pairs[(a, b)] = 0.0 if hi >= -TOLERANCE_NS else -hi
    if not any(pairs.values()):
        return {}
    ranks = sorted({r for p in pairs for r in p})
    offsets = {ranks[0]: 0.0}
    frontier = [ranks[0]]
    while frontier:  # along the pairs from the lowest rank
        a = frontier.pop()
        for (x, y), o in pairs.items():
            if x == a and y not in offsets:
                offsets[y] = offsets[a] + o
                frontier.append(y)
            elif y == a and x not in offsets:
                offsets[x] = offsets[a] - o
                frontier.append(x)
    return {r: int(round(o)) for r, o in sorted(offsets.items()) if round(o)}


def align_clocks(
    events: pd.DataFrame, memory: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame, dict[int, int], str | None]:
    """The event and memory tables on one clock (each rank's times less its offset,
    :func:`rank_offsets`), the offsets and the note that says so; unchanged, with no note,
    where the messages show no offset."""
    offsets = rank_offsets(message_delays(events))
    if not offsets:
        return events, memory, {}, None

    def shifted(table: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
        table = table.copy()
        by = table["rank"].map(offsets).fillna(0).astype("int64").to_numpy()
        for c in columns:
            if c in table:
                table[c] = table[c] - by
        return table

    shown = ", ".join(f"rank {r}'s {o / 1e6:+.3f} ms" for r, o in offsets.items())
    note = (
        "the ranks' clocks differ (messages seemed consumed before they were sent): times "
        f"put on rank {min(events['rank'])}'s clock, which {shown} read ahead of"
    )
    return shifted(events, _TIME_COLUMNS), shifted(memory, ("t_ns",)), offsets, note

"""The link model's terms from a measured run: how long a message took once it could move.

:func:`comm_link_us` reads the receives ranks waited on (WAIT spans naming a RECV) against the
matching SENDs; :func:`vpipe.predict.calibrate.calibrate` puts the result in its Calibration.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

US = 1e3  # ns per cost-model time unit


# A wait that finds its data there takes about 20 us (the executor's own work), and on a busy
# host up to a few hundred: a wait counts as blocked until its data arrived only when it took
# longer than this floor and than twice the slowest (95th percentile) wait of the run that
# surely found its data there (its message could move more than _SURELY_THERE_NS earlier).
_BLOCKED_NS = 50_000
_SURELY_THERE_NS = 5_000_000
# Late receives whose wait blocked that a handshake is read from, at least. With one or two,
# a wait the host slowed past the threshold (100 us of executor lag, 7-19 ms after its
# message could move) set the median alone: a handshake of 6-19 ms, where a message took
# 0.1-0.3 ms, put one calibration's predictions 44% high (docs/runtime.md).
_MIN_BLOCKED = 3


def _blocked_threshold_ns(m: pd.DataFrame, ready: pd.Series) -> float:
    """The wait duration past which a receive's wait was blocked (see :data:`_BLOCKED_NS`)."""
    found = (m["end_ns"] - m["start_ns"])[m["start_ns"] - ready > _SURELY_THERE_NS]
    return max(_BLOCKED_NS, 2 * float(found.quantile(0.95))) if len(found) >= 5 else _BLOCKED_NS


def comm_link_us(events: pd.DataFrame) -> tuple[float, float]:
    """The link model's ``(latency, handshake)`` in microseconds, from the receives ranks
    waited on (0 when no wait was still blocked once its message could move, e.g. no WAIT
    spans).

    A message can move once the matching SEND on the peer and the rank's own RECV are both
    posted; from then to the end of a wait still blocked at that point is one message's time.
    Its median over receives posted before the send began is ``latency``; over receives posted
    after it, ``latency + handshake`` (gloo's rendezvous: the sender's I/O thread writes the
    payload only once it hears of the receive). A run without such late receives, or without
    early ones, gives handshake 0 and the median of what it has as latency.
    """
    kind = events["kind"].astype(str)
    name = events["name"].astype(str)
    waits = events[kind == "WAIT"].assign(comm=name[kind == "WAIT"].str.extract(r"(RECV_[FB])")[0])
    sends = events[kind.isin(["SEND_F", "SEND_B"])]
    if waits.empty or sends.empty:
        return 0.0, 0.0
    # the send feeding RECV_F at stage s comes from stage s-1; RECV_B at s from stage s+1
    w = waits.assign(
        src_stage=np.where(waits["comm"] == "RECV_F", waits["stage"] - 1, waits["stage"] + 1),
        send_kind=np.where(waits["comm"] == "RECV_F", "SEND_F", "SEND_B"),
    )
    keys = ["run_id", "step", "microbatch"]
    s = sends[[*keys, "stage", "start_ns", "end_ns"]].assign(send_kind=kind[sends.index])
    m = w.merge(
        s.rename(columns={"stage": "src_stage", "start_ns": "send_start", "end_ns": "send_end"}),
        on=[*keys, "send_kind", "src_stage"],
        how="inner",
    )
    recvs = events[kind.isin(["RECV_F", "RECV_B"])]
    r = recvs[[*keys, "stage", "end_ns"]].assign(comm=kind[recvs.index])
    m = m.merge(r.rename(columns={"end_ns": "recv_end"}), on=[*keys, "stage", "comm"], how="left")
    late = (m["recv_end"] > m["send_start"]).to_numpy()
    blocked_ns = _blocked_threshold_ns(m, np.maximum(m["recv_end"], m["send_end"]))
    early = m[~late]
    blocked = (early["start_ns"] <= early["send_end"]) & (early["end_ns"] >= early["send_end"])
    took_early = ((early["end_ns"] - early["send_end"])[blocked] / US).to_numpy()
    m = m[late]
    ready = np.maximum(m["recv_end"], m["send_end"])
    waited = (m["end_ns"] - m["start_ns"] > blocked_ns) & (m["end_ns"] >= ready)
    took_late = _left_censored_median(
        ((m["end_ns"] - ready)[waited] / US).to_numpy(),
        ((m["start_ns"] - ready)[~waited].clip(lower=0) / US).to_numpy(),
    )
    if math.isnan(took_late):
        return (float(np.median(took_early)) if len(took_early) else 0.0), 0.0
    if not len(took_early):
        return took_late, 0.0
    latency = float(np.median(took_early))
    return latency, max(took_late - latency, 0.0)


def _left_censored_median(exact: np.ndarray, at_most: np.ndarray) -> float:
    """Median of a sample of which ``exact`` values are known and the rest are only known to
    be at most ``at_most`` (a late receive whose wait did not block: its message had arrived
    by the time the wait began). Kaplan-Meier on the negated values; NaN with fewer than
    :data:`_MIN_BLOCKED` exact values, or when they are too few to reach the median (one
    blocked wait among many that did not block says nothing of the typical message)."""
    if len(exact) < _MIN_BLOCKED:
        return math.nan
    values = np.concatenate([-exact, -at_most])
    is_exact = np.concatenate([np.ones(len(exact), bool), np.zeros(len(at_most), bool)])
    order = np.lexsort((~is_exact, values))  # ascending; exact values before bounds at a tie
    at_risk, survive, last = len(values), 1.0, math.nan
    for v, ex in zip(values[order], is_exact[order], strict=True):
        if ex:
            survive *= 1 - 1 / at_risk
            last = -float(v)
            if survive <= 0.5:
                return last
        at_risk -= 1
    return math.nan

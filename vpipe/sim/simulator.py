"""Event-driven simulator of pipeline schedules under a simple cost model.

The simulator replays the lowered program with :func:`vpipe.ir.engine.replay`, under the
execution semantics described there (SEND/RECV post without blocking; per-rank program order;
a compute action, or each part of an overlap action, waits for its own input, then runs). A
message arrives ``comm_latency + bytes / comm_bandwidth`` after both its SEND and its RECV are
posted (:class:`vpipe.ir.engine.LinkModel`: links are not shared, so transfers never queue behind
each other); hand-over between stages on one rank is free. Costs are in abstract time units
(``time_unit_ns`` converts them when exporting).

Bubble ratio, two definitions (both per rank and overall):

* **whole step** (``bubble_ratio``): idle / (idle + busy) of each rank over [0, makespan],
  i.e. ``1 - busy_r / makespan``; overall ``1 - sum(busy) / (ranks * makespan)``.
* **excluding skew** (``bubble_ratio_excl_skew``): the same over each rank's own span, from the
  start of its first compute action to the end of its last, so the staggered start-up and
  drain of later ranks do not count; overall ``sum(span - busy) / sum(span)``.

Only compute counts as busy; posting a SEND or RECV takes no time.

Peak live activations: a (stage, microbatch) is live on its rank from its F until its last
backward part (B, or the W after an I) has run; the peak per rank is counted in program order
(ranks run one action at a time, so it does not depend on timing), in microbatch-stage units,
and in bytes when ``activation_bytes`` is given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from vpipe.ir import Schedule
from vpipe.ir.engine import Program, Timing, compile_program, replay
from vpipe.ir.flat import KIND_ORDER, PART_BITS, Flat, comm_messages, decode_messages, flatten
from vpipe.ir.lowering import CommPlan, plan_comm, slot_keys
from vpipe.ir.validation import check_static
from vpipe.sim.cost_model import CostModel, CostModelError, parse_numbers
from vpipe.sim.posts import comm_rows

__all__ = [
    "CostModel",
    "CostModelError",
    "Prepared",
    "SimResult",
    "parse_numbers",
    "prepare",
    "simulate",
]

KIND_NAMES = ("F", "B", "I", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B")


@dataclass
class SimResult:
    """Outcome of :func:`simulate`. Times are in the cost model's units; memory per rank in
    stage activations (``peak_stage_activations``: one stage's saved tensors for one
    microbatch), activation units (``peak_activation_units``: one microbatch's of a rank's
    share of the model, 1/P of it, so a V stage counts half) and bytes
    (``peak_activation_bytes``, when the costs give activation bytes)."""

    schedule: Schedule
    costs: CostModel
    makespan: float
    bubble_ratio: float
    bubble_ratio_per_rank: list[float]
    bubble_ratio_excl_skew: float
    bubble_ratio_per_rank_excl_skew: list[float]
    peak_stage_activations: list[int]
    peak_activation_bytes: list[float] | None
    comm_ops: list[int]
    busy: list[float]
    span: float = 0.0  # the longest rank span: a rank's first compute start to its last end
    _raw: _Raw | None = field(repr=False, default=None)

    @property
    def peak_activation_units(self) -> list[float]:
        """Peak activations per rank in activation units: stage activations x P / stages."""
        ratio = self.schedule.n_ranks / self.schedule.n_stages
        return [x * ratio for x in self.peak_stage_activations]

    @property
    def peak_activations(self) -> list[int]:
        """The old name of :attr:`peak_stage_activations` (deprecated: it named no unit)."""
        import warnings

        warnings.warn(
            "SimResult.peak_activations is peak_stage_activations (stage activations); "
            "peak_activation_units gives them in activation units",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.peak_stage_activations

    @cached_property
    def columns(self) -> dict[str, np.ndarray]:
        """The timeline as numpy columns, without pandas: rank, stage, microbatch, kind (codes
        into ``KIND_NAMES``), start, end."""
        return _timeline_columns(self._raw)

    @cached_property
    def compute_columns(self) -> dict[str, np.ndarray]:
        """The compute rows of :attr:`columns` alone, in the same order (rank-major, program
        order): what the iteration's end and the data-parallel reductions read, without
        the SEND/RECV rows or a sort."""
        fl, timing = self._raw.prepared.fl, self._raw.timing
        return {"rank": fl.p_rank.copy(), "stage": fl.p_stage.copy(),
                "microbatch": fl.p_mb.copy(), "kind": fl.p_kind.astype(np.int8),
                "start": timing.start.copy(), "end": timing.end.copy()}  # fmt: skip

    @cached_property
    def timeline(self):
        """One row per action (overlap parts as their own rows, each from its own start:
        a part may wait for its input after the previous part; SEND and RECV rows span from
        their posting to the message's arrival): rank, stage, microbatch, kind, name, start,
        end; per rank in program order."""
        import pandas as pd

        c = self.columns
        stage, kind, mb = c["stage"], c["kind"], c["microbatch"]
        names = [
            f"{s}{k}{m}"
            for s, k, m in zip(
                stage.tolist(), np.array(KIND_NAMES)[kind].tolist(), mb.tolist(), strict=True
            )
        ]
        return pd.DataFrame(
            {
                "rank": c["rank"],
                "stage": stage,
                "microbatch": mb,
                "kind": pd.Categorical.from_codes(kind, categories=list(KIND_NAMES)),
                "name": names,
                "start": c["start"],
                "end": c["end"],
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary."""
        return {
            "schedule": self.schedule.name,
            "ranks": self.schedule.n_ranks,
            "stages": self.schedule.n_stages,
            "microbatches": self.schedule.n_microbatches,
            "makespan": self.makespan,
            "bubble_ratio": self.bubble_ratio,
            "bubble_ratio_per_rank": self.bubble_ratio_per_rank,
            "bubble_ratio_excl_skew": self.bubble_ratio_excl_skew,
            "bubble_ratio_per_rank_excl_skew": self.bubble_ratio_per_rank_excl_skew,
            "peak_stage_activations": self.peak_stage_activations,
            "peak_activation_units": self.peak_activation_units,
            "peak_activation_bytes": self.peak_activation_bytes,
            "comm_ops": self.comm_ops,
            "span": self.span,
        }

    def objective(self, objective: str) -> float:
        """The step time by ``objective``: ``makespan`` (ranks start together, the step ends
        with the last) or ``span`` (the longest rank span, iterations overlapping)."""
        return self.span if objective == "span" else self.makespan

    def to_events(
        self,
        run_id: str,
        schedule: str | Schedule | None = None,
        time_unit_ns: float = 1000,
        step: int = 0,
    ):
        """The timeline as an event table (:mod:`vpipe.events` schema), source "simulated"."""
        from vpipe.events import events_frame

        tl = self.timeline
        name = schedule.name if isinstance(schedule, Schedule) else schedule
        n = len(tl)
        return events_frame(
            {
                "run_id": [run_id] * n,
                "source": ["simulated"] * n,
                "impl": ["vpipe"] * n,
                "schedule": [name or self.schedule.name] * n,
                "rank": tl["rank"].to_numpy(),
                "step": np.full(n, step),
                "stage": tl["stage"].to_numpy(),
                "microbatch": tl["microbatch"].to_numpy(),
                "kind": tl["kind"].astype(str).to_numpy(),
                "name": tl["name"].to_numpy(),
                "start_ns": np.rint(tl["start"].to_numpy() * time_unit_ns).astype(np.int64),
                "end_ns": np.rint(tl["end"].to_numpy() * time_unit_ns).astype(np.int64),
            }
        )

    def to_chrome_trace(self, path: str | Path | None = None, time_unit_ns: float = 1000) -> dict:
        """Chrome trace JSON (opens in Perfetto): one process per rank; compute actions are
        complete ("X") events on thread 0; SEND/RECV transfers are async events, since they
        overlap. Written to ``path`` when given; the trace dict is returned."""
        import orjson

        from vpipe.outputs import atomic_write

        c = self.columns
        us = time_unit_ns / 1000.0
        events: list[dict[str, Any]] = []
        for r in range(self.schedule.n_ranks):
            events.append(
                {"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}}
            )
            events.append(
                {"ph": "M", "name": "process_sort_index", "pid": r, "args": {"sort_index": r}}
            )
            events.append(
                {"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}}
            )
        kinds = np.array(KIND_NAMES)[c["kind"]].tolist()
        rows = zip(
            c["rank"].tolist(),
            c["stage"].tolist(),
            kinds,
            c["microbatch"].tolist(),
            (c["start"] * us).tolist(),
            ((c["end"] - c["start"]) * us).tolist(),
            strict=True,
        )
        for i, (r, s, k, m, ts, dur) in enumerate(rows):
            name = f"{s}{k}{m}"
            args = {"stage": s, "microbatch": m}
            if len(k) == 1:
                events.append(
                    {
                        "ph": "X",
                        "name": name,
                        "cat": k,
                        "pid": r,
                        "tid": 0,
                        "ts": ts,
                        "dur": dur,
                        "args": args,
                    }
                )
            else:
                base = {"name": name, "cat": "comm", "pid": r, "tid": 0, "id": i}
                events.append({**base, "ph": "b", "ts": ts, "args": args})
                events.append({**base, "ph": "e", "ts": ts + dur})
        trace = {
            "traceEvents": events,
            "displayTimeUnit": "ns",
            "otherData": {"schedule": self.schedule.name, "source": "vpipe.sim.simulator", **self.to_dict()},
        }
        if path is not None:
            data = orjson.dumps(trace)
            atomic_write(path, lambda tmp: tmp.write_bytes(data))
        return trace


@dataclass
class Prepared:
    """What simulating a schedule needs that no cost changes: its flat columns (statically
    valid), its communication plan and replay program, and (lazily) the layout of its
    timeline. A caller timing one schedule under many cost models prepares it once
    (:func:`prepare`)."""

    schedule: Schedule
    recv_lookahead: int
    fl: Flat
    plan: CommPlan | None
    prog: Program

    @cached_property
    def timeline_layout(self) -> _Layout:
        return _timeline_layout(self.fl, self.prog, self.plan)

    @cached_property
    def stage_peaks(self) -> list:
        """Peak live (stage, microbatch) activations per rank, in program order."""
        fl, P = self.fl, self.schedule.n_ranks
        delta = np.array([1, -1, 0, -1], np.int64)[fl.p_kind]
        return _segment_peaks(delta, np.searchsorted(fl.p_rank, np.arange(P + 1)))


def prepare(schedule: Schedule, recv_lookahead: int = 1) -> Prepared:
    """Flatten, check and plan ``schedule`` for :func:`simulate` (``prepared=``); invalid
    schedules raise ScheduleError."""
    fl = flatten(schedule)
    check_static(fl)
    plan = None if fl.lowered else plan_comm(fl, recv_lookahead)
    prog = compile_program(fl, None if plan is None else (plan.e, plan.recv_op))
    return Prepared(schedule, recv_lookahead, fl, plan, prog)


def simulate(
    schedule: Schedule,
    costs: CostModel | str | None = None,
    *,
    recv_lookahead: int = 1,
    action_times: Mapping[tuple[int, str, int], float] | None = None,
    prepared: Prepared | None = None,
) -> SimResult:
    """Simulate one step of a schedule. A compute-only schedule is lowered as
    :func:`vpipe.ir.lowering.lower` would (``recv_lookahead``) without materialising the actions;
    a lowered one runs as given. ``action_times`` gives some compute parts their own time,
    keyed by (stage, kind letter, microbatch), e.g. a measured step's
    (:mod:`vpipe.predict.step_replay`); the others cost what ``costs`` says, overlap scaling
    included. ``costs`` per rank's share (``unit="rank"``, as cost strings are) are split evenly
    over the schedule's stages per rank; a string is parsed (:meth:`CostModel.parse`).
    ``prepared``: this schedule's :func:`prepare`, when the caller keeps it. Invalid
    schedules raise ScheduleError."""
    if isinstance(costs, str):
        costs = CostModel.parse(costs)
    costs = (costs or CostModel()).for_schedule(schedule.stages_per_rank)  # unit=rank: 1/V each
    if prepared is None:
        prepared = prepare(schedule, recv_lookahead)
    elif prepared.schedule is not schedule or prepared.recv_lookahead != recv_lookahead:
        raise ValueError("simulate: prepared= was prepared for another schedule or lookahead")
    fl, plan, prog = prepared.fl, prepared.plan, prepared.prog
    S = schedule.n_stages
    f, b, w = costs.stage_times(S)
    part_dur = np.concatenate([f, costs.backward_times(S), b, w])[fl.part_index]
    if costs.overlap != 1.0 and len(fl.p_op) > len(fl.o_rank):  # parts of overlap actions
        in_compound = np.bincount(fl.p_op, minlength=len(fl.o_rank))[fl.p_op] > 1
        part_dur = np.where(in_compound, part_dur * costs.overlap, part_dur)
    if action_times:
        keys = zip(fl.p_stage.tolist(), fl.p_kind.tolist(), fl.p_mb.tolist(), strict=True)
        given = [action_times.get((s, KIND_ORDER[k].value, m)) for s, k, m in keys]
        part_dur = np.array([d if t is None else t for d, t in zip(part_dur, given, strict=True)])
    op_lead, tail = _overheads(fl, plan, costs)
    part_lead = np.zeros(len(fl.p_op))
    part_lead[np.searchsorted(fl.p_op, np.arange(len(fl.o_rank)))] = op_lead
    timing = replay(prog, part_dur, costs.links(S), part_lead)
    return _summarise(schedule, costs, prepared, part_dur, timing, tail)


def _overheads(fl: Flat, plan: CommPlan | None, costs: CostModel) -> tuple[np.ndarray, np.ndarray]:
    """Per compute op, the runtime's time before it (``gap``, plus ``gap`` for each SEND/RECV
    since the rank's previous op and ``post`` for each operation they post: messages bundled
    into one, :mod:`vpipe.ir.bundling`, post once); per rank, that of the SENDs/RECVs after its
    last op."""
    n_ops, P = len(fl.o_rank), fl.schedule.n_ranks
    if costs.post == 0 and costs.gap == 0:
        return np.zeros(n_ops), np.zeros(P)
    c_rank, nxt, posts = comm_rows(fl, plan)
    # gap per SEND/RECV action; post per operation posted (a bundle posts one for several)
    cost = costs.gap + costs.post * posts
    inside = nxt < fl.o_lo[c_rank + 1]  # else after the rank's last op
    lead_t = costs.gap + np.bincount(nxt[inside], weights=cost[inside], minlength=n_ops)
    tail = np.bincount(c_rank[~inside], weights=cost[~inside], minlength=P)
    return lead_t.astype(float), tail.astype(float)


def _summarise(schedule, costs, prepared: Prepared, part_dur, timing: Timing, tail) -> SimResult:
    P, S = schedule.n_ranks, schedule.n_stages
    fl, plan = prepared.fl, prepared.plan
    lo = fl.o_lo
    end = timing.op_end
    rank_end = tail.copy()
    has_ops = lo[1:] > lo[:-1]
    rank_end[has_ops] += end[lo[1:][has_ops] - 1]
    makespan = float(rank_end.max()) if len(end) else 0.0
    busy = np.bincount(fl.p_rank, weights=part_dur, minlength=P)
    has = lo[1:] > lo[:-1]
    first, last = np.zeros(P), np.zeros(P)
    first[has] = timing.op_start[lo[:-1][has]]
    last[has] = end[lo[1:][has] - 1]
    span = last - first
    per_rank = (1.0 - busy / makespan) if makespan > 0 else np.zeros(P)
    overall = 1.0 - busy.sum() / (P * makespan) if makespan > 0 else 0.0
    with np.errstate(invalid="ignore", divide="ignore"):
        per_rank_ex = np.where(span > 0, (span - busy) / np.where(span > 0, span, 1), 0.0)
    overall_ex = float((span - busy).sum() / span.sum()) if span.sum() > 0 else 0.0
    act = costs.stage_activation_bytes(S)
    peak_bytes = None
    if act is not None:
        plo = np.searchsorted(fl.p_rank, np.arange(P + 1))
        peak_bytes = _byte_peaks(fl, act, costs.stage_recompute_bytes(S), plo)
    if fl.lowered:
        comm_ops = np.bincount(fl.c_rank, minlength=P)
    else:
        comm_ops = np.bincount(fl.o_rank[plan.send_op], minlength=P)
        comm_ops += np.bincount(plan.dst, minlength=P)
    return SimResult(
        schedule=schedule,
        costs=costs,
        makespan=makespan,
        bubble_ratio=float(overall),
        bubble_ratio_per_rank=[float(x) for x in per_rank],
        bubble_ratio_excl_skew=overall_ex,
        bubble_ratio_per_rank_excl_skew=[float(x) for x in per_rank_ex],
        peak_stage_activations=[int(x) for x in prepared.stage_peaks],
        peak_activation_bytes=None if peak_bytes is None else [float(x) for x in peak_bytes],
        comm_ops=[int(x) for x in comm_ops],
        busy=[float(x) for x in busy],
        span=float(span.max()) if len(span) else 0.0,
        _raw=_Raw(prepared, timing),
    )


@dataclass
class _Raw:
    """What the lazy timeline is built from."""

    prepared: Prepared
    timing: Timing


@dataclass(frozen=True)
class _Layout:
    """A schedule's timeline without its times: the rows' rank, stage, microbatch and kind in
    program order (``order``: where each row comes from among the compute parts, then the
    SEND/RECV rows), and per SEND/RECV row the op whose end posts it and its message."""

    columns: dict[str, np.ndarray]
    order: np.ndarray
    post_op: np.ndarray
    message: np.ndarray


def _timeline_layout(fl: Flat, prog: Program, plan: CommPlan | None) -> _Layout:
    s = fl.schedule
    M, NB = s.n_microbatches, s.n_stages - 1
    if fl.lowered:
        e, is_send, _ = comm_messages(fl)
        c_rank, c_stage, c_kind, c_mb = fl.c_rank, fl.c_stage, fl.c_kind + 4, fl.c_mb
        p_seq, c_seq = fl.p_pos << PART_BITS | fl.p_sub, fl.c_pos << PART_BITS
        tie = np.zeros(len(fl.p_rank) + len(e), np.int64)
    else:
        d, b, mm = decode_messages(plan.e, NB, M)
        n = len(plan.e)
        e = np.concatenate([plan.e, plan.e])
        is_send = np.arange(2 * n) < n
        c_rank = np.concatenate([fl.o_rank[plan.send_op], plan.dst])
        c_stage = np.concatenate([b + d, b + 1 - d])
        c_kind = np.concatenate([4 + 2 * d, 5 + 2 * d])
        c_mb = np.concatenate([mm, mm])
        # Program order as lower() writes it.
        op_key, send_key, recv_key = slot_keys(fl, plan)
        p_seq = op_key[fl.p_op] << PART_BITS | fl.p_sub
        c_seq = np.concatenate([send_key << PART_BITS | plan.send_sub, recv_key << PART_BITS])
        tie = np.concatenate([np.zeros(len(fl.p_rank) + n, np.int64), plan.order])
    post_op = np.where(is_send, prog.send_op[e], prog.recv_op[e])
    cols = {
        "rank": np.concatenate([fl.p_rank, c_rank]),
        "stage": np.concatenate([fl.p_stage, c_stage]),
        "microbatch": np.concatenate([fl.p_mb, c_mb]),
        "kind": np.concatenate([fl.p_kind, c_kind]).astype(np.int8),
    }
    order = np.lexsort((tie, np.concatenate([p_seq, c_seq]), cols["rank"]))
    return _Layout({k: v[order] for k, v in cols.items()}, order, post_op, e)


def _timeline_columns(raw: _Raw) -> dict[str, np.ndarray]:
    """Timeline columns, one row per compute part and per SEND/RECV, in program order."""
    lay, timing = raw.prepared.timeline_layout, raw.timing
    c_start = np.append(timing.op_end, 0.0)[lay.post_op]  # -1: a RECV posted at the start
    start = np.concatenate([timing.start, c_start])
    end = np.concatenate([timing.end, timing.arrive[lay.message]])
    cols = {k: v.copy() for k, v in lay.columns.items()}  # the caller's own, as before
    return {**cols, "start": start[lay.order], "end": end[lay.order]}


def _byte_peaks(fl: Flat, act: np.ndarray, rec: np.ndarray, bounds: np.ndarray) -> list:
    """Peak bytes per rank in program order, as the runtime counts them: F adds what it keeps
    (``act``); a recomputing B holds ``rec`` while it runs, then frees both; I adds ``rec``
    until its W frees both."""
    a, r = act[fl.p_stage], rec[fl.p_stage]
    net = np.select([fl.p_kind == 0, fl.p_kind == 1, fl.p_kind == 2], [a, -a, r], -(a + r))
    during = np.where(fl.p_kind == 1, r, 0.0)  # above the count before the B
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        after = np.cumsum(net[lo:hi])
        before = after - net[lo:hi]
        out.append(max(float(np.max(np.maximum(after, before + during[lo:hi]))), 0.0)
                   if hi > lo else 0)  # fmt: skip
    return out


def _segment_peaks(delta: np.ndarray, bounds: np.ndarray) -> list:
    """Max running sum (floored at 0) of ``delta`` within each [bounds[r], bounds[r+1])."""
    out = []
    for r in range(len(bounds) - 1):
        seg = delta[bounds[r] : bounds[r + 1]]
        out.append(max(np.cumsum(seg).max(), 0) if len(seg) else 0)
    return out

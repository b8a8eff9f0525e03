"""Calibrate the simulator from a measured run and predict other schedules (fidelity).

From a measured run's event table :func:`calibrate` takes, per stage, the median (or, with
``stat="mean"``, the mean) duration of F, I, W and B spans, per-action overheads, and the
communication latency:

- **I/W split**: I and W spans give ``b`` and ``w``, and a B beside them (dualpipev) keeps its
  own cost; with only B (1f1b) the split is assumed, ``w = w_share * B`` (default 0.5: the
  two matmuls of a linear layer have equal FLOPs), except on stage 0, whose I computes
  nothing (the batch needs no gradient): all of it is W. Splitting costs more than one B: I + W
  is B times ``split_ratio`` past the first stage, from the run's own B beside I and W or from
  the sweep's probe (:mod:`vpipe.predict.split_cost`); the cost model keeps both prices.
- **Overhead**: a rank's step holds more than compute and waits. Posting a SEND or RECV
  occupies the rank: ``post`` is the mean SEND/RECV span (a total over many actions is what
  matters, and posting times are heavy-tailed). Between spans the executor's own work leaves
  gaps: ``gap`` is the time of the steps covered by no span on a rank divided by the number of
  actions (compute and communication). The cost model charges them where the predicted
  schedule's lowered program has them (:class:`vpipe.sim.CostModel`'s ``post`` and ``gap``),
  as rank time that is neither busy nor waiting. Only runs with WAIT spans (vpipe's runtime)
  have these; in other tables idle time and overhead look alike, and both are 0.
- **Communication**: for each receive the rank waited on, the time from when the message could
  move (its SEND on the peer and its RECV both posted) to the end of the wait: the median over
  receives posted before their send is the cost model's ``comm_latency``, and what receives
  posted after it take beyond that is ``comm_handshake`` (:func:`comm_link_us`).
- **Communication threads**: on a host whose cores the compute threads fill, gloo's and
  vpipe's communication threads run on compute's time (:mod:`vpipe.trace.thread_cpu`). A
  sweep measures their CPU per timed step (the runs table's ``comm_thread_cpu_s``; events
  alone do not hold it); :func:`with_comm_threads` divides it by the operations the run's
  schedule posts (:func:`vpipe.sim.posts.posted_operations`) and the cost model charges that
  with each ``post``, so a schedule that posts more pays for it. The run's own share is already
  in its compute spans: :func:`anchor`, which applies it first, takes that share back out.
- **Stage granularity**: a 1f1b run at P=2 has 2 stages, zbv and interleaved-1f1b at P=2 have
  4, so per-stage costs do not transfer as they are. The model is split into ``n_units`` equal
  pieces (MLP blocks, GPT layers) as :func:`vpipe.models.build_model` splits them (contiguous,
  earlier stages take the extra piece); a calibrated stage's cost is shared equally by its
  pieces and a predicted stage costs the sum of its pieces (F, and the whole backward, which is
  then split as above). Overheads are per action and do not scale.
  This is exact for equal blocks; a model with a heavier first or last piece (GPT's embedding
  and head) is approximated.
- **Data parallel**: a ``--dp`` run's gradient reductions (REDUCE rows and the step end's WAIT
  for them, :mod:`vpipe.ir.reduction`) are not pipeline work: calibration leaves them out, and
  the reductions are added by :mod:`vpipe.sim.collectives`.

Times in the cost model are microseconds (``time_unit_ns=1000``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pandas as pd

from vpipe.errors import TraceError
from vpipe.events import COMPUTE_KINDS
from vpipe.metrics.per_run import KEYS, _union_ns, rank_metrics, step_metrics
from vpipe.predict.links import comm_link_us
from vpipe.predict.pieces import lcm, rescale_stages
from vpipe.predict.recompute_share import recomputable_us
from vpipe.predict.split_cost import in_run_ratio, run_figure, split_factors
from vpipe.trace.operators import RUN_NAME

US = 1e3  # ns per cost-model time unit


@dataclass
class Calibration:
    """Costs measured on one run, in microseconds, per stage of that run."""

    f: np.ndarray
    b: np.ndarray  # input gradient (I)
    w: np.ndarray  # weight gradient (W)
    post: float  # per SEND/RECV action
    gap: float  # per action
    comm_latency: float
    w_share: float | None  # the assumed W share of B, or None when I and W were measured
    run_id: str = ""
    overlap: float = 1.0  # an overlap action's span over the sum of its parts' separate costs
    comm_handshake: float = 0.0  # added to a message whose receive is posted after its send
    full_b: np.ndarray | None = None  # B's own time where a stage also ran I and W, else NaN
    compute_scale: float = 1.0  # F, I, W and B times are multiplied by it (vpipe.predict.anchor)
    recomputable: np.ndarray | None = None  # per stage, an F's time in RECOMPUTABLE spans
    # the communication threads' CPU per posted operation, where it came out of compute's cores
    # (with_comm_threads); charged with ``post``
    comm_threads: float = 0.0
    # (I + W) over a fused B past the first stage (vpipe.predict.split_cost); None: unknown, 1
    split_ratio: float | None = None
    # per stage, one forward run alone (the forward probe; NaN where not probed): what a full
    # recomputation reruns (vpipe.predict.recompute_share.full_shares)
    forward_alone: np.ndarray | None = None

    @property
    def n_stages(self) -> int:
        return len(self.f)

    def cost_model(self, schedule: Any, n_units: int | None = None) -> Any:
        """A CostModel for ``schedule`` on the same model (split into its stage count)."""
        from vpipe.sim import CostModel

        n_stages, k = schedule.n_stages, self.compute_scale
        split = split_factors(n_stages, self.split_ratio)
        if n_stages == self.n_stages:
            f, fused = self.f * k, self.fused_backward() * k
            if self.w_share is None:  # I and W as measured
                b, w = self.b * k, self.w * k
            else:
                b, w = split_backward(fused * split, self.w_share)
        else:
            n_units = n_units or lcm(self.n_stages, n_stages)
            f, fused = (rescale_stages(x * k, n_units, n_stages)
                        for x in (self.f, self.fused_backward()))  # fmt: skip
            b, w = split_backward(fused * split, self.share_of_w())
        per_stage = {
            s: {"f": f[s], "b": b[s], "w": w[s], "B": float(fused[s])} for s in range(n_stages)
        }
        return CostModel(
            comm_latency=self.comm_latency,
            comm_handshake=self.comm_handshake,
            per_stage=per_stage,
            post=self.post + self.comm_threads,
            gap=self.gap,
            overlap=self.overlap,
        )

    def fused_backward(self) -> np.ndarray:
        """Per stage, what one fused B costs: as measured where the run ran B, else its I + W
        over the split ratio (:mod:`vpipe.predict.split_cost`)."""
        total = self.b + self.w
        if self.w_share is not None:  # the run's backwards were B
            return total
        fused = total / split_factors(self.n_stages, self.split_ratio)
        if self.full_b is not None:
            fused = np.where(np.isfinite(self.full_b), self.full_b, fused)
        return fused

    def share_of_w(self) -> float:
        """W's share of a backward past the first stage: assumed, or measured (median)."""
        if self.w_share is not None:
            return self.w_share
        total = self.b[1:] + self.w[1:]
        return float(np.median(self.w[1:] / total)) if len(total) else 0.5

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "f_us": self.f.round(1).tolist(),
            "i_us": self.b.round(1).tolist(),
            "w_us": self.w.round(1).tolist(),
            "b_full_us": None if self.full_b is None else self.full_b.round(1).tolist(),
            "post_us": round(self.post, 1),
            "gap_us": round(self.gap, 1),
            "comm_latency_us": round(self.comm_latency, 1),
            "comm_handshake_us": round(self.comm_handshake, 1),
            "overlap": round(self.overlap, 3),
            "w_share": self.w_share,
            "compute_scale": round(self.compute_scale, 4),
            "comm_threads_us": round(self.comm_threads, 1),
            "split_ratio": None if self.split_ratio is None else round(self.split_ratio, 3),
        }


def split_backward(total: np.ndarray, share: float) -> tuple[np.ndarray, np.ndarray]:
    """Per-stage backward totals as (I, W) with W's ``share``; the first stage computes no
    input gradient, so all of its backward is W."""
    w = total * share
    w[0] = total[0]
    return total - w, w


def calibrate(
    events: pd.DataFrame,
    *,
    w_share: float = 0.5,
    stat: str = "median",
    split_ratio: float | None = None,
    forward_alone: np.ndarray | None = None,
) -> Calibration:
    """Calibrate from one measured run's event table (see the module docstring);
    ``split_ratio``, the run's probe of its split backward, where the run did not measure it
    itself (:mod:`vpipe.predict.split_cost`); ``forward_alone``, its probe of each stage's
    forward alone (:func:`vpipe.predict.recompute_share.full_shares`)."""
    if events.empty:
        raise TraceError("cannot calibrate from an empty event table")
    in_steps = events[events["step"] >= 0]
    ev = without_reductions(in_steps)
    kind = ev["kind"].astype(str)
    dur_us, names = (ev["end_ns"] - ev["start_ns"]) / US, ev["name"].astype(str)
    plain = ~names.str.startswith("(") & (names != RUN_NAME)  # overlap parts share a span
    if stat not in ("median", "mean"):
        raise TraceError(f"unknown statistic {stat!r}: use 'median' or 'mean'")
    med = dur_us[plain & kind.isin(COMPUTE_KINDS)].groupby([ev["stage"], kind]).agg(stat)
    n_stages = int(ev.loc[kind.isin(COMPUTE_KINDS), "stage"].max()) + 1
    f, b, w = np.zeros(n_stages), np.zeros(n_stages), np.zeros(n_stages)
    full_b = np.full(n_stages, np.nan)
    measured_iw = True
    for s in range(n_stages):
        get = lambda k, s=s: med.get((s, k), np.nan)  # noqa: E731
        if np.isnan(get("F")):
            raise TraceError(f"run has no F spans for stage {s}: cannot calibrate it")
        f[s] = get("F")
        if not np.isnan(get("I")) and not np.isnan(get("W")):
            b[s], w[s] = get("I"), get("W")
            full_b[s] = get("B")  # a B beside I and W costs what it measured
        elif not np.isnan(get("B")):
            share = 1.0 if s == 0 else w_share  # stage 0: no input gradient to compute
            b[s], w[s] = get("B") * (1 - share), get("B") * share
            measured_iw = False
        else:
            raise TraceError(f"run has neither B nor I and W spans for stage {s}")
    post = gap = 0.0  # without WAIT spans (simulated runs) idle time looks like overhead
    if (kind == "WAIT").any():
        comm = dur_us[kind.isin(["SEND_F", "RECV_F", "SEND_B", "RECV_B"])]
        post = float(comm.mean() / _posting_share(ev)) if len(comm) else 0.0
        gap = _gap_per_action_us(without_reductions(in_steps, waits=False))
    latency, handshake = comm_link_us(ev)
    return Calibration(
        f,
        b,
        w,
        post if np.isfinite(post) else 0.0,
        gap,
        latency,
        None if measured_iw else w_share,
        str(ev["run_id"].iloc[0]) if len(ev) else "",
        _overlap_factor(ev, dur_us, kind, f, b, w, np.where(np.isfinite(full_b), full_b, b + w)),
        handshake,
        full_b if np.isfinite(full_b).any() else None,
        recomputable=recomputable_us(ev, n_stages),
        split_ratio=in_run_ratio(b, w, full_b) or split_ratio,
        forward_alone=forward_alone,
    )


def _overlap_factor(
    ev: pd.DataFrame,
    dur_us: pd.Series,
    kind: pd.Series,
    f: np.ndarray,
    b: np.ndarray,
    w: np.ndarray,
    fused: np.ndarray,
) -> float:
    """Median over a run's overlap actions of the compound's computing time (its span less
    the waits inside it) over the sum of its parts' separate median costs (a B part's:
    ``fused``); 1 when the run has none."""
    parts = compound_parts(ev.assign(kind=kind, us=dur_us), f, b, w, fused)
    if parts.empty:
        return 1.0
    per = parts.groupby(COMPOUND_KEYS, observed=True).agg(
        own=("own", "sum"), computing=("computing", "first")
    )
    per = per[per["own"] > 0]
    return float((per["computing"] / per["own"]).median()) if len(per) else 1.0


COMPOUND_KEYS = [*KEYS, "name"]


def compound_parts(
    ev: pd.DataFrame, f: np.ndarray, b: np.ndarray, w: np.ndarray, fused: np.ndarray | None = None
) -> pd.DataFrame:
    """The rows of overlap-action parts in ``ev`` (which has a string ``kind`` and the span in
    microseconds as ``us``), each with ``own``, its calibrated cost (a B part's: ``fused``,
    else ``b + w``), and ``computing``, its compound's computing time: the parts' rows tile
    the compound less its waits (each part its own interval, or a shared one), so that is the
    sum over their distinct intervals."""
    compound = ev["name"].astype(str).str.startswith("(") & ev["kind"].isin(COMPUTE_KINDS)
    cost = {"F": f, "B": b + w if fused is None else fused, "I": b, "W": w}
    parts = ev[compound]
    parts = parts.assign(
        own=[float(cost[k][s]) for k, s in zip(parts["kind"], parts["stage"], strict=True)]
    )
    distinct = parts.drop_duplicates([*COMPOUND_KEYS, "start_ns", "end_ns"])
    computing = distinct.groupby(COMPOUND_KEYS, observed=True)["us"].sum().rename("computing")
    return parts.join(computing, on=COMPOUND_KEYS)


def without_reductions(ev: pd.DataFrame, *, waits: bool = True) -> pd.DataFrame:
    """``ev`` less its data-parallel reduction rows: REDUCE spans and, with ``waits``, the
    step end's WAITs for them (kept for the gap per action: that wait is no executor gap)."""
    reduction = ev["kind"].astype(str) == "REDUCE"
    if waits:
        reduction |= ev["name"].astype(str).str.fullmatch(r"WAIT:\d+REDUCE\d+")
    return ev[~reduction] if reduction.any() else ev


def _posting_share(ev: pd.DataFrame) -> float:
    """The share of a run's SEND/RECV actions that post an operation (bundled messages post
    one for several, :mod:`vpipe.ir.bundling`), from the program its first step ran; 1 when that
    program cannot be read back from the events."""
    from vpipe.ir import Schedule, ScheduleError, parse_action
    from vpipe.ir.bundling import posting_rows
    from vpipe.ir.flat import flatten

    kind = ev["kind"].astype(str)
    compute = ev[kind.isin(COMPUTE_KINDS)]
    step = ev.loc[ev["step"] >= 0, "step"].min()
    rows = ev[(ev["step"] == step) & ~kind.isin(["WAIT", "GPU", "other"])].sort_values("start_ns")
    try:
        actions = [
            [parse_action(str(n)) for n in g["name"].drop_duplicates()]
            for _, g in rows.groupby("rank", sort=True, observed=True)
        ]
        placement = dict(
            zip(compute["stage"].astype(int), compute["rank"].astype(int), strict=True)
        )
        n_microbatches = int(compute["microbatch"].max()) + 1
        schedule = Schedule(len(actions), max(placement) + 1, n_microbatches, placement, actions)
        posts = posting_rows(flatten(schedule))
    except (ScheduleError, ValueError, KeyError):
        return 1.0
    return float(posts.mean()) if len(posts) else 1.0


def _gap_per_action_us(ev: pd.DataFrame) -> float:
    """Per rank and step: time in the step covered by no span, over the number of actions."""
    r = rank_metrics(ev).set_index(KEYS)
    kind = ev["kind"].astype(str)
    spans = ev[~kind.isin(["other", "GPU"])]  # (GPU: other work on the device, no action)
    covered = _union_ns(spans, KEYS) / 1e9
    n_actions = spans[kind[spans.index] != "WAIT"].groupby(KEYS, observed=True).size()
    gap = (r["window_s"] - covered.reindex(r.index).fillna(0)).clip(lower=0)
    n = n_actions.reindex(r.index).fillna(0)
    return float(gap.sum() / n.sum() * 1e6) if n.sum() else 0.0


def model_units(meta: dict[str, Any]) -> int | None:
    """Pieces the benchmark model of a run is split into (MLP blocks; GPT embedding, layers
    and head), from the run's metadata; None when unknown."""
    from vpipe.models import DEFAULT_SIZES, model_pieces, resolve_sizes

    model = meta.get("model")
    if model not in DEFAULT_SIZES:
        return None
    sizes = resolve_sizes(model, int(meta.get("stages") or 1), meta.get("sizes") or {})
    return model_pieces(model, sizes)


def predict(
    cal: Calibration, schedule: Any, n_units: int | None = None, *, recv_lookahead: int = 1
) -> Any:
    """Simulate ``schedule`` with costs calibrated on another run, lowered with the runtime's
    ``recv_lookahead`` (when compute-only); returns the SimResult."""
    from vpipe.sim import simulate

    return simulate(schedule, cal.cost_model(schedule, n_units), recv_lookahead=recv_lookahead)


_ANCHOR_ROUNDS = 6  # fixed-point steps; each shrinks the miss by about overheads / step


def anchor(
    cal: Calibration,
    schedule: Any,
    timed_s: float | None,
    n_units: int | None = None,
    *,
    recv_lookahead: int = 1,
    comm_thread_cpu_s: float | None = None,
) -> Calibration:
    """``cal`` with the ``compute_scale`` that makes its own ``schedule`` (the config it was
    calibrated on) simulate to ``timed_s`` seconds, its timed median; ``cal`` unchanged when
    there is none (a run converted from traces).

    Why: the few profiled steps a calibration reads are a small sample of a shared host's state
    and run under the profiler, so their level is off by several percent either way, while
    their structure (how F, I, W and B of each stage compare; posting and link costs) is
    measured inside the same steps, which share the host's state. The timed median is taken
    over many interleaved steps. Only compute is scaled, never the overheads or the link.
    ``comm_thread_cpu_s``, the same timed steps' communication-thread CPU, is charged first
    (:func:`with_comm_threads`)."""
    cal = with_comm_threads(cal, schedule, comm_thread_cpu_s, recv_lookahead=recv_lookahead)
    if timed_s is None or not timed_s > 0:
        return cal
    target = timed_s * 1e9 / US
    k = cal.compute_scale
    for _ in range(_ANCHOR_ROUNDS):
        made = predict(replace(cal, compute_scale=k), schedule, n_units,
                       recv_lookahead=recv_lookahead).makespan  # fmt: skip
        if not made > 0 or abs(made / target - 1) < 1e-4:
            break
        k *= target / made
    return replace(cal, compute_scale=k)


def fidelity_table(
    cal: Calibration,
    cases: list[tuple[str, Any, pd.DataFrame | None, float | None]],
    n_units: int | None = None,
    calibration_events: pd.DataFrame | None = None,
    **calibrate_kw: Any,
) -> pd.DataFrame:
    """Measured vs predicted step time and bubble ratio for (label, schedule, measured events,
    timed median seconds or None) cases; ``error`` = predicted / timed median - 1, or, for a
    case with no timed steps, predicted / median of the profiled steps - 1.

    With ``calibration_events``, also ``paired_error``: for every step number present in both
    the calibration run and a case's run, calibrate on that step alone, predict, and compare
    with the case's same step; the median over steps. Runs recorded interleaved (step k of
    every schedule in the same round, as ``vpipe bench --profile-steps`` does) then share the
    machine's state within a pair, which cancels most of the load noise of a shared machine.
    """
    rows = []
    for label, schedule, measured, timed_s in cases:
        sim = predict(cal, schedule, n_units)
        row: dict[str, Any] = {
            "schedule": label,
            "stages": schedule.n_stages,
            "predicted_step_ms": sim.makespan * US / 1e6,
            "predicted_bubble": sim.bubble_ratio,
        }
        if timed_s is not None:
            row["timed_step_ms"] = timed_s * 1e3
        if measured is not None and not measured.empty:
            m = step_metrics(measured)
            row["profiled_step_ms"] = float(m["step_time_s"].median() * 1e3)
            q1, q3 = m["step_time_s"].quantile([0.25, 0.75]) * 1e3
            row["profiled_iqr_ms"] = f"{q1:.2f}-{q3:.2f}"
            row["measured_bubble"] = float(m["bubble_ratio"].median())
        against = row.get("timed_step_ms", row.get("profiled_step_ms"))
        if against:
            row["error"] = row["predicted_step_ms"] / against - 1
        if measured is not None and not measured.empty and calibration_events is not None:
            # profiled steps against profiled steps, pairwise
            row["paired_error"], row["pairs"] = _paired_error(
                calibration_events, schedule, m, n_units, calibrate_kw
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _paired_error(
    cal_events: pd.DataFrame, schedule: Any, measured: pd.DataFrame, n_units: int | None, kw: dict
) -> tuple[float, int]:
    errors = []
    by_step = measured.set_index("step")["step_time_s"]
    for step, ev in cal_events[cal_events["step"] >= 0].groupby("step"):
        if step in by_step.index:
            made = predict(calibrate(ev, **kw), schedule, n_units).makespan * US / 1e9
            errors.append(made / by_step[step] - 1)
    return (float(np.median(errors)) if errors else float("nan")), len(errors)


def timed_median_s(row: Any) -> float | None:
    """A measured run's timed median step time (its runs-table row or metadata), when it has
    timed steps (a sweep's run; a run converted from traces has none)."""
    try:
        steps = int(row.get("measured_steps") or 0)
    except (TypeError, ValueError):  # NA
        steps = 0
    value = row.get("step_time_s")
    return float(value) if steps and value is not None and value == value else None


def judged_against(run: Any) -> float:
    """A measured run's step time to judge predictions against: its timed median, or the
    median of its profiled steps when it has no timed steps (a run converted from traces)."""
    timed = getattr(run, "step_time_s", None)
    if timed is None or pd.isna(timed):
        return float(getattr(run, "profiled_step_time_s", float("nan")))
    return float(timed)


def comm_thread_cpu_s(row: Any) -> float | None:
    """A run's communication threads' CPU seconds per timed step (its runs-table row, a row
    tuple or its metadata), or None where they were not measured."""
    value = run_figure(row, "comm_thread_cpu_s")
    return value if value is not None and value >= 0 else None


def with_comm_threads(
    cal: Calibration, schedule: Any, cpu_s_per_step: float | None, *, recv_lookahead: int = 1
) -> Calibration:
    """``cal`` with the communication threads' cost per posted operation (microseconds), from
    the CPU seconds per step its own run's ``schedule`` spent in them (see the module's doc);
    unchanged without the figure or messages."""
    from vpipe.sim.posts import posted_operations

    if cpu_s_per_step is None:
        return cal
    posts = posted_operations(schedule, recv_lookahead)
    return replace(cal, comm_threads=cpu_s_per_step * 1e6 / posts) if posts else cal

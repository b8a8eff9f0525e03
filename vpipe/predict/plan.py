"""``vpipe plan``: which schedule to run for a memory budget, from a calibrated cost model.

Costs come from a measured run (a store and run id: per-stage F, I, W medians, posting and gap
overheads, message latency, and the bytes saved for backward per rank) or from an explicit
spec. Both are turned into a cost model for any schedule and microbatch size:

- compute scales with the rows of a microbatch (``batch / M``) and with the share of the model
  a stage holds (its pieces: MLP blocks, GPT layers; or 1/P of the model per full stage for an
  explicit spec);
- posting, gap, message latency and handshake are per action and do not scale;
- activation bytes per stage scale like compute: a stage's share times the rows.

Every catalogue family x stages per rank x microbatch count that the family can build is
simulated (:func:`vpipe.sim.simulate`). The candidates whose peak activation memory fits the
budget on every rank and whose predicted step is within the predictions' error (``tie``:
measured on the calibration run's sweep, :mod:`vpipe.predict.plan_error`; else
:data:`PREDICTION_ERROR`) of the fastest are a tie; the tie rule
(:mod:`vpipe.schedules.ties`: less memory, then the simpler schedule) picks the one recommended,
with the receive lookahead to run it with (:func:`best_lookahead`). Budgets are bytes (``12GiB``, ``500MB``) or
activation units (``6units``: the most microbatch activations of a full stage, 1/P of the
model, a rank may hold; a V stage's count half).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from vpipe.errors import ScheduleError
from vpipe.ir import Schedule
from vpipe.predict.budget import Budget, PlanError
from vpipe.predict.plan_ties import PREDICTION_ERROR, candidate_label, tie_note, tied
from vpipe.sim import CostModel, parse_numbers
from vpipe.sim.cost_model import split_unit

__all__ = [
    "PREDICTION_ERROR",
    "Budget",
    "Candidate",
    "PlanError",
    "SpecCosts",
    "best_lookahead",
    "candidates",
    "plan",
    "candidate_label",
    "recommend",
    "tie_note",
    "tied",
]


@dataclass(frozen=True)
class SpecCosts:
    """An explicit cost spec: times in microseconds of one full stage (1/P of the model, one
    stage per rank) for one microbatch of ``rows`` rows: forward ``f``, input gradient ``b``,
    weight gradient ``w``; per message ``comm``, and ``handshake`` more when its receive is
    posted after its send; per SEND/RECV ``post`` and per action ``gap``; ``act_bytes`` saved
    for backward by one such stage and microbatch."""

    f: float
    b: float
    w: float
    comm: float = 0.0
    act_bytes: float = 0.0
    rows: float = 1.0
    post: float = 0.0
    gap: float = 0.0
    handshake: float = 0.0

    @classmethod
    def parse(cls, text: str) -> SpecCosts:
        """``f=1.2,b=1.1,w=0.9,comm=0.05,act_bytes=2e6,rows=64``; f, b and w are required.
        Per rank's share of the model (``unit=rank``, :data:`COST_CONVENTION`): ``unit=stage``
        is refused, since plan chooses the stages per rank itself."""
        text, unit = split_unit(text, "--cost", PlanError)
        if unit == "stage":
            raise PlanError(
                "--cost unit=stage: plan chooses the stages per rank V itself, so its costs are "
                "per rank's share of the model (unit=rank): multiply per-stage f, b, w and "
                "act_bytes of a schedule with V stages per rank by V (f=1 per stage at V=2 is "
                "f=2 per rank)"
            )
        values = parse_numbers(text, cls.__dataclass_fields__, "--cost", PlanError)
        for key, number in values.items():
            if not math.isfinite(number) or number < 0:
                raise PlanError(f"--cost {key}={number:g}: must be a finite number >= 0")
        missing = [k for k in ("f", "b", "w") if k not in values]
        if missing:
            raise PlanError(
                f"--cost needs {', '.join(missing)} (and may give comm, act_bytes, ...)"
            )
        if values.get("rows", 1.0) <= 0:
            raise PlanError("--cost rows must be > 0")
        return cls(**values)

    def cost_model(self, schedule: Schedule, rows: float) -> CostModel:
        """Costs of ``schedule``'s stages for microbatches of ``rows`` rows."""
        share = schedule.n_ranks / schedule.n_stages * rows / self.rows
        return CostModel(
            f=self.f * share, b=self.b * share, w=self.w * share, comm_latency=self.comm,
            comm_handshake=self.handshake, activation_bytes=self.act_bytes * share,
            post=self.post, gap=self.gap,
        )  # fmt: skip


@dataclass(frozen=True)
class CalibratedCosts:
    """Costs calibrated on a measured run (see :func:`from_run`)."""

    calibration: Any  # vpipe.predict.calibrate.Calibration
    pieces: int  # the model's pieces (MLP blocks; GPT embedding, layers, head)
    rows: float  # rows of the calibration run's microbatches
    bytes_per_piece_row: float  # activation bytes one piece saves per row of a microbatch
    meta: dict[str, Any] | None = None  # the run's (its model's shapes: plan_recompute)

    def cost_model(self, schedule: Schedule, rows: float) -> CostModel:
        from vpipe.predict.pieces import split_sizes

        if schedule.n_stages > self.pieces:
            raise ScheduleError(
                f"{schedule.n_stages} stages need at least as many model pieces, and the "
                f"calibration run's model has {self.pieces} (calibrate on a run of a bigger "
                f"model, e.g. --sizes n_blocks={schedule.n_stages})"
            )
        cm = self.calibration.cost_model(schedule, self.pieces)
        k = rows / self.rows
        per_stage = {s: {n: v * k for n, v in c.items()} for s, c in cm.per_stage.items()}
        act = [
            p * rows * self.bytes_per_piece_row for p in split_sizes(self.pieces, schedule.n_stages)
        ]
        return replace(cm, per_stage=per_stage, activation_bytes=act)


# what plan --from needs of a run, and where a run converted from traces gets it
_NEEDED = {
    "schedule": "vpipe trace --schedule NAME labels it",
    "ranks": "vpipe trace reads it from the trace's distributedInfo",
    "microbatches": "vpipe trace reads it from the trace's action spans",
    "batch": "vpipe trace --batch B labels it",
    "model": "plan re-splits vpipe's built-in models only; for another model's trace, "
    "vpipe analyze TRACE --predict compares schedules on its own stages",
}


def from_run(store_root: str, run_id: str) -> CalibratedCosts:
    """Costs from a measured run of a results store (see :func:`calibrated_costs`)."""
    from vpipe.predict.calibrate import timed_median_s
    from vpipe.schedules import make_schedule
    from vpipe.trace.store import Store

    run = Store(store_root).run(run_id)  # one read of that run's files
    meta = run.meta
    for key, hint in _NEEDED.items():
        if key not in meta or meta[key] is None or meta[key] != meta[key]:
            raise PlanError(f"run {run_id!r} records no {key}: cannot plan from it ({hint})")
    memory = run.memory
    saved = memory[memory["what"].astype(str) == "saved_activations"]
    peaks = saved.groupby("rank")["bytes"].max().to_dict() if len(saved) else {}
    schedule = make_schedule(str(meta["schedule"]), int(meta["ranks"]), int(meta["microbatches"]))
    return calibrated_costs(run.events, peaks, schedule, meta, timed_median_s(meta))


def calibrated_costs(
    events: Any,
    peak_bytes: dict[int, float],
    schedule: Schedule,
    meta: dict[str, Any],
    timed_s: float | None = None,
) -> CalibratedCosts:
    """Costs from a measured run: calibrated per-action medians (:mod:`vpipe.predict.calibrate`),
    anchored to the run's timed median step ``timed_s`` when it has one, and the bytes saved
    for backward per model piece and row, from the run's measured peak per rank
    (``peak_bytes``) against the simulated peak of the same schedule. ``meta`` names the
    model, its sizes, stages and batch (the global batch of ``meta["dp"]`` replicas, if any)."""
    from vpipe.predict.calibrate import anchor, calibrate, comm_thread_cpu_s, model_units
    from vpipe.predict.pieces import split_sizes
    from vpipe.predict.recompute_share import forward_alone_us
    from vpipe.predict.split_cost import split_backward_ratio
    from vpipe.sim import simulate

    pieces = model_units({**meta, "stages": schedule.n_stages})
    if pieces is None:
        raise PlanError(
            f"model {meta.get('model')!r}: its pieces are unknown (built-in models only)"
        )
    rows = int(meta["batch"]) / _replicas(meta) / schedule.n_microbatches
    units = split_sizes(pieces, schedule.n_stages)
    sim = simulate(schedule, CostModel(activation_bytes=[u * rows for u in units]))
    ratios = [peak_bytes.get(r, 0) / p for r, p in enumerate(sim.peak_activation_bytes) if p]
    cal = calibrate(events, split_ratio=split_backward_ratio(meta),
                    forward_alone=forward_alone_us(meta))  # fmt: skip
    cal = anchor(cal, schedule, timed_s, pieces, comm_thread_cpu_s=comm_thread_cpu_s(meta))
    return CalibratedCosts(cal, pieces, rows, float(max(ratios, default=0.0)), meta)


def _replicas(meta: dict[str, Any]) -> int:
    """Data-parallel replicas of a run (``vpipe bench --dp``; 1 when not recorded)."""
    try:
        return max(1, int(meta.get("dp") or 1))
    except (TypeError, ValueError):  # NA: a store mixing runs with and without --dp
        return 1


@dataclass
class Candidate:
    """One schedule family x stages per rank x microbatch count, simulated."""

    schedule: str
    stages_per_rank: int
    microbatches: int
    predicted_step_s: float
    samples_per_s: float
    bubble_ratio: float
    peak_activation_bytes: list[float]
    peak_activation_units: list[float]  # microbatch activations of a full stage (1/P of model)
    fits: bool = True
    # data parallel (--dp N): reduction time the step grew by, and what ran under compute
    dp_exposed_s: float = 0.0
    dp_hidden_s: float = 0.0
    placement: str | None = None  # auto's rows: the placement it was scheduled on
    recompute: str = "none"  # activation recomputation (vpipe.predict.plan_recompute)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def microbatch_choices(batch: int, ranks: int, limit: int | None = None) -> list[int]:
    """Microbatch counts worth trying: divisors of the batch up to ``limit`` (default 8P)."""
    top = limit or max(8 * ranks, 8)
    return [m for m in range(1, min(batch, top) + 1) if batch % m == 0]


def candidates(
    costs: Any,
    ranks: int,
    batch: int,
    *,
    microbatches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    time_unit_s: float = 1e-6,
    dp: Any = None,
    budget: Budget | None = None,
    objective: str = "makespan",
    left_out: dict[str, str] | None = None,
) -> list[Candidate]:
    """Every family (or those named) x stages per rank x microbatch count it can build, with
    the simulator's prediction by ``objective`` (makespan or longest rank span).
    ``costs.cost_model(schedule, rows)`` gives each one's costs, in units of ``time_unit_s``
    seconds. With a ``budget``, ``auto`` is scheduled for these costs, this budget and this
    objective on each placement (:mod:`vpipe.predict.plan_auto`) rather than taken from the
    catalogue. With ``dp`` (:class:`vpipe.predict.dp_costs.DPCosts`) ``batch`` is the global
    batch of ``dp.replicas`` pipelines, and each step ends when its gradient reductions do.
    A program already listed (interleaved-1f1b with one stage per rank is 1f1b's) is not
    listed again; ``left_out`` receives, per family with no candidate, why (its first
    refusal), or the family whose programs it repeats."""
    from vpipe.predict.plan_auto import PLACEMENTS

    replicas = dp.replicas if dp is not None else 1
    if batch % replicas:
        raise PlanError(f"batch {batch} does not split into {replicas} replicas")
    batch_per_replica = batch // replicas
    from vpipe.schedules import catalogue
    from vpipe.sim import simulate

    families = catalogue.families() if schedules is None else [catalogue.get(s) for s in schedules]
    out = []
    seen: dict[tuple, str] = {}  # program -> the family listed with it
    for fam in families:
        adaptive = fam.name == "auto" and budget is not None
        spr = sorted({fam.stages_per_rank, 1, 2, 4})
        shapes = PLACEMENTS if adaptive else [(None, v) for v in spr]
        refusals: dict[int, str] = {}  # stages per rank -> the first refusal
        repeats: set[str] = set()  # families whose programs this one repeats
        for placement, v in shapes:
            for m in microbatches or microbatch_choices(batch_per_replica, ranks):
                if batch_per_replica % m:
                    raise PlanError(
                        f"batch {batch_per_replica} per replica does not split into {m} microbatches"
                    )
                rows = batch_per_replica / m
                try:
                    schedule = _build(costs, fam, ranks, m, rows, v, placement, budget, objective)
                    cm = costs.cost_model(schedule, rows)
                except ScheduleError as e:
                    refusals.setdefault(v, str(e))  # the family cannot build this combination
                    continue
                program = _program(schedule)
                if program in seen:
                    repeats.add(seen[program])
                    continue
                seen[program] = fam.name
                r = simulate(schedule, cm)
                reduced = dp.step(schedule, r.columns, r.makespan) if dp is not None else None
                step_s = (reduced.step_end if reduced else r.objective(objective)) * time_unit_s
                out.append(
                    Candidate(
                        fam.name,
                        v,
                        m,
                        step_s,
                        batch / step_s if step_s > 0 else math.inf,
                        r.bubble_ratio,
                        [float(x) for x in r.peak_activation_bytes or [0.0]],
                        r.peak_activation_units,
                        dp_exposed_s=reduced.exposed * time_unit_s if reduced else 0.0,
                        dp_hidden_s=reduced.hidden * time_unit_s if reduced else 0.0,
                        placement=placement,
                    )  # fmt: skip
                )
        if left_out is not None and not any(c.schedule == fam.name for c in out):
            if repeats:  # it built programs, each already listed under another family
                names = " and ".join(sorted(repeats))
                left_out[fam.name] = f"every program it builds here is also {names}'s, listed under that name"
            else:
                left_out[fam.name] = refusals.get(fam.stages_per_rank, next(iter(refusals.values()), ""))
    return out


def _build(
    costs: Any, family: Any, ranks: int, m: int, rows: float, v: int, placement: str | None,
    budget: Budget | None, objective: str,
) -> Schedule:  # fmt: skip
    """One candidate's schedule: auto on ``placement`` for the plan's costs, budget and
    objective; another cost-adapted family for the plan's costs; any other as generated."""
    from vpipe.predict.plan_auto import adapted_for_plan, auto_for_plan

    if placement is not None:
        return auto_for_plan(costs, ranks, m, rows, placement, v, budget, objective)
    if family.cost_adapted:
        return adapted_for_plan(costs, family, ranks, m, rows, v)
    return family.generator(ranks, m, v)


def _program(schedule: Schedule) -> tuple:
    """What a schedule runs, whatever its family's name: placement and each rank's actions."""
    placement = tuple(sorted(schedule.placement.items()))
    return placement, tuple(tuple(map(str, acts)) for acts in schedule.actions)


def plural(n: int, word: str) -> str:
    """``1 stage``, ``2 stages``, ``2 microbatches``."""
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith(('ch', 's', 'x')) else 's'}"


def recommend(
    found: list[Candidate],
    budget: Budget,
    tie: float = PREDICTION_ERROR,
    measured_m: Sequence[int] | None = None,
) -> Candidate:
    """Mark which candidates fit and return the one to run: of the fitting candidates
    predicted within ``tie`` of the fastest (:func:`tied`; at the ``measured_m`` microbatch
    counts first), the one the tie rule picks (:func:`vpipe.schedules.ties.break_tie`: less
    memory, then the simpler schedule). A budget nothing fits is a PlanError naming the
    smallest peak available."""
    from vpipe.schedules.ties import Tied, break_tie

    if not found:
        raise PlanError("no schedule family can run this many ranks and microbatches")
    for c in found:
        c.fits = budget.peak(c) <= budget.value
    if not any(c.fits for c in found):
        low = min(found, key=budget.peak)
        raise PlanError(
            f"nothing fits --memory {budget.describe(budget.value)} per rank: the smallest peak "
            f"is {budget.describe(budget.peak(low))} ({low.schedule}, "
            f"{plural(low.stages_per_rank, 'stage')} per rank, M={low.microbatches})"
        )
    tie_set = tied(found, tie, measured_m)
    pick = break_tie([Tied(c.schedule, budget.peak(c), c.stages_per_rank, c.microbatches)
                      for c in tie_set])  # fmt: skip
    return tie_set[pick]


# Lookaheads the planner tries, and how much faster (relative) a larger one must be simulated
# to be worth its receive buffers: a smaller gain is inside the simulator's error.
LOOKAHEADS = (0, 1, 2, 3)
LOOKAHEAD_GAIN = 0.01


def best_lookahead(
    schedule: Schedule, costs: CostModel, dp: Any = None
) -> tuple[int, dict[int, float]]:
    """The receive lookahead (:func:`vpipe.ir.lowering.lower`) to run ``schedule`` with, and the
    simulated step per lookahead tried: the smallest within ``LOOKAHEAD_GAIN`` of the fastest
    (a larger one holds more receive buffers). Posting receives earlier matters when the
    link charges a handshake for receives posted after their send (gloo). With ``dp``
    (:class:`vpipe.predict.dp_costs.DPCosts`) each step ends with its gradient reductions, so
    a lookahead that only moves work under an exposed reduction gains nothing."""
    from vpipe.sim import simulate

    def step(k: int) -> float:
        r = simulate(schedule, costs, recv_lookahead=k)
        return dp.step(schedule, r.columns, r.makespan).step_end if dp else r.makespan

    steps = {k: step(k) for k in LOOKAHEADS}
    fastest = min(steps.values())
    return min(k for k, s in steps.items() if s <= fastest * (1 + LOOKAHEAD_GAIN)), steps


def plan(
    costs: Any,
    ranks: int,
    batch: int,
    budget: Budget,
    *,
    time_unit_s: float = 1e-6,
    objective: str = "makespan",
    tie: float = PREDICTION_ERROR,
    recompute: Sequence[str] = ("none",),
    measured_m: Sequence[int] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """``{"recommended": ..., "candidates": [...], "tied": [...], "tie": ..., "tie_rule": ...,
    "recv_lookahead": ..., "objective": ..., "left_out": {...}}`` (fitting candidates first,
    fastest by ``objective`` first; the candidates within ``tie`` of the fastest that the
    recommended one was chosen from by the tie rule; the lookahead for the recommended one;
    why each family without a candidate has none), as ``vpipe plan --json`` prints it. Each
    ``recompute`` mode's candidates are weighed together (:mod:`vpipe.predict.plan_recompute`).
    With ``measured_m`` (the microbatch counts a sweep measured) the recommendation is chosen
    among candidates at those counts when any fits; the others are extrapolated."""
    from vpipe.predict.plan_recompute import with_recompute
    from vpipe.schedules import catalogue
    from vpipe.schedules.ties import TIE_RULE

    if not 0 <= tie < 1:
        raise PlanError(f"--tie must be a fraction in [0, 1), got {tie:g}")
    left_out: dict[str, str] = {}
    found = []
    for mode in recompute:
        for c in candidates(
            with_recompute(costs, mode), ranks, batch, time_unit_s=time_unit_s, budget=budget,
            objective=objective, left_out=left_out, **kw,
        ):  # fmt: skip
            c.recompute = mode
            found.append(c)
    best = recommend(found, budget, tie, measured_m)
    costs = with_recompute(costs, best.recompute)
    ranked = sorted(found, key=lambda c: (not c.fits, c.predicted_step_s, budget.peak(c)))
    rows = batch / (kw["dp"].replicas if kw.get("dp") else 1) / best.microbatches
    schedule = _build(
        costs, catalogue.get(best.schedule), ranks, best.microbatches, rows,
        best.stages_per_rank, best.placement, budget, objective,
    )  # fmt: skip
    k, steps = best_lookahead(schedule, costs.cost_model(schedule, rows), kw.get("dp"))
    lookahead = {
        "best": k,
        "predicted_step_s": {str(n): s * time_unit_s for n, s in steps.items()},
    }
    return {
        "recommended": best.to_dict(),
        "candidates": [c.to_dict() for c in ranked],
        "tied": [c.to_dict() for c in tied(found, tie, measured_m)],
        "tie": tie,
        "tie_rule": TIE_RULE,
        "recv_lookahead": lookahead,
        "objective": objective,
        "left_out": left_out,
        "measured_m": None if measured_m is None else [int(m) for m in measured_m],
    }


def pareto_frame(found: list[dict[str, Any]]) -> Any:
    """The candidates on the Pareto front (no other is both faster and smaller), as the table
    :func:`vpipe.report.plots.plot_pareto` draws: one panel, points labelled ``family vV MM``;
    memory in bytes (``peak_memory_bytes``), or in units (``peak_memory_units``: microbatch
    activations of a full stage) when the costs give no activation bytes."""
    import pandas as pd

    from vpipe.metrics.per_run import pareto_front

    table = pd.DataFrame(
        {
            "schedule": [candidate_label(c) for c in found],
            "impl": ["fits" if c["fits"] else "over budget" for c in found],
            "microbatches": ["all"] * len(found),
            "samples_per_s": [c["samples_per_s"] for c in found],
            "peak_memory_bytes": [float(np.max(c["peak_activation_bytes"])) for c in found],
        }
    )
    if not table["peak_memory_bytes"].any():  # costs without act_bytes: memory in units only
        units = [float(np.max(c["peak_activation_units"])) for c in found]
        table = table.drop(columns="peak_memory_bytes").assign(peak_memory_units=units)
        return pareto_front(table, "peak_memory_units", "samples_per_s")
    return pareto_front(table, "peak_memory_bytes", "samples_per_s")

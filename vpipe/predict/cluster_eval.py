"""One cluster candidate (a layout x a schedule family x a microbatch count) costed: its memory
per GPU by part, a bound on its speed before any schedule is simulated, and, when it fits,
its simulated iteration with MFU, HFU and the share of the step each cost takes. Many
microbatches are simulated at two smaller counts and extended linearly (:data:`EXTEND`).

Used by :mod:`vpipe.predict.cluster`, which searches the candidates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

import numpy as np

from vpipe.errors import ScheduleError
from vpipe.ir import Kind
from vpipe.predict.plan import plural
from vpipe.sim.activation_memory import activation_peaks
from vpipe.sim.model_costs import ModelCosts

__all__ = ["ClusterCandidate", "busy_bound", "evaluate"]

# A schedule of M > PROBE x stages microbatches is first built with that many: more microbatches
# never lower a family's peak (tests/test_cluster_plan.py checks it), so a probe over the
# budget rules the whole out without building it.
PROBE = 2
# A schedule of M > EXTEND x stages microbatches is simulated at PROBE x and EXTEND x stages and
# its iteration time, bubble and peak extended linearly to M: past the warm-up every catalogue
# family repeats the same pattern per microbatch (tests/test_cluster_plan.py checks it).
EXTEND = 3
SHARES = ("compute", "elementwise", "recompute", "tp", "cp", "fsdp", "bubble", "dp", "optimizer")


@dataclass
class ClusterCandidate:
    """One layout x schedule, predicted. Memory is the fullest GPU's, by part (``total``,
    ``weights``, ``gradients``, ``optimizer``, ``activations``, ``buffers``); ``step_shares``
    the share of the iteration each cost takes on the busiest rank (:data:`SHARES`)."""

    schedule: str
    tp: int
    pp: int
    cp: int
    dp: int
    shard: str
    recompute: str
    stages_per_rank: int
    microbatch_size: int
    microbatches: int
    memory_bytes: dict[str, float]
    tokens_per_s_per_gpu: float = 0.0
    mfu: float = 0.0
    hfu: float = 0.0
    iteration_s: float = math.inf
    pipeline_s: float = math.inf
    bubble: float = 1.0
    step_shares: dict[str, float] = field(default_factory=dict)
    fits: bool = True
    tied: bool = False  # within the tie band of the fastest

    @property
    def total_bytes(self) -> float:
        return self.memory_bytes["total"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        return (f"{self.schedule} (tp={self.tp}, pp={self.pp}, cp={self.cp}, dp={self.dp}, "
                f"shard {self.shard}, recompute {self.recompute}, "
                f"{plural(self.stages_per_rank, 'stage')} per rank, microbatch "
                f"{self.microbatch_size} x {self.microbatches})")  # fmt: skip


@lru_cache(maxsize=128)
def _built(name: str, pp: int, m: int, v: int) -> tuple[Any, Any]:
    """A catalogue family's schedule and what simulating it needs that no cost changes
    (:func:`vpipe.sim.simulator.prepare`: its flat form, communication plan and program): the
    same for every layout with this pipeline shape, so built once per search."""
    from vpipe.schedules import catalogue
    from vpipe.sim.simulator import prepare

    schedule = catalogue.get(name).generator(pp, m, v)
    return schedule, prepare(schedule)


@lru_cache(maxsize=128)
def _rows(name: str, pp: int, m: int, v: int) -> list:
    """The gradient points of :func:`_built`'s schedule, read once."""
    from vpipe.sim.collectives import gradient_rows

    schedule, prepared = _built(name, pp, m, v)
    return gradient_rows(schedule, prepared.fl)


def _memory(costs: ModelCosts, peaks: list[float]) -> dict[str, float]:
    """The fullest GPU's memory by part, with activations at ``peaks`` per rank."""
    parts = costs.extra["memory"]
    r = max(range(len(parts)), key=lambda k: sum(parts[k].values()) + peaks[k])
    out = {**parts[r], "activations": peaks[r]}
    return {"total": sum(out.values()), **out}


def busy_bound(costs: ModelCosts, m: int, post_validated: bool = False) -> float:
    """Seconds no schedule of ``m`` microbatches can beat: each rank's F and backward (a
    fused B, never dearer than I + W) of every microbatch and its optimizer step, no bubble;
    with a synchronous optimizer (ranks start together) also the first microbatch's forwards
    on the stages before the rank's first."""
    lay = costs.layout
    busy, first = [0.0] * lay.pp, [len(costs.f)] * lay.pp
    for s, backward in enumerate(costs.b):
        r = lay.rank_of(s)
        busy[r] += m * (costs.f[s] + backward)
        first[r] = min(first[r], s)
    fill = [0.0 if post_validated else sum(costs.f[: first[r]]) for r in range(lay.pp)]
    return max(b + f + step for b, f, step in zip(busy, fill, costs.optimizer_step_s,
                                                  strict=True))  # fmt: skip


def evaluate(costs: ModelCosts, fam: Any, m: int, batch: int, budget: float,
             post_validated: bool, schedule_fn: Any = None,
             i_frees: float | None = None) -> ClusterCandidate | None:  # fmt: skip
    """The candidate of family ``fam`` with ``m`` microbatches on ``costs``' layout: over the
    budget (``fits`` False, memory a lower bound when the schedule was not built whole), or
    simulated. None when the family cannot build this shape. ``schedule_fn(fam, layout, m,
    costs)`` builds ``auto`` (scheduled for the costs); ``i_frees`` replaces the share of a
    stage's activations its I frees."""
    lay, arch = costs.layout, costs.arch
    alloc, freed = costs.alloc_bytes, costs.freed_by_i
    if i_frees is not None:
        freed = [a * i_frees for a in alloc]
    base = dict(schedule=fam.name, tp=lay.tp, pp=lay.pp, cp=lay.cp, dp=lay.dp, shard=lay.shard,
                recompute=lay.recompute, stages_per_rank=lay.stages_per_rank,
                microbatch_size=arch.microbatch, microbatches=m)  # fmt: skip
    floor = _memory(costs, [max(alloc)] * lay.pp)
    if floor["total"] > budget:  # not one microbatch fits beside the weights
        return ClusterCandidate(**base, memory_bytes=floor, fits=False)
    probe = PROBE * lay.n_stages
    extend = fam.name != "auto" and m > EXTEND * lay.n_stages
    try:
        if fam.name != "auto" and m > probe:  # its first microbatches' peak bounds the whole's
            sched, prep = _built(fam.name, lay.pp, probe, lay.stages_per_rank)
            first = _memory(costs, activation_peaks(sched, alloc, freed, prep.fl))
            if first["total"] > budget:
                return ClusterCandidate(**base, memory_bytes=first, fits=False)
        if fam.name == "auto":
            built = [(schedule_fn(fam, lay, m, costs), None)]
        else:
            counts = (probe, EXTEND * lay.n_stages) if extend else (m,)
            built = [_built(fam.name, lay.pp, k, lay.stages_per_rank) for k in counts]
    except ScheduleError:
        return None
    runs = [activation_peaks(sched, alloc, freed, prep and prep.fl) for sched, prep in built]
    if extend:  # a family's step and peak grow linearly with M past its warm-up
        grow = _linear(probe, EXTEND * lay.n_stages, m)
        need = _memory(costs, [grow(a, b) for a, b in zip(*runs, strict=True)])
    else:
        need = _memory(costs, runs[0])
    if need["total"] > budget:
        return ClusterCandidate(**base, memory_bytes=need, fits=False)
    keys = [None] if fam.name == "auto" else [(fam.name, lay.pp, k, lay.stages_per_rank)
                                              for k in counts]  # fmt: skip
    timed = [_timed(costs, sched, post_validated, key and _rows(*key), prep)
             for (sched, prep), key in zip(built, keys, strict=True)]  # fmt: skip
    if extend:
        (it1, sim1), (it2, sim2) = timed
        it = SimpleNamespace(**{k: grow(getattr(it1, k), getattr(it2, k))
                                for k in ("time", "pipeline", "exposed_reduction")})  # fmt: skip
        busy = grow(sum(sim1.busy), sum(sim2.busy))
        bubble = 1 - busy / (lay.pp * grow(sim1.makespan, sim2.makespan))
    else:
        it, sim = timed[0]
        bubble = sim.bubble_ratio
    seconds = it.time / 1e6
    fused = np.zeros(lay.n_stages)  # read from the schedule only where it changes a share
    if any(costs.hidden_in_b):
        fused = _fused_shares(built[-1][0], lay.n_stages)
    model = batch * arch.model_flops() / arch.microbatch  # F, I and W of every sequence
    recomputed = _recomputed_flops(costs) * batch / arch.microbatch
    peak = costs.machine.peak(arch.precision) * lay.gpus * seconds
    return ClusterCandidate(
        **base, memory_bytes=need, tokens_per_s_per_gpu=batch * arch.seq_len / seconds / lay.gpus,
        mfu=model / peak, hfu=(model + recomputed) / peak, iteration_s=seconds,
        pipeline_s=it.pipeline / 1e6, bubble=bubble,
        step_shares=_shares(costs, m, it, seconds, fused),
    )  # fmt: skip


def _linear(m1: int, m2: int, m: int) -> Any:
    """The value at ``m`` of a figure that is ``a`` at ``m1`` and ``b`` at ``m2``, linearly."""
    return lambda a, b: a + (m - m1) * (b - a) / (m2 - m1)


def _timed(costs: ModelCosts, schedule: Any, post_validated: bool, rows: list | None = None,
           prepared: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """The simulated step of ``schedule`` with its data-parallel reductions (``rows``: its
    gradient points, ``prepared``: its :func:`vpipe.sim.simulator.prepare`, when kept), and
    its iteration."""
    from vpipe.sim import simulate
    from vpipe.sim.collectives import simulate_reductions
    from vpipe.sim.iteration import iteration

    lay = costs.layout
    sim = simulate(schedule, costs.cost_model(), prepared=prepared)
    reductions = None
    if lay.dp > 1:
        collective, buckets = costs.dp_reduction()
        reductions = simulate_reductions(schedule, sim.compute_columns, sim.makespan, collective,
                                         buckets, rows, lay.overlap_grad_reduce)  # fmt: skip
    it = iteration(sim.compute_columns, lay.pp, costs.iteration_costs(post_validated), reductions)
    return it, sim


def _recomputed_flops(costs: ModelCosts) -> float:
    """FLOPs one microbatch's recomputation adds over the whole model (every GPU of a group)."""
    blk = costs.extra["block"]
    return blk.recompute_flops * costs.arch.layers * costs.layout.group


def _fused_shares(schedule: Any, n_stages: int) -> np.ndarray:
    """Per stage, the share of its backwards that ``schedule`` runs fused (B, not I then W)."""
    counts = np.zeros((n_stages, 2))
    for program in schedule.actions:
        for action in program:
            for part in action.compute_parts():
                if part.kind in (Kind.B, Kind.I):
                    counts[part.stage, int(part.kind is Kind.I)] += 1
    return counts[:, 0] / np.maximum(counts.sum(axis=1), 1)


def _shares(costs: ModelCosts, m: int, it: Any, seconds: float,
            fused: np.ndarray) -> dict[str, float]:  # fmt: skip
    """The share of the iteration each cost takes on the busiest rank: its passes' parts
    (TP's less what its fused backwards, ``fused`` per stage, hide under W),
    the pipeline's idle time (bubble), what the data-parallel reductions added, ZeRO-3's
    first gather and the rest of the iteration's end (optimizer step, synchronisation,
    tied-embedding all-reduce)."""
    lay, parts = costs.layout, costs.extra["parts"]
    per_rank: list[dict[str, float]] = [dict.fromkeys(SHARES, 0.0) for _ in range(lay.pp)]
    for kind in "FIW":
        for s, p in enumerate(parts[kind]):
            for key, t in p.items():
                per_rank[lay.rank_of(s)][key] += m * t
    for s, hidden in enumerate(costs.hidden_in_b):
        per_rank[lay.rank_of(s)]["tp"] -= m * fused[s] * hidden
    r = max(range(lay.pp), key=lambda k: sum(per_rank[k].values()))
    out = per_rank[r]
    pipeline = it.pipeline / 1e6
    out["bubble"] = max(0.0, pipeline - sum(out.values()))
    out["dp"] = it.exposed_reduction / 1e6
    out["fsdp"] = costs.extra["fsdp_s"][r]
    out["optimizer"] = max(0.0, seconds - pipeline - out["dp"] - out["fsdp"])
    return {k: v / seconds for k, v in out.items()}

"""``vpipe plan --arch --machine --gpus``: the layout and schedule to rent, predicted from the
model and the machine alone (:mod:`vpipe.sim.model_costs`), with no run.

Every pipeline size ``pp`` dividing the GPUs (``dp = gpus / pp`` replicas), microbatch size,
schedule family and stages per rank is costed: weights, gradients and optimizer state per GPU
first (a layout they overflow is dropped before any schedule is built), then each schedule's
peak activation bytes per rank (F allocates, I frees its share, W the rest), then, for what
fits the GPU, the simulated pipeline step, its data-parallel reductions and the iteration's
end (optimizer step and its synchronisation, :mod:`vpipe.sim.iteration`). Candidates are
ranked by predicted tokens per second per GPU (:func:`rank_candidates`); a plan nothing fits
is one line naming the smallest need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vpipe.errors import ScheduleError
from vpipe.predict.plan import PlanError, plural
from vpipe.sim.arch import Arch
from vpipe.sim.machine import GIB, Machine
from vpipe.sim.model_costs import Layout, ModelCostError, Rates, activation_peaks, model_costs

__all__ = [
    "PREDICTION_ERROR",
    "USABLE_MEMORY",
    "ClusterCandidate",
    "cluster_candidates",
    "plan_cluster",
    "rank_candidates",
]

# Share of a GPU's memory a plan fills when no budget is given; the rest is left to the CUDA
# context, the allocator's fragmentation and kernels' workspaces (assumed).
USABLE_MEMORY = 0.9
MICROBATCH_SIZES = (1, 2, 4, 8)
# Relative error of a predicted speedup against a measured one: the median error of
# bench.published on the zero-bubble paper's tables (2.4%, docs/plan.md), rounded up.
# Candidates closer than this to the fastest are ties.
PREDICTION_ERROR = 0.03
# actions the cost-adaptive scheduler may schedule per candidate, and the layouts it is tried on
AUTO_SEARCH = 6_000
AUTO_LAYOUTS = 3
# A schedule of M > PROBE x stages microbatches is first built with that many: more microbatches
# never lower a family's peak (tests/test_cluster_plan.py checks it), so a probe over the
# budget rules the whole out without building it.
PROBE = 2


@dataclass
class ClusterCandidate:
    """One layout x schedule, predicted. Memory is the fullest GPU's, split into its parts."""

    schedule: str
    pp: int
    dp: int
    stages_per_rank: int
    microbatch_size: int
    microbatches: int
    tokens_per_s_per_gpu: float
    iteration_s: float
    pipeline_s: float
    bubble: float
    memory_bytes: float
    static_bytes: float  # weights, gradients, optimizer state
    activation_bytes: float
    fits: bool = True
    tied: bool = False  # within PREDICTION_ERROR of the fastest

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        return (f"{self.schedule} (pp={self.pp}, dp={self.dp}, {plural(self.stages_per_rank, 'stage')} "
                f"per rank, microbatch {self.microbatch_size} x {self.microbatches})")  # fmt: skip


@dataclass(frozen=True)
class ClusterSpec:
    """What a cluster plan is asked: the model, the machine, ``gpus`` and a global ``batch`` of
    sequences, and how to run (see :func:`plan_cluster`)."""

    arch: Arch
    machine: Machine
    gpus: int
    batch: int
    budget: float  # bytes per GPU
    rates: Rates | None = None
    schedules: Sequence[str] | None = None
    microbatch_sizes: Sequence[int] = MICROBATCH_SIZES
    shard: str = "optimizer"
    post_validated: bool = False
    pp_inner: bool = True
    i_frees: float | None = None  # replaces the model's own share when given


def cluster_candidates(spec: ClusterSpec) -> tuple[list[ClusterCandidate], ClusterCandidate | None]:
    """Every candidate that fits ``spec.budget`` on every GPU, and the one needing the least
    memory among those that do not (None when all fit); a candidate dropped before its
    schedule was built (or built whole) records a lower bound of its need."""
    from vpipe.schedules import catalogue

    arch = spec.arch
    families = catalogue.families() if spec.schedules is None else [
        catalogue.get(s) for s in spec.schedules
    ]
    found: list[ClusterCandidate] = []
    least: ClusterCandidate | None = None

    def keep(cands: list[ClusterCandidate]) -> None:
        nonlocal least
        for cand in cands:
            if cand.fits:
                found.append(cand)
            elif least is None or cand.memory_bytes < least.memory_bytes:
                least = cand

    layouts = []
    for pp in (d for d in range(1, spec.gpus + 1) if spec.gpus % d == 0 and d <= arch.layers):
        dp = spec.gpus // pp
        for mb in spec.microbatch_sizes:
            if spec.batch % dp == 0 and (spec.batch // dp) % mb == 0:
                layouts.append((pp, dp, mb, spec.batch // dp // mb))
    fixed = [f for f in families if f.name != "auto"]
    for pp, dp, mb, m in layouts:
        for fam in fixed:
            keep(_family(spec, arch.with_microbatch(mb), fam, pp, dp, m))
    if len(fixed) < len(families):  # auto, on the most promising layouts only (it is slow)
        auto = catalogue.get("auto")
        for pp, dp, mb, m in _promising(spec, layouts, found):
            keep(_family(spec, arch.with_microbatch(mb), auto, pp, dp, m))
    return found, least


def _promising(spec: ClusterSpec, layouts: list, found: list[ClusterCandidate]) -> list:
    """The :data:`AUTO_LAYOUTS` layouts auto is tried on: those where a fixed family was
    fastest first, then those with the most microbatches (the least bubble to start from)."""
    best: dict[tuple, float] = {}
    for c in found:
        key = (c.pp, c.microbatch_size)
        best[key] = max(best.get(key, 0.0), c.tokens_per_s_per_gpu)
    order = sorted(layouts, key=lambda x: (-best.get((x[0], x[2]), 0.0), -x[3], x[0]))
    return order[:AUTO_LAYOUTS]


def _family(spec: ClusterSpec, arch: Arch, fam: Any, pp: int, dp: int, m: int) -> list:
    """The candidates of one family at one layout: its stages per rank (and, for auto, its
    placements) that build."""
    out = []
    if fam.name == "auto":
        shapes = [("loop", 1), ("v", 2)]
    elif fam.placement == "v":
        shapes = [("v", 2)]
    else:  # a family with stages per rank to choose also tries 4
        spr = fam.stages_per_rank
        shapes = [("loop", v) for v in sorted({spr} | ({4} if spr > 1 else set()))]
    for placement, v in shapes:
        if pp * v > arch.layers:
            continue
        layout = Layout(pp, dp, v, placement, spec.pp_inner, spec.shard)
        try:
            costs = model_costs(arch, spec.machine, layout, spec.rates)
        except ModelCostError:
            continue
        cand = _evaluate(spec, costs, fam, m)
        if cand is not None:
            out.append(cand)
    return out


def _evaluate(spec: ClusterSpec, costs: Any, fam: Any, m: int) -> ClusterCandidate | None:
    from vpipe.sim import simulate
    from vpipe.sim.collectives import simulate_reductions
    from vpipe.sim.iteration import iteration

    lay = costs.layout
    alloc = costs.alloc_bytes
    freed = costs.freed_by_i if spec.i_frees is None else [a * spec.i_frees for a in alloc]
    static = [s + t for s, t in zip(costs.static_bytes, costs.transient_bytes, strict=True)]
    base = dict(schedule=fam.name, pp=lay.pp, dp=lay.dp, stages_per_rank=lay.stages_per_rank,
                microbatch_size=costs.arch.microbatch, microbatches=m,
                tokens_per_s_per_gpu=0.0, iteration_s=math.inf, pipeline_s=math.inf,
                bubble=1.0)  # fmt: skip
    if max(static) + max(alloc) > spec.budget:  # not one microbatch fits beside the weights
        r = max(range(lay.pp), key=lambda k: static[k])
        return ClusterCandidate(**base, memory_bytes=static[r] + max(alloc),
                                static_bytes=costs.static_bytes[r], activation_bytes=max(alloc),
                                fits=False)  # fmt: skip
    cm = costs.cost_model()

    def memory(schedule: Any) -> dict[str, float]:
        peaks = activation_peaks(schedule, alloc, freed)
        r = max(range(lay.pp), key=lambda k: static[k] + peaks[k])
        return dict(memory_bytes=static[r] + peaks[r], static_bytes=costs.static_bytes[r],
                    activation_bytes=peaks[r])  # fmt: skip

    probe = PROBE * lay.n_stages
    try:
        if fam.name != "auto" and m > probe:  # its first microbatches' peak bounds the whole's
            first = memory(fam.generator(lay.pp, probe, lay.stages_per_rank))
            if first["memory_bytes"] > spec.budget:
                return ClusterCandidate(**base, **first, fits=False)
        schedule = _schedule(spec, fam, lay, m, cm, alloc, freed, static)
    except ScheduleError:
        return None
    need = memory(schedule)
    if need["memory_bytes"] > spec.budget:
        return ClusterCandidate(**base, **need, fits=False)
    sim = simulate(schedule, cm)
    reductions = None
    if lay.dp > 1:
        collective, buckets = costs.dp_reduction()
        reductions = simulate_reductions(schedule, sim.columns, sim.makespan, collective, buckets)
    it = iteration(sim.columns, lay.pp, costs.iteration_costs(spec.post_validated), reductions)
    seconds = it.time / 1e6
    tokens = spec.batch * costs.arch.seq_len
    base.update(tokens_per_s_per_gpu=tokens / seconds / spec.gpus, iteration_s=seconds,
                pipeline_s=it.pipeline / 1e6, bubble=sim.bubble_ratio)  # fmt: skip
    return ClusterCandidate(**base, **need)


def _schedule(spec: ClusterSpec, fam: Any, lay: Layout, m: int, cm: Any, alloc, freed, static):
    """The family's schedule; ``auto`` scheduled for these costs within the activation bytes
    the fullest GPU has left."""
    if fam.name != "auto":
        return fam.generator(lay.pp, m, lay.stages_per_rank)
    from vpipe.schedules.adaptive import MemoryModel
    from vpipe.schedules.auto import auto_schedule

    limit = spec.budget - max(static)
    objective = "span" if spec.post_validated else "makespan"
    return auto_schedule(
        lay.pp, m, cm, limit, lay.placement, objective=objective,
        memory=MemoryModel.from_bytes(alloc, freed), search_budget=AUTO_SEARCH,
        fixed_families=False,
    )  # fmt: skip


def rank_candidates(
    found: list[ClusterCandidate], error: float = PREDICTION_ERROR
) -> tuple[list[ClusterCandidate], ClusterCandidate]:
    """The ranking, in one place: the candidates by predicted tokens/s per GPU, fastest first,
    those within ``error`` (relative) of the fastest marked ``tied`` (no prediction tells them
    apart); and the recommendation: of the tied, the one the tie rule picks
    (:func:`vpipe.schedules.ties.break_tie`: least memory, then the simpler schedule), as
    ``vpipe plan`` and the reports pick."""
    from vpipe.schedules.ties import Tied, break_tie

    best = max(c.tokens_per_s_per_gpu for c in found)
    for c in found:
        c.tied = c.tokens_per_s_per_gpu >= best * (1 - error)
    ranked = sorted(found, key=lambda c: -c.tokens_per_s_per_gpu)
    tie = [c for c in ranked if c.tied]
    pick = break_tie(
        [Tied(c.schedule, c.memory_bytes, c.stages_per_rank, c.microbatches) for c in tie]
    )
    return ranked, tie[pick]


def plan_cluster(spec: ClusterSpec) -> dict[str, Any]:
    """``{"recommended", "candidates", "budget_bytes", "rates", "arch", "machine", ...}``: the
    ranked candidates that fit (:func:`rank_candidates`); a PlanError when none does, naming
    the smallest need and its parts."""
    found, least = cluster_candidates(spec)
    if not found:
        if least is None:
            raise PlanError(
                f"no layout of {spec.gpus} GPUs splits {spec.arch.layers} layers and a batch of "
                f"{spec.batch} into pipelines (try another --batch or --gpus)"
            )
        raise PlanError(
            f"nothing fits {spec.budget / GIB:.1f} GiB per GPU: the least any candidate needs "
            f"is {least.memory_bytes / GIB:.1f} GiB or more ({least.label()}: weights, gradients and "
            f"optimizer state {least.static_bytes / GIB:.1f} GiB, activations "
            f"{least.activation_bytes / GIB:.1f} GiB)"
        )
    ranked, recommended = rank_candidates(found)
    rates = spec.rates or Rates.default(spec.machine, spec.arch.precision)
    return {
        "recommended": recommended.to_dict(),
        "candidates": [c.to_dict() for c in ranked],
        "budget_bytes": spec.budget,
        "rates": {"F": rates.f, "I": rates.i, "W": rates.w, "source": rates.source},
        "arch": spec.arch.to_dict(),
        "machine": spec.machine.name,
        "gpus": spec.gpus,
        "batch": spec.batch,
        "optimizer": "post-validated" if spec.post_validated else "sync",
        "prediction_error": PREDICTION_ERROR,
        "over_budget": least.to_dict() if least else None,
    }


def default_budget(machine: Machine) -> float:
    """:data:`USABLE_MEMORY` of the machine's memory per GPU."""
    return machine.memory * USABLE_MEMORY



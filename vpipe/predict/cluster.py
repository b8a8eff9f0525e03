"""``vpipe plan --arch --machine --gpus``: the layout and schedule to rent, predicted from the
model and the machine alone (:mod:`vpipe.sim.model_costs`), with no run.

Every split of the GPUs into tensor (``tp``), context (``cp``), pipeline (``pp``) and data
(``dp``) parallel GPUs that the model takes (any of them fixed; TP and CP inside a node,
``tp x cp`` at most the node's GPUs unless fixed), every recomputation setting (unless
fixed), microbatch size, schedule family and stages per rank is a candidate. Each layout is
costed (:func:`vpipe.sim.model_costs.model_costs`); a candidate whose weights and one
microbatch's activations overflow the budget is dropped first, then one whose schedule's
first microbatches already do. Families scheduled for the costs (``auto``, ``v-half``,
``v-min``) are slow to build: each is tried on the :data:`AUTO_LAYOUTS` candidates with the
best bounds only. Of the rest, the candidates are simulated fastest bound first
(:func:`vpipe.predict.cluster_eval.busy_bound`: no schedule beats its busiest rank's work),
and the search stops once the next bound is slower than the fastest simulated one by more
than the tie band: none of the rest could be fastest or tied (they are counted as ``bounded``).
Candidates are ranked by predicted tokens per second per GPU (:func:`rank_candidates`); a plan
nothing fits is one line naming the smallest need.

The tie band is the machine's measured error (:data:`vpipe.sim.efficiency.MEASURED_ERROR`,
from the published tables); for a machine with none, the error is unknown, and the largest
measured one is used and says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vpipe.predict.cluster_eval import ClusterCandidate, busy_bound, evaluate
from vpipe.predict.plan import PlanError
from vpipe.sim.arch import Arch
from vpipe.sim.efficiency import MEASURED_ERROR
from vpipe.sim.machine import GIB, Machine
from vpipe.sim.model_costs import (
    Layout,
    ModelCostError,
    ModelCosts,
    Rates,
    layer_split,
    model_costs,
)
from vpipe.sim.parallel import RECOMPUTE, ParallelError, Split

__all__ = [
    "USABLE_MEMORY",
    "ClusterSpec",
    "default_budget",
    "plan_cluster",
    "rank_candidates",
    "tie_band",
]

# Share of a GPU's memory a plan fills when no budget is given; the rest is left to the CUDA
# context, the allocator's fragmentation and kernels' workspaces (assumed).
USABLE_MEMORY = 0.9
MICROBATCH_SIZES = (1, 2, 4, 8)
# actions the cost-adaptive scheduler may schedule per candidate, and how many candidates of
# each family scheduled for costs (auto, v-half, v-min: slow) are built, best bound first
AUTO_SEARCH = 6_000
AUTO_LAYOUTS = 3


@dataclass(frozen=True)
class ClusterSpec:
    """What a cluster plan is asked: the model, the machine, ``gpus`` and a global ``batch`` of
    sequences, how to run, and which of ``tp``, ``pp``, ``cp``, ``dp``, ``recompute`` are fixed
    (None: searched). ``overlap_grad_reduce`` and ``overlap_tp_backward``: what the runtime
    overlaps (:class:`vpipe.sim.model_costs.Layout`)."""

    arch: Arch
    machine: Machine
    gpus: int
    batch: int
    budget: float  # bytes per GPU
    rates: Rates | None = None  # None: the machine's fitted efficiency per layout
    schedules: Sequence[str] | None = None
    microbatch_sizes: Sequence[int] = MICROBATCH_SIZES
    shard: str = "optimizer"
    post_validated: bool = False
    pp_inner: bool = True
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    dp: int | None = None
    recompute: Sequence[str] | None = None  # the modes weighed (None: each)
    i_frees: float | None = None  # replaces the model's own share when given
    overlap_grad_reduce: bool = True
    overlap_tp_backward: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.recompute, str):  # one mode, not its letters
            object.__setattr__(self, "recompute", (self.recompute,))


def tie_band(machine: Machine) -> tuple[float, str]:
    """(relative band, how it was found): the machine's measured error, or the largest
    measured one where it has none."""
    known = MEASURED_ERROR.get(machine.name)
    if known is not None:
        return known, f"{machine.name}'s measured error against published runs"
    worst = max(v for v in MEASURED_ERROR.values() if v is not None)
    return worst, (f"{machine.name}'s error is unknown (no published runs): the largest "
                   f"measured one")  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def splits(spec: ClusterSpec) -> list[tuple[int, int, int, int]]:
    """Every (tp, cp, pp, dp) to try; a fixed one that cannot work is refused in one line."""
    arch, gpn = spec.arch, spec.machine.gpus_per_node
    fixed = [(k, getattr(spec, k)) for k in ("tp", "pp", "cp", "dp") if getattr(spec, k)]
    product = 1
    for _, v in fixed:
        product *= v
    if spec.gpus % product:
        names = " x ".join(f"{k}={v}" for k, v in fixed)
        raise PlanError(f"--gpus {spec.gpus} is not divisible by {names} = {product}")
    if spec.tp or spec.cp:
        try:
            Split(spec.tp or 1, spec.cp or 1).check(arch)
        except ParallelError as e:
            raise PlanError(str(e)) from None
    out = []
    for tp in [spec.tp] if spec.tp else [d for d in _divisors(gpn) if spec.gpus % d == 0]:
        for cp in [spec.cp] if spec.cp else [d for d in _divisors(gpn) if tp * d <= gpn]:
            try:
                Split(tp, cp).check(arch)
            except ParallelError:
                continue
            if spec.gpus % (tp * cp):
                continue
            rest = spec.gpus // (tp * cp)
            for pp in [spec.pp] if spec.pp else _divisors(rest):
                if rest % pp or pp > arch.layers + 2 or (spec.dp and spec.dp != rest // pp):
                    continue
                out.append((tp, cp, pp, rest // pp))
    if not out:
        raise PlanError(f"no split of {spec.gpus} GPUs into tp x cp x pp x dp works for "
                        f"{arch.name} with the fixed figures given")  # fmt: skip
    return out


def _shapes(fam: Any, pp: int, layers: int) -> list[tuple[str, int]]:
    if fam.name == "auto":
        shapes = [("loop", 1), ("v", 2)]
    elif fam.placement == "v":
        shapes = [("v", 2)]
    else:  # a family with stages per rank to choose also tries 4 and 8
        spr = fam.stages_per_rank
        shapes = [("loop", v) for v in sorted({spr} | ({4, 8} if spr > 1 else set()))]
    return [(p, v) for p, v in shapes if pp * v <= layers + 2 and (pp > 1 or v == 1)]


def cluster_candidates(spec: ClusterSpec) -> dict[str, Any]:
    """``{"found", "least", "bounded", "tried", "simulated"}``: the candidates simulated that
    fit, the one needing the least memory of those that do not, how many were left
    unsimulated by their bound, tried in all, and simulated."""
    from vpipe.schedules import catalogue

    arch = spec.arch
    families = catalogue.families() if spec.schedules is None else [
        catalogue.get(s) for s in spec.schedules
    ]
    band = tie_band(spec.machine)[0]
    queue = []
    for tp, cp, pp, dp in splits(spec):
        for mb in spec.microbatch_sizes:
            if spec.batch % dp or (spec.batch // dp) % mb:
                continue
            m = spec.batch // dp // mb
            for rc in spec.recompute or RECOMPUTE:
                for fam in families:
                    for placement, v in _shapes(fam, pp, arch.layers):
                        lay = Layout(pp, dp, v, placement, spec.pp_inner, spec.shard, tp, cp, rc,
                                     spec.overlap_grad_reduce, spec.overlap_tp_backward)
                        queue.append((lay, mb, m, fam))
    # a layout's costs and bound, shared by the families of its shape (m follows from it)
    costed: dict[tuple, tuple[ModelCosts, float] | None] = {}
    archs = {mb: arch.with_microbatch(mb) for mb in spec.microbatch_sizes}
    bounds = []
    for lay, mb, m, fam in queue:
        key = (lay, mb)
        if key not in costed:
            try:
                costs = model_costs(archs[mb], spec.machine, lay, spec.rates)
                costed[key] = costs, busy_bound(costs, m, spec.post_validated)
            except (ModelCostError, ParallelError):
                costed[key] = None
        if costed[key] is not None:
            costs, bound = costed[key]
            bounds.append((bound, len(bounds), costs, fam, m))
    bounds.sort(key=lambda x: (x[0], x[1]))
    found: list[ClusterCandidate] = []
    least: ClusterCandidate | None = None
    best_s = float("inf")
    bounded = 0
    slow_tries: dict[str, int] = {}
    simulated = 0
    for bound_s, _, costs, fam, m in bounds:
        if bound_s > best_s * (1 + band):
            bounded += 1
            continue
        if fam.cost_adapted:  # scheduled for costs: slow, so on the most promising layouts only
            if slow_tries.get(fam.name, 0) >= AUTO_LAYOUTS:
                bounded += 1
                continue
            slow_tries[fam.name] = slow_tries.get(fam.name, 0) + 1
        cand = evaluate(costs, fam, m, spec.batch, spec.budget, spec.post_validated,
                        lambda f, lay, mm, c: _schedule(spec, f, lay, mm, c),
                        spec.i_frees)  # fmt: skip
        if cand is None:
            continue
        simulated += cand.fits
        if cand.fits:
            found.append(cand)
            best_s = min(best_s, cand.iteration_s)
        elif least is None or cand.total_bytes < least.total_bytes:
            least = cand
    return {"found": found, "least": least, "bounded": bounded, "tried": len(bounds),
            "simulated": simulated}  # fmt: skip


def _schedule(spec: ClusterSpec, fam: Any, lay: Layout, m: int, costs: Any):
    """``auto`` scheduled for these costs within the activation bytes the fullest GPU has left
    (held bytes counted from F, which never undercounts)."""
    from vpipe.schedules.adaptive import MemoryModel
    from vpipe.schedules.auto import auto_schedule

    static = [sum(p.values()) for p in costs.extra["memory"]]
    alloc = [max(a, h) for a, h in zip(costs.saved_bytes, costs.held_after_i, strict=True)]
    freed = [a - h for a, h in zip(alloc, costs.held_after_i, strict=True)]
    objective = "span" if spec.post_validated else "makespan"
    return auto_schedule(
        lay.pp, m, costs.cost_model(), spec.budget - max(static), lay.placement,
        objective=objective, memory=MemoryModel.from_bytes(alloc, freed),
        search_budget=AUTO_SEARCH, fixed_families=False,
    )  # fmt: skip


def rank_candidates(
    found: list[ClusterCandidate], error: float
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
        [Tied(c.schedule, c.total_bytes, c.stages_per_rank, c.microbatches) for c in tie]
    )
    return ranked, tie[pick]


def plan_cluster(spec: ClusterSpec) -> dict[str, Any]:
    """``{"recommended", "candidates", "tie_band", ...}``: the ranked candidates that fit
    (:func:`rank_candidates`); a PlanError when none does, naming the smallest need."""
    got = cluster_candidates(spec)
    found, least = got["found"], got["least"]
    if not found:
        if least is None:
            raise PlanError(
                f"no layout of {spec.gpus} GPUs splits {spec.arch.layers} layers and a batch of "
                f"{spec.batch} into pipelines (try another --batch or --gpus)"
            )
        mem = least.memory_bytes
        raise PlanError(
            f"nothing fits {spec.budget / GIB:.1f} GiB per GPU: the least any candidate needs "
            f"is {mem['total'] / GIB:.1f} GiB or more ({least.label()}: weights, gradients and "
            f"optimizer state {(mem['weights'] + mem['gradients'] + mem['optimizer']) / GIB:.1f}"
            f" GiB, activations {mem['activations'] / GIB:.1f} GiB, buffers "
            f"{mem['buffers'] / GIB:.1f} GiB)"
        )
    band, why = tie_band(spec.machine)
    ranked, recommended = rank_candidates(found, band)
    rec_arch = spec.arch.with_microbatch(recommended.microbatch_size)
    rates = spec.rates or Rates.for_shapes(spec.machine, rec_arch, recommended.tp, recommended.cp)
    stages = recommended.pp * recommended.stages_per_rank
    return {
        "recommended": recommended.to_dict(),
        "layers_per_stage": layer_split(spec.arch.layers, stages),
        "candidates": [c.to_dict() for c in ranked],
        "budget_bytes": spec.budget,
        "rates": {"F": rates.f, "I": rates.i, "W": rates.w, "source": rates.source},
        "arch": spec.arch.to_dict(),
        "machine": spec.machine.name,
        "gpus": spec.gpus,
        "batch": spec.batch,
        "optimizer": "post-validated" if spec.post_validated else "sync",
        "grad_reduce": "during" if spec.overlap_grad_reduce else "after",
        "tp_backward": "beside-w" if spec.overlap_tp_backward else "after-w",
        "tie_band": band,
        "tie_band_source": why,
        "measured_error": MEASURED_ERROR.get(spec.machine.name),
        "simulated": got["simulated"],
        "bounded": got["bounded"],
        "tried": got["tried"],
        "over_budget": least.to_dict() if least else None,
    }


def default_budget(machine: Machine) -> float:
    """:data:`USABLE_MEMORY` of the machine's memory per GPU."""
    return machine.memory * USABLE_MEMORY


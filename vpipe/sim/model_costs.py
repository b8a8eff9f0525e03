"""Costs of a transformer on a machine, with no run: what :mod:`vpipe.sim.arch` counts, over
what :mod:`vpipe.sim.machine` delivers, for one pipeline layout.

For a :class:`Layout` (pipeline ranks, data-parallel replicas, stages per rank, placement,
which GPUs the ranks sit on) :func:`model_costs` gives, per stage: its layers (the
embedding's and the head's stages one layer short when the layers do not split evenly, so
padding lands where the extra work is), its F, I and W times (FLOPs over the achieved rate of
each pass kind, :class:`Rates`), the bytes its F saves and those still held after its I; per
boundary the message's bytes and time (same node or across nodes); per rank the bytes of
weights, gradients and optimizer state (mixed-precision Adam, optionally sharded over the
replicas) and the optimizer step's time (memory-bound: :data:`ADAM_BYTES` per parameter over
the memory bandwidth). Times are seconds; :meth:`ModelCosts.cost_model` converts them to the
simulator's microseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vpipe.errors import VpipeError
from vpipe.ir import Schedule
from vpipe.ir.flat import flatten
from vpipe.sim.arch import Arch
from vpipe.sim.collectives import CollectiveCost
from vpipe.sim.cost_model import CostModel
from vpipe.sim.iteration import IterationCosts
from vpipe.sim.machine import Machine

__all__ = [
    "ADAM_BYTES",
    "DEFAULT_EFFICIENCY",
    "MEMORY_EFFICIENCY",
    "Layout",
    "ModelCosts",
    "Rates",
    "activation_peaks",
    "layer_split",
    "model_costs",
]

US = 1e6  # simulator time units (microseconds) per second

# Fractions of dense peak FLOP/s that F, I and W reach when no measured run is given: GPT-style
# blocks profiled on A100s in the zero-bubble paper (Table 9; `python -m bench.published`
# prints the fractions each of its four models reaches), rounded down.
DEFAULT_EFFICIENCY = {"F": 0.55, "I": 0.55, "W": 0.75}
# Fraction of the memory bandwidth a streaming update (the optimizer step) reaches: assumed.
MEMORY_EFFICIENCY = 0.8
# Bytes a mixed-precision Adam step moves per parameter: 16-bit gradient to fp32 (2 + 4), the
# gradient norm (4), the update (reads weight, gradient, m, v; writes weight, m, v: 7 x 4) and
# the fp32 weight back to 16 bits (4 + 2); fp16 adds unscaling the gradients (4 + 4). fp32
# training has no copies: norm and update only.
ADAM_BYTES = {"bf16": 44, "fp16": 52, "fp32": 32}
# Bytes per parameter held per GPU: 16-bit weights, gradients (fp32 accumulation with bf16,
# 16 bits with fp16), and Adam's fp32 master weights, m and v (shardable over replicas).
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = {"bf16": 4, "fp16": 2, "fp32": 4}
OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8}
SHARDING = ("none", "optimizer", "gradients")


class ModelCostError(VpipeError, ValueError):
    """A layout or rate that makes no sense for this model; the message says which."""


@dataclass(frozen=True)
class Rates:
    """Achieved FLOP/s of F, I and W, and where they come from."""

    f: float
    i: float
    w: float
    source: str = ""

    @classmethod
    def default(cls, machine: Machine, precision: str) -> Rates:
        """:data:`DEFAULT_EFFICIENCY` of the machine's peak in ``precision``."""
        peak = machine.peak(precision)
        e = DEFAULT_EFFICIENCY
        return cls(peak * e["F"], peak * e["I"], peak * e["W"],
                   f"default efficiency F {e['F']}, I {e['I']}, W {e['W']} of "
                   f"{machine.name}'s {precision} peak")  # fmt: skip

    @classmethod
    def measured(
        cls, arch: Arch, layers: int, head: bool, times_s: Sequence[float], source: str
    ) -> Rates:
        """Rates from a measured stage of ``layers`` blocks (plus the LM head when ``head``):
        its FLOPs per kind over its measured F, I and W seconds."""
        rates = []
        for kind, t in zip("FIW", times_s, strict=True):
            flops = layers * arch.layer_flops(kind) + (arch.head_flops(kind) if head else 0.0)
            if not t > 0:
                raise ModelCostError(f"measured {kind} time must be > 0, got {t!r}")
            rates.append(flops / t)
        return cls(*rates, source=source)

    def efficiency(self, machine: Machine, precision: str) -> dict[str, float]:
        """Each kind's rate as a fraction of the machine's peak."""
        peak = machine.peak(precision)
        return {"F": self.f / peak, "I": self.i / peak, "W": self.w / peak}


@dataclass(frozen=True)
class Layout:
    """``pp`` pipeline ranks x ``dp`` replicas, ``stages_per_rank`` stages on each rank placed
    ``placement`` (``loop``: stage s on rank s mod pp; ``v``: rank r holds r and 2pp-1-r).
    GPUs are numbered node by node; ``pp_inner``: a replica's pipeline ranks take consecutive
    GPUs (pipeline messages stay in a node where they can, replicas span nodes), else the
    replicas of one rank do. ``shard``: what is split over the replicas (``none``,
    ``optimizer`` state, or ``gradients`` too)."""

    pp: int
    dp: int = 1
    stages_per_rank: int = 1
    placement: str = "loop"
    pp_inner: bool = True
    shard: str = "optimizer"

    def __post_init__(self) -> None:
        if self.pp < 1 or self.dp < 1 or self.stages_per_rank < 1:
            raise ModelCostError(f"pp, dp and stages per rank must be >= 1, got {self}")
        if self.placement not in ("loop", "v"):
            raise ModelCostError(f"placement must be 'loop' or 'v', got {self.placement!r}")
        if self.placement == "v" and self.stages_per_rank != 2:
            raise ModelCostError("the v placement has exactly 2 stages per rank")
        if self.shard not in SHARDING:
            raise ModelCostError(f"shard must be one of {', '.join(SHARDING)}, got {self.shard!r}")

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def rank_of(self, stage: int) -> int:
        if self.placement == "v":
            return stage if stage < self.pp else 2 * self.pp - 1 - stage
        return stage % self.pp

    def gpu(self, rank: int, replica: int = 0) -> int:
        return replica * self.pp + rank if self.pp_inner else rank * self.dp + replica

    def same_node(self, rank_a: int, rank_b: int, gpus_per_node: int) -> bool:
        """Whether every replica's ranks ``rank_a`` and ``rank_b`` share a node."""
        return all(
            self.gpu(rank_a, d) // gpus_per_node == self.gpu(rank_b, d) // gpus_per_node
            for d in range(self.dp)
        )

    def replicas_in_one_node(self, rank: int, gpus_per_node: int) -> bool:
        return len({self.gpu(rank, d) // gpus_per_node for d in range(self.dp)}) == 1


def layer_split(layers: int, stages: int) -> list[int]:
    """Blocks per stage: ``layers // stages`` each, and the remainder one more each on middle
    stages spread evenly, then on the first, then on the last: the embedding's and the head's
    stages are the ones left short (as the zero-bubble paper's runs have one layer fewer on
    the first and last stage)."""
    if stages < 1:
        raise ModelCostError(f"stages must be >= 1, got {stages}")
    base, extra = divmod(layers, stages)
    sizes = [base] * stages
    middle = max(stages - 2, 0)
    picks = [1 + (2 * j + 1) * middle // (2 * extra) for j in range(min(extra, middle))]
    picks += [0, stages - 1][: max(0, extra - middle)]
    for s in picks:
        sizes[s] += 1
    return sizes


@dataclass(frozen=True)
class ModelCosts:
    """Per-stage, per-boundary and per-rank costs of one layout (see the module docstring);
    times in seconds, sizes in bytes."""

    arch: Arch
    machine: Machine
    layout: Layout
    rates: Rates
    layers: list[int]
    f: list[float]
    i: list[float]
    w: list[float]
    boundary_s: list[float]  # one message over boundary s (0 when both stages share a rank)
    saved_bytes: list[float]  # what a stage's F saves, per microbatch
    held_after_i: list[float]  # what it still holds after its I, for its W
    params: list[int]  # per rank
    optimizer_step_s: list[float]  # per rank
    static_bytes: list[float]  # per rank: weights, gradients, optimizer state
    transient_bytes: list[float]  # per rank: the largest working set one pass adds
    extra: dict = field(default_factory=dict)

    def cost_model(self, post_s: float = 0.0) -> CostModel:
        """The simulator's per-stage cost model, in microseconds (``post_s``: rank time per
        SEND or RECV posted)."""
        per_stage = {s: {"f": self.f[s] * US, "b": self.i[s] * US, "w": self.w[s] * US}
                     for s in range(len(self.f))}  # fmt: skip
        return CostModel(
            f=0.0, b=0.0, w=0.0, per_stage=per_stage, activation_bytes=list(self.alloc_bytes),
            boundary_time=[t * US for t in self.boundary_s], post=post_s * US,
        )  # fmt: skip

    def iteration_costs(self, post_validated: bool = False) -> IterationCosts:
        """What ends an iteration (:mod:`vpipe.sim.iteration`), in microseconds: each rank's
        optimizer step; the all-reduce of a tied embedding's gradient between the first and
        last stage when two ranks hold them; and, unless ``post_validated``, the global
        all-reduce of the gradient norm (two in fp16: the overflow check too), a tree of
        2 log2(GPUs) latencies."""
        lay, m, arch = self.layout, self.machine, self.arch
        tail = [0.0] * lay.pp
        first, last = lay.rank_of(0), lay.rank_of(lay.n_stages - 1)
        if arch.tied_embeddings and first != last:
            same = lay.same_node(first, last, m.gpus_per_node)
            t = m.message_time(arch.vocab * arch.hidden * GRAD_BYTES[arch.precision], same)
            tail[first] = tail[last] = t * US
        gpus = lay.pp * lay.dp
        latency = m.link(gpus <= m.gpus_per_node)[0]
        rounds = 2 if arch.precision == "fp16" else 1
        sync = rounds * 2 * math.ceil(math.log2(gpus)) * latency if gpus > 1 else 0.0
        return IterationCosts([t * US for t in self.optimizer_step_s], tail, sync * US,
                              post_validated)  # fmt: skip

    def dp_reduction(self) -> tuple[CollectiveCost, dict[int, list[float]]]:
        """The data-parallel gradient all-reduce (a ring over the replicas, on the slowest
        link among them; microseconds and bytes per microsecond) and each stage's gradient
        bytes, reduced in one bucket once the stage's gradients are complete."""
        lay, m = self.layout, self.machine
        inside = all(lay.replicas_in_one_node(r, m.gpus_per_node) for r in range(lay.pp))
        latency, bandwidth = m.link(inside)
        cost = CollectiveCost(lay.dp, bandwidth / US, latency * US)
        per_param = GRAD_BYTES[self.arch.precision]
        arch = self.arch
        buckets = {}
        for s, k in enumerate(self.layers):
            n = k * arch.layer_params() + (arch.embedding_params() if s == 0 else 0)
            if s == lay.n_stages - 1:
                n += arch.head_params()
            buckets[s] = [float(n * per_param)]
        return cost, buckets

    @property
    def alloc_bytes(self) -> list[float]:
        """Bytes a stage's microbatch occupies from its F (the larger of what F saves and what
        its I leaves for W, so that the count never undershoots)."""
        return [max(a, b) for a, b in zip(self.saved_bytes, self.held_after_i, strict=True)]

    @property
    def freed_by_i(self) -> list[float]:
        """Bytes a stage's I frees of :attr:`alloc_bytes`."""
        return [max(0.0, a - h) for a, h in zip(self.alloc_bytes, self.held_after_i, strict=True)]


def model_costs(
    arch: Arch, machine: Machine, layout: Layout, rates: Rates | None = None
) -> ModelCosts:
    """The costs of ``arch`` on ``machine`` laid out as ``layout`` (see the module docstring);
    ``rates`` default to :meth:`Rates.default`."""
    rates = rates or Rates.default(machine, arch.precision)
    n = layout.n_stages
    if n > arch.layers + 2:
        raise ModelCostError(f"{n} stages for {arch.layers} layers: at most {arch.layers + 2}")
    layers = layer_split(arch.layers, n)
    last = n - 1
    times = {}
    for kind, rate in zip("FIW", (rates.f, rates.i, rates.w), strict=True):
        block, head = arch.layer_flops(kind), arch.head_flops(kind)
        times[kind] = [(k * block + (head if s == last else 0.0)) / rate
                       for s, k in enumerate(layers)]  # fmt: skip
    saved = [k * arch.layer_saved_bytes() + (arch.head_saved_bytes() if s == last else 0.0)
             for s, k in enumerate(layers)]  # fmt: skip
    saved[0] += arch.embedding_saved_bytes()
    held = [k * arch.layer_weight_grad_bytes()
            + (arch.head_weight_grad_bytes() if s == last else 0.0)
            for s, k in enumerate(layers)]  # fmt: skip
    boundary = []
    for s in range(n - 1):
        a, b = layout.rank_of(s), layout.rank_of(s + 1)
        same = layout.same_node(a, b, machine.gpus_per_node)
        boundary.append(0.0 if a == b else machine.message_time(arch.boundary_bytes(), same))
    params = [0] * layout.pp
    for s, k in enumerate(layers):
        params[layout.rank_of(s)] += k * arch.layer_params()
    params[layout.rank_of(0)] += arch.embedding_params()
    if not (arch.tied_embeddings and layout.rank_of(0) == layout.rank_of(last)):
        params[layout.rank_of(last)] += arch.head_params()
    p = arch.precision
    shard_opt = layout.dp if layout.shard != "none" else 1
    shard_grad = layout.dp if layout.shard == "gradients" else 1
    per_param = WEIGHT_BYTES[p] + GRAD_BYTES[p] / shard_grad + OPTIMIZER_BYTES[p] / shard_opt
    bandwidth = machine.memory_bandwidth * MEMORY_EFFICIENCY
    step = [n_p / shard_opt * ADAM_BYTES[p] / bandwidth for n_p in params]
    transient = [0.0] * layout.pp
    # the loss's logits (16-bit) and their fp32 softmax on the head's rank, two messages'
    # receive buffers on every rank
    transient[layout.rank_of(last)] += arch.tokens * arch.vocab * (arch.value_bytes + 4)
    transient = [t + 2 * arch.boundary_bytes() for t in transient]
    return ModelCosts(
        arch, machine, layout, rates, layers, times["F"], times["I"], times["W"], boundary,
        saved, held, params, step, [n_p * per_param for n_p in params], transient,
    )  # fmt: skip



def activation_peaks(
    schedule: Schedule, alloc: Sequence[float], freed_by_i: Sequence[float]
) -> list[float]:
    """Each rank's peak activation bytes over its program order: a stage's F allocates
    ``alloc[stage]``, its I frees ``freed_by_i[stage]``, its W the rest, a full backward B
    all of it (:class:`vpipe.schedules.adaptive.MemoryModel`'s accounting)."""
    fl = flatten(schedule)
    a, fi = np.asarray(alloc, float), np.asarray(freed_by_i, float)
    table = np.stack([a, -a, -fi, fi - a])  # F, B, I, W (the flat kind codes 0-3)
    delta = table[fl.p_kind, fl.p_stage]
    bounds = np.searchsorted(fl.p_rank, np.arange(schedule.n_ranks + 1))
    peaks = []
    for r in range(schedule.n_ranks):
        seg = delta[bounds[r] : bounds[r + 1]]
        peaks.append(float(max(np.cumsum(seg).max(), 0.0)) if len(seg) else 0.0)
    return peaks

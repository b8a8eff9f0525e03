"""Costs of a transformer on a machine, with no run: what :mod:`vpipe.sim.arch` counts, over
what :mod:`vpipe.sim.machine` delivers, for one pipeline layout.

For a :class:`Layout` (pipeline ranks, data-parallel replicas, tensor and context parallel
GPUs per rank, stages per rank, placement, sharding, recomputation, which GPUs the ranks sit
on) :func:`model_costs` gives, per stage: its layers (the embedding's and the head's stages
one layer short when the layers do not split evenly, so padding lands where the extra work
is), its F, I and W times on one GPU (FLOPs over the achieved rate of each pass kind,
:class:`Rates`, plus TP's and CP's collectives and the recomputed forward, each booked apart
in ``extra["parts"]``), its fused backward B (I + W less the TP collectives of I that run
beside W's GEMMs when the two are one pass), the bytes its F saves and those still held after
its I (:mod:`vpipe.sim.parallel`); per boundary the message's bytes and time (same node or
across nodes); per rank the bytes of weights, gradients and optimizer state (mixed-precision
Adam, optionally sharded over the replicas; ``extra["memory"]`` per part, with the buffers)
and the optimizer step's time (memory-bound: :data:`ADAM_BYTES` per parameter over the memory
bandwidth). Times are seconds; :meth:`ModelCosts.cost_model` converts them to the
simulator's microseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vpipe.errors import VpipeError
from vpipe.sim.arch import Arch
from vpipe.sim.collectives import CollectiveCost
from vpipe.sim.cost_model import CostModel
from vpipe.sim.efficiency import Fit, fit_for
from vpipe.sim.iteration import IterationCosts
from vpipe.sim.machine import Machine
from vpipe.sim.parallel import Split, block_on_gpu, head_elementwise_bytes

__all__ = [
    "ADAM_BYTES",
    "MEMORY_EFFICIENCY",
    "Layout",
    "ModelCosts",
    "Rates",
    "layer_split",
    "model_costs",
    "stage_parts",
]

US = 1e6  # simulator time units (microseconds) per second

# Fraction of the memory bandwidth a streaming update (the optimizer step) reaches: assumed.
MEMORY_EFFICIENCY = 0.8
# Bytes a mixed-precision Adam step moves per parameter: 16-bit gradient to fp32 (2 + 4), the
# gradient norm (4), the update (reads weight, gradient, m, v; writes weight, m, v: 7 x 4) and
# the fp32 weight back to 16 bits (4 + 2); fp16 adds unscaling the gradients (4 + 4). fp32
# training has no copies: norm and update only. fp8 training (Transformer Engine) keeps bf16
# weights and fp32 master copies: counted as bf16 (its fp8 weight copies are left out).
ADAM_BYTES = {"bf16": 44, "fp16": 52, "fp32": 32, "fp8": 44}
# Bytes per parameter held per GPU: 16-bit weights, gradients (fp32 accumulation with bf16,
# 16 bits with fp16), and Adam's fp32 master weights, m and v (shardable over replicas).
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
GRAD_BYTES = {"bf16": 4, "fp16": 2, "fp32": 4, "fp8": 4}
OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8, "fp8": 12}
SHARDING = ("none", "optimizer", "gradients", "full")


class ModelCostError(VpipeError, ValueError):
    """A layout or rate that makes no sense for this model; the message says which."""


@dataclass(frozen=True)
class Rates:
    """Achieved FLOP/s of F, I and W, and where they come from. ``gemms_only``: the rates are
    the matrices' alone (the fitted efficiency), so the memory-bound operators are charged
    apart; rates read off measured passes hold them already."""

    f: float
    i: float
    w: float
    source: str = ""
    gemms_only: bool = False

    @classmethod
    def for_shapes(cls, machine: Machine, arch: Arch, tp: int = 1, cp: int = 1,
                   fit: Fit | None = None) -> Rates:  # fmt: skip
        """The machine's fitted efficiency (:mod:`vpipe.sim.efficiency`, or ``fit``) for a
        block's GEMMs on one GPU: the microbatch's tokens over ``cp`` by the hidden size over
        ``tp``."""
        peak = machine.peak(arch.precision)
        tokens, width = arch.tokens / cp, arch.hidden / tp
        fit = fit or fit_for(machine.name)
        e = fit.efficiency(arch.precision, tokens, width)
        other = "" if machine.name in ("a100", "h100", "h200") else " (the H100's fit)"
        return cls(peak * e, peak * e, peak * e,
                   f"{e:.3f} of {machine.name}'s {arch.precision} peak for {tokens:g} tokens x "
                   f"width {width:g} per GPU, fitted on {fit.fitted_on}{other}",
                   gemms_only=True)  # fmt: skip

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
    Each rank is a group of ``tp x cp`` GPUs (tensor, then context parallel, on consecutive
    GPUs so that they share a node when it is large enough). Groups are numbered node by
    node; ``pp_inner``: a replica's pipeline ranks take consecutive groups (pipeline messages
    stay in a node where they can, replicas span nodes), else the replicas of one rank do.
    ``shard``: what is split over the replicas (``none``, ``optimizer`` state, ``gradients``
    too, or ``full``: parameters too, gathered before each F and I of a stage and its
    gradients reduce-scattered after each W, ZeRO-3 / FSDP). ``recompute``: ``none``,
    ``selective`` or ``full`` (:mod:`vpipe.sim.parallel`). ``overlap_grad_reduce``: the
    data-parallel reduction runs one bucket per block as the stage's last backward fills it
    (Megatron-LM's ``--overlap-grad-reduce``, DDP, FSDP), else the stage's gradients in one
    bucket once that backward has ended. ``overlap_tp_backward``: a fused backward runs I's
    TP collectives beside the column-parallel matrices' weight gradients (Megatron-LM's
    asynchronous TP communication, in its releases since late 2021), else after them."""

    pp: int
    dp: int = 1
    stages_per_rank: int = 1
    placement: str = "loop"
    pp_inner: bool = True
    shard: str = "optimizer"
    tp: int = 1
    cp: int = 1
    recompute: str = "none"
    overlap_grad_reduce: bool = True
    overlap_tp_backward: bool = True

    def __post_init__(self) -> None:
        if min(self.pp, self.dp, self.stages_per_rank, self.tp, self.cp) < 1:
            raise ModelCostError(f"pp, dp, tp, cp and stages per rank must be >= 1, got {self}")
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

    @property
    def group(self) -> int:
        """GPUs per pipeline rank (tensor x context parallel)."""
        return self.tp * self.cp

    @property
    def gpus(self) -> int:
        return self.pp * self.dp * self.group

    def gpu(self, rank: int, replica: int = 0) -> int:
        """The first GPU of the rank's group in ``replica``."""
        g = replica * self.pp + rank if self.pp_inner else rank * self.dp + replica
        return g * self.group

    def same_node(self, rank_a: int, rank_b: int, gpus_per_node: int) -> bool:
        """Whether every replica's ranks ``rank_a`` and ``rank_b`` share a node."""
        return bool(self.same_nodes([rank_a], [rank_b], gpus_per_node)[0])

    def same_nodes(self, ranks_a: Sequence[int], ranks_b: Sequence[int],
                   gpus_per_node: int) -> np.ndarray:  # fmt: skip
        """:meth:`same_node` of each pair of ``ranks_a`` and ``ranks_b`` at once."""
        if self.group > gpus_per_node:
            return np.zeros(len(ranks_a), bool)
        nodes = self._first_gpus() // gpus_per_node
        return np.all(nodes[:, list(ranks_a)] == nodes[:, list(ranks_b)], axis=0)

    def _first_gpus(self) -> np.ndarray:
        """(replica, rank): the first GPU of the rank's group in that replica."""
        d, r = np.arange(self.dp)[:, None], np.arange(self.pp)[None, :]
        g = d * self.pp + r if self.pp_inner else r * self.dp + d
        return g * self.group

    def all_replicas_in_one_node(self, gpus_per_node: int) -> bool:
        """Whether each rank's replicas (all their GPUs) share one node, rank by rank."""
        first = self._first_gpus()
        lo, hi = first // gpus_per_node, (first + self.group - 1) // gpus_per_node
        return bool(np.all(lo == lo[0]) and np.all(hi == lo[0]))


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
    hidden_in_b: list[float]  # what a fused backward hides of I's TP collectives under W
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
        for s, hidden in enumerate(self.hidden_in_b):
            if hidden > 0:  # a fused backward is cheaper than I then W
                per_stage[s]["B"] = self.b[s] * US
        return CostModel(
            f=0.0, b=0.0, w=0.0, per_stage=per_stage, activation_bytes=list(self.alloc_bytes),
            boundary_time=[t * US for t in self.boundary_s], post=post_s * US,
        )  # fmt: skip

    def iteration_costs(self, post_validated: bool = False) -> IterationCosts:
        """What ends an iteration (:mod:`vpipe.sim.iteration`), in microseconds: each rank's
        optimizer step; ZeRO-3's exposed first gather; the all-reduce of a tied embedding's
        gradient between the first and last stage when two ranks hold them; and, unless ``post_validated``, the global
        all-reduce of the gradient norm (two in fp16: the overflow check too), a tree of
        2 log2(GPUs) latencies."""
        lay, m, arch = self.layout, self.machine, self.arch
        tail = [t * US for t in self.extra.get("fsdp_s", [0.0] * lay.pp)]
        first, last = lay.rank_of(0), lay.rank_of(lay.n_stages - 1)
        if arch.tied_embeddings and first != last:
            same = lay.same_node(first, last, m.gpus_per_node)
            nbytes = arch.vocab * arch.hidden * GRAD_BYTES[arch.precision] / lay.tp
            t = m.message_time(nbytes, same)
            tail[first] += t * US
            tail[last] += t * US
        gpus = lay.gpus
        latency = m.link(gpus <= m.gpus_per_node)[0]
        rounds = 2 if arch.precision == "fp16" else 1
        sync = rounds * 2 * math.ceil(math.log2(gpus)) * latency if gpus > 1 else 0.0
        return IterationCosts([t * US for t in self.optimizer_step_s], tail, sync * US,
                              post_validated)  # fmt: skip

    def dp_reduction(self) -> tuple[CollectiveCost, dict[int, list[float]]]:
        """The data-parallel gradient all-reduce (a ring over the replicas, on the slowest
        link among them; microseconds and bytes per microsecond) and each stage's gradient
        bytes: one bucket per block in the order the backward fills them (the head's with the
        last block, the embedding's with the first) when the layout overlaps the reduction
        with the backward, else one bucket for the stage. With the
        optimizer state sharded (Megatron-LM's distributed optimizer, ZeRO-1 to 3) it is a
        reduce-scatter, half an all-reduce's bytes, counted as such; the updated parameters'
        all-gather runs under the next iteration's forwards (not counted), except ZeRO-3's
        first gather per rank (``extra["fsdp_s"]``, in :meth:`iteration_costs`)."""
        lay, m = self.layout, self.machine
        inside = lay.all_replicas_in_one_node(m.gpus_per_node)
        latency, bandwidth = m.link(inside)
        cost = CollectiveCost(lay.dp, bandwidth / US, latency * US)
        per_param = GRAD_BYTES[self.arch.precision]
        if lay.shard != "none":
            per_param /= 2
        arch = self.arch
        buckets = {}
        for s, k in enumerate(self.layers):
            sizes = [float(arch.layer_params())] * k or [0.0]
            if s == lay.n_stages - 1:
                sizes[0] += arch.head_params()
            if s == 0:
                sizes[-1] += arch.embedding_params()
            if not lay.overlap_grad_reduce:
                sizes = [sum(sizes)]
            buckets[s] = [n * per_param / lay.tp for n in sizes]
        return cost, buckets

    @property
    def b(self) -> list[float]:
        """A fused backward per stage: I + W less what it hides of I's TP collectives."""
        return [i + w - h for i, w, h in zip(self.i, self.w, self.hidden_in_b, strict=True)]

    @property
    def alloc_bytes(self) -> list[float]:
        """Bytes a stage's microbatch occupies from its F: without recomputation the larger of
        what F saves and what its I leaves for W, so that the count never undershoots; with
        it what F saves (I then rebuilds what W needs: :attr:`freed_by_i` is negative)."""
        if self.layout.recompute != "none":
            return list(self.saved_bytes)
        return [max(a, b) for a, b in zip(self.saved_bytes, self.held_after_i, strict=True)]

    @property
    def freed_by_i(self) -> list[float]:
        """Bytes a stage's I frees of :attr:`alloc_bytes` (negative: I allocates)."""
        pairs = zip(self.alloc_bytes, self.held_after_i, strict=True)
        if self.layout.recompute != "none":
            return [a - h for a, h in pairs]
        return [max(0.0, a - h) for a, h in pairs]


def model_costs(
    arch: Arch, machine: Machine, layout: Layout, rates: Rates | None = None,
    fit: Fit | None = None,
) -> ModelCosts:  # fmt: skip
    """The costs of ``arch`` on ``machine`` laid out as ``layout`` (see the module docstring);
    ``rates`` default to :meth:`Rates.for_shapes` (the machine's fitted efficiency for this
    layout's GEMM shapes); ``fit`` replaces the machine's fitted terms."""
    fit = fit or fit_for(machine.name)
    split = Split(layout.tp, layout.cp, recompute=layout.recompute)
    split.check(arch)
    n_gpu = layout.group
    rates = rates or Rates.for_shapes(machine, arch, layout.tp, layout.cp, fit)
    n = layout.n_stages
    if n > arch.layers + 2:
        raise ModelCostError(f"{n} stages for {arch.layers} layers: at most {arch.layers + 2}")
    layers = layer_split(arch.layers, n)
    last = n - 1
    blk = block_on_gpu(arch, split)
    comm = block_comm_s(machine, layout, blk, rates, fit.tp_hidden)
    bandwidth = machine.memory_bandwidth * MEMORY_EFFICIENCY
    head_moved = head_elementwise_bytes(arch, split)
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in "FIW"}
    for kind in "FIW":
        head = arch.head_flops(kind) / n_gpu
        parts[kind] = [stage_parts(kind, k, blk, comm, rates, bandwidth,
                                   *((head, head_moved[kind]) if s == last else (0.0, 0.0)))
                       for s, k in enumerate(layers)]  # fmt: skip
    ranks = [layout.rank_of(s) for s in range(n)]
    params = [0] * layout.pp
    per_layer = arch.layer_params()
    for r, k in zip(ranks, layers, strict=True):
        params[r] += k * per_layer
    params[ranks[0]] += arch.embedding_params()
    if not (arch.tied_embeddings and ranks[0] == ranks[last]):
        params[ranks[last]] += arch.head_params()
    params = [-(-p_r // layout.tp) for p_r in params]  # per GPU: TP splits every matrix
    times = {k: [sum(p.values()) for p in parts[k]] for k in "FIW"}
    saved = [k * blk.saved_bytes + (arch.head_saved_bytes() / n_gpu if s == last else 0.0)
             for s, k in enumerate(layers)]  # fmt: skip
    saved[0] += arch.embedding_saved_bytes() / layout.cp
    held = [k * blk.held_after_i + (arch.head_weight_grad_bytes() / n_gpu if s == last else 0.0)
            for s, k in enumerate(layers)]  # fmt: skip
    message = arch.boundary_bytes() / n_gpu  # each GPU of a group sends its own share
    send = {same: machine.message_time(message, same) for same in (False, True)}
    same = layout.same_nodes(ranks[:-1], ranks[1:], machine.gpus_per_node).tolist()
    boundary = [0.0 if a == b else send[sm]
                for a, b, sm in zip(ranks[:-1], ranks[1:], same, strict=True)]  # fmt: skip
    memory = _memory_parts(arch, layout, layers, params, blk, message)
    shard_opt = layout.dp if layout.shard != "none" else 1
    step = [n_p / shard_opt * ADAM_BYTES[arch.precision] / bandwidth for n_p in params]
    static = [m["weights"] + m["gradients"] + m["optimizer"] for m in memory]
    return ModelCosts(
        arch, machine, layout, rates, layers, times["F"], times["I"], times["W"],
        [k * comm["hidden_in_b"] for k in layers], boundary, saved, held, params, step, static,
        [m["buffers"] for m in memory], extra={"parts": parts, "memory": memory, "block": blk,
               "fsdp_s": _fsdp_gather_s(arch, machine, layout, layers)},
    )  # fmt: skip


def stage_parts(kind: str, blocks: int, blk, comm: dict, rates: Rates, bandwidth: float,
                head_flops: float = 0.0, head_bytes: float = 0.0) -> dict[str, float]:  # fmt: skip
    """Seconds of one pass ``kind`` of a stage of ``blocks`` blocks (``blk``, with their
    collectives ``comm`` from :func:`block_comm_s`) and the head's FLOPs and memory traffic,
    by part: the matrices (``compute``), the memory-bound operators at ``bandwidth`` bytes/s
    (``elementwise``; none when ``rates`` are measured passes, which hold them), the forward
    recomputed before I, TP's and CP's collectives."""
    rate = {"F": rates.f, "I": rates.i, "W": rates.w}[kind]
    apart = 1.0 if rates.gemms_only else 0.0
    moved = blk.elementwise_bytes[kind]
    again = 0.0
    if kind == "I":
        again = blk.recompute_flops / rates.i + apart * blk.recompute_elementwise_bytes / bandwidth
    return {"compute": (blocks * blk.flops[kind] + head_flops) / rate,
            "elementwise": apart * (blocks * moved + head_bytes) / bandwidth,
            "recompute": blocks * again, "tp": blocks * comm["tp"][kind],
            "cp": blocks * comm["cp"][kind]}  # fmt: skip


def block_comm_s(machine: Machine, layout: Layout, blk, rates: Rates, tp_hidden: float) -> dict:
    """Per block and pass, seconds of TP's collectives (less the share ``tp_hidden`` under the
    GEMMs) and of CP's ring beyond the attention it overlaps; a fully recomputed block's I
    repeats F's. ``hidden_in_b``: what a fused backward hides of I's own two collectives,
    each under its column-parallel matrix's weight-gradient GEMM (at most that GEMM's time)."""
    tp, cp = layout.tp, layout.cp
    out: dict[str, Any] = {"tp": {}, "cp": {}}
    lat, bw = machine.link(tp <= machine.gpus_per_node)
    ring = 2 * (tp - 1) * lat * (1 if blk.tp_bytes and tp > 1 else 0)
    tp_pass = (ring + blk.tp_bytes / bw) * (1 - tp_hidden)
    full = layout.recompute == "full"
    out["tp"] = {"F": tp_pass, "I": tp_pass * (2 if full else 1), "W": 0.0}
    out["hidden_in_b"] = sum(min(tp_pass / 2, w / rates.w) for w in blk.column_w_flops
                             if layout.overlap_tp_backward)  # fmt: skip
    lat, bw = machine.link(tp * cp <= machine.gpus_per_node)
    for kind, rate in (("F", rates.f), ("I", rates.i)):
        ring = (cp - 1) * lat + blk.cp_bytes[kind] / bw if cp > 1 else 0.0
        out["cp"][kind] = max(0.0, ring - blk.attention_flops[kind] / rate)
    if full:
        out["cp"]["I"] += out["cp"]["F"]
    out["cp"]["W"] = 0.0
    return out


def _fsdp_gather_s(arch: Arch, machine: Machine, layout: Layout, layers: list[int]) -> list[float]:
    """Per rank, ZeRO-3's exposed all-gather: each stage's 16-bit parameters are gathered over
    the replicas' ring once per step before the stage's first F (torch's UNSHARD) and kept
    until its last W (RESHARD); the first stage's gather waits, the rest are prefetched under
    the stages before them."""
    dp, lat_bw = layout.dp, machine.link(layout.all_replicas_in_one_node(machine.gpus_per_node))
    out = [0.0] * layout.pp
    if layout.shard != "full" or dp == 1:
        return out
    firsts: dict[int, int] = {}
    for st in range(len(layers)):
        firsts.setdefault(layout.rank_of(st), st)
    for r in range(layout.pp):
        s = firsts[r]
        n_p = layers[s] * arch.layer_params() + (arch.embedding_params() if s == 0 else 0)
        n_p /= layout.tp
        out[r] = (dp - 1) * lat_bw[0] + (dp - 1) / dp * n_p * WEIGHT_BYTES[arch.precision] / lat_bw[1]
    return out


def _memory_parts(arch: Arch, layout: Layout, layers: list[int], params: list[int], blk,
                  message: float) -> list[dict[str, float]]:  # fmt: skip
    """Per GPU of each rank: weights, gradients and optimizer state (each divided over the
    replicas as ``shard`` says) and buffers: the loss's logits (16-bit) and their fp32 softmax
    on the head's GPU, two messages' receive buffers, one block's rebuilt activations while
    it recomputes, and with ``full`` sharding the rank's gathered 16-bit weights and its
    unsharded gradients, held from a stage's first F to its last W (less the shard counted
    under weights and gradients)."""
    p, dp, sh = arch.precision, layout.dp, layout.shard
    w_div = dp if sh == "full" else 1
    g_div = dp if sh in ("gradients", "full") else 1
    o_div = dp if sh != "none" else 1
    last = layout.rank_of(len(layers) - 1)
    out = []
    for r, n_p in enumerate(params):
        buffers = 2 * message + blk.working_bytes
        if r == last:
            buffers += arch.tokens * arch.vocab * (arch.value_bytes + 4) / layout.group
        if sh == "full":
            buffers += n_p * (WEIGHT_BYTES[p] + GRAD_BYTES[p]) * (1 - 1 / dp)
        out.append({"weights": n_p * WEIGHT_BYTES[p] / w_div,
                    "gradients": n_p * GRAD_BYTES[p] / g_div,
                    "optimizer": n_p * OPTIMIZER_BYTES[p] / o_div, "buffers": buffers})  # fmt: skip
    return out

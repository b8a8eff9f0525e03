"""The sweep driver behind ``vpipe bench``: many configs, one launch of P ranks.

A sweep is schedules x microbatch counts x implementations (vpipe's runtime, torch's
``torch.distributed.pipelining``) on one model. All configs are built once per rank, warmed
up, then measured in interleaved rounds (:mod:`vpipe.sweep.rounds`: each config's timed steps
in turn, so machine noise hits every config alike; within ``max_minutes``, more rounds of the
configs whose order is still open). Each timed step starts after a barrier; its time is the
slowest rank's (with ``dp`` replicas, of all ranks x replicas: :mod:`vpipe.sweep.dp_bench`).
Every rank times a host-speed reference before each step (:mod:`vpipe.sweep.reference`), and
each round records the host's state (:mod:`vpipe.trace.host_state`) and the communication
threads' CPU (:mod:`vpipe.trace.thread_cpu`). After each of the first rounds each config runs
one profiled step (interleaved, so calibration and timing see the same host; converted to the
event table on its own rank: no shared filesystem needed; a vpipe config's first is preceded by
its split and forward probes, :mod:`vpipe.sweep.split_probe`), and at the end one memory step
(bytes saved for backward, from autograd's hooks, alike for both implementations; the CUDA
allocator's peak on GPUs). It imports torch only in the rank worker and the post-processing.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vpipe.errors import VpipeError
from vpipe.schedules import catalogue
from vpipe.sweep.harness import IMPLS, RankSpec
from vpipe.sweep.progress import Progress

# Fixed when this module is imported: families registered later join only when named.
DEFAULT_SCHEDULES = catalogue.names(lambda f: f.default_sweep)
QUICK_SCHEDULES = catalogue.names(lambda f: f.quick_sweep)
# The default sweep is compute-bound: MLP blocks 512 -> 1024, 64-row microbatches (batch 512,
# M = 8), so the ranking says something about real hardware; its 8 blocks split into every
# stage count vpipe plan weighs at 2 ranks and into V-schedules at 4. Base rounds take about a
# minute on 2 cores; rounds are added within DEFAULT_MAX_MINUTES.
DEFAULT_MLP_SIZES = {"d_model": 512, "d_hidden": 1024, "n_blocks": 8}
DEFAULT_MAX_MINUTES = 4.0
# Within that budget, rounds also go to configs whose median step time is known to worse than
# +-3% (95%): the fidelity table judges predictions against ratios of these medians, and with
# the base rounds' 9 steps a median on this kind of host is known to +-7-17%, so the table
# would measure timing noise (docs/runtime.md, the fidelity matrix)
DEFAULT_TIMING_PRECISION = 3.0
# --quick: 3 rounds of 2 steps give each pair of configs the 6 pairs an interval needs
# (vpipe.stats.MIN_SAMPLES), and open ones get rounds for up to this long, so that its
# verdict can settle on a quiet host rather than always end in "too few pairs"
QUICK_ROUNDS, QUICK_STEPS, QUICK_MAX_MINUTES = 3, 2, 1.0
DEFAULT_BATCH = 512
DEFAULT_MICROBATCHES = (8,)
# On GPUs (--device cuda) the default is a GPT sized to be compute-bound on an H100/H200-class
# GPU over NCCL: a layer's forward ~0.45 TFLOP (about 1 ms in bf16) against ~16 MB per message,
# 4 sequences of 1024 tokens per microbatch at M=8; n_layers grows to the largest stage count.
GPU_MODEL = "gpt"
GPU_SIZES = {"vocab": 32768, "d_model": 2048, "n_heads": 16, "seq_len": 1024}
GPU_BATCH, GPU_QUICK_BATCH = 32, 16
DEFAULT_PROFILE_STEPS = 6  # calibration takes per-action medians over these (docs/runtime.md)


class BenchError(VpipeError, ValueError):
    """A sweep that cannot run as asked (unknown schedule or impl, batch not divisible...)."""


@dataclass(frozen=True)
class Config:
    """One point of the sweep."""

    schedule: str
    microbatches: int
    impl: str

    @property
    def key(self) -> str:
        return f"{self.schedule}-m{self.microbatches}-{self.impl}"

    def run_id(self, bench_id: str, *, simulated: bool = False) -> str:
        """The runs-table id of this config's measured (or simulated) run in sweep ``bench_id``."""
        return f"{bench_id}-{self.key}" + ("-sim" if simulated else "")


@dataclass
class SweepSpec:
    """Everything that defines a sweep; picklable, sent to every rank."""

    ranks: int = 2
    device: str = "cpu"
    backend: str | None = None
    dtype: str | None = None  # None: bf16 on cuda, fp32 on cpu (vpipe.sweep.harness.DTYPES)
    model: str = "mlp"
    sizes: dict[str, int] = field(default_factory=dict)
    batch: int = DEFAULT_BATCH
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    microbatches: tuple[int, ...] = DEFAULT_MICROBATCHES
    impls: tuple[str, ...] = IMPLS
    warmup: int = 2
    steps: int = 3
    rounds: int = 3
    profile: bool = True
    profile_steps: int = DEFAULT_PROFILE_STEPS
    seed: int = 0
    trace_dir: str | None = None
    progress: bool = True
    verbose: bool = False  # the profiler's trace-point lines on stderr
    profile_ops: bool = False  # every aten op in the profiled steps, not only the action spans
    # vpipe's runtime knobs (vpipe.runtime.Pipeline): receive lookahead, message bundling
    recv_lookahead: int = 1
    bundle_messages: bool = True
    post_thread: bool | None = None  # None: on gloo
    recompute: str = "none"  # activation recomputation (vpipe.runtime.recompute)
    cpu_allocator: str = "cached"  # how each rank's malloc keeps freed memory (host_memory)
    # cross-run comparisons (vpipe.report.crossrun): independent launches, a known injected delay
    blocks: int = 1
    # the memory step at the end of a launch; blocks after a sweep's first skip it, as only
    # the first block's memory is kept (vpipe.sweep.blocks.merge_blocks)
    memory_step: bool = True
    # a paced side's gate directory (vpipe.sweep.gate): the timed rounds start when asked
    gate: str | None = None
    inject_delay_ms: float = 0.0  # extra sleep per step on rank inject_delay_rank
    inject_delay_pct: float = 0.0  # and this % of that rank's previous step
    inject_delay_rank: int = 0
    # data parallel (vpipe.sweep.dp_bench): replicas of the pipeline, ranks x dp processes
    dp: int = 1
    dp_bucket_bytes: int | None = None
    # rounds added after the base ones to configs whose order is open (vpipe.sweep.rounds),
    # while they fit before `deadline` (time.time() seconds, set when the sweep starts: the
    # command's start plus max_minutes); 0: the rounds are fixed
    max_minutes: float = 0.0
    deadline: float | None = None
    # and to configs whose median step time is not yet known to +- this many percent (95%)
    timing_precision: float = 0.0
    # torch configs that failed to run, key -> cause (vpipe.sweep.torch_failures): left out;
    # run_sweep fills it in, and copies made by dataclasses.replace share it
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Processes of the sweep: pipeline ranks x data-parallel replicas."""
        return self.ranks * self.dp

    def __post_init__(self) -> None:
        self.schedules = tuple(catalogue.canonical(s) for s in self.schedules)
        self.microbatches = tuple(int(m) for m in self.microbatches)
        self.impls = tuple(self.impls)
        if self.backend is None:
            self.backend = "nccl" if self.device == "cuda" else "gloo"

    def configs(self) -> list[Config]:
        """Every (schedule, microbatches, impl), less torch for families torch has no class
        for (those run on vpipe only) and less the torch configs that ``failed``."""
        vpipe_only = catalogue.names(lambda f: f.torch_class is None)
        return [
            Config(s, m, i)
            for s in self.schedules
            for m in self.microbatches
            for i in self.impls
            if not (i == "torch" and s in vpipe_only) and Config(s, m, i).key not in self.failed
        ]

    def leave_out_unrunnable(self) -> str | None:
        """Drop the torch baseline where it cannot run (CUDA over gloo) and say why in one line;
        BenchError when it was all the sweep asked for."""
        from vpipe.sweep.harness import torch_baseline_refusal

        why = torch_baseline_refusal(self.device, self.backend or "")
        if why is None or "torch" not in self.impls:
            return None
        if set(self.impls) == {"torch"}:
            raise BenchError(why)
        self.impls = tuple(i for i in self.impls if i != "torch")
        return f"torch baseline left out: {why}"

    def validate(self) -> None:
        """Reject a sweep that cannot run, before any process starts."""
        from vpipe.models import resolve_sizes
        from vpipe.schedules import schedule_names

        for what, value, low in (
            ("ranks", self.ranks, 1),
            ("batch", self.batch, 1),
            ("steps", self.steps, 1),
            ("rounds", self.rounds, 1),
            ("warmup", self.warmup, 0),
            ("recv-lookahead", self.recv_lookahead, 0),
            ("profile-steps", self.profile_steps, 1),
            ("blocks", self.blocks, 1),
            ("inject-delay-ms", self.inject_delay_ms, 0),
            ("inject-delay-pct", self.inject_delay_pct, 0),
            ("dp", self.dp, 1),
            ("max-minutes", self.max_minutes, 0),
            ("timing-precision", self.timing_precision, 0),
        ):
            if value < low:
                raise BenchError(f"--{what} must be >= {low}, got {value}")
        if self.timing_precision >= 100:
            raise BenchError(
                f"--timing-precision is a percentage below 100, got {self.timing_precision:g}"
            )
        if self.max_minutes and self.blocks > 1:
            raise BenchError(
                "--max-minutes adds rounds to one launch, and --blocks K repeats the same "
                "rounds K times: give --max-minutes 0 with --blocks"
            )
        if not self.schedules or not self.microbatches or not self.impls:
            raise BenchError(
                "the sweep is empty: give at least one schedule, microbatch count "
                "and implementation"
            )
        for impl in self.impls:
            if impl not in IMPLS:
                raise BenchError(f"unknown implementation {impl!r}: choose from {', '.join(IMPLS)}")
        try:
            resolve_sizes(self.model, 1, self.sizes)  # imports torch; far cheaper than a launch
        except VpipeError as e:
            raise BenchError(str(e)) from None
        if self.device not in ("cpu", "cuda"):
            raise BenchError(f"unknown device {self.device!r}: choose cpu or cuda")
        names = schedule_names()
        for s in self.schedules:
            if s not in names:
                raise BenchError(f"unknown schedule {s!r}: choose from {', '.join(names)}")
        if not self.configs():  # torch only, for families torch has no class for
            raise BenchError(
                "the sweep is empty: torch.distributed.pipelining has no class for "
                f"{', '.join(self.schedules)}; run them with --impl vpipe"
            )
        if not 0 <= self.inject_delay_rank < self.ranks:
            raise BenchError(
                f"--inject-delay-rank {self.inject_delay_rank} is not a rank of {self.ranks}"
            )
        if self.dp > 1:
            from vpipe.sweep.dp_bench import check_dp_sweep

            check_dp_sweep(self)
        for m in self.microbatches:
            if m < 1 or self.batch % m:
                raise BenchError(f"batch {self.batch} is not divisible into {m} microbatches")
        built: set[int] = set()  # every config with this stage count splits the same model
        for rank_spec in self.rank_specs().values():
            n_stages = rank_spec.schedule.n_stages
            rank_spec.check(build=n_stages not in built)  # ScheduleError / ModelError name it
            built.add(n_stages)

    def rank_specs(self) -> dict[Config, RankSpec]:
        """Each config's rank harness spec, in sweep order, its schedule built here, in the
        launching process. Model sizes are fixed across the sweep, grown to the largest stage
        count, so every schedule splits the same model."""
        from vpipe.models import resolve_sizes
        from vpipe.schedules import make_schedule

        configs = self.configs()
        built = {
            (c.schedule, c.microbatches): make_schedule(c.schedule, self.ranks, c.microbatches)
            for c in configs
        }
        max_stages = max((s.n_stages for s in built.values()), default=1)
        sizes = resolve_sizes(self.model, max_stages, self.sizes)
        return {
            c: RankSpec(
                built[(c.schedule, c.microbatches)],
                impl=c.impl,
                model=self.model,
                sizes=sizes,
                batch=self.batch,
                seed=self.seed,
                device=self.device,
                backend=self.backend,
                dtype=self.dtype,
                bundle_messages=self.bundle_messages,
                recv_lookahead=self.recv_lookahead,
                post_thread=self.post_thread,
                recompute=self.recompute,
                inject_delay_s=self.inject_delay_ms / 1e3,
                inject_delay_share=self.inject_delay_pct / 100,
                inject_delay_rank=self.inject_delay_rank,
                dp=self.dp,
                dp_bucket_bytes=self.dp_bucket_bytes,
            )
            for c in configs
        }


# ---------------------------------------------------------------------------------------------
# The rank worker


def rank_worker(
    rank: int, world: int, spec: SweepSpec, run_id: str, rank_specs: dict[Config, RankSpec],
    failures: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the whole sweep on one rank (process group already initialised); a torch config
    that fails its warm-up is written to ``failures`` (:mod:`vpipe.sweep.torch_failures`).

    Returns this rank's results: per config its step times (already the max over ranks),
    reference times and each step's round (:mod:`vpipe.sweep.rounds`), per-config memory and,
    when profiling, per-config event tables (one profiled step per profile round).
    """
    import pandas as pd
    import torch

    from vpipe.runtime.host_memory import apply_cpu_allocator
    from vpipe.sweep.dp_bench import step_record
    from vpipe.sweep.gate import RankGate, gated_rounds
    from vpipe.sweep.harness import build
    from vpipe.sweep.reference import DeviceReference, Reference, device_round
    from vpipe.sweep.rounds import Rounds, comm_thread_clock
    from vpipe.sweep.torch_failures import warm_up

    if world != spec.world_size:
        asks = f"{spec.ranks} x {spec.dp} replicas" if spec.dp > 1 else f"{spec.ranks}"
        raise BenchError(f"the job has {world} ranks but the sweep asks for {asks}")
    configs = list(rank_specs)  # the launcher's view: ranks may not know a plugin family
    allocator = apply_cpu_allocator(spec.cpu_allocator)
    temp_traces = spec.profile and spec.trace_dir is None
    if temp_traces:  # per host, so multi-host jobs need no shared filesystem
        spec = replace(spec, trace_dir=tempfile.mkdtemp(prefix=f"vpipe-traces-{rank}-"))
    profile_rounds = spec.profile_steps if spec.profile else 0
    n_units = len(configs) * (1 + spec.memory_step + spec.rounds + profile_rounds)
    progress = Progress(n_units, spec.progress and rank == 0)
    try:
        harnesses = []
        for cfg in configs:
            make = lambda c=cfg: build(rank_specs[c], rank)  # noqa: E731
            harnesses.append(
                warm_up(cfg.key, cfg.impl, cfg.schedule, make, spec.warmup, rank, failures)
            )
            progress.advance(f"warm up {cfg.key}")
        ref_shape = sweep_reference_shape(spec, rank_specs)
        device = harnesses[0].device
        # on a GPU the per-step reference runs on the CPU and describes the host side; the
        # device's own reference and state are read once per round (vpipe.trace.device_state)
        on_gpu = getattr(device, "type", "cpu") == "cuda"
        reference = Reference(ref_shape, torch.device("cpu") if on_gpu else device)
        device_reference = DeviceReference(device) if on_gpu else None
        dp_steps: list[dict[str, Any]] = []

        def record(i: int, index: int, h: Any) -> None:  # this rank's reductions in the step
            dp_steps.append(step_record(i, index, rank, spec.ranks, h))

        timed = Rounds(spec, configs, harnesses, reference, rank, progress.advance,
                       record if spec.dp > 1 else None,
                       lambda: device_round(device_reference, device),
                       comm_thread_clock(world) if not on_gpu and spec.dp == 1 else None)  # fmt: skip
        traced: dict[str, list[Any]] = {cfg.key: [] for cfg in configs}
        probes: dict[str, list[float]] = {}
        forwards: dict[str, dict[int, float]] = {}

        def profile_round(r: int) -> None:  # interleaved with the timed rounds
            for cfg, h in zip(configs, harnesses, strict=True):
                out = Path(spec.trace_dir) / cfg.key / f"round{r}"
                meta = _trace_meta(spec, cfg, h, run_id)
                # torch's runtime marks no waits: they are read from its operators
                ops = spec.profile_ops or cfg.impl == "torch"
                if r == 0:  # a split backward and a forward alone (vpipe.sweep.split_probe)
                    probes[cfg.key] = h.split_probe()
                    forwards[cfg.key] = h.forward_probe()
                ev = h.profiled_step(out, meta, verbose=spec.verbose, ops=ops)
                # one recorded step per round: number it by its round (torch's traces count
                # their ProfilerStep from 1 again in every round)
                traced[cfg.key].append(ev.assign(step=ev["step"].where(ev["step"] < 0, r)))
                progress.advance(f"profile {r + 1}/{profile_rounds} {cfg.key}")

        everyone = list(range(len(configs)))
        if spec.gate is not None:  # vpipe ab's rounds, one at a time (vpipe.sweep.gate)
            gated_rounds(RankGate(spec.gate, rank), timed, everyone)
        else:
            for r in range(spec.rounds):
                timed.run(r, everyone)
                if r < profile_rounds:
                    profile_round(r)
        for r in range(spec.rounds, profile_rounds):
            profile_round(r)
        r = spec.rounds
        while active := timed.more():  # the configs whose order is open, within the budget
            progress.extend(len(active))
            timed.run(r, active)
            r += 1
        host = timed.host_rounds()
        events = {k: pd.concat(v, ignore_index=True) for k, v in traced.items() if v}
        memory = {}
        if spec.memory_step:
            for cfg, h in zip(configs, harnesses, strict=True):
                memory[cfg.key] = h.memory_step()
                progress.advance(f"memory {cfg.key}")
    finally:
        progress.close()
        if temp_traces:
            shutil.rmtree(spec.trace_dir, ignore_errors=True)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_allocator": allocator,
        "sizes": dict(next(iter(rank_specs.values())).sizes) if rank_specs else {},
        "n_stages": {cfg.key: h.n_stages for cfg, h in zip(configs, harnesses, strict=True)},
        "tokens_per_sample": harnesses[0].tokens_per_sample if harnesses else None,
        "times": timed.times,
        "refs": timed.refs,
        "rounds": timed.rounds,
        "comm_thread_cpu_s": timed.comm_cpu_s,
        "split_probe": probes,
        "forward_probe": forwards,
        "stop": timed.stop,
        "reference": ref_shape,
        "host_rounds": host,
        "memory": memory,
        "events": events,
        **({"dp_steps": dp_steps} if spec.dp > 1 else {}),
    }


def sweep_reference_shape(spec: SweepSpec, rank_specs: dict[Config, RankSpec]) -> dict[str, int]:
    """The sweep's host-speed reference shape (:mod:`vpipe.sweep.reference`): one microbatch of the
    largest microbatch count through the model's first layer sizes."""
    from vpipe.sweep.reference import reference_shape

    sizes = dict(next(iter(rank_specs.values())).sizes) if rank_specs else dict(spec.sizes)
    return reference_shape(sizes, spec.batch, max(spec.microbatches))


def _trace_meta(spec: SweepSpec, cfg: Config, h: Any, bench_id: str) -> dict[str, Any]:
    """What a config's trace carries about itself (read back by ``vpipe trace``)."""
    return {
        "run_id": cfg.run_id(bench_id),
        "schedule": cfg.schedule,
        "impl": cfg.impl,
        "ranks": spec.ranks,
        "stages": h.n_stages,
        "microbatches": cfg.microbatches,
        "model": spec.model,
        "sizes": dict(h.spec.sizes),
        "batch": spec.batch,
        "tokens_per_sample": h.tokens_per_sample,
        "dtype": h.spec.precision,
        "recv_lookahead": spec.recv_lookahead,
        "bundle_messages": spec.bundle_messages,
        "post_thread": cfg.impl == "vpipe" and h.spec.posts_from_thread,
        "recompute": spec.recompute,
    }


def run_sweep(spec: SweepSpec, run_id: str | None = None) -> list[dict[str, Any]]:
    """Launch (or join, under torchrun) the sweep; return every rank's results on the
    coordinating process (the spawning parent, or rank 0 of a torchrun job) and [] elsewhere.
    A torch config that fails its warm-up goes into ``spec.failed`` and the sweep is launched
    again without it (:mod:`vpipe.sweep.torch_failures`)."""
    from vpipe.runtime import launch
    from vpipe.sweep.torch_failures import launch_until_done

    run_id = run_id or new_run_id()
    if launch.in_torchrun():
        rank_specs = spec.rank_specs()
        import torch.distributed as dist

        rank, world, _ = launch.init_from_env(device=spec.device, backend=spec.backend)
        try:
            mine = rank_worker(rank, world, spec, run_id, rank_specs)
            gathered: list[Any] = [None] * world if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        finally:
            launch.leave_job()
        return list(gathered) if rank == 0 else []
    once = lambda failures: launch.spawn(rank_worker, spec.world_size, spec, run_id,  # noqa: E731
        spec.rank_specs(), failures, backend=spec.backend, timeout_s=1800)  # fmt: skip
    return launch_until_done(once, spec.failed, lambda: len(spec.configs()))


def new_run_id() -> str:
    """A sortable, unique id for one sweep."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid() % 100000:05d}"


def spec_dict(spec: SweepSpec) -> dict[str, Any]:
    """The spec as JSON-ready metadata (the data-parallel fields only with ``dp > 1``)."""
    d = asdict(spec)
    del d["deadline"]  # a moment of this launch, not the sweep's definition
    del d["gate"]  # how the rounds were paced, not what the sweep is
    del d["memory_step"]  # which of its blocks measure memory, not what the sweep is
    if not spec.failed:
        del d["failed"]
    if spec.dp == 1:
        del d["dp"], d["dp_bucket_bytes"]
    for k in ("schedules", "microbatches", "impls"):
        d[k] = list(d[k])
    return d

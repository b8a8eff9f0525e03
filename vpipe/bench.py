"""The sweep driver behind ``vpipe bench``: many configs, one launch of P ranks.

A sweep is schedules x microbatch counts x implementations (vpipe's runtime, torch's
``torch.distributed.pipelining``) on one model. All configs are built once per rank, warmed
up, then measured in interleaved rounds (for each round, for each config, ``steps`` timed
steps) so that machine noise hits every config alike. Each timed step starts after a barrier;
its time is the slowest rank's. Afterwards each config runs one profiled step (Kineto trace,
converted to the event table on its own rank, so no shared filesystem is needed across hosts)
and one memory step (live saved-activation bytes from autograd's saved-tensor hooks, the same
measure for both implementations; the CUDA allocator's peak on GPUs).

This module imports torch only inside the rank worker and the post-processing.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from vpipe.errors import VpipeError
from vpipe.schedules import catalogue

# Fixed when this module is imported: families registered later join only when named.
DEFAULT_SCHEDULES = catalogue.names(lambda f: f.default_sweep)
QUICK_SCHEDULES = catalogue.names(lambda f: f.quick_sweep)
IMPLS = ("vpipe", "torch")
# Smaller than the models' defaults so that the default sweep takes about a minute on 2 cores.
BENCH_SIZES = {"mlp": {"d_model": 256, "d_hidden": 1024}}


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
    model: str = "mlp"
    sizes: dict[str, int] = field(default_factory=dict)
    batch: int = 32
    schedules: tuple[str, ...] = DEFAULT_SCHEDULES
    microbatches: tuple[int, ...] = (4, 8)
    impls: tuple[str, ...] = IMPLS
    warmup: int = 2
    steps: int = 3
    rounds: int = 3
    profile: bool = True
    seed: int = 0
    trace_dir: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        self.schedules = tuple(self.schedules)
        self.microbatches = tuple(int(m) for m in self.microbatches)
        self.impls = tuple(self.impls)
        if self.backend is None:
            self.backend = "nccl" if self.device == "cuda" else "gloo"

    def configs(self) -> list[Config]:
        """Every (schedule, microbatches, impl), less torch for families torch has no class
        for: those run on vpipe only."""
        vpipe_only = catalogue.names(lambda f: f.torch_class is None)
        return [
            Config(s, m, i)
            for s in self.schedules
            for m in self.microbatches
            for i in self.impls
            if not (i == "torch" and s in vpipe_only)
        ]

    def validate(self) -> None:
        """Reject a sweep that cannot run, before any process starts."""
        from vpipe.schedules import make_schedule, schedule_names

        names = schedule_names()
        for what, value, low in (
            ("ranks", self.ranks, 1),
            ("batch", self.batch, 1),
            ("steps", self.steps, 1),
            ("rounds", self.rounds, 1),
            ("warmup", self.warmup, 0),
        ):
            if value < low:
                raise BenchError(f"--{what} must be >= {low}, got {value}")
        if not self.schedules or not self.microbatches or not self.impls:
            raise BenchError(
                "the sweep is empty: give at least one schedule, microbatch count "
                "and implementation"
            )
        for impl in self.impls:
            if impl not in IMPLS:
                raise BenchError(f"unknown implementation {impl!r}: choose from {', '.join(IMPLS)}")
        from vpipe.models import DEFAULT_SIZES  # imports torch; still far cheaper than a launch

        if self.model not in DEFAULT_SIZES:
            raise BenchError(
                f"unknown model {self.model!r}: choose from {', '.join(DEFAULT_SIZES)}"
            )
        unknown = sorted(set(self.sizes) - set(DEFAULT_SIZES[self.model]))
        if unknown:
            raise BenchError(
                f"model {self.model!r} has no size {unknown[0]!r}: sizes are "
                f"{', '.join(DEFAULT_SIZES[self.model])}"
            )
        if self.device not in ("cpu", "cuda"):
            raise BenchError(f"unknown device {self.device!r}: choose cpu or cuda")
        for s in self.schedules:
            if s not in names:
                raise BenchError(f"unknown schedule {s!r}: choose from {', '.join(names)}")
        if not self.configs():  # torch only, for families torch has no class for
            raise BenchError(
                "the sweep is empty: torch.distributed.pipelining has no class for "
                f"{', '.join(self.schedules)}; run them with --impl vpipe"
            )
        for m in self.microbatches:
            if m < 1 or self.batch % m:
                raise BenchError(f"batch {self.batch} is not divisible into {m} microbatches")
            for s in self.schedules:
                schedule = make_schedule(s, self.ranks, m)  # ScheduleError names the problem
                if "torch" in self.impls and catalogue.get(s).torch_class is not None:
                    from vpipe.baselines.torch_pp import torch_placement

                    torch_placement(s, self.ranks, schedule.n_stages)


# ---------------------------------------------------------------------------------------------
# Progress (rank 0 only)


class _Progress:
    """A rich progress bar on a terminal, plain lines otherwise (logs, CI, pytest)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._t0 = time.perf_counter()
        self._bar: Any = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(
                TextColumn("{task.description:<34}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TimeElapsedColumn(),
            )
            self._task = self._bar.add_task("starting", total=total)
            self._bar.start()

    def advance(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=what)
        else:
            print(
                f"[{self.done}/{self.total} {time.perf_counter() - self._t0:6.1f}s] {what}",
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# ---------------------------------------------------------------------------------------------
# Memory measure shared by both implementations


class SavedTensorMeter:
    """Live bytes of tensors autograd saved for backward (activations), and their peak.

    Storages of the tensors given as ``exclude`` (parameters, and so also views of them such
    as a transposed weight) are not counted; a storage saved several times counts once. A
    packed tensor is released when autograd frees the node that saved it (after its backward or
    weight-gradient computation), so the peak includes activations held for a deferred W.
    """

    def __init__(self, exclude: Iterable[Any] = ()) -> None:
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live = 0
        self.peak = 0
        self.samples: list[tuple[int, int]] = []
        self._refs: dict[int, list[int]] = {}

    def _add(self, key: int, nbytes: int) -> None:
        ref = self._refs.get(key)
        if ref is None:
            self._refs[key] = [1, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.samples.append((time.time_ns(), self.live))
        else:
            ref[0] += 1

    def _drop(self, key: int) -> None:
        ref = self._refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[key]
            self.live -= ref[1]
            self.samples.append((time.time_ns(), self.live))

    def hooks(self) -> Any:
        """A context manager under which autograd's saved tensors are metered."""
        import torch

        meter = self

        class _Held:
            __slots__ = ("t", "key")

            def __init__(self, t: Any) -> None:
                storage = t.untyped_storage()
                self.t, self.key = t, storage.data_ptr()
                meter._add(self.key, storage.nbytes())

            def __del__(self) -> None:
                meter._drop(self.key)

        def pack(t: Any) -> Any:
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in meter._exclude:
                return t
            return _Held(t)

        def unpack(x: Any) -> Any:
            return x.t if isinstance(x, _Held) else x

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


# ---------------------------------------------------------------------------------------------
# The rank worker


@dataclass
class _Runner:
    config: Config
    step: Callable[[], Any]
    params: list[Any]
    stats: Callable[[], dict[str, Any]]
    n_stages: int
    tokens_per_sample: int | None


def _sizes_for(spec: SweepSpec, max_stages: int) -> dict[str, int]:
    """Model sizes fixed across the sweep, so every schedule splits the same model."""
    from vpipe.models import DEFAULT_SIZES

    sizes = {**DEFAULT_SIZES[spec.model], **BENCH_SIZES.get(spec.model, {})}
    for key, need in (("n_blocks", max_stages), ("n_layers", max_stages - 2)):
        if key in sizes:
            sizes[key] = max(sizes[key], need)
    sizes.update(spec.sizes)
    return sizes


def _build_runner(spec: SweepSpec, cfg: Config, rank: int, sizes: dict[str, int]) -> _Runner:
    import torch

    from vpipe.models import build_model
    from vpipe.schedules import make_schedule

    schedule = make_schedule(cfg.schedule, spec.ranks, cfg.microbatches)
    model = build_model(spec.model, schedule.n_stages, seed=spec.seed, **sizes)
    device = (
        torch.device(spec.device, torch.cuda.current_device())
        if spec.device == "cuda"
        else torch.device("cpu")
    )
    n_stages = schedule.n_stages
    if cfg.impl == "vpipe":
        placement = schedule.placement
    else:
        from vpipe.baselines.torch_pp import torch_placement

        placement = torch_placement(cfg.schedule, spec.ranks, n_stages)
    modules = {s: model.stages[s].to(device) for s, r in placement.items() if r == rank}
    inputs, targets = model.make_batch(spec.batch, spec.seed)
    x = inputs.to(device) if 0 in modules else None
    y = targets.to(device) if n_stages - 1 in modules else None
    if cfg.impl == "vpipe":
        import torch.distributed as dist

        from vpipe.runtime import Pipeline

        group = dist.group.WORLD

        pipe: Any = Pipeline(
            schedule, modules=modules, loss_fn=model.loss_fn, group=group, device=device
        )
    else:
        from vpipe.baselines.torch_pp import TorchPipeline

        pipe = TorchPipeline(
            cfg.schedule,
            modules,
            model.loss_fn,
            n_stages=n_stages,
            n_microbatches=cfg.microbatches,
            device=device,
        )
    params = [p for m in modules.values() for p in m.parameters()]

    def step() -> Any:
        for p in params:
            p.grad = None
        return pipe.step(inputs=x, targets=y)

    return _Runner(cfg, step, params, lambda: dict(pipe.stats), n_stages, model.tokens_per_sample)


def _timed_step(runner: _Runner, cuda: bool) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    runner.step()
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _profile_config(spec: SweepSpec, runner: _Runner, rank: int, run_id: str) -> Any:
    """One profiled step of a config on this rank, converted to the event table (or None)."""
    import torch.distributed as dist

    from vpipe.trace.kineto import convert
    from vpipe.trace.record import StepProfiler

    cfg = runner.config
    out = Path(spec.trace_dir) / cfg.key
    meta = dict(
        run_id=run_id,
        schedule=cfg.schedule,
        impl=cfg.impl,
        ranks=spec.ranks,
        microbatches=cfg.microbatches,
        model=spec.model,
        batch=spec.batch,
    )
    with StepProfiler(out, rank, wait=0, warmup=1, active=1, metadata=meta) as prof:
        for _ in range(2):
            dist.barrier()
            runner.step()
            prof.step()
    return convert(
        [out / f"rank{rank}.json"], run_id=run_id, impl=cfg.impl, schedule=cfg.schedule
    ).events


def _memory_config(runner: _Runner, cuda: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    meter = SavedTensorMeter(exclude=runner.params)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    with meter.hooks():
        runner.step()
    out: dict[str, Any] = {"peak_bytes": meter.peak, "samples": meter.samples}
    if cuda:
        torch.cuda.synchronize()
        out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated())
    stats = runner.stats()
    if "peak_live_activation_bytes" in stats:
        out["runtime_peak_bytes"] = stats["peak_live_activation_bytes"]
    return out


def rank_worker(rank: int, world: int, spec: SweepSpec, run_id: str) -> dict[str, Any]:
    """Run the whole sweep on one rank (process group already initialised).

    Returns this rank's results: step times (already the max over ranks), per-config memory
    and, when profiling, per-config event tables.
    """
    import torch
    import torch.distributed as dist

    if world != spec.ranks:
        raise BenchError(f"the job has {world} ranks but the sweep asks for {spec.ranks}")
    from vpipe.schedules import make_schedule

    cuda = spec.device == "cuda"
    configs = spec.configs()
    temp_traces = spec.profile and spec.trace_dir is None
    if temp_traces:  # per host, so multi-host jobs need no shared filesystem
        spec = replace(spec, trace_dir=tempfile.mkdtemp(prefix=f"vpipe-traces-{rank}-"))
    max_stages = max(
        make_schedule(c.schedule, spec.ranks, c.microbatches).n_stages for c in configs
    )
    sizes = _sizes_for(spec, max_stages)
    n_units = len(configs) * (2 + spec.rounds + (1 if spec.profile else 0))
    progress = _Progress(n_units, spec.progress and rank == 0)
    try:
        runners = []
        for cfg in configs:
            runner = _build_runner(spec, cfg, rank, sizes)
            for _ in range(spec.warmup):
                dist.barrier()
                runner.step()
            runners.append(runner)
            progress.advance(f"warm up {cfg.key}")
        times = torch.zeros(len(configs), spec.rounds * spec.steps, dtype=torch.float64)
        for r in range(spec.rounds):
            for i, runner in enumerate(runners):
                for k in range(spec.steps):
                    times[i, r * spec.steps + k] = _timed_step(runner, cuda)
                progress.advance(f"round {r + 1}/{spec.rounds} {runner.config.key}")
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        memory, events = {}, {}
        for runner in runners:
            key = runner.config.key
            if spec.profile:
                events[key] = _profile_config(spec, runner, rank, f"{run_id}-{key}")
                progress.advance(f"profile {key}")
            memory[key] = _memory_config(runner, cuda)
            progress.advance(f"memory {key}")
    finally:
        progress.close()
        if temp_traces:
            shutil.rmtree(spec.trace_dir, ignore_errors=True)
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "sizes": sizes,
        "n_stages": {r.config.key: r.n_stages for r in runners},
        "tokens_per_sample": runners[0].tokens_per_sample if runners else None,
        "times": times.tolist(),
        "memory": memory,
        "events": events,
    }


def run_sweep(spec: SweepSpec, run_id: str | None = None) -> list[dict[str, Any]]:
    """Launch (or join, under torchrun) the sweep; return every rank's results on the
    coordinating process (the spawning parent, or rank 0 of a torchrun job) and [] elsewhere."""
    from vpipe.runtime import launch

    run_id = run_id or new_run_id()
    if launch.in_torchrun():
        import torch.distributed as dist

        rank, world, _ = launch.init_from_env(device=spec.device, backend=spec.backend)
        try:
            mine = rank_worker(rank, world, spec, run_id)
            gathered: list[Any] = [None] * world if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        finally:
            dist.destroy_process_group()
        return list(gathered) if rank == 0 else []
    return launch.spawn(rank_worker, spec.ranks, spec, run_id, backend=spec.backend, timeout_s=1800)


def new_run_id() -> str:
    """A sortable, unique id for one sweep."""
    return time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + f"-{os.getpid() % 100000:05d}"


def spec_dict(spec: SweepSpec) -> dict[str, Any]:
    """The spec as JSON-ready metadata."""
    d = asdict(spec)
    for k in ("schedules", "microbatches", "impls"):
        d[k] = list(d[k])
    return d


def parse_list(text: str | Sequence[str]) -> list[str]:
    """Comma-separated CLI list (or an already split one) without blanks."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return [s.strip() for s in items if s.strip()]


def parse_sizes(text: str) -> dict[str, int]:
    """``"d_model=64,n_blocks=8"`` -> ``{"d_model": 64, "n_blocks": 8}``."""
    sizes: dict[str, int] = {}
    for item in parse_list(text):
        key, sep, value = item.partition("=")
        if not sep or not value.strip().isdigit():
            raise VpipeError(f"--sizes: expected NAME=INT items, got {item!r}")
        sizes[key.strip()] = int(value)
    return sizes

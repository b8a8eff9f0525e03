"""One rank harness: build this rank's pipeline once, then step, time, profile and meter it.

Everything that runs a pipeline on a rank (``vpipe run``, ``vpipe bench``, the asv suite, the
tests) goes through :func:`build`: a :class:`RankSpec` (schedule, implementation, model, sizes,
batch, seed, device, backend) gives a :class:`RankHarness` holding this rank's stage modules,
its batch slice, and vpipe's :class:`~vpipe.runtime.Pipeline` or torch's baseline
(:class:`~vpipe.baselines.TorchPipeline`) over the same modules. The harness is the one place
for the device and backend choice, the torch placement check, the reference gradient check and
the memory meter (:class:`~vpipe.sweep.memory_meter.SavedTensorMeter`: bytes autograd saves for backward, the same
measure for both implementations, plus the CUDA allocator's peak on GPUs).

A spec carries the built :class:`~vpipe.ir.Schedule`, not a name, so schedules made in the
launching process (a registered plugin family, a CSV file) reach every rank as they are.
Importing this module does not import torch.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vpipe.errors import ScheduleError, VpipeError
from vpipe.ir import Schedule
from vpipe.runtime.launch import local_device
from vpipe.sweep.memory_meter import SavedTensorMeter

IMPLS = ("vpipe", "torch")
DEVICES = ("cpu", "cuda")
# Precisions a run's stages compute and communicate in (parameters, activations and gradients
# cast alike; losses in float32), by name -> torch dtype name.
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# The reference check's default relative tolerance per precision (the reference runs in
# float32 on the CPU from the same weights, rounded to the precision). Worst errors measured
# on zbv at P=1, M=4, batch 32: fp32 1.5e-7 (gpt) and 1.7e-7 (mlp); bf16 3.8e-2 (gpt) and
# 9.8e-3 (mlp); fp16 0.14 (gpt: a LayerNorm weight's gradient, which underflows without loss
# scaling, which vpipe does not do) and 1.3e-3 (mlp).
CHECK_TOL = {"fp32": 1e-5, "bf16": 1e-1, "fp16": 2e-1}


def default_dtype(device: str) -> str:
    """The precision people train in on ``device``: bf16 on GPUs, fp32 on CPUs."""
    return "bf16" if device == "cuda" else "fp32"


def default_backend(device: str) -> str:
    """The process-group backend for a device kind: NCCL on GPUs, gloo on CPUs."""
    return "nccl" if device == "cuda" else "gloo"


def torch_baseline_refusal(device: str, backend: str) -> str | None:
    """Why torch's baseline cannot run on ``device`` over ``backend`` (None: it can).

    torch.distributed.pipelining hands its stages' device tensors to the process group as they
    are; gloo then writes from a device pointer and the rank aborts. vpipe's runtime stages
    such messages through the host, so it runs there."""
    if device == "cuda" and backend == "gloo":
        return (
            "the torch baseline cannot run CUDA tensors over gloo (torch.distributed.pipelining "
            "hands device tensors to gloo, which aborts the rank): use --backend nccl with one "
            "GPU per rank, or --impl vpipe (vpipe stages its messages through the host)"
        )
    return None


@dataclass(frozen=True)
class RankSpec:
    """What one rank builds; picklable, made once in the launching process.

    ``schedule`` is compute-only or lowered; the vpipe implementation lowers a compute-only
    one, torch's runs the compute-only form through its class of the same name, or, with
    ``torch_program``, through its ``_PipelineScheduleRuntime`` loaded with this very schedule
    (a CSV file's). ``sizes`` are the model's sizes as given (the defaults fill the rest).
    """

    schedule: Schedule
    impl: str = "vpipe"
    model: str = "mlp"
    sizes: Mapping[str, int] = field(default_factory=dict)
    batch: int = 32
    seed: int = 0
    device: str = "cpu"
    backend: str | None = None
    dtype: str | None = None  # a DTYPES name; None: default_dtype(device)
    torch_program: bool = False  # torch runs ``schedule`` itself (its CSV runtime), not a class
    # vpipe's runtime knobs (see vpipe.runtime.Pipeline)
    bundle_messages: bool = True
    recv_lookahead: int = 1
    static_shapes: bool = True  # every step of a harness feeds the same batch shape
    comm_channels: bool | None = None  # one process group per direction (None: on NCCL)
    post_thread: bool | None = None  # post communication off the compute thread (None: gloo)
    time_actions: bool = False  # CUDA events per action, in stats["action_times"] (CUDA only)
    # a known slowdown to check that comparisons catch one: seconds slept per step on one rank,
    # plus a share of that rank's previous step (a slowdown in proportion to the step, as extra
    # work would be, whatever the host's load)
    inject_delay_s: float = 0.0
    inject_delay_share: float = 0.0
    inject_delay_rank: int = 0
    # data parallel: replicas of the pipeline (world = ranks x dp; vpipe.runtime.data_parallel),
    # each on its own shard of the batch, gradients all-reduced in buckets of dp_bucket_bytes
    dp: int = 1
    dp_bucket_bytes: int | None = None
    # what each stage keeps for backward: none, full or selective (vpipe.runtime.recompute;
    # torch's baseline: torch.utils.checkpoint on the same modules)
    recompute: str = "none"

    @property
    def world_size(self) -> int:
        return self.schedule.n_ranks * self.dp

    @property
    def process_backend(self) -> str:
        return self.backend or default_backend(self.device)

    @property
    def precision(self) -> str:
        """The run's precision (a :data:`DTYPES` name)."""
        return self.dtype or default_dtype(self.device)

    @property
    def posts_from_thread(self) -> bool:
        """Whether vpipe's runtime posts communication from its poster thread."""
        from vpipe.runtime.comm import uses_post_thread

        return uses_post_thread(self.process_backend, self.post_thread)

    def check(self, *, build: bool = True) -> None:
        """Reject a spec no rank could run (before any process starts). ``build`` also builds
        the model once (a user's model or sizes can fail only then); a sweep builds each split
        once, not once per config."""
        s = self.schedule
        if self.impl not in IMPLS:
            raise VpipeError(
                f"unknown implementation {self.impl!r}: choose from {', '.join(IMPLS)}"
            )
        if self.device not in DEVICES:
            raise VpipeError(f"unknown device {self.device!r}: choose cpu or cuda")
        if self.precision not in DTYPES:
            raise VpipeError(f"unknown dtype {self.precision!r}: choose from {', '.join(DTYPES)}")
        from vpipe.runtime.recompute import RECOMPUTE_MODES

        if self.recompute not in RECOMPUTE_MODES:
            raise VpipeError(
                f"unknown --recompute {self.recompute!r}: choose from {', '.join(RECOMPUTE_MODES)}"
            )
        why = torch_baseline_refusal(self.device, self.process_backend)
        if self.impl == "torch" and why:
            raise VpipeError(why)
        if self.batch < 1 or self.batch % (s.n_microbatches * self.dp):
            per = f"{self.dp} replicas x " if self.dp > 1 else ""
            raise VpipeError(
                f"batch {self.batch} does not split into {per}{s.n_microbatches} equal microbatches"
            )
        if self.dp > 1:
            from vpipe.runtime.data_parallel import DataParallelError, check_layout

            check_layout(self.world_size, s.n_ranks, self.dp, self.process_backend, self.device)
            if self.impl != "vpipe":
                raise DataParallelError("--dp runs vpipe's runtime only (not --impl torch)")
        if self.impl == "torch" and not self.torch_program:
            check_torch_placement(s)
        if build:
            from vpipe.models import build_model

            build_model(self.model, s.n_stages, self.seed, **self.sizes)  # ModelError names it


def check_torch_placement(schedule: Schedule) -> None:
    """Raise ScheduleError unless torch's class for ``schedule.name`` places its stages as the
    schedule does (and exists at all)."""
    from vpipe.baselines.torch_pp import torch_placement

    if torch_placement(schedule.name, schedule.n_ranks, schedule.n_stages) != schedule.placement:
        raise ScheduleError(f"torch's {schedule.name} places stages differently from vpipe's")


class RankHarness:
    """This rank's stages, batch and pipeline for one :class:`RankSpec` (see :func:`build`)."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        import torch

        from vpipe.models import build_model

        self.spec, self.rank = spec, rank
        s = spec.schedule
        self.device = local_device(spec.device, rank)
        self.model = build_model(spec.model, s.n_stages, spec.seed, **spec.sizes)
        self.mesh = None
        if spec.dp > 1:  # rank = replica * P + pipeline rank
            from vpipe.runtime.data_parallel import make_mesh

            self.mesh = make_mesh(s.n_ranks, spec.dp, self.device.type)
        self.pp_rank, self.replica = rank % s.n_ranks, rank // s.n_ranks
        self.stages = s.stages_of(self.pp_rank)
        self.dtype = getattr(torch, DTYPES[spec.precision])
        modules = {
            i: self.model.stages[i].to(device=self.device, dtype=self.dtype) for i in self.stages
        }
        self.params = [p for m in modules.values() for p in m.parameters()]
        self.inputs_full, self.targets_full = self.model.make_batch(spec.batch, spec.seed)
        mine = slice(
            self.replica * spec.batch // spec.dp, (self.replica + 1) * spec.batch // spec.dp
        )
        here = {"device": self.device, "dtype": self.dtype}
        self.inputs = _cast(self.inputs_full[mine], **here) if 0 in modules else None
        self.targets = _cast(self.targets_full[mine], **here) if s.loss_stage in modules else None
        self.pipe = _make_pipeline(spec, modules, self.model.loss_fn, self.device, self.mesh)
        self.cuda = self.device.type == "cuda"
        self.losses: list[Any] | None = None  # the last step's, on the loss rank
        self.last_step_s = 0.0  # this rank's last step, without an injected delay (host clock)

    @property
    def n_stages(self) -> int:
        return self.spec.schedule.n_stages

    @property
    def tokens_per_sample(self) -> int | None:
        return self.model.tokens_per_sample

    @property
    def stats(self) -> dict[str, Any]:
        """The pipeline's figures of its last step (vpipe: live activations, step time)."""
        return dict(getattr(self.pipe, "stats", {}))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> Any:
        """One training step from zeroed gradients; the losses on the loss rank, else None."""
        self.zero_grad()
        if self.rank == self.spec.inject_delay_rank:
            delay = self.spec.inject_delay_s + self.spec.inject_delay_share * self.last_step_s
            if delay:
                time.sleep(delay)
        t0 = time.perf_counter()
        self.losses = self.pipe.step(self.inputs, self.targets)
        self.last_step_s = time.perf_counter() - t0
        return self.losses

    def timed_step(self) -> float:
        """Seconds of one step on this rank, started together with every rank (barrier) and
        including the GPU's work (timed by CUDA events on GPUs: :mod:`vpipe.timing`)."""
        import torch.distributed as dist

        from vpipe.timing import step_seconds

        dist.barrier()
        return step_seconds(self.step, self.device)

    def profiled_step(
        self,
        out_dir: str | Path,
        metadata: Mapping[str, Any],
        *,
        verbose: bool = False,
        ops: bool = False,
    ) -> Any:
        """One step under torch.profiler, written to ``out_dir/rank{R}.pt.trace.json`` and
        returned as this rank's event table; ``verbose`` shows the profiler's own stderr lines;
        ``ops`` records every aten op besides the action spans
        (:class:`~vpipe.trace.record.StepProfiler`).

        A traced warm-up step comes first on CUDA (where CUPTI starts) and with ``ops`` (without
        it torch's recorded steps ran longer). Recording only vpipe's spans on CPU, it cost a
        whole step and changed neither the recorded step nor the predictions calibrated on it
        (docs/runtime.md, "How many profiled steps")."""
        import torch.distributed as dist

        from vpipe.trace.kineto import convert
        from vpipe.trace.record import StepProfiler

        warmup = 1 if ops or self.cuda else 0
        with StepProfiler(
            out_dir,
            self.rank,
            metadata=metadata,
            verbose=verbose,
            ops=ops,
            device=self.device,
            wait=0,
            warmup=warmup,
            active=1,
        ) as p:
            for _ in range(warmup + 1):
                dist.barrier()
                self.step()
                p.step({"activations": self.stats.get("peak_live_activation_bytes")})
        trace = p.path
        meta = dict(metadata)
        # one file, read as its pipeline's rank; a sweep keeps the global rank (--dp replicas)
        return convert(
            [trace], run_id=meta.get("run_id"), impl=meta.get("impl"), schedule=meta.get("schedule"),
            microbatches=meta.get("microbatches"),
        ).events.assign(rank=self.rank).astype({"rank": "int32"})  # fmt: skip

    def split_probe(self) -> list[float]:
        """(I + W) / B per repeat on this rank's stages (:mod:`vpipe.sweep.split_probe`); []
        for torch's runtime, whose split backward is its own."""
        if self.spec.impl != "vpipe":
            return []
        from vpipe.sweep.split_probe import probe_split

        return probe_split(self.pipe.stages, self.targets, self.spec.schedule.n_microbatches,
                           self.device)  # fmt: skip

    def forward_probe(self) -> dict[int, float]:
        """Seconds of one forward alone per stage of this rank (:func:`vpipe.sweep.split_probe.
        probe_forwards`); {} for torch's runtime and recomputing stages."""
        if self.spec.impl != "vpipe":
            return {}
        from vpipe.sweep.split_probe import probe_forwards

        return probe_forwards(self.pipe.stages, self.targets, self.spec.schedule.n_microbatches,
                              self.device)  # fmt: skip

    def memory_step(self) -> dict[str, Any]:
        """One step under the memory meter: the peak and samples of bytes saved for backward,
        the CUDA allocator's peak on GPUs, and the runtime's own live-activation peak."""
        import torch
        import torch.distributed as dist

        meter = SavedTensorMeter(exclude=self.params)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        dist.barrier()
        with meter.hooks():
            self.step()
        out: dict[str, Any] = {"peak_bytes": meter.peak, "samples": meter.samples}
        if self.cuda:
            torch.cuda.synchronize(self.device)
            out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
        if "peak_live_activation_bytes" in self.stats:
            out["runtime_peak_bytes"] = self.stats["peak_live_activation_bytes"]
        return out

    def check(self, losses: Any, tol: float | None = None) -> list[dict[str, Any]]:
        """This rank's losses and gradients (of the last step) against the unpipelined
        reference on the same batch, in float32; one finding per comparison (``tol`` None:
        the precision's :data:`CHECK_TOL`)."""
        import torch

        tol = CHECK_TOL[self.spec.precision] if tol is None else tol
        reference = self.model.reference_model().to("cpu", torch.float32)
        return check_against_reference(
            reference,
            self.model,
            self.stages,
            losses,
            self.inputs_full,
            self.targets_full,
            self.spec.schedule.n_microbatches,
            tol,
            replicas=self.spec.dp,
            replica=self.replica,
        )


def _cast(x: Any, device: Any, dtype: Any) -> Any:
    """``x`` (a tensor or a tuple of them) on ``device``, its floating tensors in ``dtype``
    (token and bucket ids stay integers)."""
    if isinstance(x, tuple):
        return tuple(_cast(t, device, dtype) for t in x)
    return x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)


def build(spec: RankSpec, rank: int) -> RankHarness:
    """This rank's harness for ``spec`` (process group already initialised)."""
    return RankHarness(spec, rank)


def _make_pipeline(
    spec: RankSpec, modules: dict[int, Any], loss_fn: Any, device: Any, mesh: Any = None
) -> Any:
    s = spec.schedule
    if spec.impl == "torch":
        from vpipe.baselines.torch_pp import TorchPipeline

        return TorchPipeline(
            s.name,
            modules,
            loss_fn,
            n_stages=s.n_stages,
            n_microbatches=s.n_microbatches,
            device=device,
            program=s if spec.torch_program else None,
            recompute=spec.recompute,
        )
    from vpipe.runtime import Pipeline

    return Pipeline(
        s,
        modules=modules,
        loss_fn=loss_fn,
        device=device,
        bundle_messages=spec.bundle_messages,
        recv_lookahead=spec.recv_lookahead,
        static_shapes=spec.static_shapes,
        comm_channels=spec.comm_channels,
        post_thread=spec.post_thread,
        time_actions=spec.time_actions,
        group=mesh.pp_group if mesh is not None else None,
        dp_group=mesh.dp_group if mesh is not None else None,
        dp_bucket_bytes=spec.dp_bucket_bytes,
        recompute=spec.recompute,
    )


# ---------------------------------------------------------------------------------------------
# The reference gradient check


def reference_step(module: Any, loss_fn: Any, x: Any, y: Any, n_microbatches: int) -> list[Any]:
    """The unpipelined step a pipeline must equal: each microbatch's loss through ``module``,
    then the backward of their mean (so ``.grad`` holds the full batch's gradient). Returns
    the per-microbatch losses, detached."""
    import torch

    chunks = zip(x.chunk(n_microbatches), y.chunk(n_microbatches), strict=True)
    losses = [loss_fn(module(xm), ym) for xm, ym in chunks]
    (torch.stack(losses).sum() / n_microbatches).backward()
    return [v.detach() for v in losses]


def check_against_reference(
    reference: Any,
    model: Any,
    stages: list[int],
    losses: list[Any] | None,
    x: Any,
    y: Any,
    n_microbatches: int,
    tol: float,
    replicas: int = 1,
    replica: int = 0,
) -> list[dict[str, Any]]:
    """Compare losses and stage gradients with ``reference`` (the unsplit model, on the CPU)
    on the same batch.

    The reference computes each microbatch's loss and backpropagates their mean. Errors are
    relative to the largest magnitude of the reference tensor. With data parallel ``replicas``
    (each ran ``n_microbatches`` of its shard of ``x``), the reference runs the whole batch as
    replicas x n_microbatches microbatches, and ``losses`` are ``replica``'s.
    """
    import torch

    all_losses = reference_step(reference, model.loss_fn, x, y, n_microbatches * replicas)
    ref_losses = all_losses[replica * n_microbatches : (replica + 1) * n_microbatches]
    out = []
    if losses is not None:
        if len(losses) != n_microbatches:
            what = f"{len(losses)} losses for {n_microbatches} microbatches"
            out.append(_finding("losses", what, float("inf"), tol))
        else:
            got = torch.stack([t.detach().cpu().float() for t in losses])
            want = torch.stack([t.detach().float() for t in ref_losses])
            out.append(_finding("losses", "per-microbatch losses", _rel_err(got, want), tol))
    ref_params = dict(reference.named_parameters())
    for s in stages:
        for name, p in model.stages[s].named_parameters():
            ref = ref_params[f"stages.{s}.{name}"].grad
            where = f"stage {s} parameter {name}"
            if p.grad is None:
                out.append(_finding(where, "no gradient", float("inf"), tol))
            else:
                out.append(_finding(where, "gradient", _rel_err(p.grad.detach().cpu(), ref), tol))
    return out


def _rel_err(got: Any, want: Any) -> float:
    scale = max(float(want.abs().max()), 1e-12)
    return float((got - want).abs().max()) / scale


def _finding(where: str, what: str, err: float, tol: float) -> dict[str, Any]:
    return {"where": where, "what": what, "err": err, "ok": err <= tol}

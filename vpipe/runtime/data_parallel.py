"""Pipeline x data parallel: P pipeline ranks times N replicas on a 2-D device mesh.

The world of P x N processes is a ``DeviceMesh`` with dims ("dp", "pp") (global rank =
dp index * P + pp index): each pipeline replica is one row, whose "pp" group the pipeline's
point-to-point messages stay in (the runtime addresses peers by their rank in that group), and
each stage's N copies form one "dp" column, across which its gradients are averaged.

:class:`GradientReducer` composes the reduction with the schedule: each stage's gradients are
split into buckets (parameters in order, a new bucket once one holds ``bucket_bytes``), and as
soon as the action after which the stage's gradients are complete has run
(:func:`vpipe.ir.reduction.gradient_points`: its last W, or B), one asynchronous all-reduce per
bucket is started on the dp group, overlapping the rest of the schedule. The step waits for all
of them at its end and writes the averages back into ``.grad``. Averaging is linear, so
gradients accumulated over several steps stay right. Under the profiler each reduction is a
span ``PP:{stage}REDUCE{bucket}`` from its start to its completion (closed by the completion
callback), and the wait at the step's end ``PP:WAIT:{stage}REDUCE{bucket}``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from vpipe.errors import PipelineError, VpipeError
from vpipe.ir import Action
from vpipe.ir.reduction import format_reduce, gradient_points

__all__ = [
    "DataParallelError",
    "GradientReducer",
    "Mesh",
    "check_fsdp",
    "check_layout",
    "make_mesh",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


class DataParallelError(VpipeError, ValueError):
    """A pipeline x data-parallel layout that cannot run; the message says what is wrong."""


def check_layout(
    world: int, pp: int, dp: int, backend: str, device: str = "cpu", fsdp: bool = False
) -> None:
    """Raise DataParallelError, before any work, unless ``world`` processes can run ``pp``
    pipeline ranks times ``dp`` replicas whose gradients ``backend`` can all-reduce on
    ``device``."""
    if dp < 1 or pp < 1:
        raise DataParallelError(f"--dp and the pipeline ranks must be >= 1, got {dp} and {pp}")
    if world != pp * dp:
        raise DataParallelError(
            f"world size {world} is not pipeline ranks x replicas = {pp} x {dp} = {pp * dp}"
        )
    if dp > 1 and backend == "nccl" and device != "cuda":
        raise DataParallelError(
            f"the dp group cannot reduce {device} gradients on nccl (CUDA tensors only): "
            "use --backend gloo or --device cuda"
        )
    if dp > 1 and backend not in ("gloo", "nccl"):
        raise DataParallelError(
            f"the dp group cannot reduce on backend {backend!r}: use gloo or nccl"
        )
    if fsdp:
        check_fsdp(backend)


def check_fsdp(backend: str) -> None:
    """Raise DataParallelError: FSDP2 stages cannot run here (gloo has no reduce-scatter of
    tensors; on NCCL vpipe's runtime does not shard stages yet)."""
    why = (
        "gloo has no reduce_scatter_tensor, which fully_shard's gradient reduction needs"
        if backend == "gloo"
        else "vpipe's runtime does not run fully_shard stages yet"
    )
    raise DataParallelError(
        f"--fsdp cannot run on {backend}: {why}; leave out --fsdp to all-reduce gradients"
    )


class Mesh(NamedTuple):
    """This process's place on the (dp, pp) mesh and the groups it talks on."""

    mesh: Any  # torch's DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_rank: int
    dp_rank: int


# Meshes made by this process, by (pp, dp, device type): a sweep builds many pipelines on one
# layout and makes its groups once.
_MESHES: dict[tuple[int, int, str], Mesh] = {}


def make_mesh(pp: int, dp: int, device_type: str = "cpu") -> Mesh:
    """The 2-D mesh ("dp", "pp") over the initialised default group (collective: every
    process calls it, the first time for a layout)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (pp, dp, device_type)
    if key in _MESHES and dist.is_initialized():
        return _MESHES[key]
    world = dist.get_world_size()
    check_layout(world, pp, dp, dist.get_backend(), device_type)
    mesh = init_device_mesh(device_type, (dp, pp), mesh_dim_names=("dp", "pp"))
    _MESHES[key] = made = Mesh(
        mesh,
        mesh.get_group("pp"),
        mesh.get_group("dp"),
        mesh.get_local_rank("pp"),
        mesh.get_local_rank("dp"),
    )
    return made


def buckets_of(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """``params`` in order, cut into buckets: a new one once the current one holds at least
    ``bucket_bytes`` (so no bucket is empty and a large parameter is a bucket of its own)."""
    out: list[list[nn.Parameter]] = []
    size = bucket_bytes
    for p in params:
        if not p.requires_grad:
            continue
        if size >= bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel() * p.element_size()
    return out


class _Flight:
    """One started reduction: its bucket, its flat buffer, its completion future and times
    (and on a GPU the CUDA events around it on the step's stream)."""

    __slots__ = ("stage", "bucket", "params", "flat", "done", "start_ns", "end_ns", "events")

    def __init__(self, stage: int, bucket: int, params: list, flat: torch.Tensor) -> None:
        self.stage, self.bucket, self.params, self.flat = stage, bucket, params, flat
        self.done: Any = None
        self.start_ns = time.time_ns()
        self.end_ns = 0
        self.events: list[Any] = []  # [started, usable] on the step's stream (CUDA only)


class GradientReducer:
    """Bucketed all-reduce of this rank's stage gradients across the dp group (see the module
    docstring). ``modules`` maps each stage on this rank to its module."""

    def __init__(
        self,
        modules: Mapping[int, nn.Module],
        group: dist.ProcessGroup,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        event: Callable[[], Any] | None = None,
    ) -> None:
        if bucket_bytes < 1:
            raise DataParallelError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
        self.group = group
        self.size = dist.get_world_size(group)
        # On a GPU the host only enqueues a reduction (NCCL's future completes at enqueue):
        # CUDA events on the step's stream time it instead (see finish)
        self._event = event
        self.device_wait_s: float | None = None
        self.buckets = {
            s: buckets_of(list(m.parameters()), bucket_bytes) for s, m in modules.items()
        }
        self._flights: list[_Flight] = []
        self.profiling = False

    def bucket_bytes(self) -> dict[tuple[int, int], int]:
        """(stage, bucket) -> bytes it reduces."""
        return {
            (s, b): sum(p.numel() * p.element_size() for p in ps)
            for s, bs in self.buckets.items()
            for b, ps in enumerate(bs)
        }

    def wrap(
        self, entries: list[tuple[Action, str, Callable[[], None]]]
    ) -> list[tuple[Action, str, Callable[[], None]]]:
        """An executor's compiled program with each stage's reductions started right after
        the action that completes its gradients."""
        points = gradient_points([a for a, _, _ in entries], sorted(self.buckets))
        out = list(entries)
        for i, stages in points.items():
            a, label, fn = out[i]
            out[i] = (a, label, _then(fn, stages, self.start))
        return out

    def start(self, stage: int) -> None:
        """Start the all-reduce of every bucket of ``stage``."""
        for b, params in enumerate(self.buckets[stage]):
            # the span and the device's start event come first: packing the bucket (the
            # concatenation) is the reduction's work, not the action's that completed it
            span, t0 = None, time.time_ns()
            if self.profiling:
                span = torch.ops.profiler._record_function_enter_new(
                    f"PP:{format_reduce(stage, b)}", None
                )
            started = self._event() if self._event is not None else None
            if started is not None:
                started.record()  # the stream reaches the reduction: it may start
            grads = [
                p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params
            ]
            flight = _Flight(stage, b, params, torch.cat(grads))
            flight.start_ns = t0
            if started is not None:
                flight.events.append(started)
            work = dist.all_reduce(flight.flat, group=self.group, async_op=True)
            flight.done = work.get_future().then(_on_done(flight, span))
            self._flights.append(flight)

    def finish(self) -> list[dict[str, Any]]:
        """Wait for every started reduction, write the averages into ``.grad``; return one
        record per reduction (stage, bucket, bytes, start_ns, end_ns: wall clock)."""
        flights, self._flights = self._flights, []
        out = []
        ready = self._event() if self._event is not None and flights else None
        if ready is not None:
            ready.record()  # the step's own work is all enqueued before this
        for f in flights:
            try:
                if self.profiling:
                    with record_function(f"PP:WAIT:{format_reduce(f.stage, f.bucket)}"):
                        f.done.wait()
                else:
                    f.done.wait()
            except Exception as e:
                raise PipelineError(
                    f"reducing stage {f.stage} bucket {f.bucket} across the dp group failed: {e}"
                ) from e
            if ready is not None:
                f.events.append(self._event())
                f.events[1].record()  # the step's stream can use the result from here
            f.flat.div_(self.size)
            for p, chunk in zip(f.params, f.flat.split([p.numel() for p in f.params]), strict=True):
                if p.grad is None:
                    p.grad = chunk.view_as(p).clone()
                else:
                    p.grad.copy_(chunk.view_as(p))
            out.append(
                {
                    "stage": f.stage,
                    "bucket": f.bucket,
                    "bytes": f.flat.numel() * f.flat.element_size(),
                    "start_ns": f.start_ns,
                    "end_ns": f.end_ns,
                }
            )
        if ready is not None:
            self._on_device(ready, flights, out)
        return out

    def _on_device(self, ready: Any, flights: list[_Flight], records: list[dict]) -> None:
        """Replace the records' host times by the device's (``start_ns``/``end_ns`` on a clock
        anchored at the first reduction's host start) and set ``device_wait_s``: how long the
        step's stream waited past its own work for the results. A reduction ends where the
        stream could use its result, so one that finished under later compute reads as
        ending when the stream got there."""
        flights[-1].events[1].synchronize()
        first, anchor = flights[0].events[0], flights[0].start_ns
        for f, r in zip(flights, records, strict=True):
            r["start_ns"] = anchor + round(first.elapsed_time(f.events[0]) * 1e6)
            r["end_ns"] = anchor + round(first.elapsed_time(f.events[1]) * 1e6)
            r["clock"] = "device"
        self.device_wait_s = max(0.0, ready.elapsed_time(flights[-1].events[1]) / 1e3)

    def discard(self) -> None:
        """Forget started reductions (after a failed step; the job ends anyway)."""
        self._flights.clear()


def _on_done(flight: _Flight, span: Any) -> Callable[[Any], None]:
    """The completion callback of ``flight``: notes its end, closes its profiler span."""

    def done(fut: Any) -> None:
        flight.end_ns = time.time_ns()
        if span is not None:
            torch.ops.profiler._record_function_exit._RecordFunction(span)
        fut.value()  # re-raise a failed reduction in the waiter

    return done


def _then(
    fn: Callable[[], None], stages: list[int], start: Callable[[int], None]
) -> Callable[[], None]:
    def run_then_reduce() -> None:
        fn()
        for s in stages:
            start(s)

    return run_then_reduce

"""The public Pipeline: run a schedule over this rank's stage modules, one step at a time."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from vpipe.errors import PipelineError, VpipeError, one_line
from vpipe.ir import Schedule
from vpipe.runtime.comm import P2P
from vpipe.runtime.executor import Executor
from vpipe.runtime.meta import (
    META_LEN,
    TensorMeta,
    as_tuple,
    decode,
    encode,
    infer_outputs,
    meta_of,
)
from vpipe.runtime.recompute import RECOMPUTE_MODES
from vpipe.runtime.stage import Stage

__all__ = ["Pipeline"]


class Pipeline:
    """Pipeline-parallel training steps for this rank's stages under ``schedule``.

    ``modules`` maps stage index to module and must hold exactly the stages that the schedule's
    placement puts on this rank. ``schedule`` may be compute-only (it is lowered here) or
    already lowered; it is validated before anything runs. ``group=None`` uses the default
    process group, or none at all for a one-rank schedule. With ``bundle_messages`` (default)
    messages that one batch sends to a peer and the peer receives in one batch travel as one
    (:mod:`vpipe.ir.bundling`); off, every SEND/RECV posts its own operation. ``recv_lookahead``
    is the lowering's (:func:`vpipe.ir.lowering.lower`) for a compute-only schedule.

    Ranks other than stage 0's cannot see the batch, so by default stage 0's rank broadcasts
    the microbatch input shape every step: one more posted operation per rank per step, and
    on NCCL a host sync. With ``static_shapes`` (what torch.distributed.pipelining assumes)
    the ranks agree on it at the first step only; a later step whose microbatch inputs differ
    raises on stage 0's rank (and the job ends, as on any rank's failure).

    ``comm_channels`` (None: on NCCL) posts each direction between two ranks on its own process
    group, so that NCCL's one stream per group cannot serialise an early receive ahead of later
    sends (:mod:`vpipe.runtime.comm`); their creation is collective over the default group.
    ``post_thread`` (None: on gloo, the only backend that takes it) posts sends and receives
    from a thread of their own, so that gloo's posting cost (0.2-1 ms on a busy host) leaves
    the compute thread (:mod:`vpipe.runtime.comm`).

    ``step(inputs, targets)`` splits ``inputs`` (on the rank of stage 0) and ``targets`` (on the
    loss rank) into M microbatches along dim 0, runs the program, and returns the unscaled
    per-microbatch losses in microbatch order on the loss rank (None elsewhere). Backward uses
    each microbatch loss scaled by 1/M, so ``.grad`` receives exactly the gradient of the
    mean-reduced loss over the whole batch. Like ``loss.backward()``, gradients accumulate
    across steps: zero them (``optimizer.zero_grad()``) between steps as usual.

    ``time_actions`` (CUDA devices only; ignored elsewhere, where host spans are the device's)
    records a CUDA event pair around every action on the stream it runs on, without
    synchronising, read after the step's synchronise into ``stats["action_times"]``
    (:class:`~vpipe.runtime.action_clock.ActionTime` per action: device ns after the step's
    start, and when a received input was there).

    After each step ``stats`` holds ``peak_live_activations`` (microbatch-stages whose F ran
    and whose last backward part had not, at most at once on this rank),
    ``peak_live_activation_bytes`` (the same in bytes kept for backward), ``step_time_s``;
    after the first, also ``comm_setup_s``: what creating the channels' communicators took
    (one tiny exchange per channel when the pipeline was built, :meth:`P2P.connect`).

    ``dp_group`` (data parallel: this rank's stages' copies in the other pipeline replicas; then
    ``group`` is this replica's pipeline group) averages each stage's gradients across it, in
    buckets of ``dp_bucket_bytes``, started as soon as the stage's gradients are complete
    (:mod:`vpipe.runtime.data_parallel`); the step ends when they are all done, and
    ``stats["reductions"]`` lists them (``stats["dp_wait_s"]``: what waiting for them took).

    ``recompute`` ("none", "full" or "selective") is what each stage keeps from its forward
    for its backward (:mod:`vpipe.runtime.recompute`); ``peak_live_activation_bytes`` counts
    what the mode keeps, and what its backward recomputes while it runs (from I until W under
    a split backward).
    """

    def __init__(
        self,
        schedule: Schedule,
        modules: Mapping[int, nn.Module],
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        bundle_messages: bool = True,
        recv_lookahead: int = 1,
        static_shapes: bool = False,
        comm_channels: bool | None = None,
        post_thread: bool | None = None,
        time_actions: bool = False,
        dp_group: dist.ProcessGroup | None = None,
        dp_bucket_bytes: int | None = None,
        recompute: str = "none",
    ) -> None:
        from vpipe.ir.bundling import comm_bundles
        from vpipe.ir.lowering import lower, validate

        if schedule.is_lowered:
            validate(schedule)
            program = schedule
        else:
            program = lower(schedule, recv_lookahead=recv_lookahead)  # validates as it lowers
        self.schedule = program
        self.rank, distributed = _rank_and_group(program, group)
        mine = program.stages_of(self.rank)
        _check_modules(modules, mine, self.rank, program)
        self.device = _pick_device(device, modules)
        for mod in modules.values():
            mod.to(self.device)
        if recompute not in RECOMPUTE_MODES:
            raise PipelineError(
                f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {recompute!r}"
            )
        self.stages = {
            s: Stage(
                s, program.n_stages, modules[s], loss_fn if s == program.loss_stage else None,
                recompute,
            )
            for s in mine
        }
        self.n_microbatches = program.n_microbatches
        for st in self.stages.values():
            st.loss_scale = 1.0 / self.n_microbatches
        self.comm = (
            P2P(group, self.device, _rank_pairs(program), comm_channels, post_thread)
            if distributed
            else None
        )
        self._executor = Executor(
            self.rank,
            program.actions[self.rank],
            self.stages,
            program.placement,
            self.comm,
            self.device,
            comm_bundles(program)[self.rank] if bundle_messages and distributed else (),
        )
        self.reducer = None
        if dp_group is not None:
            from vpipe.runtime.data_parallel import DEFAULT_BUCKET_BYTES, GradientReducer

            cuda = self.device.type == "cuda"
            self.reducer = GradientReducer(
                modules,
                dp_group,
                dp_bucket_bytes or DEFAULT_BUCKET_BYTES,
                event=(lambda: torch.cuda.Event(enable_timing=True)) if cuda else None,
            )
            self._executor._program = self.reducer.wrap(self._executor._program)
        if self.comm is not None and self.comm.channels:
            self.comm.connect()  # communicators made now, not in the first step
        if time_actions and self.device.type == "cuda":
            from vpipe.runtime.action_clock import ActionClock

            self._executor.clock = ActionClock(program.actions[self.rank], self.device)
        self.static_shapes = static_shapes
        self._key: tuple[TensorMeta, ...] | None = None
        self._key_work: Any = None
        self._step = 0
        self.stats: dict[str, Any] = {}

    @property
    def is_loss_rank(self) -> bool:
        return self.schedule.loss_stage in self.stages

    def step(self, inputs: Any = None, targets: Any = None) -> list[torch.Tensor] | None:
        """Run one training step (see the class docstring)."""
        profiling = torch._C._autograd._profiler_enabled()
        if profiling:
            with record_function(f"PP:STEP:{self._step}"):
                return self._step_impl(inputs, targets, True)
        return self._step_impl(inputs, targets, False)

    def _step_impl(self, inputs: Any, targets: Any, profiling: bool) -> list[torch.Tensor] | None:
        t0 = time.perf_counter()
        n = self.n_microbatches
        mb_inputs: list[tuple[torch.Tensor, ...]] = []
        mb_targets: list[Any] = []
        if 0 in self.stages:
            if inputs is None:
                raise PipelineError(f"rank {self.rank} holds stage 0: step() needs inputs")
            mb_inputs = _split(as_tuple(inputs, "inputs"), n, "inputs", self.device)
        if self.is_loss_rank:
            if targets is None:
                raise PipelineError(f"rank {self.rank} holds the loss stage: step() needs targets")
            mb_targets = [
                t if len(t) > 1 else t[0]
                for t in _split(as_tuple(targets, "targets"), n, "targets", self.device)
            ]
        try:
            key = self._input_key(mb_inputs)
            if key != self._key:
                self._infer_meta(key)
                self._key = key
        except VpipeError:
            raise
        except Exception as e:
            raise PipelineError(
                f"rank {self.rank}: step {self._step}: exchanging input shapes failed: "
                f"{one_line(e)}"
            ) from e
        ex, reducer = self._executor, self.reducer
        ex.profiling = profiling
        if reducer is not None:
            reducer.profiling = profiling
        try:
            losses = ex.run(mb_inputs, mb_targets, n)
            self._finish_key_broadcast()
            t_wait = time.perf_counter()
            reductions = reducer.finish() if reducer is not None else None
            t_wait = time.perf_counter() - t_wait
        except VpipeError:
            ex.reset()
            if reducer is not None:
                reducer.discard()
            raise
        left = ex.leftovers()
        if left:
            ex.reset()
            raise PipelineError(f"rank {self.rank}: the program left {left} stashed values behind")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # step_time_s covers the GPU work too
        self._step += 1
        self.stats = {
            "peak_live_activations": ex.peak_live,
            "peak_live_activation_bytes": ex.peak_live_bytes,
            "step_time_s": time.perf_counter() - t0,
        }
        if reductions is not None:
            self.stats["reductions"] = reductions
            # the step's end waiting for its reductions: on a GPU the device's wait (events)
            device_wait = self.reducer.device_wait_s
            self.stats["dp_wait_s"] = t_wait if device_wait is None else device_wait
        if self._step == 1 and self.comm is not None and self.comm.connect_s is not None:
            self.stats["comm_setup_s"] = self.comm.connect_s  # reported once
        if ex.clock is not None:  # after the synchronise: reading the events does not stall
            self.stats["action_times"] = ex.clock.read()
        return losses

    # -- shapes ------------------------------------------------------------------------------
    def _input_key(self, mb_inputs: list[tuple[torch.Tensor, ...]]) -> tuple[TensorMeta, ...]:
        """Microbatch input metadata, agreed by all ranks: broadcast from stage 0's rank every
        step, or only at the first with ``static_shapes`` (other ranks cannot know the batch
        shape). The source does not wait for it; the others need it before their first receive
        anyway."""
        key = meta_of(mb_inputs[0]) if mb_inputs else None
        if self.comm is None:
            return key
        if self.static_shapes and self._key is not None:
            if key is not None and key != self._key:
                raise PipelineError(
                    f"rank {self.rank}: step {self._step}: microbatch inputs {_shapes(key)} "
                    f"differ from the first step's {_shapes(self._key)}, and the pipeline has "
                    "static_shapes=True"
                )
            return self._key
        words = torch.tensor(encode(key) if key is not None else [0] * META_LEN, dtype=torch.int64)
        words = words.to(self.device)
        src = self.schedule.placement[0]
        work = dist.broadcast(words, group=self.comm.group, group_src=src, async_op=True)
        if self.rank == src:
            self._key_work = work  # completed at the end of the step
            return key
        work.wait()
        return decode(words.tolist())

    def _finish_key_broadcast(self) -> None:
        work, self._key_work = self._key_work, None
        if work is not None:
            try:
                work.wait()
            except Exception as e:
                raise PipelineError(
                    f"rank {self.rank}: step {self._step}: broadcasting the input shape failed: "
                    f"{one_line(e)}"
                ) from e

    def _infer_meta(self, first: tuple[TensorMeta, ...]) -> None:
        """Propagate input/output metadata through the stages in order (see meta.py)."""
        placement, me = self.schedule.placement, self.rank
        current = first
        for s in range(self.schedule.n_stages):
            nxt = placement.get(s + 1)
            if placement[s] == me:
                st = self.stages[s]
                try:
                    out = (
                        ()
                        if st.is_last
                        else infer_outputs(st.module, current, self.device, f"stage {s} output")
                    )
                except VpipeError:
                    raise
                except Exception as e:
                    raise PipelineError(
                        f"rank {me}: stage {s} failed on inputs {current}: {type(e).__name__}: {e}"
                    ) from e
                st.set_meta(current, out)
                current = out
                if nxt is not None and nxt != me:
                    self.comm.send_now(
                        torch.tensor(encode(out), dtype=torch.int64, device=self.device), nxt
                    )
            elif nxt == me:
                buf = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
                self.comm.recv_now(buf, placement[s])
                current = decode(buf.tolist())


def _rank_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The pairs of ranks holding adjacent stages: those that exchange messages."""
    p = schedule.placement
    pairs = {tuple(sorted((p[s], p[s + 1]))) for s in range(schedule.n_stages - 1)}
    return sorted(pair for pair in pairs if pair[0] != pair[1])


def _shapes(key: tuple[TensorMeta, ...]) -> str:
    return ", ".join(f"{list(shape)} {str(dtype).removeprefix('torch.')}" for shape, dtype in key)


def _rank_and_group(schedule: Schedule, group: dist.ProcessGroup | None) -> tuple[int, bool]:
    """This rank's index in the group, and whether there is a process group to talk on."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        if schedule.n_ranks == 1:
            return 0, False
        raise PipelineError(
            f"schedule {schedule.name!r} has {schedule.n_ranks} ranks but torch.distributed is "
            "not initialised (use vpipe.runtime.launch.spawn or torchrun)"
        )
    size = dist.get_world_size(group)
    if size != schedule.n_ranks:
        raise PipelineError(
            f"schedule {schedule.name!r} has {schedule.n_ranks} ranks but the process group has {size}"
        )
    return dist.get_rank(group), True


def _check_modules(
    modules: Mapping[int, nn.Module], mine: list[int], rank: int, schedule: Schedule
) -> None:
    missing = sorted(set(mine) - set(modules))
    extra = sorted(set(modules) - set(mine))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing stage(s) {missing}")
        if extra:
            parts.append(f"stage(s) {extra} not on this rank")
        raise PipelineError(
            f"rank {rank}: modules must hold exactly stages {mine} of schedule "
            f"{schedule.name!r} ({schedule.style} placement): " + "; ".join(parts)
        )
    for s, mod in modules.items():
        if not isinstance(mod, nn.Module):
            raise PipelineError(
                f"rank {rank}: modules[{s}] is a {type(mod).__name__}, not an nn.Module"
            )


def _pick_device(
    device: torch.device | str | None, modules: Mapping[int, nn.Module]
) -> torch.device:
    if device is not None:
        return torch.device(device)
    for mod in modules.values():
        for p in mod.parameters():
            return p.device
    return torch.device("cpu")


def _split(
    values: tuple[torch.Tensor, ...], n: int, what: str, device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    batch = values[0].shape[0] if values[0].dim() else 0
    for v in values:
        if v.dim() == 0 or v.shape[0] != batch:
            raise PipelineError(f"{what}: every tensor needs the same batch size along dim 0")
    if batch < n or batch % n:
        raise PipelineError(f"{what}: batch size {batch} is not a multiple of {n} microbatches")
    chunks = [v.detach().to(device, non_blocking=True).chunk(n) for v in values]
    return [tuple(c[m] for c in chunks) for m in range(n)]

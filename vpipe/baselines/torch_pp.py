"""Run vpipe's benchmark configurations through torch.distributed.pipelining.

``TorchPipeline`` wraps the torch schedule class matching a vpipe schedule name, built from the
same per-stage modules under torch's placement for that class (loop; ``v`` for the V
schedules), with the same call shape as ``vpipe.runtime.Pipeline``:
``losses = pipe.step(inputs, targets)``.

Loss scaling: torch computes each microbatch's loss unscaled and, with ``scale_grads=True``,
divides the accumulated gradients by M at the end of the step. For a mean-reduced loss over
equal microbatches that is the gradient of the full-batch loss, i.e. exactly what vpipe and
the unpipelined reference leave in ``.grad``; the returned per-microbatch losses are unscaled,
as vpipe's are.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from vpipe.errors import PipelineError, ScheduleError
from vpipe.ir import Schedule, make_placement
from vpipe.schedules.catalogue import Family, LiveView
from vpipe.timing import step_seconds

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["TORCH_SCHEDULES", "TorchPipeline", "torch_placement"]


class TorchSchedule(NamedTuple):
    """Which torch class implements a vpipe schedule name, and how it places stages."""

    class_name: str
    style: str  # "loop" or "v"
    multi: bool  # takes a list of stages (PipelineScheduleMulti) rather than one stage


def _torch_schedule(family: Family) -> TorchSchedule | None:
    if family.torch_class is None:
        return None
    return TorchSchedule(family.torch_class, family.placement, family.torch_multi)


# The catalogue's families that torch has a class for, following the catalogue as it changes.
TORCH_SCHEDULES: LiveView[TorchSchedule] = LiveView(_torch_schedule)


def _lookup(name: str) -> TorchSchedule:
    try:
        return TORCH_SCHEDULES[name]
    except KeyError:
        raise ScheduleError(
            f"no torch.distributed.pipelining schedule for {name!r}: torch has "
            f"{', '.join(TORCH_SCHEDULES)}"
        ) from None


def torch_placement(name: str, n_ranks: int, n_stages: int) -> dict[int, int]:
    """The stage -> rank map torch's class for ``name`` uses."""
    spec = _lookup(name)
    if not spec.multi and n_stages != n_ranks:
        raise ScheduleError(
            f"torch's {spec.class_name} runs one stage per rank: got {n_stages} stages "
            f"on {n_ranks} ranks"
        )
    if spec.style == "v" and n_stages != 2 * n_ranks:
        raise ScheduleError(
            f"torch's {spec.class_name} needs exactly 2 stages per rank: got {n_stages} "
            f"stages on {n_ranks} ranks"
        )
    return make_placement(spec.style, n_ranks, n_stages)


class TorchPipeline:
    """torch.distributed.pipelining's schedule ``name`` over this rank's stage modules.

    ``modules`` must hold exactly this rank's stages under :func:`torch_placement`. Modules are
    used in place (their ``.grad`` receives the gradients) and moved to ``device``.

    With ``program`` (a compute-only vpipe schedule, e.g. read from a CSV file) torch runs that
    schedule through its ``_PipelineScheduleRuntime``, loaded from torch's CSV format, as
    torchtitan runs ``pipeline_parallel_schedule_csv``; stages are placed as ``program`` says
    and ``name`` only labels it.

    ``recompute`` ("none", "full", "selective") runs each stage module under torch's own
    checkpointing (:mod:`vpipe.baselines.checkpointing`).
    """

    def __init__(
        self,
        name: str,
        modules: Mapping[int, nn.Module],
        loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
        *,
        n_stages: int,
        n_microbatches: int,
        group: Any = None,
        device: torch.device | str | None = None,
        program: Schedule | None = None,
        recompute: str = "none",
    ) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed import pipelining

        if not dist.is_initialized():
            raise PipelineError("TorchPipeline needs an initialised torch.distributed group")
        rank, n_ranks = dist.get_rank(group), dist.get_world_size(group)
        if program is None:
            spec = _lookup(name)
            class_name, multi = spec.class_name, spec.multi
            placement = torch_placement(name, n_ranks, n_stages)
        else:
            class_name, multi, placement = "_PipelineScheduleRuntime", True, program.placement
        mine = sorted(s for s, r in placement.items() if r == rank)
        if sorted(modules) != mine:
            raise PipelineError(
                f"rank {rank}: torch's {class_name} places stages {mine} on this rank, "
                f"got modules for stages {sorted(modules)}"
            )
        self.name = name
        self.rank = rank
        self.n_stages = n_stages
        self.n_microbatches = n_microbatches
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.stats: dict[str, float] = {}
        self._has_first = 0 in modules
        self._has_last = n_stages - 1 in modules
        from vpipe.baselines.checkpointing import checkpointed

        stages = [
            pipelining.PipelineStage(
                checkpointed(modules[s].to(self.device), recompute),
                s,
                n_stages,
                self.device,
                group=group,
            )
            for s in mine
        ]
        cls = getattr(pipelining.schedules, class_name)
        try:
            self._schedule = cls(
                stages if multi else stages[0],
                n_microbatches,
                loss_fn=loss_fn,
                scale_grads=True,
            )
            if program is not None:
                _load_program(self._schedule, program)
        except ValueError as e:
            raise ScheduleError(f"torch's {class_name} rejects this configuration: {e}") from None
        if recompute == "selective" and _splits_backward(self._schedule):
            raise PipelineError(
                f"torch's {class_name} splits the backward (I, then W: two backward passes "
                "through a stage), which torch's selective checkpointing refuses ('backward "
                "once on any region'): use recompute full, or a schedule without I/W"
            )

    def step(
        self, inputs: Any = None, targets: torch.Tensor | None = None
    ) -> list[torch.Tensor] | None:
        """Run one training step; return per-microbatch losses on the loss rank, else None.

        ``inputs`` is used on the rank holding stage 0 and ``targets`` on the loss rank; both
        are split into M microbatches along dim 0 by torch.
        """
        args: tuple[Any, ...] = ()
        if self._has_first:
            if inputs is None:
                raise PipelineError(f"rank {self.rank}: holds stage 0 but got no inputs")
            args = inputs if isinstance(inputs, tuple) else (inputs,)
        kwargs: dict[str, Any] = {"return_outputs": False}
        losses: list[torch.Tensor] | None = None
        if self._has_last:
            if targets is None:
                raise PipelineError(
                    f"rank {self.rank}: holds the loss stage {self.n_stages - 1} but got no targets"
                )
            losses = []
            kwargs.update(target=targets, losses=losses)
        # on a GPU: CUDA events around the step, read after its synchronise (vpipe.timing)
        self.stats["step_time_s"] = step_seconds(
            lambda: self._schedule.step(*args, **kwargs), self.device
        )
        return losses


def _splits_backward(schedule: Any) -> bool:
    """Whether torch's schedule object runs a split backward (I and W actions)."""
    order = getattr(schedule, "pipeline_order", None) or {}
    return any(
        a is not None and str(a.computation_type.value) in ("I", "W")
        for actions in order.values()
        for a in actions
    )


def _load_program(runtime: Any, program: Schedule) -> None:
    """Give torch's runtime ``program`` through its CSV reader (the format torch documents)."""
    fd, path = tempfile.mkstemp(suffix=".csv", prefix="vpipe-program-")
    os.close(fd)
    try:
        program.compute_only().to_csv(path)
        runtime._load_csv(path, format="compute_only")
    finally:
        os.unlink(path)

"""The data-parallel side of a plan: N pipeline replicas whose stage gradients are all-reduced
over a link (``vpipe plan --dp N --dp-cost ...``), added to each candidate's simulated step by
:func:`vpipe.sim.collectives.simulate_reductions`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from vpipe.errors import VpipeError
from vpipe.ir import Schedule
from vpipe.sim import parse_numbers
from vpipe.sim.collectives import CollectiveCost, DPStep, bucket_sizes, simulate_reductions

__all__ = ["DPCosts", "DPCostError"]


class DPCostError(VpipeError, ValueError):
    """A --dp / --dp-cost that makes no sense; the message names it."""


@dataclass(frozen=True)
class DPCosts:
    """``replicas`` pipelines; per full stage (1/P of the model) ``grad_bytes`` of gradients,
    reduced in buckets of ``bucket_mb`` MiB over a ring of ``bw`` GB/s with ``lat``
    microseconds per ring step and ``launch`` microseconds per reduction."""

    replicas: int
    grad_bytes: float = 0.0
    bw: float = math.inf
    lat: float = 0.0
    launch: float = 0.0
    bucket_mb: float = 25.0

    @classmethod
    def parse(cls, text: str | None, replicas: int) -> DPCosts:
        """``grad_bytes=4e8,bw=25,lat=10[,launch=..,bucket_mb=..]``; grad_bytes and bw are
        required with more than one replica."""
        if replicas < 1:
            raise DPCostError(f"--dp must be >= 1, got {replicas}")
        keys = [k for k in cls.__dataclass_fields__ if k != "replicas"]
        values = parse_numbers(text or "", keys, "--dp-cost", DPCostError)
        for key, v in values.items():
            if not v >= 0 or (key in ("bw", "bucket_mb") and v == 0):
                raise DPCostError(f"--dp-cost {key}={v:g}: must be a number > 0")
        if replicas > 1 and not {"grad_bytes", "bw"} <= set(values):
            raise DPCostError("--dp N > 1 needs --dp-cost grad_bytes=..,bw=.. (GB/s)[,lat=..]")
        return cls(replicas, **values)

    def collective(self) -> CollectiveCost:
        """The ring all-reduce cost in microseconds (bandwidth in bytes per us)."""
        return CollectiveCost(self.replicas, self.bw * 1e3, self.lat, self.launch)

    def step(self, schedule: Schedule, columns: dict, makespan: float) -> DPStep:
        """``schedule``'s simulated step (``columns``, ``makespan``) with its reductions."""
        per_stage = self.grad_bytes * schedule.n_ranks / schedule.n_stages
        buckets = bucket_sizes(per_stage, self.bucket_mb * 2**20) or [0.0]
        return simulate_reductions(
            schedule,
            columns,
            makespan,
            self.collective(),
            dict.fromkeys(range(schedule.n_stages), buckets),
        )

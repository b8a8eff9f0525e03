"""The timed rounds of a sweep on one rank: the base rounds over every config, then, within
the sweep's time budget, more rounds of the configs whose order is still open or whose
median is not yet known to the sweep's precision.

A round runs ``steps`` timed steps of each of its configs in turn, each after a host-speed
reference (:mod:`vpipe.sweep.reference`), and samples the host's state around it (on a GPU also
the device reference and the GPU's state, once at the round's start). After every
round the step times are reduced to the slowest rank's, so every rank holds the same figures.
After the base rounds (``--rounds``), rank 0 asks the verdict's rules which configs more rounds
could still order (:func:`vpipe.report.winner.open_configs`: the open contenders of each group
and their leader), adds the configs whose median step time is not yet known to the
sweep's precision (``vpipe bench --timing-precision``: the report judges its predictions
against these medians, and a loosely known one makes its fidelity table measure timing
noise), and broadcasts them; rounds of those alone follow until none is left or the next
round, the memory steps and the outputs would not fit before the deadline (``vpipe bench
--max-minutes``). Without a deadline the rounds are fixed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# Seconds kept for what follows the last round on the launching process: simulating each
# profiled config, the plan, plots and the report (about 8 s for the default sweep on 2 cores).
OUTPUT_RESERVE_S = 15.0
# The memory step of a config runs with saved-tensor hooks: counted as this many timed steps.
MEMORY_STEP_COST = 2.0


class Rounds:
    """One rank's timed rounds (see the module's doc). ``record(i, index, harness)`` is called
    after every timed step of config ``i`` (``index``: the step's position among the config's
    timed steps), for per-step records such as the data-parallel reductions."""

    def __init__(
        self,
        spec: Any,
        configs: Sequence[Any],
        harnesses: Sequence[Any],
        reference: Any,
        rank: int,
        advance: Callable[[str], None],
        record: Callable[[int, int, Any], None] | None = None,
        device_state: Callable[[], dict[str, Any]] | None = None,
        comm_threads: Callable[[], int | None] | None = None,
    ) -> None:
        self.spec, self.configs, self.harnesses = spec, list(configs), list(harnesses)
        self.reference, self.rank, self.advance, self.record = reference, rank, advance, record
        self.device_state = device_state  # on a GPU: the device reference and NVML per round
        self.devices: list[dict[str, Any]] = []
        n = len(self.configs)
        self.times: list[list[float]] = [[] for _ in range(n)]
        self.refs: list[list[float]] = [[] for _ in range(n)]
        self.rounds: list[list[int]] = [[] for _ in range(n)]
        self.samples: list[tuple[dict, dict]] = []  # host state before and after each round
        self.labels: list[int] = []  # each sampled round's number
        self.own_cpu: list[float] = []
        self.seconds: list[list[float]] = [[] for _ in range(n)]  # wall per round, this rank
        # CPU ns of the communication threads so far, where they take compute's cores
        # (vpipe.trace.thread_cpu), else None; per config and round: their CPU seconds per step
        # summed over the ranks, NaN unless every rank measured
        self.comm_threads = comm_threads
        self.comm_cpu_s: list[list[float]] = [[] for _ in range(n)]
        self.stop = "fixed"  # why the rounds ended: fixed, decided or budget

    def run(self, r: int, active: Sequence[int]) -> None:
        """Round ``r`` over the configs ``active`` (indices), reduced across ranks."""
        import torch
        import torch.distributed as dist

        from vpipe.trace import host_state

        steps = self.spec.steps
        self.devices.append(self.device_state() if self.device_state is not None else {})
        t = torch.zeros(len(active), steps, dtype=torch.float64)
        ref = torch.zeros_like(t)
        comm = torch.zeros(len(active) + 1, dtype=torch.float64)  # the last: ranks measuring
        read = self.comm_threads or (lambda: None)
        before = host_state.sample()
        for row, i in enumerate(active):
            h, t0, c0 = self.harnesses[i], time.perf_counter(), read()
            for k in range(steps):
                ref[row, k] = self.reference.timed()
                t[row, k] = h.timed_step()
                if self.record is not None:
                    self.record(i, len(self.times[i]) + k, h)
            c1 = read()
            if c0 is not None and c1 is not None:
                comm[row] = (c1 - c0) / 1e9 / steps
                comm[-1] = 1
            self.seconds[i].append(time.perf_counter() - t0)
            self.advance(f"round {r + 1} {self.configs[i].key}")
        after = host_state.sample()
        self.own_cpu.append(after["own_cpu_s"] - before["own_cpu_s"])
        self.samples.append((before, after))
        self.labels.append(r)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(ref, op=dist.ReduceOp.MAX)
        dist.all_reduce(comm, op=dist.ReduceOp.SUM)
        everyone = comm[-1].item() == dist.get_world_size()
        for row, i in enumerate(active):
            self.times[i] += t[row].tolist()
            self.refs[i] += ref[row].tolist()
            self.rounds[i] += [r] * steps
            self.comm_cpu_s[i].append(comm[row].item() if everyone else float("nan"))

    def more(self) -> list[int]:
        """The configs of the next round: rank 0's choice (see the module's doc), broadcast to
        every rank; [] when the rounds end."""
        import torch
        import torch.distributed as dist

        chosen = torch.zeros(len(self.configs), dtype=torch.int64)
        if self.rank == 0:
            for i in self._choose():
                chosen[i] = 1
        dist.broadcast(chosen, src=0)
        return [i for i, flag in enumerate(chosen.tolist()) if flag]

    def _choose(self) -> list[int]:
        from vpipe.report.winner import open_configs

        deadline = getattr(self.spec, "deadline", None)
        if deadline is None:
            return []
        wanted = open_configs(self.steps_frame())
        loose = self.loose()
        active = [i for i, c in enumerate(self.configs)
                  if (c.schedule, c.microbatches, c.impl) in wanted or i in loose]  # fmt: skip
        if not active:
            self.stop = "decided"
            return []
        if time.time() + self._seconds_left(active) > deadline:
            self.stop = "budget"
            return []
        return active

    def loose(self) -> set[int]:
        """The configs whose timed median is not yet known to +- ``spec.timing_precision``
        percent (95% interval; too few steps for one counts as not known); none when 0."""
        from vpipe.stats import looser_than

        target = self.spec.timing_precision
        return set(looser_than(dict(enumerate(self.times)), target)) if target else set()

    def _seconds_left(self, active: Sequence[int]) -> float:
        """What the next round of ``active``, the memory steps and the outputs would take."""
        round_s = sum(statistics.median(self.seconds[i]) for i in active)
        memory_s = MEMORY_STEP_COST * sum(statistics.median(t) for t in self.times if t)
        return round_s + memory_s + OUTPUT_RESERVE_S

    def steps_frame(self) -> Any:
        """The timed steps so far as the verdict reads them (schedule, microbatches, impl,
        round, step, step_time_s)."""
        import pandas as pd

        steps = self.spec.steps
        return pd.DataFrame(
            [
                {"schedule": c.schedule, "microbatches": c.microbatches, "impl": c.impl,
                 "round": r, "step": j % steps, "step_time_s": t}
                for c, times, rounds in zip(self.configs, self.times, self.rounds, strict=True)
                for j, (t, r) in enumerate(zip(times, rounds, strict=True))
            ]  # fmt: skip
        )

    def host_rounds(self) -> list[dict[str, Any]]:
        """Each round's host state (:func:`vpipe.trace.host_state.round_state`) with its
        round; collective: the ranks' own CPU seconds are summed."""
        import torch
        import torch.distributed as dist

        from vpipe.trace import host_state

        cpu = torch.tensor(self.own_cpu, dtype=torch.float64)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)
        return [
            {**host_state.round_state(b, a, c), **d, "round": r}
            for (b, a), c, d, r in zip(
                self.samples, cpu.tolist(), self.devices, self.labels, strict=True
            )
        ]


def comm_thread_clock(world: int) -> Callable[[], int | None] | None:
    """A reader of this rank's communication threads' CPU ns (:mod:`vpipe.trace.thread_cpu`)
    where the host's compute threads (its ranks x torch's threads) take every core, so that
    those threads run on compute's time; else None."""
    import os

    import torch

    from vpipe.runtime.comm import poster_thread_ids
    from vpipe.trace.thread_cpu import comm_thread_ns, cores_shared

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if not cores_shared(local_ranks * torch.get_num_threads()):
        return None
    return lambda: comm_thread_ns(poster_thread_ids())

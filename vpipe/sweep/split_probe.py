"""The split probe: what a split backward (I, then W) costs over a fused B on this rank's stages.

A run of a schedule that never splits (1f1b) cannot tell the simulator what I and W cost, and
one that always splits (zbv) cannot tell it what B costs; predicting one from the other needs
the ratio (:mod:`vpipe.predict.split_cost`). So before a config's first profiled step each
rank runs, on each of its stages that computes an input gradient, one microbatch's forward
and fused backward, then a forward, I and W, alternating which pair goes first, for about a
second (``seconds``; at most 48 repeats), and keeps each repeat's (I + W) / B: a paired
ratio, so a host whose speed drifts moves both sides. Inputs and output gradients are random tensors of the shapes
the stage exchanged in its last step (its metadata), the target the rank's first microbatch's.

:func:`probe_forwards` times, the same way, one microbatch's forward of each stage alone (then
drops it with a B): what a full recomputation reruns in each B or I. In a pipeline the F
actions of a small stage took up to twice that (docs/runtime.md, "Activation recomputation"),
and a recomputation priced at them came out 9-14% long.

Nothing of either probe is left behind: its microbatches are keyed outside any step's, its
gradients are dropped (every step starts from zeroed gradients) and the random draws of its
forwards come from a forked RNG. A recomputing stage is not probed (its backward reruns the
forward, which the simulator charges on its own), nor torch's runtime.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from vpipe.runtime.meta import as_tuple

__all__ = ["forwards_us", "probe_forwards", "probe_split"]

_FUSED, _SPLIT = -1, -2  # microbatch keys no step uses


def probe_split(
    stages: Mapping[int, Any],
    targets: Any,
    n_microbatches: int,
    device: torch.device,
    *,
    seconds: float = 1.0,
    min_repeats: int = 4,
    max_repeats: int = 48,
) -> list[float]:
    """Per repeat and probed stage (see the module docstring), (I + W) / B; [] when no stage of
    this rank computes an input gradient or its stages recompute. ``targets`` are the rank's
    step targets (None unless it holds the loss stage)."""
    probed = [st for st in stages.values() if _probed(st)]
    if not probed:
        return []
    target = _first_microbatch(targets, n_microbatches)
    sync = _synchronizer(device)
    ratios: list[float] = []
    with _forked_rng(device):
        for st in probed:  # gradients exist from here on: every timed pass accumulates
            _fused(st, device, target, sync)
            _split(st, device, target, sync)
        deadline = time.perf_counter() + seconds
        rep = 0
        while rep < min_repeats or (rep < max_repeats and time.perf_counter() < deadline):
            for st in probed:
                if rep % 2:
                    iw = _split(st, device, target, sync)
                    b = _fused(st, device, target, sync)
                else:
                    b = _fused(st, device, target, sync)
                    iw = _split(st, device, target, sync)
                ratios.append(iw / b)
            rep += 1
    _drop_grads(probed)
    return ratios


def probe_forwards(
    stages: Mapping[int, Any],
    targets: Any,
    n_microbatches: int,
    device: torch.device,
    *,
    repeats: int = 8,
) -> dict[int, float]:
    """Per stage of this rank that keeps its activations (no recomputation) and knows its
    shapes, the median seconds of one microbatch's forward run alone, over ``repeats`` after
    one untimed (see the module docstring); {} where none does."""
    mine = [st for st in stages.values() if st.recompute == "none" and st.in_meta]
    target = _first_microbatch(targets, n_microbatches)
    sync = _synchronizer(device)
    times: dict[int, list[float]] = {st.index: [] for st in mine}
    with _forked_rng(device):
        for rep in range(repeats + 1):
            for st in mine:
                values = _values(st.in_meta, device)
                sync()
                t0 = time.perf_counter()
                st.forward(_FUSED, values, target)
                sync()
                if rep:
                    times[st.index].append(time.perf_counter() - t0)
                st.backward(_FUSED, None if st.is_last else _values(st.float_out_meta, device))
    _drop_grads(mine)
    return {s: statistics.median(v) for s, v in times.items() if v}


def forwards_us(per_rank: Iterable[Mapping[int, float]]) -> list[float | None] | None:
    """Every rank's :func:`probe_forwards` as one list of microseconds per stage (None where
    no rank probed a stage): the runs table's and a trace's ``forward_alone_us``; None where
    no stage was probed."""
    got = {int(s): t for mine in per_rank for s, t in mine.items()}
    if not got:
        return None
    return [round(got[s] * 1e6, 1) if s in got else None for s in range(max(got) + 1)]


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """What waits for the device's queued work (nothing on a CPU)."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _forked_rng(device: torch.device) -> Any:
    """The random state restored on exit: the probes' draws leave a step's unchanged."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _drop_grads(stages: list[Any]) -> None:
    """The probes' accumulated gradients dropped (every step starts from zeroed ones)."""
    for st in stages:
        for p in st.module.parameters():
            p.grad = None


def _probed(stage: Any) -> bool:
    return not stage.is_first and stage.recompute == "none" and bool(stage.in_meta)


def _first_microbatch(targets: Any, n: int) -> Any:
    if targets is None:
        return None
    parts = tuple(t.chunk(n)[0] for t in as_tuple(targets, "targets"))
    return parts[0] if len(parts) == 1 else parts


def _values(meta: tuple, device: torch.device) -> tuple[torch.Tensor, ...]:
    return tuple(
        torch.randn(shape, dtype=dtype, device=device)
        if dtype.is_floating_point
        else torch.zeros(shape, dtype=dtype, device=device)
        for shape, dtype in meta
    )


def _forward(stage: Any, m: int, device: torch.device, target: Any) -> tuple | None:
    """Run F for probe microbatch ``m``; the output gradients its backward takes."""
    stage.forward(m, _values(stage.in_meta, device), target)
    return None if stage.is_last else _values(stage.float_out_meta, device)


def _fused(stage: Any, device: torch.device, target: Any, sync: Callable[[], None]) -> float:
    grads = _forward(stage, _FUSED, device, target)
    sync()
    t0 = time.perf_counter()
    stage.backward(_FUSED, grads)
    sync()
    return time.perf_counter() - t0


def _split(stage: Any, device: torch.device, target: Any, sync: Callable[[], None]) -> float:
    grads = _forward(stage, _SPLIT, device, target)
    sync()
    t0 = time.perf_counter()
    stage.backward_input(_SPLIT, grads)
    stage.backward_weight(_SPLIT)
    sync()
    return time.perf_counter() - t0

"""Achieved FLOP/s of F, I and W measured on a run, for a cluster plan (``vpipe plan --arch
... --from STORE --run RUN``): the run's calibrated per-stage medians
(:mod:`vpipe.predict.calibrate`) over the FLOPs its stages do, counted by
:mod:`vpipe.sim.arch` on the run's model. Only the built-in ``gpt`` model's FLOPs are known.
The rates describe the machine the run was made on: plan for that machine.
"""

from __future__ import annotations

from typing import Any

from vpipe.predict.plan import PlanError
from vpipe.sim.arch import Arch
from vpipe.sim.model_costs import Rates

__all__ = ["calibrated_rates", "rates_from_run", "run_arch"]


def run_arch(meta: dict[str, Any], rows: float) -> Arch:
    """The run's ``gpt`` model as an :class:`Arch` (fp32, ``rows`` sequences a microbatch)."""
    from vpipe.models import resolve_sizes

    if meta.get("model") != "gpt":
        raise PlanError(
            f"--from with --arch needs a run of the gpt model (its FLOPs are known); this run "
            f"is of model {meta.get('model')!r}"
        )
    sizes = resolve_sizes("gpt", int(meta.get("stages") or 1), meta.get("sizes") or {})
    if rows < 1 or rows != int(rows):
        raise PlanError(f"the run's microbatches have {rows:g} rows: need a whole number")
    return Arch(
        "gpt", layers=sizes["n_layers"], hidden=sizes["d_model"], heads=sizes["n_heads"],
        seq_len=sizes["seq_len"], vocab=sizes["vocab"], microbatch=int(rows), precision="fp32",
        learned_positions=True, tied_embeddings=False,
    )  # fmt: skip


def rates_from_run(store_root: str, run_id: str) -> Rates:
    """F, I and W rates of run ``run_id`` in ``store_root`` (see the module docstring)."""
    from vpipe.predict.plan import from_run
    from vpipe.trace.store import Store

    meta = Store(store_root).run(run_id).meta
    run_arch(meta, 1)  # a gpt run, or a clear error before calibrating
    return calibrated_rates(from_run(store_root, run_id), meta, run_id)


def calibrated_rates(costs: Any, meta: dict[str, Any], run_id: str = "") -> Rates:
    """Rates from a run's calibrated costs (:class:`vpipe.predict.plan.CalibratedCosts`): each
    kind's FLOPs over all stages (the model's pieces, embedding, blocks and head, split as
    the benchmark models split them) over its measured time over all stages."""
    from vpipe.predict.pieces import split_sizes

    arch = run_arch(meta, costs.rows)
    cal = costs.calibration
    first = 0
    flops = {"F": 0.0, "I": 0.0, "W": 0.0}
    for n in split_sizes(costs.pieces, cal.n_stages):  # pieces: embedding, blocks..., head
        blocks = len(set(range(first, first + n)) & set(range(1, arch.layers + 1)))
        head = first + n == costs.pieces
        for kind in flops:
            flops[kind] += blocks * arch.layer_flops(kind) + (arch.head_flops(kind) if head else 0)
        first += n
    times = {"F": float(cal.f.sum()), "I": float(cal.b.sum()), "W": float(cal.w.sum())}
    if min(times.values()) <= 0:
        raise PlanError(f"run {run_id!r}: a pass kind has no measured time: cannot derive rates")
    return Rates(
        *(flops[k] / (times[k] * 1e-6) for k in "FIW"),
        source=f"measured: run {run_id} ({meta.get('model')}, {meta.get('host', 'its host')})",
    )

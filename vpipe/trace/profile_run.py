"""Profile several schedules on one model in one launch, interleaved round by round.

Comparing schedules on a shared, noisy machine is fairest when their measurements alternate
(A B C A B C ...): a load spike then hits all of them. :func:`profile_schedules` spawns the
ranks once, builds one :class:`vpipe.runtime.Pipeline` per schedule on the same model (same
seed and sizes), warms each up, then for each round profiles one step of each schedule (after
one profiler warm-up step) with :class:`vpipe.trace.record.StepProfiler`. Every round's traces
land in ``OUT/traces/<schedule>/round<r>/rank<R>.json``; :func:`collect` converts them into one
event table per schedule (each round is a distinct step) and appends the runs to the store at
``OUT/store``, ready for ``vpipe analyze OUT/store --run <prefix>-1f1b --predict zbv ...``.

``python -m vpipe.trace.profile_run OUT [--schedules 1f1b zbv interleaved-1f1b] [--rounds 5]``
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd


@dataclass
class ProfileSpec:
    """What to run: picklable, sent to every rank."""

    out_dir: str
    schedules: list[str]
    ranks: int = 2
    microbatches: int = 8
    model: str = "mlp"
    sizes: dict[str, int] = field(default_factory=dict)
    batch: int = 32
    rounds: int = 3
    seed: int = 0
    prefix: str = "prof"

    def run_id(self, schedule: str) -> str:
        return f"{self.prefix}-{schedule}"


def _rank_main(rank: int, n_ranks: int, spec: ProfileSpec) -> list[list[str]]:
    import torch.distributed as dist

    from vpipe.models import build_model
    from vpipe.passes import lower
    from vpipe.runtime import Pipeline
    from vpipe.schedules import make_schedule
    from vpipe.trace.record import StepProfiler

    runs = []
    for name in spec.schedules:
        sched = lower(make_schedule(name, n_ranks, spec.microbatches))
        model = build_model(spec.model, sched.n_stages, spec.seed, **spec.sizes)
        modules = {s: model.stages[s] for s in sched.stages_of(rank)}
        pipe = Pipeline(sched, modules=modules, loss_fn=model.loss_fn)
        x, y = model.make_batch(spec.batch, spec.seed)
        args = (x if 0 in modules else None, y if sched.loss_stage in modules else None)
        meta = {
            "run_id": spec.run_id(name), "schedule": name, "impl": "vpipe", "ranks": n_ranks,
            "stages": sched.n_stages, "microbatches": spec.microbatches, "model": spec.model,
            "sizes": spec.sizes, "batch": spec.batch, "tokens_per_sample": model.tokens_per_sample,
        }  # fmt: skip
        runs.append((name, pipe, args, modules, meta))
        _step(pipe, args, modules)  # shape inference, first-touch allocations
    for r in range(spec.rounds):
        for name, pipe, args, modules, meta in runs:
            out = Path(spec.out_dir) / "traces" / name / f"round{r}"
            dist.barrier()
            with StepProfiler(out, rank, wait=0, warmup=1, active=1, metadata=meta) as prof:
                for _ in range(2):
                    _step(pipe, args, modules)
                    prof.step({"activations": pipe.stats.get("peak_live_activation_bytes")})
    return [[str(a) for a in pipe.schedule.actions[rank]] for _, pipe, _, _, _ in runs]


def _step(pipe: Any, args: tuple[Any, Any], modules: dict[int, Any]) -> None:
    for m in modules.values():
        for p in m.parameters():
            p.grad = None
    pipe.step(*args)


def profile_schedules(spec: ProfileSpec, timeout_s: float = 900.0) -> list[list[list[str]]]:
    """Run the spec; returns each rank's lowered program per schedule (for checks)."""
    from vpipe.runtime.launch import spawn

    return spawn(_rank_main, spec.ranks, spec, timeout_s=timeout_s)


def collect(spec: ProfileSpec) -> dict[str, tuple[pd.DataFrame, pd.DataFrame, dict]]:
    """Convert every schedule's rounds into (events, memory, meta), one step per round."""
    from vpipe.trace.kineto import convert

    out = {}
    for name in spec.schedules:
        rounds = sorted((Path(spec.out_dir) / "traces" / name).glob("round*"))
        parts = [convert([d], run_id=spec.run_id(name)) for d in rounds]
        events = pd.concat([p.events for p in parts], ignore_index=True)
        memory = pd.concat([p.memory for p in parts], ignore_index=True)
        out[name] = (events, memory, parts[0].meta if parts else {})
    return out


def store_runs(
    spec: ProfileSpec, tables: dict[str, tuple[pd.DataFrame, pd.DataFrame, dict]]
) -> Path:
    """Append each schedule's run, with its metrics, to ``OUT/store``."""
    from vpipe.analysis import summarize
    from vpipe.trace.store import Store, meta_columns

    store = Store(Path(spec.out_dir) / "store")
    for events, memory, meta in tables.values():
        row = meta_columns(meta)
        row.update(source="measured", status="ok", rounds=spec.rounds)
        row.update(
            summarize(
                events, memory, batch=spec.batch, tokens_per_sample=meta.get("tokens_per_sample")
            )
        )
        store.append_run(row, events, memory)
    return store.root


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output directory (traces/ and store/ inside)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "zbv", "interleaved-1f1b"])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--model", default="mlp")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefix", default="prof")
    a = p.parse_args(argv)
    spec = ProfileSpec(
        a.out, a.schedules, a.ranks, a.microbatches, a.model, {}, a.batch, a.rounds, prefix=a.prefix
    )
    profile_schedules(spec)
    print(store_runs(spec, collect(spec)))


if __name__ == "__main__":
    main()

"""Side-by-side benchmark: vpipe's runtime against torch.distributed.pipelining on identical work.

One launch of P local processes; for every schedule both implementations get their own copy of
the same seeded model, are warmed up, then timed in interleaved pairs (vpipe step, torch step,
vpipe step, ...), each step bracketed by barriers. The figure is the median of the pairwise
ratios vpipe/torch. Memory is the peak of bytes held by torch's CPU/CUDA allocator during one
steady-state step, relative to the step's start, from torch.profiler's memory events (so it
counts activations, gradients and communication buffers a step allocates, not parameters).

Run: ``python -m vpipe.baselines.compare --schedules zbv,interleaved-1f1b,dualpipev``.
Also prints figures for split backward: I then W against B on one stage of the model.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

from vpipe.bench import parse_list
from vpipe.errors import VpipeError
from vpipe.schedules import catalogue

# The baseline and the V-schedules, those torch has a class for, in display order.
DEFAULT_SCHEDULES = catalogue.names(
    lambda f: (f.baseline or f.placement == "v") and f.torch_class is not None
)


def compare(
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    *,
    ranks: int = 2,
    microbatches: int = 8,
    batch: int = 32,
    model: str = "mlp",
    sizes: dict[str, int] | None = None,
    warmup: int = 3,
    pairs: int = 15,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Run the benchmark in one local launch; return one row per schedule (rank 0's timing,
    every rank's memory)."""
    from vpipe.passes import lower, validate
    from vpipe.runtime import launch
    from vpipe.schedules import make_schedule

    if batch % microbatches:
        raise VpipeError(f"batch {batch} does not split into {microbatches} microbatches")
    lowered = []
    for name in schedules:
        s = lower(make_schedule(name, ranks, microbatches))
        validate(s)
        lowered.append(s)
    cfg = dict(model=model, sizes=sizes or {}, batch=batch, warmup=warmup, pairs=pairs, seed=seed)
    per_rank = launch.spawn(_compare_rank, ranks, lowered, cfg, timeout_s=1800)
    rows = []
    for i in range(len(lowered)):
        row = dict(per_rank[0][i])
        row["mem_vpipe"] = [r[i]["mem_vpipe"] for r in per_rank]
        row["mem_torch"] = [r[i]["mem_torch"] for r in per_rank]
        rows.append(row)
    return rows


def _compare_rank(rank: int, n_ranks: int, schedules: list, cfg: dict) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from vpipe.baselines.torch_pp import TorchPipeline
    from vpipe.models import build_model
    from vpipe.runtime import Pipeline

    out = []
    for sched in schedules:
        impls = {}
        for impl in ("vpipe", "torch"):
            m = build_model(cfg["model"], sched.n_stages, cfg["seed"], **cfg["sizes"])
            modules = {s: m.stages[s] for s in sched.stages_of(rank)}
            if impl == "vpipe":
                pipe = Pipeline(sched, modules=modules, loss_fn=m.loss_fn)
            else:
                pipe = TorchPipeline(
                    sched.name,
                    modules,
                    m.loss_fn,
                    n_stages=sched.n_stages,
                    n_microbatches=sched.n_microbatches,
                )
            x, y = m.make_batch(cfg["batch"], cfg["seed"])
            params = [p for mod in modules.values() for p in mod.parameters()]
            impls[impl] = (
                pipe,
                x if 0 in modules else None,
                y if sched.loss_stage in modules else None,
                params,
            )
        for _ in range(cfg["warmup"]):
            for impl in impls.values():
                _timed_step(dist, *impl)
        times: dict[str, list[float]] = {"vpipe": [], "torch": []}
        for _ in range(cfg["pairs"]):
            for name, impl in impls.items():
                times[name].append(_timed_step(dist, *impl))
        ratios = [a / b for a, b in zip(times["vpipe"], times["torch"], strict=True)]
        row = {
            "schedule": sched.name,
            "ranks": n_ranks,
            "microbatches": sched.n_microbatches,
            "vpipe_ms": statistics.median(times["vpipe"]) * 1e3,
            "torch_ms": statistics.median(times["torch"]) * 1e3,
            "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
        for name, impl in impls.items():
            row[f"mem_{name}"] = _step_peak_bytes(dist, *impl)
        out.append(row)
    return out


def _timed_step(dist: Any, pipe: Any, x: Any, y: Any, params: list) -> float:
    import time as _time

    for p in params:
        p.grad = None
    dist.barrier()
    t0 = _time.perf_counter()
    pipe.step(x, y)
    dist.barrier()
    return _time.perf_counter() - t0


def _step_peak_bytes(dist: Any, pipe: Any, x: Any, y: Any, params: list) -> int:
    """Peak allocator bytes during one step above the step's start: the running sum of the
    profiler's allocation/free events (the ``[memory]`` instants of its trace)."""
    import json
    import os
    import tempfile

    from torch.profiler import profile

    for p in params:
        p.grad = None
    dist.barrier()
    with profile(profile_memory=True) as prof:
        pipe.step(x, y)
    dist.barrier()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.unlink(path)
    deltas = sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]")
    level = peak = 0
    for _, delta in deltas:
        level += delta
        peak = max(peak, level)
    return peak


# ---------------------------------------------------------------------------------------------
# Split backward: I + W against B


def split_backward_figures(
    d_model: int = 512, d_hidden: int = 2048, n_blocks: int = 1, rows: int = 4, repeats: int = 50
) -> dict[str, float]:
    """Median time of B and of (I then W) on one stage of the benchmark MLP, interleaved.

    ``rows`` is the microbatch size (the benchmark: batch 32 / 8 microbatches = 4).
    """
    import torch

    from vpipe.models import build_model
    from vpipe.runtime.backward import backward_full, backward_input, grad_node

    stage = build_model("mlp", 1, 0, d_model=d_model, d_hidden=d_hidden, n_blocks=n_blocks).stages[
        0
    ]
    params = list(stage.parameters())
    param_nodes = {grad_node(p): p for p in params}
    x0 = torch.randn(rows, d_model)
    g = torch.randn(rows, d_model)

    def run_b() -> float:
        x = x0.clone().requires_grad_(True)
        out = stage(x)
        t0 = time.perf_counter()
        backward_full([out], [g], [x])
        return time.perf_counter() - t0

    def run_iw() -> tuple[float, float]:
        x = x0.clone().requires_grad_(True)
        out = stage(x)
        t0 = time.perf_counter()
        _, task = backward_input([out], [g], [x], param_nodes)
        t1 = time.perf_counter()
        task.run()
        return t1 - t0, time.perf_counter() - t1

    for _ in range(5):
        run_b()
        run_iw()
    b_times, i_times, w_times, iw_ratio = [], [], [], []
    for _ in range(repeats):
        for p in params:
            p.grad = None
        b = run_b()
        for p in params:
            p.grad = None
        i, w = run_iw()
        b_times.append(b)
        i_times.append(i)
        w_times.append(w)
        iw_ratio.append((i + w) / b)
    return {
        "b_us": statistics.median(b_times) * 1e6,
        "i_us": statistics.median(i_times) * 1e6,
        "w_us": statistics.median(w_times) * 1e6,
        "iw_over_b_median": statistics.median(iw_ratio),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m vpipe.baselines.compare", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--schedules", default=",".join(DEFAULT_SCHEDULES))
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--model", default="mlp")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pairs", type=int, default=15)
    p.add_argument("--split-backward-rows", type=int, nargs="*", default=[4, 32])
    p.add_argument("--skip-pipelines", action="store_true", help="only the I+W vs B figures")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    for rows in args.split_backward_rows:
        f = split_backward_figures(rows=rows)
        print(
            f"split backward, MLP block 512-2048, {rows} rows, 1 thread: B {f['b_us']:.0f} us, "
            f"I {f['i_us']:.0f} us + W {f['w_us']:.0f} us; median (I+W)/B = "
            f"{f['iw_over_b_median']:.3f}",
            flush=True,
        )
    if args.skip_pipelines:
        return 0
    rows = compare(
        parse_list(args.schedules),
        ranks=args.ranks,
        microbatches=args.microbatches,
        batch=args.batch,
        model=args.model,
        warmup=args.warmup,
        pairs=args.pairs,
    )
    print(
        f"vpipe vs torch.distributed.pipelining: model={args.model} P={args.ranks} "
        f"M={args.microbatches} batch={args.batch}, {args.pairs} interleaved pairs after "
        f"{args.warmup} warm-up steps each"
    )
    print(
        f"{'schedule':<18}{'vpipe ms':>10}{'torch ms':>10}{'ratio':>8}{'min':>7}{'max':>7}"
        "  peak step MiB per rank vpipe | torch"
    )
    for r in rows:
        mv = " ".join(f"{b / 2**20:.2f}" for b in r["mem_vpipe"])
        mt = " ".join(f"{b / 2**20:.2f}" for b in r["mem_torch"])
        print(
            f"{r['schedule']:<18}{r['vpipe_ms']:>10.2f}{r['torch_ms']:>10.2f}"
            f"{r['ratio_median']:>8.3f}{r['ratio_min']:>7.2f}{r['ratio_max']:>7.2f}  {mv} | {mt}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``vpipe run``: train a benchmark model for a few steps under a schedule, on local processes
or inside a torchrun job, printing per-step time and loss; ``--check`` compares losses and every
gradient with the unpipelined reference.

The schedule (and model split) is validated before any process starts. Torch is imported only
inside the functions that run ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass, field
from typing import Any

from vpipe.commands._runtime_flags import add_runtime_flags, dp_fields, positive_int
from vpipe.errors import PipelineError, VpipeError, one_line
from vpipe.ir import Schedule
from vpipe.schedules.load import is_csv_source
from vpipe.sweep.cli_lists import parse_sizes
from vpipe.sweep.harness import RankSpec, build


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a schedule on a benchmark model (local processes or torchrun)",
        description=(
            "Run NAME (a built-in schedule or a torch-format CSV file) for a few training steps. "
            "Outside torchrun, spawns --ranks local processes; under torchrun, joins its job."
        ),
    )
    p.add_argument("schedule", metavar="NAME", help="schedule name or CSV file")
    p.add_argument(
        "--ranks",
        "-p",
        type=positive_int,
        help="pipeline ranks (default: inferred from a CSV; under torchrun its world size; else 2)",
    )
    p.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        help="microbatches per step (default: inferred from a CSV, else max(8, 2 x ranks))",
    )
    p.add_argument(
        "--stages-per-rank", "-v", type=positive_int, help="stages per rank (schedule default)"
    )
    p.add_argument(
        "--model",
        default="mlp",
        help="mlp, gpt, tuple, looped-mlp, or your own package.module:function "
        "(see examples/custom_model.py)",
    )
    p.add_argument(
        "--sizes", default="", help="model sizes, e.g. d_model=64,n_blocks=8 (model defaults)"
    )
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        help="default: gloo on cpu, nccl on cuda (one GPU per local rank); with gloo, cuda ranks "
        "may share GPUs: rank r on cuda:(r mod GPUs), all on cuda:0 with one GPU",
    )
    p.add_argument("--impl", choices=("vpipe", "torch"), default="vpipe")
    p.add_argument("--check", action="store_true", help="compare with the unpipelined reference")
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="--check relative tolerance (default by --dtype: fp32 1e-5, bf16 0.1, fp16 0.2)",
    )
    p.add_argument(
        "--profile", metavar="DIR", help="write per-rank Kineto traces to DIR/rank<N>.pt.trace.json"
    )
    p.add_argument(
        "--verbose", action="store_true", help="show the profiler's own USDT/STAGE lines on stderr"
    )
    p.add_argument(
        "--profile-ops",
        action="store_true",
        help="record every aten op in the profiled steps too (for reading the traces; it slows "
        "the steps it records), not only vpipe's and torch's action spans",
    )
    p.add_argument("--seed", type=int, default=0)
    add_runtime_flags(p)
    p.add_argument("--timeout", type=float, default=600.0, help="local job timeout in seconds")
    p.set_defaults(func=run_command)


@dataclass
class RunConfig:
    """Everything a rank needs; picklable so spawned processes receive it."""

    rank: RankSpec
    steps: int
    check: bool
    tol: float | None  # None: the precision's default
    profile: str | None
    meta: dict[str, Any] = field(default_factory=dict)
    verbose: bool = False  # the profiler's trace-point lines on stderr
    profile_ops: bool = False  # every aten op in the trace, not only the action spans
    cpu_allocator: str = "cached"  # how each rank's malloc keeps freed memory (host_memory)


def run_command(args: argparse.Namespace) -> int:
    """Validate everything, then run the ranks; 0 on success, 1 when --check fails."""
    cfg = build_config(args)
    from vpipe.runtime import launch

    n_ranks = cfg.rank.world_size  # pipeline ranks x --dp replicas
    if launch.in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if cfg.rank.dp > 1:
            from vpipe.runtime.data_parallel import check_layout

            check_layout(world, cfg.rank.schedule.n_ranks, cfg.rank.dp, cfg.rank.process_backend)
        if world != n_ranks:
            raise PipelineError(
                f"torchrun started {world} processes but the schedule has {n_ranks} ranks"
            )
        rank, _, _ = launch.init_from_env(cfg.rank.device, args.backend)

        try:
            result = run_rank(rank, n_ranks, cfg)
        except VpipeError:
            raise
        except Exception as e:  # one line naming the rank, as a local run reports it
            raise PipelineError(f"rank {rank}: {one_line(e)}") from None
        finally:
            launch.leave_job()
        return 0 if result["ok"] else 1
    if cfg.rank.device == "cuda":
        launch.check_gpus(n_ranks, cfg.rank.process_backend)
    results = launch.spawn(
        run_rank, n_ranks, cfg, backend=cfg.rank.process_backend, timeout_s=args.timeout
    )
    return 0 if all(r["ok"] for r in results) else 1


def build_config(args: argparse.Namespace) -> RunConfig:
    """Resolve and validate schedule, model and sizes in this process, before any rank runs."""
    if args.steps < 1 or args.batch < 1:
        raise VpipeError(f"--steps and --batch must be >= 1, got {args.steps} and {args.batch}")
    if args.profile:  # before any rank starts, as every output path
        from vpipe.outputs import check_output_dir

        check_output_dir(args.profile, append=True, flag="--profile")
    if not is_csv_source(args.schedule):  # a built-in name: defaults as vpipe bench's
        if args.ranks is None:
            args.ranks = int(os.environ.get("WORLD_SIZE", 2))
        if args.microbatches is None:
            args.microbatches = max(8, 2 * args.ranks)
    schedule = resolve_schedule(args)
    sizes = parse_sizes(args.sizes)
    spec = RankSpec(
        schedule,
        impl=args.impl,
        model=args.model,
        sizes=sizes,
        batch=args.batch,
        seed=args.seed,
        device=args.device,
        backend=args.backend,
        dtype=args.dtype,
        torch_program=args.impl == "torch" and is_csv_source(args.schedule),
        bundle_messages=args.bundle_messages,
        recv_lookahead=args.recv_lookahead,  # what lowered the schedule (resolve_schedule)
        post_thread=args.post_thread,
        recompute=args.recompute,
        **dp_fields(args),
    )
    spec.check()
    meta = {
        "schedule": schedule.name,
        "impl": args.impl,
        "ranks": schedule.n_ranks,
        "stages": schedule.n_stages,
        "microbatches": schedule.n_microbatches,
        "model": args.model,
        "sizes": sizes,
        "batch": args.batch,
        "device": args.device,
        "dtype": spec.precision,
        "seed": args.seed,
        "recv_lookahead": args.recv_lookahead,
        "bundle_messages": args.bundle_messages,
        "post_thread": spec.posts_from_thread,
        "dp": spec.dp,
        "recompute": args.recompute,
    }
    return RunConfig(
        spec,
        args.steps,
        args.check,
        args.tol,
        args.profile,
        meta,
        verbose=args.verbose,
        profile_ops=args.profile_ops,
        cpu_allocator=args.cpu_allocator,
    )


def resolve_schedule(args: argparse.Namespace) -> Schedule:
    """A built-in schedule or a CSV file's (as the schedule commands load them), lowered and
    validated; for the torch impl compute-only (torch lowers it itself)."""
    from vpipe.ir.lowering import lower, validate
    from vpipe.schedules.load import load_schedule

    name = args.schedule
    schedule = load_schedule(name, args.ranks, args.microbatches, args.stages_per_rank)
    if args.impl == "torch":
        return schedule.compute_only()
    if args.recv_lookahead < 0:
        raise VpipeError(f"--recv-lookahead must be >= 0, got {args.recv_lookahead}")
    lowered = (
        schedule if schedule.is_lowered else lower(schedule, recv_lookahead=args.recv_lookahead)
    )
    validate(lowered)
    return lowered


# ---------------------------------------------------------------------------------------------
# One rank


def run_rank(rank: int, n_ranks: int, cfg: RunConfig) -> dict[str, Any]:
    """Build this rank's harness, run the steps (then one metered step), print on rank 0,
    check against the reference."""
    import torch
    import torch.distributed as dist

    from vpipe.runtime.host_memory import apply_cpu_allocator
    from vpipe.trace.record import StepProfiler

    cfg.meta["cpu_allocator"] = apply_cpu_allocator(cfg.cpu_allocator)  # what is in effect
    h = build(cfg.rank, rank)
    if cfg.profile:  # the traces carry what a split backward and a forward alone cost here
        cfg.meta["split_backward_ratio"] = _split_probe(h, n_ranks)
        cfg.meta["forward_alone_us"] = _forward_probe(h, n_ranks)
    loss_rank = cfg.rank.schedule.loss_rank
    times: list[float] = []
    wait, warmup = int(cfg.steps >= 3), int(cfg.steps >= 2)  # skip shape inference if we can
    active = max(1, min(3, cfg.steps - wait - warmup))
    window = {"wait": wait, "warmup": warmup, "active": active}
    with StepProfiler(
        cfg.profile,
        rank,
        metadata=cfg.meta,
        verbose=cfg.verbose,
        ops=cfg.profile_ops,
        device=h.device,
        **window,
    ) as prof:
        for k in range(cfg.steps):
            slowest = torch.tensor([h.timed_step()], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times.append(float(slowest.item()))
            loss = _broadcast_mean_loss(h.losses, loss_rank, h.device)
            prof.step({"activations": h.stats.get("peak_live_activation_bytes")})
            if rank == 0:
                print(f"step {k}: {times[-1] * 1e3:.2f} ms  loss {loss:.6f}", flush=True)
    memory = h.memory_step()
    peaks: list[Any] = [None] * n_ranks
    dist.all_gather_object(peaks, {k: v for k, v in memory.items() if k != "samples"})
    ok, n_checked = True, 0
    if cfg.check:
        failures = h.check(h.losses, cfg.tol)
        gathered: list[Any] = [None] * n_ranks
        dist.all_gather_object(gathered, (rank, failures))
        bad = [(r, f) for r, fs in gathered for f in fs if not f["ok"]]
        ok, n_checked = not bad, sum(len(fs) for _, fs in gathered)
        if rank == 0:
            _print_check(gathered, bad)
    if rank == 0:
        _print_summary(cfg, h.tokens_per_sample, times, peaks)
    if cfg.rank.dp > 1:
        from vpipe.sweep.dp_report import print_reductions

        print_reductions(rank, n_ranks, h.stats, cfg.rank.schedule.n_ranks)
    return {
        "rank": rank,
        "ok": ok,
        "checked": n_checked,
        "step_times_s": times,
        "losses": None if h.losses is None else [float(t.detach()) for t in h.losses],
        "peak_memory": peaks[rank],
    }


def _split_probe(h: Any, n_ranks: int) -> float | None:
    """The run's split probe (:mod:`vpipe.sweep.split_probe`), the median over every rank's
    repeats, after one untimed step (in which the stages learn their shapes); None for torch's
    runtime and recomputing stages, which are not probed (and then take no extra step)."""
    import statistics

    import torch.distributed as dist

    if h.spec.impl != "vpipe" or h.spec.recompute != "none":
        return None
    dist.barrier()
    h.step()
    everyone: list[Any] = [None] * n_ranks
    dist.all_gather_object(everyone, h.split_probe())
    ratios = [x for mine in everyone for x in mine]
    return statistics.median(ratios) if ratios else None


def _forward_probe(h: Any, n_ranks: int) -> list[float | None] | None:
    """Every stage's forward alone in microseconds (:func:`vpipe.sweep.split_probe.
    probe_forwards`), gathered from every rank after the split probe's untimed step; None
    where no rank probed (torch's runtime, recomputing stages)."""
    import torch.distributed as dist

    from vpipe.sweep.split_probe import forwards_us

    everyone: list[Any] = [None] * n_ranks
    dist.all_gather_object(everyone, h.forward_probe() if h.spec.recompute == "none" else {})
    return forwards_us(everyone)


def _broadcast_mean_loss(losses: list[Any] | None, loss_rank: int, device: Any) -> float:
    import torch
    import torch.distributed as dist

    value = torch.zeros(1, dtype=torch.float64, device=device)
    if losses is not None:
        value[0] = float(torch.stack([t.detach().float() for t in losses]).mean())
    dist.broadcast(value, src=loss_rank)
    return float(value.item())


def _print_check(gathered: list[Any], bad: list[Any]) -> None:
    worst = max((f["err"] for _, fs in gathered for f in fs), default=0.0)
    n = sum(len(fs) for _, fs in gathered)
    if not bad:
        print(f"check: OK ({n} comparisons, max relative error {worst:.2e})", flush=True)
        return
    for r, f in bad:
        print(
            f"check: MISMATCH rank {r} {f['where']}: {f['what']} max relative error {f['err']:.3e}",
            file=sys.stderr,
            flush=True,
        )
    print(f"check: FAILED ({len(bad)} of {n} comparisons)", file=sys.stderr, flush=True)


def _print_summary(
    cfg: RunConfig, tokens_per_sample: int | None, times: list[float], peaks: list[Any]
) -> None:
    timed = times[1:] if len(times) > 1 else times  # the first step infers shapes
    med = statistics.median(timed)
    batch = cfg.rank.batch
    rate = f"{batch / med:.1f} samples/s"
    if tokens_per_sample:
        rate += f", {batch * tokens_per_sample / med:.0f} tokens/s"
    mem = " ".join(f"r{r}:{_size(p['peak_bytes'])}" for r, p in enumerate(peaks))
    if all("cuda_peak_bytes" in p for p in peaks):
        mem += "; CUDA allocator peak " + " ".join(
            f"r{r}:{_size(p['cuda_peak_bytes'])}" for r, p in enumerate(peaks)
        )
    s = cfg.rank.schedule
    print(
        f"summary: {s.name} impl={cfg.rank.impl} ranks={s.n_ranks} stages={s.n_stages} "
        f"microbatches={s.n_microbatches} model={cfg.rank.model} batch={batch}: median step "
        f"{med * 1e3:.2f} ms (slowest rank) over {len(timed)} steps, {rate}; peak saved "
        f"activations {mem}",
        flush=True,
    )
    if len(times) > 1:
        print(
            "(the loss repeats from step to step: vpipe run times forward and backward only, no "
            "optimizer step changes the weights)",
            flush=True,
        )


def _size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}GiB"

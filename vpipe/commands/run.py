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
import time
from dataclasses import dataclass, field
from typing import Any

from vpipe.bench import parse_sizes
from vpipe.errors import PipelineError, ScheduleError, VpipeError
from vpipe.ir import Schedule

_MODELS = ("mlp", "gpt", "tuple")


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
    p.add_argument("--ranks", "-p", type=int, help="pipeline ranks (inferred from a CSV)")
    p.add_argument("--microbatches", "-m", type=int, help="microbatches per step")
    p.add_argument("--stages-per-rank", "-v", type=int, help="stages per rank (schedule default)")
    p.add_argument("--model", choices=_MODELS, default="mlp")
    p.add_argument(
        "--sizes", default="", help="model sizes, e.g. d_model=64,n_blocks=8 (model defaults)"
    )
    p.add_argument("--steps", type=int, default=10, help="training steps (default 10)")
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", choices=("gloo", "nccl"), help="default: gloo on cpu, nccl on cuda")
    p.add_argument("--impl", choices=("vpipe", "torch"), default="vpipe")
    p.add_argument("--check", action="store_true", help="compare with the unpipelined reference")
    p.add_argument("--tol", type=float, default=1e-5, help="--check relative tolerance")
    p.add_argument("--profile", metavar="DIR", help="write per-rank Kineto traces to DIR")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="local job timeout in seconds")
    p.set_defaults(func=run_command)


@dataclass
class RunConfig:
    """Everything a rank needs; picklable so spawned processes receive it."""

    schedule: Schedule  # lowered, validated (vpipe impl); compute-only for torch
    impl: str
    model: str
    sizes: dict[str, int]
    steps: int
    batch: int
    device: str
    seed: int
    check: bool
    tol: float
    profile: str | None
    meta: dict[str, Any] = field(default_factory=dict)


def run_command(args: argparse.Namespace) -> int:
    """Validate everything, then run the ranks; 0 on success, 1 when --check fails."""
    cfg = build_config(args)
    from vpipe.runtime import launch

    n_ranks = cfg.schedule.n_ranks
    if launch.in_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != n_ranks:
            raise PipelineError(
                f"torchrun started {world} processes but the schedule has {n_ranks} ranks"
            )
        rank, _, _ = launch.init_from_env(cfg.device, args.backend)
        import torch.distributed as dist

        try:
            result = run_rank(rank, n_ranks, cfg)
        except VpipeError:
            raise
        except Exception as e:  # one line naming the rank, as a local run reports it
            first = (str(e).strip().splitlines() or [""])[0]
            raise PipelineError(f"rank {rank}: {type(e).__name__}: {first}") from None
        finally:
            dist.destroy_process_group()
        return 0 if result["ok"] else 1
    if cfg.device == "cuda":
        _check_gpus(n_ranks)
    backend = args.backend or _default_backend(cfg.device)
    results = launch.spawn(run_rank, n_ranks, cfg, backend=backend, timeout_s=args.timeout)
    return 0 if all(r["ok"] for r in results) else 1


def _default_backend(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _check_gpus(n_ranks: int) -> None:
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < n_ranks:
        raise VpipeError(
            f"--device cuda needs one CUDA device per local rank: {n_ranks} ranks, {have} devices"
        )


def build_config(args: argparse.Namespace) -> RunConfig:
    """Resolve and validate schedule, model and sizes in this process, before any rank runs."""
    for flag in ("ranks", "microbatches", "stages_per_rank"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise VpipeError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.steps < 1 or args.batch < 1:
        raise VpipeError(f"--steps and --batch must be >= 1, got {args.steps} and {args.batch}")
    schedule = resolve_schedule(args)
    if args.batch % schedule.n_microbatches:
        raise VpipeError(
            f"--batch {args.batch} does not split into {schedule.n_microbatches} equal microbatches"
        )
    sizes = parse_sizes(args.sizes)
    from vpipe.models import build_model

    build_model(args.model, schedule.n_stages, args.seed, **sizes)  # raises ModelError early
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
        "seed": args.seed,
    }
    return RunConfig(
        schedule,
        args.impl,
        args.model,
        sizes,
        args.steps,
        args.batch,
        args.device,
        args.seed,
        args.check,
        args.tol,
        args.profile,
        meta,
    )


def resolve_schedule(args: argparse.Namespace) -> Schedule:
    """A built-in schedule or a CSV file's (as the schedule commands load them), lowered and
    validated; for the torch impl, a built-in schedule, compute-only."""
    from vpipe.passes import lower, validate
    from vpipe.schedules.load import is_csv_source, load_schedule

    name = args.schedule
    if args.impl == "torch" and is_csv_source(name):
        raise ScheduleError("--impl torch runs torch's built-in schedules, not a CSV file")
    schedule = load_schedule(name, args.ranks, args.microbatches, args.stages_per_rank)
    if args.impl == "torch":
        from vpipe.baselines.torch_pp import torch_placement

        if torch_placement(name, schedule.n_ranks, schedule.n_stages) != schedule.placement:
            raise ScheduleError(f"torch's {name} places stages differently from vpipe's")
        return schedule.compute_only()
    lowered = schedule if schedule.is_lowered else lower(schedule)
    validate(lowered)
    return lowered


# ---------------------------------------------------------------------------------------------
# One rank


def make_pipeline(cfg: RunConfig, model: Any, device: Any) -> Any:
    """vpipe's Pipeline or the torch baseline over this rank's stages of ``model``."""
    import torch.distributed as dist

    rank, sched = dist.get_rank(), cfg.schedule
    modules = {s: model.stages[s].to(device) for s in sched.stages_of(rank)}
    if cfg.impl == "torch":
        from vpipe.baselines.torch_pp import TorchPipeline

        return TorchPipeline(
            sched.name,
            modules,
            model.loss_fn,
            n_stages=sched.n_stages,
            n_microbatches=sched.n_microbatches,
            device=device,
        )
    from vpipe.runtime import Pipeline

    return Pipeline(sched, modules=modules, loss_fn=model.loss_fn, device=device)


def run_rank(rank: int, n_ranks: int, cfg: RunConfig) -> dict[str, Any]:
    """Build this rank's stages and pipeline, run the steps, print on rank 0, check."""
    import torch.distributed as dist

    from vpipe.models import build_model
    from vpipe.trace.record import StepProfiler

    sched = cfg.schedule
    device = _device(cfg.device, rank)
    model = build_model(cfg.model, sched.n_stages, cfg.seed, **cfg.sizes)
    reference = model.reference_model() if cfg.check else None  # before any .to(device)
    pipe = make_pipeline(cfg, model, device)
    mine = sched.stages_of(rank)
    first_rank, loss_rank = sched.placement[0], sched.loss_rank
    x, y = model.make_batch(cfg.batch, cfg.seed)
    inputs = x.to(device) if rank == first_rank else None
    targets = y.to(device) if rank == loss_rank else None
    params = [p for s in mine for p in model.stages[s].parameters()]
    times: list[float] = []
    losses: list[Any] | None = None
    wait, warmup = int(cfg.steps >= 3), int(cfg.steps >= 2)  # skip shape inference if we can
    active = max(1, min(3, cfg.steps - wait - warmup))
    window = {"wait": wait, "warmup": warmup, "active": active}
    with StepProfiler(cfg.profile, rank, metadata=cfg.meta, **window) as prof:
        for k in range(cfg.steps):
            for p in params:
                p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            losses = pipe.step(inputs, targets)
            dist.barrier()
            times.append(time.perf_counter() - t0)
            loss = _broadcast_mean_loss(losses, loss_rank, device)
            prof.step({"activations": getattr(pipe, "stats", {}).get("peak_live_activation_bytes")})
            if rank == 0:
                print(f"step {k}: {times[-1] * 1e3:.2f} ms  loss {loss:.6f}", flush=True)
    peak = _peak_memory(device)
    peaks = [None] * n_ranks
    dist.all_gather_object(peaks, peak)
    ok, n_checked = True, 0
    if cfg.check:
        failures = check_against_reference(
            reference, model, mine, losses, x, y, sched.n_microbatches, cfg.tol, device
        )
        gathered: list[Any] = [None] * n_ranks
        dist.all_gather_object(gathered, (rank, failures))
        bad = [(r, f) for r, fs in gathered for f in fs if not f["ok"]]
        ok, n_checked = not bad, sum(len(fs) for _, fs in gathered)
        if rank == 0:
            _print_check(gathered, bad)
    if rank == 0:
        _print_summary(cfg, model, times, peaks)
    return {
        "rank": rank,
        "ok": ok,
        "checked": n_checked,
        "step_times_s": times,
        "losses": None if losses is None else [float(t) for t in losses],
        "peak_memory": peak,
    }


def _device(kind: str, rank: int) -> Any:
    """cpu, or this process's GPU: LOCAL_RANK under torchrun, else the rank (local spawn)."""
    import torch

    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def _broadcast_mean_loss(losses: list[Any] | None, loss_rank: int, device: Any) -> float:
    import torch
    import torch.distributed as dist

    value = torch.zeros(1, dtype=torch.float64, device=device)
    if losses is not None:
        value[0] = float(torch.stack([t.detach().float() for t in losses]).mean())
    dist.broadcast(value, src=loss_rank)
    return float(value.item())


def _peak_memory(device: Any) -> dict[str, int]:
    """Peak memory of this rank: the CUDA allocator's peak, or the process's max RSS."""
    import resource

    import torch

    if device.type == "cuda":
        return {"cuda_max_allocated": int(torch.cuda.max_memory_allocated(device))}
    return {"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def check_against_reference(
    reference: Any,
    model: Any,
    stages: list[int],
    losses: list[Any] | None,
    x: Any,
    y: Any,
    n_microbatches: int,
    tol: float,
    device: Any,
) -> list[dict[str, Any]]:
    """Compare this rank's losses and stage gradients with the reference on the same batch.

    The reference computes each microbatch's loss and backpropagates their mean. Errors are
    relative to the largest magnitude of the reference tensor.
    """
    import torch

    chunks = zip(x.chunk(n_microbatches), y.chunk(n_microbatches), strict=True)
    ref_losses = [model.loss_fn(reference(xm), ym) for xm, ym in chunks]
    (torch.stack(ref_losses).sum() / n_microbatches).backward()
    out = []
    if losses is not None:
        if len(losses) != n_microbatches:
            out.append(
                _finding(
                    "losses",
                    f"{len(losses)} losses for {n_microbatches} microbatches",
                    float("inf"),
                    tol,
                )
            )
        else:
            got = torch.stack([t.detach().cpu().float() for t in losses])
            want = torch.stack([t.detach().float() for t in ref_losses])
            out.append(_finding("losses", "per-microbatch losses", _rel_err(got, want), tol))
    ref_params = dict(reference.named_parameters())
    for s in stages:
        for name, p in model.stages[s].named_parameters():
            ref = ref_params[f"stages.{s}.{name}"].grad
            where = f"stage {s} parameter {name}"
            if p.grad is None:
                out.append(_finding(where, "no gradient", float("inf"), tol))
            else:
                out.append(_finding(where, "gradient", _rel_err(p.grad.detach().cpu(), ref), tol))
    return out


def _rel_err(got: Any, want: Any) -> float:
    scale = max(float(want.abs().max()), 1e-12)
    return float((got - want).abs().max()) / scale


def _finding(where: str, what: str, err: float, tol: float) -> dict[str, Any]:
    return {"where": where, "what": what, "err": err, "ok": err <= tol}


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


def _print_summary(cfg: RunConfig, model: Any, times: list[float], peaks: list[Any]) -> None:
    timed = times[1:] if len(times) > 1 else times  # the first step infers shapes
    med = statistics.median(timed)
    rate = f"{cfg.batch / med:.1f} samples/s"
    if model.tokens_per_sample:
        rate += f", {cfg.batch * model.tokens_per_sample / med:.0f} tokens/s"
    mem = " ".join(f"r{r}:{next(iter(p.values())) / 2**20:.0f}MiB" for r, p in enumerate(peaks))
    kind = next(iter(peaks[0]))
    s = cfg.schedule
    print(
        f"summary: {s.name} impl={cfg.impl} ranks={s.n_ranks} stages={s.n_stages} "
        f"microbatches={s.n_microbatches} model={cfg.model} batch={cfg.batch}: median step "
        f"{med * 1e3:.2f} ms over {len(timed)} steps, {rate}; peak {kind} {mem}",
        flush=True,
    )

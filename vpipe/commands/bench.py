"""``vpipe bench`` (sweep schedules x microbatches x implementations in one launch) and
``vpipe report`` (HTML/Markdown reports and cross-run comparisons)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from vpipe.bench import DEFAULT_SCHEDULES

    p = subparsers.add_parser(
        "bench",
        help="sweep schedules x microbatches x implementations in one launch; write plots+report",
        description="Run every config (schedule x microbatch count x implementation) in one "
        "launch of P ranks, interleaved in rounds; store runs, events, plots and a report. "
        "Under torchrun it joins the job instead of spawning.",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="pipeline ranks P (default 2; under torchrun the job's world size)",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: gloo on cpu, nccl on cuda",
    )
    p.add_argument("--model", default="mlp", help="mlp, gpt or tuple (default mlp)")
    p.add_argument(
        "--sizes",
        default="",
        help="model sizes, e.g. d_model=512,d_hidden=2048,n_blocks=4 (default for mlp: "
        "d_model=256,d_hidden=1024; n_blocks/n_layers grow to the largest stage count)",
    )
    p.add_argument("--batch", type=int, default=32, help="samples per step (default 32)")
    p.add_argument(
        "--schedules",
        default=",".join(DEFAULT_SCHEDULES),
        help="comma-separated schedule names (default %(default)s)",
    )
    p.add_argument("--microbatches", default="4,8", help="comma-separated counts (default 4,8)")
    p.add_argument("--impl", default="vpipe,torch", help="vpipe, torch or both (default both)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per config (default 2)")
    p.add_argument(
        "--steps", type=int, default=3, help="timed steps per config per round (default 3)"
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds over all configs (default 3)"
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=1,
        help="profiled steps per config, one per interleaved round (default 1)",
    )
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the profiled step (no events, Gantt charts or simulation)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sweep: interleaved-1f1b vs zbv, M=4, both impls, a small MLP",
    )
    p.add_argument(
        "--traces",
        default=None,
        metavar="DIR",
        help="keep the per-config Kineto traces (Perfetto) under DIR",
    )
    p.add_argument("--out", default="results/latest", help="output directory (default %(default)s)")
    p.add_argument(
        "--verbose", action="store_true", help="show the profiler's own USDT/STAGE lines on stderr"
    )
    p.set_defaults(func=run_bench)

    r = subparsers.add_parser(
        "report",
        help="HTML/Markdown report of a bench run, or a speedup comparison of several runs",
        description="With one run: its summary. With several (different commits or machines): "
        "the speedup of each over the first, with spreads. Arguments are vpipe bench output "
        "directories, runs Parquet files or results stores.",
    )
    r.add_argument("runs", nargs="+", metavar="RUN_OR_STORE")
    r.add_argument("-o", "--output", default="report.html", help="HTML file (default %(default)s)")
    r.set_defaults(func=run_report)


def run_bench(args: argparse.Namespace) -> int:
    from vpipe.bench import (
        QUICK_SCHEDULES,
        SweepSpec,
        new_run_id,
        parse_list,
        parse_sizes,
        run_sweep,
    )

    sizes = parse_sizes(args.sizes)

    if args.ranks is None:  # torchrun sets WORLD_SIZE; validate before importing torch
        args.ranks = int(os.environ.get("WORLD_SIZE", 2))
    if args.quick:
        spec = SweepSpec(
            ranks=args.ranks,
            device=args.device,
            backend=args.backend,
            model=args.model,
            sizes=sizes or ({"d_model": 128, "d_hidden": 512} if args.model == "mlp" else {}),
            batch=16,
            schedules=QUICK_SCHEDULES,
            microbatches=(4,),
            impls=tuple(parse_list(args.impl)),
            warmup=1,
            steps=2,
            rounds=2,
            profile=not args.no_profile,
            profile_steps=args.profile_steps,
        )
    else:
        spec = SweepSpec(
            ranks=args.ranks,
            device=args.device,
            backend=args.backend,
            model=args.model,
            sizes=sizes,
            batch=args.batch,
            schedules=tuple(parse_list(args.schedules)),
            microbatches=tuple(_ints(args.microbatches)),
            impls=tuple(parse_list(args.impl)),
            warmup=args.warmup,
            steps=args.steps,
            rounds=args.rounds,
            profile=not args.no_profile,
            profile_steps=args.profile_steps,
        )
    spec.validate()
    from vpipe.bench_results import collect, write_outputs

    out = Path(args.out)
    spec.trace_dir = args.traces
    spec.verbose = args.verbose
    bench_id = new_run_id()
    t0 = time.perf_counter()
    results = run_sweep(spec, bench_id)
    if not results:  # a non-coordinating rank of a torchrun job
        return 0
    sweep_s = time.perf_counter() - t0
    res = collect(spec, results, bench_id, sweep_s)
    paths = write_outputs(res, out)
    total_s = time.perf_counter() - t0
    print(res.summary_text())
    print(f"sweep {sweep_s:.1f} s, total {total_s:.1f} s; report: {paths['html']}")
    return 0


def _ints(text: str) -> list[int]:
    from vpipe.bench import BenchError, parse_list

    try:
        return [int(x) for x in parse_list(text)]
    except ValueError:
        raise BenchError(f"--microbatches must be comma-separated integers, got {text!r}") from None


def run_report(args: argparse.Namespace) -> int:
    from vpipe.report import comparison_report

    html_text, md_text = comparison_report(args.runs)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html_text, encoding="utf-8")
    out.with_suffix(".md").write_text(md_text, encoding="utf-8")
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0

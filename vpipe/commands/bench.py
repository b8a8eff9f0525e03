"""``vpipe bench`` (sweep schedules x microbatches x implementations in one launch) and
``vpipe report`` (HTML/Markdown reports and cross-run comparisons)."""

from __future__ import annotations

import argparse
import os
import time
from typing import TYPE_CHECKING

from vpipe.commands._runtime_flags import add_runtime_flags, dp_fields

if TYPE_CHECKING:
    from vpipe.sweep.driver import SweepSpec


def register(subparsers: argparse._SubParsersAction) -> None:
    from vpipe.sweep.driver import (
        DEFAULT_MAX_MINUTES,
        DEFAULT_PROFILE_STEPS,
        DEFAULT_SCHEDULES,
        DEFAULT_TIMING_PRECISION,
        QUICK_MAX_MINUTES,
        QUICK_SCHEDULES,
    )

    p = subparsers.add_parser(
        "bench",
        help="sweep schedules x microbatches x implementations in one launch; write plots+report",
        description="Run every config (schedule x microbatch count x implementation) in one "
        "launch of P ranks, interleaved in rounds; store runs, events, plots and a report. "
        "Under torchrun it joins the job instead of spawning.",
    )
    p.add_argument(
        "--ranks",
        "-p",
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
    p.add_argument(
        "--model",
        default=None,
        help="mlp, gpt, tuple, looped-mlp, or your own package.module:function (default mlp; "
        "on cuda gpt at GPU sizes; see examples/custom_model.py)",
    )
    p.add_argument(
        "--sizes",
        default="",
        help="model sizes, e.g. d_model=512,d_hidden=2048,n_blocks=4 (default: the model's, "
        "n_blocks/n_layers grown to the largest stage count; the default mlp sweep: "
        "d_model=512,d_hidden=1024,n_blocks=8, which vpipe plan can split for every schedule "
        "up to 8 stages; on cuda gpt at vocab=32768,d_model=2048,n_heads=16,seq_len=1024)",
    )
    p.add_argument(
        "--batch", type=int, help="samples per step (default 512, --quick 16; on cuda 32, 16)"
    )
    p.add_argument(
        "--schedules",
        help=f"comma-separated schedule names (default {','.join(DEFAULT_SCHEDULES)}; "
        f"--quick: {','.join(QUICK_SCHEDULES)})",
    )
    p.add_argument("--microbatches", "-m", help="comma-separated counts (default 8; --quick: 4)")
    p.add_argument(
        "--impl", default=None, help="vpipe, torch or both (default both; with --dp: vpipe)"
    )
    p.add_argument("--warmup", type=int, help="warm-up steps per config (default 2; --quick: 1)")
    p.add_argument(
        "--steps", type=int, help="timed steps per config in each round (default 3; --quick: 2)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        help="rounds over all configs, each timing every config's steps in turn (default 3; "
        "--quick: 3)",
    )
    p.add_argument(
        "--max-minutes",
        type=float,
        help="time budget of the whole command: after --rounds, keep adding rounds to the "
        "configs whose order is still open or whose median is looser than --timing-precision, "
        "until none is or the budget would run out (default "
        f"{DEFAULT_MAX_MINUTES:g}; --quick: {QUICK_MAX_MINUTES:g}; --blocks: 0, the rounds fixed)",
    )
    p.add_argument(
        "--timing-precision",
        type=float,
        metavar="PCT",
        help="within --max-minutes, also add rounds to every config whose median step time is "
        "not yet known to +-PCT%% (95%%): the report's fidelity table and its plan's error are "
        f"judged against these medians (default {DEFAULT_TIMING_PRECISION:g}; --quick: 0, "
        "none)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        help="profiled steps per config, one per interleaved round; calibration takes "
        f"per-action medians over them (default {DEFAULT_PROFILE_STEPS}; --quick: 1)",
    )
    p.add_argument(
        "--blocks",
        type=int,
        default=1,
        help="blocks: independent launches of the whole sweep (default 1; not the model's "
        "n_blocks, its layers); with several, a later "
        "`vpipe report A B` measures run-to-run variance instead of assuming it",
    )
    p.add_argument(
        "--inject-delay-ms",
        type=float,
        default=0.0,
        metavar="MS",
        help="sleep MS per step on one rank (a known slowdown, recorded in the run's meta, to "
        "check that comparisons catch one; default 0)",
    )
    p.add_argument(
        "--inject-delay-pct",
        type=float,
        default=0.0,
        metavar="PCT",
        help="sleep PCT%% of its previous step per step on one rank: a slowdown in proportion "
        "to the step, as extra work would be, whatever the host's load (host clock; default 0)",
    )
    p.add_argument(
        "--inject-delay-rank", type=int, default=0, help="the rank that sleeps (default 0)"
    )
    add_runtime_flags(p)
    p.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the profiled step (no events, Gantt charts or simulation)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sweep: other defaults (see each flag; a small MLP); flags you give still apply",
    )
    p.add_argument(
        "--traces",
        default=None,
        metavar="DIR",
        help="keep the per-config Kineto traces (Perfetto) under DIR",
    )
    p.add_argument("--out", default="results/latest", help="output directory (default %(default)s)")
    keep = p.add_mutually_exclusive_group()
    keep.add_argument(
        "--append",
        action="store_true",
        help="add this sweep's runs to the store already in --out (its steps, plots and report "
        "then describe this sweep)",
    )
    keep.add_argument(
        "--force",
        action="store_true",
        help="replace what --out holds once the sweep is done (swapped in whole: Ctrl-C "
        "before then keeps the old output)",
    )
    p.add_argument(
        "--paced",
        action="store_true",
        help="run one block (a launch of the ranks) each time a line 'block' comes on stdin and "
        "answer with its steps; 'end' writes every finished block to --out (vpipe ab's side "
        "of a session; see docs/comparing.md)",
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
    p.set_defaults(func=run_bench)

    r = subparsers.add_parser(
        "report",
        help="HTML/Markdown report of a bench run, or a comparison of several runs",
        description="With one run: its summary. With several (different commits or machines): "
        "the step-time ratio of each to the first, with 95% intervals and verdicts; called a "
        "speedup only when host, torch, threads and workload match. Arguments are vpipe bench "
        "output directories, runs Parquet files or results stores.",
    )
    r.add_argument("runs", nargs="+", metavar="RUN_OR_STORE")
    r.add_argument("-o", "--output", default="report.html", help="HTML file (default %(default)s)")
    r.set_defaults(func=run_report)


def run_bench(args: argparse.Namespace) -> int:
    """The sweep, then its outputs swapped into --out whole; Ctrl-C says what --out holds."""
    from pathlib import Path

    from vpipe.outputs import kept_note

    try:
        return _sweep_and_write(args)
    except KeyboardInterrupt as e:
        if str(e):  # staged_dir's note: it knows what --out holds now
            raise
        raise KeyboardInterrupt(kept_note(Path(args.out))) from None


def sweep_spec(args: argparse.Namespace) -> SweepSpec:
    """The sweep ``vpipe bench``'s arguments ask for (``--quick``'s and the GPU's defaults where
    a flag is not given), validated; a torch baseline that cannot run is left out, in one
    printed line."""
    from vpipe.sweep.cli_lists import parse_list, parse_sizes
    from vpipe.sweep.driver import (
        DEFAULT_BATCH,
        DEFAULT_MAX_MINUTES,
        DEFAULT_MICROBATCHES,
        DEFAULT_MLP_SIZES,
        DEFAULT_PROFILE_STEPS,
        DEFAULT_SCHEDULES,
        DEFAULT_TIMING_PRECISION,
        GPU_BATCH,
        GPU_MODEL,
        GPU_QUICK_BATCH,
        GPU_SIZES,
        QUICK_MAX_MINUTES,
        QUICK_ROUNDS,
        QUICK_SCHEDULES,
        QUICK_STEPS,
        SweepSpec,
    )

    sizes = parse_sizes(args.sizes)
    on_gpu = args.device == "cuda"
    model = args.model or (GPU_MODEL if on_gpu else "mlp")
    if on_gpu and model == GPU_MODEL and not sizes:
        sizes = dict(GPU_SIZES)
    dp = dp_fields(args)  # --dp N: N replicas of the pipeline (vpipe.sweep.dp_bench)
    if args.ranks is None:  # torchrun sets WORLD_SIZE; validate before importing torch
        args.ranks = max(1, int(os.environ.get("WORLD_SIZE", 2 * args.dp)) // args.dp)
    if args.quick:
        defaults = dict(batch=GPU_QUICK_BATCH if on_gpu else 16, schedules=QUICK_SCHEDULES,
                        microbatches="4", warmup=1, steps=QUICK_STEPS, rounds=QUICK_ROUNDS,
                        profile_steps=1, timing_precision=0.0,
                        max_minutes=0.0 if args.blocks > 1 else QUICK_MAX_MINUTES)  # fmt: skip
        if not sizes and model == "mlp":
            sizes = {"d_model": 128, "d_hidden": 512}
    else:
        defaults = dict(batch=GPU_BATCH if on_gpu else DEFAULT_BATCH, schedules=DEFAULT_SCHEDULES,
                        microbatches=",".join(map(str, DEFAULT_MICROBATCHES)), warmup=2, steps=3,
                        rounds=3, profile_steps=DEFAULT_PROFILE_STEPS,
                        timing_precision=DEFAULT_TIMING_PRECISION,
                        max_minutes=0.0 if args.blocks > 1 else DEFAULT_MAX_MINUTES)  # fmt: skip
        if not sizes and model == "mlp":
            sizes = dict(DEFAULT_MLP_SIZES)
    given = {k: getattr(args, k) for k in defaults if getattr(args, k) is not None}
    opts = {**defaults, **given}
    spec = SweepSpec(
        ranks=args.ranks,
        device=args.device,
        backend=args.backend,
        dtype=args.dtype,
        model=model,
        sizes=sizes,
        batch=opts["batch"],
        schedules=tuple(parse_list(opts["schedules"])),
        microbatches=tuple(_ints(opts["microbatches"])),
        impls=tuple(parse_list(_impls(args.impl, args.dp))),
        warmup=opts["warmup"],
        steps=opts["steps"],
        rounds=opts["rounds"],
        profile=not args.no_profile,
        profile_steps=opts["profile_steps"],
        recv_lookahead=args.recv_lookahead,
        bundle_messages=args.bundle_messages,
        post_thread=args.post_thread,
        recompute=args.recompute,
        cpu_allocator=args.cpu_allocator,
        blocks=args.blocks,
        max_minutes=opts["max_minutes"],
        timing_precision=opts["timing_precision"],
        inject_delay_ms=args.inject_delay_ms,
        inject_delay_pct=args.inject_delay_pct,
        inject_delay_rank=args.inject_delay_rank,
        **dp,
    )
    left_out = spec.leave_out_unrunnable()
    if left_out:
        print(left_out, flush=True)
    spec.validate()
    return spec


def _sweep_and_write(args: argparse.Namespace) -> int:
    started = time.time()
    from vpipe.sweep.blocks import run_blocks
    from vpipe.sweep.driver import new_run_id

    spec = sweep_spec(args)
    if args.paced:  # vpipe ab's side of a paced session (vpipe.sweep.paced): rounds fixed
        from vpipe.sweep.paced import serve

        return serve(spec, args.out)
    from vpipe.outputs import check_output_dir, staged_dir
    from vpipe.runtime import launch
    from vpipe.sweep.results import collect
    from vpipe.sweep.write import write_outputs

    out = check_output_dir(args.out, append=args.append, force=args.force)
    check_output_dir(out.resolve().parent, append=True, flag="--out's parent")  # staging there
    spec.trace_dir = args.traces
    spec.deadline = started + 60 * spec.max_minutes if spec.max_minutes else None
    spec.verbose = args.verbose
    spec.profile_ops = args.profile_ops
    if spec.device == "cuda" and not launch.in_torchrun():
        launch.check_gpus(spec.world_size, spec.backend)
    bench_id = new_run_id()
    t0 = time.perf_counter()
    results = run_blocks(spec, bench_id)
    if not results:  # a non-coordinating rank of a torchrun job
        return 0
    sweep_s = time.perf_counter() - t0
    # Written into a sibling directory and swapped in whole (--append: onto a copy of --out),
    # so Ctrl-C at any moment leaves the previous complete output or this one.
    with staged_dir(out, keep=args.append) as staging:
        res = collect(spec, results, bench_id, sweep_s)
        write_outputs(res, staging)
    for line in res.verdict():
        print(line)
    print(res.summary_text())
    for line in res.failure_lines():  # torch configs that could not run
        print(line)
    if spec.dp > 1:
        from vpipe.report.dp_section import dp_share_table

        print(dp_share_table(res.runs).to_string(index=False))
    print(res.precision_line())
    budget = f" of a {spec.max_minutes:g}-minute budget" if spec.max_minutes else ""
    print(
        f"{res.meta['rounds_run']} rounds; sweep {sweep_s:.1f} s, total "
        f"{time.time() - started:.1f} s{budget}; report: {out / 'report.html'}"
    )
    return 0


def _impls(text: str | None, dp: int) -> str:
    """``--impl``: a comma-separated list, ``both`` (vpipe,torch), or the default (both; with
    ``--dp``, vpipe)."""
    if text is None:
        return "vpipe" if dp > 1 else "vpipe,torch"
    return "vpipe,torch" if text.strip() == "both" else text


def _ints(text: str) -> list[int]:
    from vpipe.sweep.cli_lists import parse_list
    from vpipe.sweep.driver import BenchError

    try:
        return [int(x) for x in parse_list(text)]
    except ValueError:
        raise BenchError(f"--microbatches must be comma-separated integers, got {text!r}") from None


def run_report(args: argparse.Namespace) -> int:
    from vpipe.outputs import atomic_write, check_output_file
    from vpipe.report.comparison import comparison_report

    out = check_output_file(args.output, "-o")
    md = check_output_file(out.with_suffix(".md"), "-o (Markdown)")
    html_text, md_text = comparison_report(args.runs, _sweep_sections(args.runs))
    atomic_write(out, lambda p: p.write_text(html_text, encoding="utf-8"))
    atomic_write(md, lambda p: p.write_text(md_text, encoding="utf-8"))
    verdict = md_text.split("## Verdict\n\n", 1)
    if len(verdict) == 2:  # the comparison's one-line verdict first
        print(verdict[1].split("\n", 1)[0])
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


def _sweep_sections(paths: list[str]) -> list:
    """One ``vpipe bench`` output's simulator fidelity and plan, made again from its store
    (:mod:`vpipe.sweep.plan_section`): the plan's predictions with their measured error."""
    from vpipe.sweep.plan_section import plan_sections
    from vpipe.sweep.stored import load_bench
    from vpipe.sweep.write import fidelity_sections, fidelity_tables

    res = load_bench(paths[0]) if len(paths) == 1 else None
    if res is None:
        return []
    fidelity = fidelity_tables(res)
    return [*fidelity_sections(res, fidelity), *plan_sections(res, fidelity)]

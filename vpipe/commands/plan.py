"""``vpipe plan``: the schedule, stages per rank and microbatch count to run for a memory
budget, from a calibrated run or an explicit cost spec (see :mod:`vpipe.predict.plan`); or,
with ``--arch``, ``--machine`` and ``--gpus``, the layout and schedule of a cluster predicted
from the model and the machine (:mod:`vpipe.commands._cluster_plan`)."""

from __future__ import annotations

import argparse
import json

from vpipe.commands._cluster_plan import (
    add_cluster_flags,
    cluster_command,
    recompute_modes,
    refuse_cluster_flags,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="recommend a schedule for a memory budget (every family x stages x M, simulated)",
        description="Simulate every schedule family x stages per rank x microbatch count with "
        "costs calibrated from a measured run (--from STORE --run RUN) or given (--cost), and "
        "recommend the fastest whose peak activation memory fits --memory on every rank. With "
        "--arch, --machine and --gpus: every pipeline x data-parallel layout, microbatch size "
        "and schedule of a model on a cluster, costed from the model and the machine.",
    )
    p.add_argument("--ranks", "-p", type=int, help="pipeline ranks P (not with --arch)")
    p.add_argument("--batch", type=int, required=True,
                   help="samples per step (with --arch: sequences, the global batch)")  # fmt: skip
    p.add_argument(
        "--memory", help="budget per rank: bytes (12GiB, 500MB) or units (6units); with --arch "
        "bytes per GPU (default 90%% of the machine's)"
    )  # fmt: skip
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from", dest="store", metavar="STORE", help="results store of the run")
    src.add_argument(
        "--cost",
        metavar="SPEC",
        help="microseconds, f=..,b=..,w=..[,comm=..,handshake=..,act_bytes=..,rows=..,post=..,"
        "gap=..], the same convention as simulate and compare: per rank's share of the model "
        "(1/P of it; a schedule with V stages per rank gives each stage 1/V) and one microbatch "
        "of `rows` rows (default 1; plan rescales to each microbatch size)",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel replicas: --batch is the global batch, and each step ends when "
        "its per-stage gradient all-reduces (--dp-cost) do (with --arch: fix dp, default "
        "searched)",
    )
    p.add_argument(
        "--dp-cost",
        metavar="SPEC",
        help="the reduction's costs: grad_bytes=.. (per full stage, 1/P of the model), bw=.. "
        "(GB/s), lat=.. (us per ring step)[,launch=..,bucket_mb=..]",
    )
    p.add_argument("--run", help="the calibration run in --from (vpipe runs STORE lists them)")
    p.add_argument("--microbatches", "-m", help="comma-separated counts (default: divisors of "
                   "the batch up to 8P)")  # fmt: skip
    p.add_argument("--schedules", help="comma-separated families (default: the whole catalogue)")
    p.add_argument(
        "--recompute", metavar="MODES",
        help="comma-separated activation recomputation modes to weigh (none, full, selective). "
        "With --from: needs a run without recomputation (default none); with --arch: default "
        "each",
    )  # fmt: skip
    p.add_argument(
        "--objective", choices=("makespan", "span"), default="makespan",
        help="rank by the step's makespan (ranks start together; default) or the longest rank "
        "span (iterations overlapping, the papers' measure)",
    )  # fmt: skip
    p.add_argument(
        "--tie", type=float, default=None, metavar="FRACTION",
        help="candidates predicted within this fraction of the fastest are a tie, broken by less "
        "memory, then the simpler schedule (default: the error measured on the sweep of --run; "
        "0.05 when it is unknown)",
    )  # fmt: skip
    p.add_argument("--top", type=int, default=15, help="rows of the table to print (default 15)")
    p.add_argument("--plot", metavar="PNG", help="throughput vs peak memory, Pareto front")
    p.add_argument("--json", action="store_true", help='print {"recommended", "candidates"}')
    add_cluster_flags(p)
    p.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    from vpipe.outputs import atomic_write, check_output_file
    from vpipe.predict.dp_costs import DPCosts
    from vpipe.predict.plan import Budget, PlanError, SpecCosts, from_run, plan
    from vpipe.predict.plan_error import tie_band, with_errors
    from vpipe.sweep.cli_lists import parse_list

    if args.arch or args.gpus or args.machine:
        return cluster_command(args)
    refuse_cluster_flags(args)
    if args.ranks is None or args.memory is None or not (args.cost or args.store):
        raise PlanError("vpipe plan needs --ranks, --memory and --from or --cost (or --arch, "
                        "--machine and --gpus for a cluster)")  # fmt: skip
    if args.ranks < 1 or args.batch < 1:
        raise PlanError(f"--ranks and --batch must be >= 1, got {args.ranks} and {args.batch}")
    budget = Budget.parse(args.memory)
    if args.plot:
        check_output_file(args.plot, "--plot")
    if args.store and not args.run:
        raise PlanError("--from needs --run RUN (vpipe runs STORE lists the runs)")
    costs = SpecCosts.parse(args.cost) if args.cost else from_run(args.store, args.run)
    if budget.units is False and not any(
        getattr(costs, k, 0) for k in ("act_bytes", "bytes_per_piece_row")
    ):
        raise PlanError("a budget in bytes needs activation bytes: give act_bytes= in --cost "
                        "or a run with memory samples, or budget in units (e.g. 6units)")  # fmt: skip
    try:
        mbs = [int(m) for m in parse_list(args.microbatches)] if args.microbatches else None
    except ValueError:
        raise PlanError(f"--microbatches must be integers, got {args.microbatches!r}") from None
    schedules = parse_list(args.schedules) if args.schedules else None
    n_dp = args.dp or 1
    dp = DPCosts.parse(args.dp_cost, n_dp) if n_dp > 1 or args.dp_cost else None
    errors = _errors(args)
    tie, tie_source = tie_band(errors, args.tie)
    result = plan(
        costs, args.ranks, args.batch, budget, microbatches=mbs, schedules=schedules, dp=dp,
        objective=args.objective, tie=tie, recompute=recompute_modes(args.recompute or "none"),
        measured_m=errors.measured_m or None,
    )  # fmt: skip
    with_errors(result, errors, tie_source)
    if args.plot:
        from vpipe.predict.plan import pareto_frame
        from vpipe.report.plots import plot_pareto, to_png

        front = pareto_frame(result["candidates"])
        x = "peak_memory_bytes" if "peak_memory_bytes" in front else "peak_memory_units"
        png = to_png(plot_pareto(front, x, predicted=True))
        atomic_write(args.plot, lambda p: p.write_bytes(png))
    if args.json:
        print(json.dumps(result))
        return 0
    print(render(result, budget, args.top, dp is not None))
    return 0


def _errors(args: argparse.Namespace) -> object:
    """The errors of the plan's predictions: measured on the sweep of --run, or unknown for
    costs given with --cost (:mod:`vpipe.predict.fidelity_runs`)."""
    from vpipe.predict.fidelity import unknown
    from vpipe.predict.fidelity_runs import PlanErrors, store_errors

    if args.store:
        return store_errors(args.store, args.run)
    given = unknown("costs given with --cost, never measured")
    return PlanErrors(given, given)


def render(result: dict, budget: object, top: int, dp: bool = False) -> str:
    """The ranked table and the recommendation as text (with ``dp``: the reductions' exposed
    and hidden ms and the exposed share of the step)."""
    from vpipe.predict.plan import candidate_label, plural, tie_note
    from vpipe.predict.plan_error import alternative_note, error_lines

    rec = result["recommended"]
    dp_head = f"{'dp exp ms':>10}{'hidden ms':>10}{'dp share':>9}" if dp else ""
    swept = result.get("measured_m") is not None  # a sweep's run: which M it measured
    m_run = f"{'M run':>7}" if swept else ""
    tied = {candidate_label(c) for c in result.get("tied", [])}
    lines = [
        f"{'schedule':<18}{'v':>3}{'M':>5}{_step_header(result):>10}{'± ms':>8}{'samples/s':>11}"
        f"{'bubble':>8}{'peak/rank':>12}{'fits':>6}{'tie':>5}{m_run}"
        f"{dp_head}"
    ]
    shown = result["candidates"][:top]
    for c in shown:
        lines.append(
            f"{c['schedule'] + _mode(c):<18}{c['stages_per_rank']:>3}{c['microbatches']:>5}"
            f"{c['predicted_step_s'] * 1e3:>10.2f}{_plus_minus(c):>8}{c['samples_per_s']:>11.1f}"
            f"{c['bubble_ratio']:>8.3f}{budget.describe(_peak(budget, c)):>12}"
            f"{'yes' if c['fits'] else 'no':>6}{'yes' if candidate_label(c) in tied else '':>5}"
            + (f"{'yes' if c['m_measured'] else 'no':>7}" if swept else "")
            + (_dp_cells(c) if dp else "")
        )
    lines.append(f"({len(shown)} of {plural(len(result['candidates']), 'candidate')} shown)")
    lines.extend(error_lines(result, shown))
    for family, why in result.get("left_out", {}).items():
        lines.append(f"left out {family}: {why}")
    lines.append(
        f"recommended: {rec['schedule']} with {plural(rec['stages_per_rank'], 'stage')} per rank "
        f"and {plural(rec['microbatches'], 'microbatch')}"
        f"{'' if _mode(rec) == '' else ', recompute ' + rec['recompute']}: "
        f"{rec['predicted_step_s'] * 1e3:.2f}{_plus_minus(rec, ' ± ')} ms per step (predicted, "
        f"{result.get('objective', 'makespan')}), "
        f"peak {budget.describe(_peak(budget, rec))} per rank (budget "
        f"{budget.describe(budget.value)})"
    )
    if len(tied) > 1:
        lines.append(tie_note(result))
    if alternative_note(result):
        lines.append(alternative_note(result))
    la = result["recv_lookahead"]
    steps = ", ".join(f"{k}: {s * 1e3:.2f}" for k, s in la["predicted_step_s"].items())
    lines.append(
        f"run it with --recv-lookahead {la['best']} (simulated ms per step by lookahead: {steps})"
    )
    return "\n".join(lines)


def _plus_minus(c: dict, before: str = "") -> str:
    """A prediction's half-interval in ms (its measured error), or ``?`` (with ``before``:
    nothing) when unknown."""
    error = c.get("error")
    if error is None:
        return "" if before else "?"
    return f"{before}{c['predicted_step_s'] * error * 1e3:.2f}"


def _mode(c: dict) -> str:
    """A candidate's recomputation as its schedule cell's suffix: ``+full``, ``+selective``."""
    mode = c.get("recompute", "none")
    return "" if mode == "none" else f" +{mode}"


def _peak(budget: object, c: dict) -> float:
    return max(c["peak_activation_units"] if budget.units else c["peak_activation_bytes"])


def _dp_cells(c: dict) -> str:
    share = c["dp_exposed_s"] / c["predicted_step_s"] if c["predicted_step_s"] else 0.0
    return f"{c['dp_exposed_s'] * 1e3:>10.2f}{c['dp_hidden_s'] * 1e3:>10.2f}{share:>9.1%}"


def _step_header(result: dict) -> str:
    """The step column's name: ``step ms``, or ``span ms`` when ranked by span."""
    return "span ms" if result.get("objective") == "span" else "step ms"

"""``vpipe plan --arch ARCH --machine MACHINE --gpus N --batch B``: a cluster's layout and
schedule predicted from the model and the machine (:mod:`vpipe.predict.cluster`). No torch or
pandas import, unless ``--from`` reads a run.

``vpipe plan --arch llama3-70b --seq-len 4096 --machine h100 --gpus 64 --batch 256`` ranks every
pipeline x data-parallel layout, microbatch size and schedule that fits an H100 by predicted
tokens per second per GPU.
"""

from __future__ import annotations

import argparse
import json


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (with --arch)")
    g.add_argument("--arch", help="model: a preset (llama3-70b, llama2-70b, llama3-8b, "
                   "gpt3-175b), a Hugging Face config.json, or a JSON file of vpipe.sim.arch.Arch "
                   "fields")  # fmt: skip
    g.add_argument("--machine", help="a100, h100, h200, or a JSON file of "
                   "vpipe.sim.machine.Machine fields (\"preset\": NAME to start from one)")  # fmt: skip
    g.add_argument("--gpus", type=int, help="GPUs in all (pipeline ranks x replicas)")
    g.add_argument("--seq-len", type=int, dest="seq_len", help="tokens per sequence (default: "
                   "the model's)")  # fmt: skip
    g.add_argument("--microbatch-sizes", dest="microbatch_sizes", default="1,2,4,8",
                   help="sequences per microbatch to try (default 1,2,4,8)")  # fmt: skip
    g.add_argument("--shard", choices=("none", "optimizer", "gradients"), default="optimizer",
                   help="what is split over data-parallel replicas (default optimizer state)")
    g.add_argument("--optimizer", choices=("sync", "post-validated"), default="sync",
                   help="sync: every rank waits for the global gradient norm before its step "
                   "(default); post-validated: each steps when ready (the zero-bubble paper's)")
    g.add_argument("--replicas-inner", action="store_true", dest="replicas_inner",
                   help="put a rank's replicas on consecutive GPUs (default: a pipeline's ranks)")
    g.add_argument("--i-frees", type=float, dest="i_frees", metavar="SHARE",
                   help="share of a stage's activations its input gradient frees (default: "
                   "the model's own, from what W still needs)")  # fmt: skip
    g.add_argument("--efficiency", metavar="F,I,W", help="fractions of peak FLOP/s reached "
                   "by F, I and W (default 0.55,0.55,0.75; --from measures them on a run)")


def cluster_command(args: argparse.Namespace) -> int:
    from vpipe.predict.cluster import ClusterSpec, default_budget, plan_cluster
    from vpipe.predict.plan import Budget, PlanError
    from vpipe.sim.arch import load_arch
    from vpipe.sim.machine import load_machine
    from vpipe.sim.model_costs import Rates

    missing = [f for f, v in (("--arch", args.arch), ("--machine", args.machine),
                              ("--gpus", args.gpus)) if not v]  # fmt: skip
    if missing:
        raise PlanError(f"a cluster plan needs --arch, --machine and --gpus: give {missing[0]}")
    for flag, given in (("--ranks", args.ranks), ("--cost", args.cost), ("--dp", args.dp > 1),
                        ("--dp-cost", args.dp_cost), ("--plot", args.plot),
                        ("--microbatches", args.microbatches)):  # fmt: skip
        if given:
            raise PlanError(f"{flag} is not a cluster plan's flag: the layout comes from --gpus")
    if args.gpus < 1 or args.batch < 1:
        raise PlanError(f"--gpus and --batch must be >= 1, got {args.gpus} and {args.batch}")
    arch = load_arch(args.arch, seq_len=args.seq_len)
    machine = load_machine(args.machine)
    budget = default_budget(machine)
    if args.memory:
        given = Budget.parse(args.memory)
        if given.units:
            raise PlanError("--memory with --arch is bytes per GPU (e.g. 70GiB), not units")
        budget = given.value
    rates = None
    if args.store:
        if not args.run:
            raise PlanError("--from needs --run RUN (vpipe runs STORE lists the runs)")
        from vpipe.predict.run_rates import rates_from_run

        rates = rates_from_run(args.store, args.run)
    elif args.efficiency:
        rates = _efficiency_rates(args.efficiency, machine, arch.precision, Rates)
    if args.i_frees is not None and not 0 <= args.i_frees <= 1:
        raise PlanError(f"--i-frees must be between 0 and 1, got {args.i_frees:g}")
    spec = ClusterSpec(
        arch, machine, args.gpus, args.batch, budget, rates=rates,
        schedules=_names(args.schedules), microbatch_sizes=_sizes(args.microbatch_sizes),
        shard=args.shard, post_validated=args.optimizer == "post-validated",
        pp_inner=not args.replicas_inner, i_frees=args.i_frees,
    )  # fmt: skip
    result = plan_cluster(spec)
    if args.json:
        print(json.dumps(result))
    else:
        print(render_cluster(result, args.top))
    return 0


def _efficiency_rates(text: str, machine, precision: str, rates_cls):
    from vpipe.predict.plan import PlanError

    try:
        f, i, w = (float(x) for x in text.split(","))
    except ValueError:
        raise PlanError(f"--efficiency {text!r}: expected three fractions F,I,W") from None
    if not all(0 < x <= 1 for x in (f, i, w)):
        raise PlanError(f"--efficiency {text!r}: each fraction must be in (0, 1]")
    peak = machine.peak(precision)
    return rates_cls(f * peak, i * peak, w * peak, f"--efficiency {text} of {machine.name}'s peak")


def _sizes(text: str) -> list[int]:
    from vpipe.predict.plan import PlanError

    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PlanError(f"--microbatch-sizes must be integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise PlanError(f"--microbatch-sizes must be integers >= 1, got {text!r}")
    return sizes


def _names(text: str | None) -> list[str] | None:
    return [x.strip() for x in text.split(",") if x.strip()] if text else None


def render_cluster(result: dict, top: int) -> str:
    """The ranked table, where its costs come from, and the recommendation, as text."""
    from vpipe.predict.plan import plural

    gib = 2**30
    head = (f"{'schedule':<17}{'v':>2}{'pp':>4}{'dp':>4}{'mb':>4}{'M':>5}{'tok/s/GPU':>11}"
            f"{'iter s':>8}{'bubble':>8}{'GiB/GPU':>9}{'static':>8}{'activ.':>8}  tie")  # fmt: skip
    lines = [
        f"{result['arch']['name']} (seq {result['arch']['seq_len']}) on {result['gpus']} "
        f"{result['machine']} GPUs, global batch {result['batch']} sequences, optimizer "
        f"{result['optimizer']}; budget {result['budget_bytes'] / gib:.1f} GiB per GPU",
        f"F/I/W rates: {result['rates']['source']}",
        head,
    ]
    for c in result["candidates"][:top]:
        lines.append(
            f"{c['schedule']:<17}{c['stages_per_rank']:>2}{c['pp']:>4}{c['dp']:>4}"
            f"{c['microbatch_size']:>4}{c['microbatches']:>5}{c['tokens_per_s_per_gpu']:>11.1f}"
            f"{c['iteration_s']:>8.2f}{c['bubble']:>8.3f}{c['memory_bytes'] / gib:>9.1f}"
            f"{c['static_bytes'] / gib:>8.1f}{c['activation_bytes'] / gib:>8.1f}"
            f"  {'yes' if c['tied'] else ''}"
        )
    shown = min(top, len(result["candidates"]))
    lines.append(f"({shown} of {plural(len(result['candidates']), 'candidate')} that fit shown; "
                 f"'tie': within the prediction's error, {result['prediction_error']:.0%}, of "
                 f"the fastest)")  # fmt: skip
    rec = result["recommended"]
    lines.append(
        f"recommended (of the tied, the least memory): {rec['schedule']} on pp={rec['pp']} x "
        f"dp={rec['dp']}, "
        f"{plural(rec['stages_per_rank'], 'stage')} per rank, microbatch {rec['microbatch_size']}"
        f" x {rec['microbatches']}: {rec['tokens_per_s_per_gpu']:.1f} tokens/s per GPU "
        f"(predicted), {rec['memory_bytes'] / gib:.1f} GiB per GPU"
    )
    return "\n".join(lines)

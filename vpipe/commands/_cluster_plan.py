"""``vpipe plan --arch ARCH --machine MACHINE --gpus N --batch B``: a cluster's layout and
schedule predicted from the model and the machine (:mod:`vpipe.predict.cluster`). No torch or
pandas import, unless ``--from`` reads a run.

``vpipe plan --arch llama3-70b --seq-len 4096 --machine h100 --gpus 64 --batch 256`` ranks every
tensor x context x pipeline x data-parallel layout, recomputation, microbatch size and
schedule that fits an H100 by predicted tokens per second per GPU.
"""

from __future__ import annotations

import argparse
import json


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster (with --arch)")
    g.add_argument("--arch", help="model: a preset (llama3.1-405b, llama3-70b, llama3-8b, "
                   "llama2-70b, gpt3-175b), a Hugging Face config.json, or a JSON file of "
                   "vpipe.sim.arch.Arch fields")  # fmt: skip
    g.add_argument("--machine", help="a100, h100, h200, b200, or a JSON file of "
                   "vpipe.sim.machine.Machine fields (\"preset\": NAME to start from one)")  # fmt: skip
    g.add_argument("--gpus", type=int, help="GPUs in all (tp x cp x pp x dp)")
    for flag, what in (("--tp", "tensor-parallel GPUs per rank"),
                       ("--cp", "context-parallel GPUs per rank"),
                       ("--pp", "pipeline ranks")):  # fmt: skip
        g.add_argument(flag, type=int, help=f"fix the {what} (default: searched)")
    g.add_argument("--seq-len", type=int, dest="seq_len", help="tokens per sequence (default: "
                   "the model's)")  # fmt: skip
    g.add_argument("--microbatch-sizes", dest="microbatch_sizes", default="1,2,4,8",
                   help="sequences per microbatch to try (default 1,2,4,8)")  # fmt: skip
    g.add_argument("--shard", choices=("none", "optimizer", "gradients", "full"),
                   default="optimizer", help="what is split over data-parallel replicas "
                   "(default optimizer state; full: parameters too, ZeRO-3 / FSDP)")
    g.add_argument("--optimizer", choices=("sync", "post-validated"), default="sync",
                   help="sync: every rank waits for the global gradient norm before its step "
                   "(default); post-validated: each steps when ready (the zero-bubble paper's)")
    g.add_argument("--grad-reduce", choices=("during", "after"), default="during",
                   dest="grad_reduce", help="the data-parallel reduction: bucket by bucket "
                   "during each stage's last backward (default: Megatron-LM's "
                   "--overlap-grad-reduce, DDP, FSDP) or once it has ended")
    g.add_argument("--tp-backward", choices=("beside-w", "after-w"), default="beside-w",
                   dest="tp_backward", help="a fused backward's input-gradient TP collectives: "
                   "beside the weight-gradient GEMMs (default: Megatron-LM's asynchronous TP "
                   "communication) or after them")
    g.add_argument("--replicas-inner", action="store_true", dest="replicas_inner",
                   help="put a rank's replicas on consecutive GPUs (default: a pipeline's ranks)")
    g.add_argument("--i-frees", type=float, dest="i_frees", metavar="SHARE",
                   help="share of a stage's activations its input gradient frees (default: "
                   "the model's own, from what W still needs)")  # fmt: skip
    g.add_argument("--efficiency", metavar="F,I,W", help="fractions of peak FLOP/s reached "
                   "by whole F, I and W passes, memory-bound operators included (default: "
                   "the machine's fitted efficiency for each layout's GEMM shapes, with those "
                   "operators charged apart; --from measures them on a run)")
    # a cluster plan's flags alone, with the defaults just given: a plan from --cost or --from
    # refuses them (refuse_cluster_flags)
    p.set_defaults(cluster_only={d: p.get_default(d) for d in CLUSTER_ONLY})


CLUSTER_ONLY = ("tp", "cp", "pp", "seq_len", "microbatch_sizes", "shard", "optimizer",
                "grad_reduce", "tp_backward", "replicas_inner", "i_frees", "efficiency")


def refuse_cluster_flags(args: argparse.Namespace) -> None:
    """A PlanError naming the first cluster-only flag given to a plan that is no cluster's."""
    from vpipe.predict.plan import PlanError

    for dest, default in args.cluster_only.items():
        if getattr(args, dest) != default:
            raise PlanError(f"--{dest.replace('_', '-')} plans a cluster: give it with --arch, "
                            "--machine and --gpus, or leave it out")  # fmt: skip


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
    for flag, given in (("--ranks", args.ranks), ("--cost", args.cost),
                        ("--dp-cost", args.dp_cost), ("--plot", args.plot),
                        ("--microbatches", args.microbatches)):  # fmt: skip
        if given:
            raise PlanError(f"{flag} is not a cluster plan's flag: the layout comes from --gpus")
    for flag, value in (("--gpus", args.gpus), ("--batch", args.batch), ("--tp", args.tp),
                        ("--cp", args.cp), ("--pp", args.pp), ("--dp", args.dp)):  # fmt: skip
        if value is not None and value < 1:
            raise PlanError(f"{flag} must be >= 1, got {value}")
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
        pp_inner=not args.replicas_inner, tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp,
        recompute=recompute_modes(args.recompute) if args.recompute else None,
        i_frees=args.i_frees, overlap_grad_reduce=args.grad_reduce == "during",
        overlap_tp_backward=args.tp_backward == "beside-w",
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
    """The ranked table, where its costs come from, and the recommendation with its memory by
    part and the share of the step each cost takes, as text."""
    from vpipe.predict.plan import plural

    gib = 2**30
    head = (f"{'schedule':<17}{'v':>2}{'tp':>3}{'cp':>3}{'pp':>4}{'dp':>5}{'recomp.':>10}"
            f"{'mb':>3}{'M':>5}{'tok/s/GPU':>10}{'MFU':>6}{'HFU':>6}{'iter s':>8}"
            f"{'GiB/GPU':>8}{'w+g+o':>7}{'activ.':>7}{'buf.':>6}  tie")  # fmt: skip
    lines = [
        f"{result['arch']['name']} (seq {result['arch']['seq_len']}) on {result['gpus']} "
        f"{result['machine']} GPUs, global batch {result['batch']} sequences, optimizer "
        f"{result['optimizer']}, shard {result['recommended']['shard']}, grad reduce "
        f"{result['grad_reduce']} the backward, a fused backward's TP "
        f"{result['tp_backward'].replace('-w', ' W')}; budget "
        f"{result['budget_bytes'] / gib:.1f} GiB per GPU",
        f"rates (recommended layout): {result['rates']['source']}",
        head,
    ]
    for c in result["candidates"][:top]:
        mem = c["memory_bytes"]
        static = mem["weights"] + mem["gradients"] + mem["optimizer"]
        lines.append(
            f"{c['schedule']:<17}{c['stages_per_rank']:>2}{c['tp']:>3}{c['cp']:>3}{c['pp']:>4}"
            f"{c['dp']:>5}{c['recompute']:>10}{c['microbatch_size']:>3}{c['microbatches']:>5}"
            f"{c['tokens_per_s_per_gpu']:>10.1f}{c['mfu']:>6.1%}{c['hfu']:>6.1%}"
            f"{c['iteration_s']:>8.2f}{mem['total'] / gib:>8.1f}{static / gib:>7.1f}"
            f"{mem['activations'] / gib:>7.1f}{mem['buffers'] / gib:>6.1f}"
            f"  {'yes' if c['tied'] else ''}"
        )
    shown = min(top, len(result["candidates"]))
    err = result["measured_error"]
    lines.append(
        f"({shown} of {plural(len(result['candidates']), 'candidate')} that fit shown; "
        f"{result['bounded']} of {result['tried']} not simulated: their no-bubble bound is "
        f"slower than the fastest by more than the tie band; 'tie': within "
        f"{result['tie_band']:.1%} of the fastest, {result['tie_band_source']}"
        + (f" {err:.1%})" if err is not None else ")")
    )
    rec = result["recommended"]
    mem = rec["memory_bytes"]
    lines.append(
        f"recommended (of the tied, the least memory): {rec['schedule']} on tp={rec['tp']} x "
        f"cp={rec['cp']} x pp={rec['pp']} x dp={rec['dp']}, recompute {rec['recompute']}, "
        f"{plural(rec['stages_per_rank'], 'stage')} per rank, microbatch {rec['microbatch_size']}"
        f" x {rec['microbatches']}: {rec['tokens_per_s_per_gpu']:.1f} tokens/s per GPU, MFU "
        f"{rec['mfu']:.1%} (predicted)"
    )
    lines.append(f"  layers per stage: {_runs(result['layers_per_stage'])}" + (
        "" if len(set(result["layers_per_stage"])) == 1 else " (uneven: the remainder goes to "
        "the middle stages, so the first and last, which hold the embedding and the head, "
        "are short)"))  # fmt: skip
    lines.append("  memory per GPU: " + ", ".join(
        f"{k} {v / gib:.1f} GiB" for k, v in mem.items()))  # fmt: skip
    lines.append("  share of the step: " + ", ".join(
        f"{k} {v:.1%}" for k, v in rec["step_shares"].items() if v >= 0.0005))  # fmt: skip
    return "\n".join(lines)


def _runs(values: list[int]) -> str:
    """``1, 2 x 62, 1``: a list with its runs of equal values counted."""
    out: list[list[int]] = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return ", ".join(f"{v} x {n}" if n > 1 else str(v) for v, n in out)


def recompute_modes(text: str) -> tuple[str, ...]:
    """``--recompute``'s comma-separated modes, checked."""
    from vpipe.predict.plan import PlanError
    from vpipe.sweep.cli_lists import parse_list

    modes = tuple(parse_list(text))
    bad = [m for m in modes if m not in ("none", "full", "selective")]
    if bad or not modes:
        raise PlanError(f"--recompute {text!r}: modes are none, full and selective")
    return modes

"""The vpipe runtime's knobs as command-line flags, shared by ``vpipe run`` and ``vpipe bench``
(a helper, not a subcommand)."""

from __future__ import annotations

import argparse
import re

from vpipe.runtime.host_memory import CPU_ALLOCATORS


def positive_int(text: str) -> int:
    """An argparse type: a count of at least 1 (ranks, microbatches, stages per rank), worded
    alike by every command."""
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    """``--dtype``, ``--recompute``, ``--cpu-allocator`` (:mod:`vpipe.runtime.host_memory`),
    ``--recv-lookahead``, ``--no-bundle``, ``--no-post-thread`` (see
    :class:`vpipe.runtime.Pipeline`) and data parallel's ``--dp``, ``--dp-bucket-mb``,
    ``--fsdp`` (:mod:`vpipe.runtime.data_parallel`)."""
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="precision of the stages' parameters, activations, messages and gradients "
        "(losses in fp32; default bf16 on cuda, fp32 on cpu); --check's tolerance follows it",
    )
    p.add_argument(
        "--recompute",
        choices=("none", "full", "selective"),
        default="none",
        help="activation recomputation: full keeps each stage's inputs and recomputes its "
        "forward before the backward (once, also under a split backward); selective "
        "recomputes the activation functions' outputs and attention's core; torch's baseline "
        "uses torch.utils.checkpoint on the same modules (default %(default)s)",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        metavar="N",
        help="data-parallel replicas of the pipeline (ranks x N processes; --batch is the "
        "global batch, sharded across them; gradients all-reduced per stage as soon as it "
        "has them; default 1)",
    )
    p.add_argument(
        "--dp-bucket-mb",
        type=float,
        default=25.0,
        metavar="MB",
        help="gradient bucket size of the --dp reductions in MiB (default %(default)s)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard stages with FSDP2 (fully_shard) instead of all-reducing: refused where "
        "it cannot run (gloo), with the reason",
    )
    p.add_argument(
        "--cpu-allocator",
        choices=CPU_ALLOCATORS,
        default=CPU_ALLOCATORS[0],
        help="cached: the ranks' malloc keeps the memory a step frees for the next, as a "
        "GPU's caching allocator does (glibc: no trimming, no mmap below 32 MiB), so steps "
        "do not pay page faults for memory given back; system: the C library's defaults "
        "(default %(default)s; recorded per run)",
    )
    p.add_argument(
        "--recv-lookahead",
        type=int,
        default=1,
        metavar="N",
        help="post each receive N compute actions before its consumer, earlier where a "
        "peer's order needs it (default %(default)s; more hides latency, holds more buffers)",
    )
    p.add_argument(
        "--no-bundle",
        dest="bundle_messages",
        action="store_false",
        help="post every SEND/RECV on its own instead of packing messages one batch sends "
        "to a peer that receives them in one batch",
    )
    p.add_argument(
        "--no-post-thread",
        dest="post_thread",
        action="store_const",
        const=False,
        default=None,
        help="on gloo, post sends and receives from the compute thread instead of the "
        "process's poster thread",
    )


def dp_fields(args: argparse.Namespace) -> dict:
    """RankSpec's data-parallel fields from the flags (refusing --fsdp, and a bad --dp or
    bucket size, in one line: :func:`vpipe.runtime.data_parallel.check_layout`)."""
    from vpipe.errors import VpipeError

    if args.dp < 1:
        raise VpipeError(f"--dp must be >= 1, got {args.dp}")
    if not args.dp_bucket_mb > 0:
        raise VpipeError(f"--dp-bucket-mb must be > 0, got {args.dp_bucket_mb}")
    if args.fsdp:
        from vpipe.runtime.data_parallel import check_fsdp

        check_fsdp(args.backend or ("nccl" if args.device == "cuda" else "gloo"))
    return {"dp": args.dp, "dp_bucket_bytes": int(args.dp_bucket_mb * 2**20)}

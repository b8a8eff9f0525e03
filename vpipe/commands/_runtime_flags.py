"""The vpipe runtime's knobs as command-line flags, shared by ``vpipe run`` and ``vpipe bench``
(a helper, not a subcommand)."""

from __future__ import annotations

import argparse


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    """``--recv-lookahead``, ``--no-bundle`` and ``--no-post-thread`` (see
    :class:`vpipe.runtime.Pipeline`)."""
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

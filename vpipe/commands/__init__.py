"""CLI subcommands: each module here defines ``register(subparsers)``, adding its commands
with ``set_defaults(func=handler)`` where ``handler(args) -> int``. Modules must import
quickly (no torch at import time): heavy imports go inside handlers. Modules named ``_*`` are
helpers the commands share."""

from vpipe.commands._runtime_flags import add_runtime_flags

__all__ = ["add_runtime_flags"]  # also for benchmark scripts that take the runtime's flags

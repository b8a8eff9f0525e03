"""The ``vpipe`` command. Subcommands live in :mod:`vpipe.commands`, one module per group."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import vpipe.commands
from vpipe.errors import VpipeError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vpipe", description="Benchmark pipeline-parallel schedules (V-schedules first)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for info in sorted(pkgutil.iter_modules(vpipe.commands.__path__), key=lambda m: m.name):
        importlib.import_module(f"vpipe.commands.{info.name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; user errors print one line to stderr and return 2."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except VpipeError as e:
        print(f"vpipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vpipe {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())

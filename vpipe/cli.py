"""The ``vpipe`` command. Subcommands live in :mod:`vpipe.commands`, one module per group."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import warnings
from collections.abc import Sequence
from typing import NoReturn

import vpipe
import vpipe.commands
from vpipe.errors import VpipeError


class _OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line (no usage dump), like every other vpipe error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="vpipe", description="Benchmark pipeline-parallel schedules (V-schedules first)."
    )
    parser.add_argument("--version", action="version", version=f"vpipe {vpipe.__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_OneLineParser
    )
    for info in sorted(pkgutil.iter_modules(vpipe.commands.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # helpers shared by commands
            continue
        importlib.import_module(f"vpipe.commands.{info.name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; user errors print one line to stderr and return 2."""
    args = build_parser().parse_args(argv)
    try:
        with warnings.catch_warnings():  # a warning is one line naming the command, too
            warnings.showwarning = lambda message, *_: print(
                f"vpipe {args.command}: warning: {message}", file=sys.stderr
            )
            return int(args.func(args) or 0)
    except VpipeError as e:
        print(f"vpipe {args.command}: error: {e}", file=sys.stderr)
        _tell_torchrun(f"vpipe {args.command}: error: {e}")
        return 2
    except BrokenPipeError:
        # Output closed early (`vpipe compare | head`): stop quietly.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt as e:  # its note, if any, says what was kept (vpipe.outputs)
        note = f": {e}" if str(e) else ""
        print(f"vpipe {args.command}: interrupted{note}", file=sys.stderr)
        return 130


def _tell_torchrun(line: str) -> None:
    """Under torchrun, put vpipe's line in the error file torchrun reads, so that its
    ChildFailedError report names the cause instead of pointing to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    import json
    import time

    try:
        with open(path, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:
        pass  # the line was printed anyway


if __name__ == "__main__":
    raise SystemExit(main())

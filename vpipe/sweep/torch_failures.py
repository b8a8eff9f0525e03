"""torch configs of a sweep that cannot run: recorded with their cause, the sweep goes on.

torch.distributed.pipelining does not run every model. Its split backward (the I/W actions of
ZBV, DualPipeV and interleaved zero bubble) keeps per-weight graph pieces that a weight used
twice in one stage (a looped block, tied weights) shares, and the second piece fails with
"Trying to backward through the graph a second time"; vpipe's runtime runs such a stage. A
sweep should show that difference, not end on it.

A torch config is built and warmed up (at least one step) under :func:`warm_up`. When that
raises, the rank writes the cause, one line, to the launch's failure directory and fails; its
peers wait on messages it will never send, so the launch stops them at once.
:func:`launch_until_done` then starts the sweep again without that config and keeps the cause in
``SweepSpec.failed`` (config key -> cause), from which the runs table gets a ``failed`` row and
the report a line. A sweep whose torch configs all run pays nothing for this; each failing
config costs one more launch (about a second each to start, plus the warm-ups before it).
Under torchrun a job cannot be started again: the failure ends it, naming the config.
"""

from __future__ import annotations

import logging
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from vpipe.errors import PipelineError, VpipeError, one_line

H = TypeVar("H")
_TORCH_LOGGER = "torch.distributed.pipelining.schedules"
_ACTION = re.compile(r"when running action (\S+?)\.?(?:\s|$)")


class TorchConfigFailed(VpipeError, RuntimeError):
    """A torch config failed to build or in its warm-up steps; the message names it."""


def warm_up(
    key: str,
    impl: str,
    schedule: str,
    make: Callable[[], H],
    steps: int,
    rank: int,
    failures: str | None,
) -> H:
    """Build config ``key``'s harness with ``make`` and run ``steps`` warm-up steps
    (``timed_step``); a torch config runs at least one. A torch config's failure is written to
    ``failures`` (when the launch gave one) and raised as :class:`TorchConfigFailed`."""
    if impl != "torch":
        h = make()
        for _ in range(steps):
            h.timed_step()  # type: ignore[attr-defined]
        return h
    with torch_error_log() as actions:
        try:
            h = make()
            for _ in range(max(steps, 1)):
                h.timed_step()  # type: ignore[attr-defined]
            return h
        except Exception as e:
            cause = failure_cause(e, schedule, rank, actions[0] if actions else None)
    if failures is None:  # under torchrun: nobody starts the job again
        raise TorchConfigFailed(
            f"torch config {key} failed: {cause}; leave it out (--impl vpipe, or --schedules "
            "without it), or let vpipe bench launch the ranks, which records the failure and "
            "goes on"
        )
    # the time says which rank failed first: its peers fail after it (connection reset)
    text = f"{time.monotonic_ns()} {cause}\n"
    (Path(failures) / f"{key}.rank{rank}").write_text(text, encoding="utf-8")
    raise TorchConfigFailed(f"torch config {key} failed: {cause}")


def failure_cause(e: BaseException, schedule: str, rank: int, action: str | None) -> str:
    """One line: which torch class failed, on which rank and action, and the error's first
    sentence (the innermost one where torch wraps it)."""
    from vpipe.baselines.torch_pp import TORCH_SCHEDULES

    while e.__cause__ is not None:  # torch wraps a stage's failure in its own RuntimeError
        e = e.__cause__
    text = one_line(e)
    end = text.find(". ")
    text = text[: end + 1] if end > 0 else text
    spec = TORCH_SCHEDULES.get(schedule)
    who = f"torch's {spec.class_name}" if spec is not None else "torch"
    where = f"rank {rank}" + (f", action {action}" if action else "")
    return f"{who} ({where}): {text}"


@contextmanager
def torch_error_log() -> Iterator[list[str]]:
    """Collect the actions that torch's pipelining runtime names in its error log (it logs the
    failing action and its whole schedule before it re-raises) and keep those lines off
    stderr: the failure is reported once, as one line."""
    actions: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        found = _ACTION.search(record.getMessage())
        if found:
            actions.append(found.group(1))
        return False

    logger = logging.getLogger(_TORCH_LOGGER)
    logger.addFilter(keep)
    try:
        yield actions
    finally:
        logger.removeFilter(keep)


def read_failures(directory: str | Path) -> dict[str, str]:
    """Config key -> cause, as ranks wrote them: per config the first rank's to fail (the
    others fail after it, on the connection it closed)."""
    found: dict[str, tuple[int, str]] = {}
    for f in Path(directory).iterdir():
        key, _, rank = f.name.rpartition(".rank")
        if not key or not rank.isdigit():
            continue
        when, _, cause = f.read_text(encoding="utf-8").strip().partition(" ")
        if key not in found or int(when) < found[key][0]:
            found[key] = (int(when), cause)
    return {k: cause for k, (_, cause) in sorted(found.items())}


def launch_until_done(
    launch: Callable[[str], list[Any]], failed: dict[str, str], remaining: Callable[[], int]
) -> list[Any]:
    """``launch(failures_dir)`` again after each launch that a torch config's failure ended,
    recording the causes in ``failed`` first (so the next launch leaves those configs out);
    any other error is raised. ``remaining()`` counts the configs still to run: when none is
    left, :class:`TorchConfigFailed` says why in one line."""
    while True:
        with tempfile.TemporaryDirectory(prefix="vpipe-failures-") as directory:
            try:
                return launch(directory)
            except PipelineError:
                found = read_failures(directory)
                if not found.keys() - failed.keys():  # not a torch config's (new) failure
                    raise
        for key, cause in found.items():
            if key not in failed:
                print(f"{key}: failed: {cause}; launching the sweep again without it",
                      file=sys.stderr, flush=True)  # fmt: skip
        failed.update(found)
        if not remaining():
            causes = "; ".join(f"{k}: {c}" for k, c in failed.items())
            raise TorchConfigFailed(f"every config of the sweep failed: {causes}")

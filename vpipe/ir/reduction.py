"""Data-parallel gradient reductions in the schedule IR: when each stage's gradients of a step
are complete, and how a reduction is named.

A pipeline replicated N times (``--dp N``) all-reduces each stage's weight gradients across its
N replicas. A stage's gradients are complete once the last compute action of the step that
writes them (its last ``W``, or ``B`` where the family runs full backwards) has run on its
rank; the reduction starts there, so a zero-bubble family that defers W to the end of the step
also delays its reductions. An overlap action counts as a whole: its reductions start after the
compound. The runtime (:mod:`vpipe.runtime.data_parallel`) and the simulator
(:mod:`vpipe.sim.collectives`) both take the rule from :func:`gradient_points`.

Reductions are not schedule actions: they never appear in a schedule or its CSV, and
:func:`vpipe.ir.parse_action` does not accept them. Their spans and event rows are named
``{stage}REDUCE{bucket}`` (the action grammar's shape, ``2REDUCE0`` = stage 2's first bucket),
parsed strictly by :func:`parse_reduce`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from vpipe.ir.schedule import Action, Kind

__all__ = ["REDUCE", "format_reduce", "gradient_points", "parse_reduce"]

REDUCE = "REDUCE"
_REDUCE_RE = re.compile(r"(\d+)REDUCE(\d+)")
_WEIGHT_KINDS = (Kind.W, Kind.B)


def format_reduce(stage: int, bucket: int) -> str:
    """The name of stage ``stage``'s reduction of bucket ``bucket``: ``{stage}REDUCE{bucket}``."""
    return f"{stage}{REDUCE}{bucket}"


def parse_reduce(text: str) -> tuple[int, int] | None:
    """(stage, bucket) of a reduction name, or None when ``text`` is not exactly one."""
    m = _REDUCE_RE.fullmatch(text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def gradient_points(program: Sequence[Action], stages: Sequence[int]) -> dict[int, list[int]]:
    """Index in ``program`` (one rank's actions, lowered or not) of the action after which each
    of ``stages`` has all its weight gradients of the step -> those stages, in stage order.

    A stage with no W or B in the program (it cannot happen in a valid schedule) is reduced
    at the end of the program."""
    last: dict[int, int] = {}
    for i, a in enumerate(program):
        for p in a.compute_parts():
            if p.kind in _WEIGHT_KINDS and p.stage in stages:
                last[p.stage] = i
    points: dict[int, list[int]] = {}
    for s in sorted(stages):
        points.setdefault(last.get(s, len(program) - 1), []).append(s)
    return points

"""Helpers shared by the schedule generators: argument checks and Schedule assembly."""

from __future__ import annotations

import operator
from collections.abc import Iterable

from vpipe.errors import ScheduleError
from vpipe.ir import Action, Kind, Schedule, overlap


def check_counts(name: str, ranks: object, microbatches: object) -> tuple[int, int]:
    """Require positive integer rank and microbatch counts; return them as ints."""
    return _positive(name, "ranks", ranks), _positive(name, "microbatches", microbatches)


def _positive(name: str, what: str, value: object) -> int:
    if isinstance(value, bool):
        raise ScheduleError(f"{name}: {what} must be an integer, got {value!r}")
    try:
        n = operator.index(value)  # ints and integer-like numbers (numpy), not floats
    except TypeError:
        raise ScheduleError(f"{name}: {what} must be an integer, got {value!r}") from None
    if n < 1:
        raise ScheduleError(f"{name}: {what} must be at least 1, got {n}")
    return n


def resolve_stages_per_rank(
    name: str, value: object, *, default: int, fixed: str = "", hint: str = ""
) -> int:
    """Resolve the stages-per-rank argument: ``None`` means ``default``.

    A family with a non-empty ``fixed`` reason accepts only ``default``; ``hint`` says what to
    use instead.
    """
    if value is None:
        return default
    value = _positive(name, "stages per rank", value)
    if fixed and value != default:
        plural = "s" if default > 1 else ""
        raise ScheduleError(
            f"{name} needs exactly {default} stage{plural} per rank ({fixed}); got {value}"
            + (f"; {hint}" if hint else "")
        )
    return value


_new = tuple.__new__  # Action(...) without NamedTuple's keyword handling: generators make
# hundreds of thousands of actions for large P and M.
_F, _B, _I, _W, _OV = Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP_F_B


def F(stage: int, mb: int) -> Action:
    return _new(Action, (stage, _F, mb, ()))


def B(stage: int, mb: int) -> Action:
    return _new(Action, (stage, _B, mb, ()))


def I(stage: int, mb: int) -> Action:  # noqa: E743
    return _new(Action, (stage, _I, mb, ()))


def W(stage: int, mb: int) -> Action:
    return _new(Action, (stage, _W, mb, ()))


def overlap_fb(forward: Action, backward: Action) -> Action:
    """The compound ``(F;B)OVERLAP_F_B`` action (parts known valid, so no checks)."""
    return _new(Action, (-1, _OV, -1, (forward, backward)))


def keep_microbatches(actions: Iterable[Action], microbatches: int) -> list[Action]:
    """Drop every part that touches a microbatch >= ``microbatches``.

    A schedule built for more microbatches stays valid and deadlock free when some
    microbatches are removed (removing work never adds a dependency), so families whose
    shape needs a minimum count build that many and keep the first ``microbatches``.
    An overlap left with one part becomes that plain action.
    """
    out = []
    for a in actions:
        if a.kind is _OV:
            parts = [p for p in a.parts if p.microbatch < microbatches]
            if len(parts) == len(a.parts):
                out.append(a)
            elif len(parts) >= 2:
                out.append(overlap(*parts))
            elif parts:
                out.append(parts[0])
        elif a.microbatch < microbatches:
            out.append(a)
    return out


def build(
    name: str,
    ranks: int,
    microbatches: int,
    placement: dict[int, int],
    actions: list[list[Action]],
    **meta: object,
) -> Schedule:
    """Assemble the compute-only Schedule returned by every generator."""
    return Schedule(
        n_ranks=ranks,
        n_stages=len(placement),
        n_microbatches=microbatches,
        placement=placement,
        actions=actions,
        name=name,
        meta=dict(meta),
    )

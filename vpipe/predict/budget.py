"""A plan's memory budget (``--memory``) and its error type: bytes with a unit, or activation
units, and how a candidate's peak is read in that measure."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from vpipe.errors import VpipeError


class Peaks(Protocol):
    """What a budget reads of a candidate: its peak per rank in both measures."""

    peak_activation_units: Sequence[float]
    peak_activation_bytes: Sequence[float]


class PlanError(VpipeError, ValueError):
    """A plan that cannot be made as asked (bad budget or costs, nothing fits)."""


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


@dataclass(frozen=True)
class Budget:
    """Peak activation memory allowed per rank: ``value`` bytes, or activation units."""

    value: float
    units: bool = False

    @classmethod
    def parse(cls, text: str) -> Budget:
        """``12GiB``, ``500MB``, ``4096`` (bytes) or ``6units`` (activation units)."""
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).lower() if m else ""
        if m is None or (unit not in _UNITS and unit not in ("unit", "units", "act")):
            raise PlanError(
                f"--memory {text!r}: expected bytes (e.g. 12GiB, 500MB, 4096) or activation "
                "units (e.g. 6units)"
            )
        if unit in ("unit", "units", "act"):
            return cls(float(m.group(1)), units=True)
        return cls(float(m.group(1)) * _UNITS[unit])

    def peak(self, c: Peaks) -> float:
        """A candidate's peak in this budget's measure (max over ranks)."""
        return float(max(c.peak_activation_units if self.units else c.peak_activation_bytes))

    def describe(self, value: float) -> str:
        return f"{value:.3g} units" if self.units else _bytes(value)


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"

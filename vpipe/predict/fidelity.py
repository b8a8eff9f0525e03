"""The measured error of a prediction, read from a sweep's fidelity tables.

A fidelity table (:func:`vpipe.predict.leave_one_out.leave_one_out`) has one row per calibration
config (``calibrated on``) and one column per predicted config, holding predicted / timed
median - 1. Predictions made from costs calibrated on config C are as good as C's row shows
on the *other* configs it predicted (its off-diagonal cells): the largest of their |error| is
the error such a prediction is stated with. Fewer than :data:`MIN_HELD_OUT` such cells say
too little: the error is then unknown, and said so in words. Pure functions of the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where a table is read: plan --cost needs none
    import pandas as pd

__all__ = [
    "MIN_HELD_OUT",
    "MeasuredError",
    "fidelity_worst",
    "held_out_error",
    "interval_text",
    "unknown",
]

MIN_HELD_OUT = 2  # held-out predictions an error needs to rest on

_COUNTS = {0: "no", 1: "one", 2: "two", 3: "three"}


@dataclass(frozen=True)
class MeasuredError:
    """A prediction's relative error: ``value`` (the largest |error| of ``cells`` held-out
    predictions, ``where``: which table and row) or None when unknown (``why``: in words)."""

    value: float | None
    cells: int = 0
    where: str = ""
    why: str = ""

    @property
    def known(self) -> bool:
        return self.value is not None

    def words(self) -> str:
        """``±8.3% (the largest |error| of 4 held-out predictions, ...)`` or ``error unknown:
        one config measured``."""
        if self.value is None:
            return f"error unknown: {self.why}"
        where = f", {self.where}" if self.where else ""
        return (f"±{self.value:.1%} (the largest |error| of {self.cells} held-out "
                f"predictions{where})")  # fmt: skip


def unknown(why: str) -> MeasuredError:
    """An error that cannot be stated, and why (``one config measured``)."""
    return MeasuredError(None, why=why)


def _configs(n: int) -> str:
    return f"{_COUNTS.get(n, n)} config{'' if n == 1 else 's'}"


def held_out_error(
    table: pd.DataFrame | None, calibrated_on: str, where: str = ""
) -> MeasuredError:
    """The error of predictions calibrated on ``calibrated_on``: the largest |error| of its
    row's cells other than its own column (NaN cells: not predicted, not counted). A table of
    None means one config was measured; fewer than :data:`MIN_HELD_OUT` cells, unknown."""
    if table is None:
        return unknown("one config measured")
    rows = table[table["calibrated on"] == calibrated_on]
    if rows.empty:
        return unknown(f"{calibrated_on} is not a calibration config of the fidelity table")
    import pandas as pd

    row = rows.iloc[0].drop(labels=["calibrated on", calibrated_on], errors="ignore")
    cells = pd.to_numeric(row, errors="coerce").dropna()
    if len(cells) < MIN_HELD_OUT:
        return unknown(f"{_configs(len(cells) + 1)} measured, {len(cells)} held out "
                       f"({MIN_HELD_OUT} needed)")  # fmt: skip
    return MeasuredError(float(cells.abs().max()), len(cells), where)


def fidelity_worst(table: pd.DataFrame) -> float:
    """The largest |error| of a leave-one-out table (its diagonal is 0: each row is anchored
    to its own config's timed median)."""
    return float(table.drop(columns="calibrated on").abs().max().max())


def interval_text(step_s: float, error: MeasuredError, unit: str = " ms", digits: int = 2) -> str:
    """A predicted step time with its interval: ``276.60 ± 8.30 ms``, or ``276.60 ms (error
    unknown)`` (``unit=""``: the numbers alone, for a column that names its unit)."""
    ms = step_s * 1e3
    if error.value is None:
        return f"{ms:.{digits}f}{unit} (error unknown)"
    return f"{ms:.{digits}f} ± {ms * error.value:.{digits}f}{unit}"

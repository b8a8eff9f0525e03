"""What splitting a backward costs: (I + W) over one fused B of the same stage and microbatch.

A split backward is not free. On a CPU host, vpipe's I then W of an MLP stage took 1.14-1.26x
its fused B alone (one thread, stages of 1 to 3 blocks, interleaved repeats), 1.00-1.22x in
dualpipev's profiled steps, and how the work around them runs moves it (docs/runtime.md). A
calibration whose run had only B (1f1b) that took I + W = B predicted zbv 8-11% short, and
one whose run had only I and W predicted 1f1b 6-11% long.

The ratio comes from the run itself where it ran B beside I and W on the same stage
(dualpipev), else from the split probe a sweep runs on each config's stages
(:mod:`vpipe.sweep.split_probe`, the runs table's ``split_backward_ratio``); unknown, it is
taken as 1. It applies to stages that compute an input gradient: the first stage's I computes
nothing, so its W is the whole backward.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["in_run_ratio", "run_figure", "run_value", "split_backward_ratio", "split_factors"]


def split_factors(n_stages: int, ratio: float | None) -> np.ndarray:
    """Per stage, what I + W costs over a fused B: ``ratio`` (1 when unknown) past the first
    stage, 1 on it."""
    out = np.full(n_stages, 1.0 if ratio is None else float(ratio))
    out[0] = 1.0
    return out


def in_run_ratio(b: np.ndarray, w: np.ndarray, full_b: np.ndarray | None) -> float | None:
    """(I + W) / B from a run that measured both on the same stages past the first (the median
    over them), or None."""
    if full_b is None or len(full_b) < 2:
        return None
    both = np.isfinite(full_b[1:]) & (full_b[1:] > 0)
    if not both.any():
        return None
    return float(np.median(((b + w)[1:] / full_b[1:])[both]))


def split_backward_ratio(row: Any) -> float | None:
    """A run's probed split ratio (its runs-table row, a row tuple or its metadata), or None
    where the run has none (torch's configs, a recomputing run, a trace from elsewhere)."""
    value = run_figure(row, "split_backward_ratio")
    return value if value is not None and value > 0 else None


def run_value(row: Any, key: str) -> Any:
    """``key`` of a run's runs-table row, row tuple or metadata as stored; None where missing."""
    return row.get(key) if hasattr(row, "get") else getattr(row, key, None)


def run_figure(row: Any, key: str) -> float | None:
    """``key`` of a run's runs-table row, row tuple or metadata as a number; None where it is
    missing, NA, NaN or not a number."""
    value = run_value(row, key)
    try:
        value = float(value)
    except (TypeError, ValueError):  # None, NA
        return None
    return value if value == value else None  # NaN

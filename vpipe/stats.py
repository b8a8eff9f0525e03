"""Statistics for A-vs-B figures: a ratio with a bootstrap 95% interval, a verdict, and an
outlier flag for timed steps.

- **Paired ratio** (:func:`paired_ratio`): two configs measured back to back give pairs of step
  times (same round and step index); the figure is the median of the pairwise ratios, and its
  interval is the percentile bootstrap over the pairs (resample the pairs with replacement,
  take each resample's median ratio, keep the 2.5th and 97.5th percentiles).
- **Ratio of medians** (:func:`ratio_of_medians`): two sweeps (different commits or machines)
  have no natural pairs; the figure is median(A) / median(B), and its interval resamples A's
  and B's steps independently.
- **Verdict**: "no significant difference" when the interval contains 1, else the direction.
  Fewer than :data:`MIN_SAMPLES` pairs (or steps per side) give no interval and no verdict:
  with 5 or fewer, even a sign test of the median cannot reach 5% (all 5 on one side: p =
  2/32), so a bootstrap interval there would only look confident.
- **Outliers** (:func:`outliers`): a step slower than :data:`OUTLIER_FACTOR` times its
  config's median step is flagged (a machine hiccup, not the code) and excluded from the
  ratio and its interval (a pair goes when either of its steps is flagged); every table using
  these statistics says how many steps were flagged.

The bootstrap draws from a generator seeded with :data:`SEED` on every call, so a report's
intervals are the same on every rendering of the same steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import numpy.typing as npt

RESAMPLES = 2000  # bootstrap resamples; percentile intervals want >= 1000 (Efron & Tibshirani)
SEED = 0
CONFIDENCE = 0.95
MIN_SAMPLES = 6
OUTLIER_FACTOR = 3.0
K = TypeVar("K")


@dataclass(frozen=True)
class Ratio:
    """A ratio with its bootstrap interval (NaN when too few samples), the samples it used
    (pairs, or the smaller side's steps) and how many steps were flagged as outliers."""

    value: float
    low: float
    high: float
    n: int
    outliers: int

    @property
    def has_interval(self) -> bool:
        return not (np.isnan(self.low) or np.isnan(self.high))

    def verdict(self, above: str = "faster", below: str = "slower") -> str:
        """``above`` when the whole interval is above 1, ``below`` when below, else "no
        significant difference" (or "too few steps" without an interval)."""
        if not self.has_interval:
            return f"too few steps (< {MIN_SAMPLES})"
        if self.low > 1:
            return above
        if self.high < 1:
            return below
        return "no significant difference"

    def interval_text(self, digits: int = 2) -> str:
        """The interval as ``low-high`` (:func:`interval_text`), or empty without one."""
        return interval_text(self.low, self.high, digits) if self.has_interval else ""


def interval_text(low: float, high: float, digits: int = 2) -> str:
    """An interval as ``low-high`` with ``digits`` decimals, or as many more (up to 6) as it
    takes for an interval that excludes 1 not to print an end of 1: "1.002-1.07", never
    "1.00-1.07", which reads as if it held 1."""
    for d in range(digits, max(digits, 6) + 1):
        lo, hi = f"{low:.{d}f}", f"{high:.{d}f}"
        if not ((low > 1 and float(lo) <= 1) or (high < 1 and float(hi) >= 1)):
            break
    return f"{lo}-{hi}"


def outliers(times: npt.ArrayLike, factor: float = OUTLIER_FACTOR) -> np.ndarray:
    """Which of one config's step times exceed ``factor`` times their median."""
    t = np.asarray(times, dtype=float)
    if t.size == 0:
        return np.zeros(0, dtype=bool)
    return t > factor * np.median(t)


def paired_ratio(num: npt.ArrayLike, den: npt.ArrayLike) -> Ratio:
    """Median of the pairwise ratios ``num[i] / den[i]`` (each array: one config's step times,
    aligned pair by pair), outlier pairs excluded, with its percentile-bootstrap interval."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if a.shape != b.shape:
        raise ValueError(f"paired samples differ in length: {a.size} vs {b.size}")
    flag_a, flag_b = outliers(a), outliers(b)
    keep = ~(flag_a | flag_b)
    ratios = a[keep] / b[keep]
    n = ratios.size
    value = float(np.median(ratios)) if n else float("nan")
    low, high = _interval(lambda idx: np.median(ratios[idx], axis=1), (n,))
    return Ratio(value, low, high, n, int(flag_a.sum() + flag_b.sum()))


def ratio_of_medians(num: npt.ArrayLike, den: npt.ArrayLike) -> Ratio:
    """median(num) / median(den) of two independent samples of step times, outliers of each
    excluded, with a percentile-bootstrap interval resampling each sample on its own."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    flag_a, flag_b = outliers(a), outliers(b)
    a, b = a[~flag_a], b[~flag_b]
    value = float(np.median(a) / np.median(b)) if a.size and b.size else float("nan")

    def stat(ia: np.ndarray, ib: np.ndarray) -> np.ndarray:
        return np.median(a[ia], axis=1) / np.median(b[ib], axis=1)

    low, high = _interval(stat, (a.size, b.size))
    return Ratio(value, low, high, min(a.size, b.size), int(flag_a.sum() + flag_b.sum()))


def median_precision(times: npt.ArrayLike) -> float:
    """How well the median of one config's step times is known: the larger side of its 95%
    bootstrap interval relative to it (0.03: +-3%), outliers excluded; NaN with fewer than
    :data:`MIN_SAMPLES` steps."""
    t = np.asarray(times, dtype=float)
    t = t[~outliers(t)]
    if t.size < MIN_SAMPLES:
        return float("nan")
    mid = float(np.median(t))
    low, high = _interval(lambda idx: np.median(t[idx], axis=1), (t.size,))
    return max(high / mid - 1, 1 - low / mid)


def looser_than(samples: Mapping[K, npt.ArrayLike], percent: float) -> list[K]:
    """The keys of ``samples`` (each one config's step times) whose median is not known to
    +-``percent`` (:func:`median_precision`; too few steps for an interval count as not
    known), in their order: what more rounds are for (``vpipe bench --timing-precision``)."""
    return [k for k, t in samples.items() if not median_precision(t) * 100 <= percent]


def _interval(stat: Callable[..., np.ndarray], sizes: tuple[int, ...]) -> tuple[float, float]:
    """Percentile-bootstrap interval of ``stat``, which maps one index matrix per sample
    (resamples x size, drawn with replacement) to the resamples' statistics."""
    if min(sizes) < MIN_SAMPLES:
        return float("nan"), float("nan")
    rng = np.random.default_rng(SEED)
    draws = [rng.integers(0, n, size=(RESAMPLES, n)) for n in sizes]
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(stat(*draws), [tail, 100 - tail])
    return float(low), float(high)

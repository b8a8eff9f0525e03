"""Models split into equal pieces (MLP blocks; GPT's embedding, layers and head) and the
per-stage figures of one split carried over to another: how a calibration on one stage count
prices a schedule with another (:mod:`vpipe.predict.calibrate`)."""

from __future__ import annotations

import numpy as np

from vpipe.errors import TraceError

__all__ = ["lcm", "rescale_stages", "split_sizes"]


def lcm(a: int, b: int) -> int:
    """The least common multiple: pieces that split evenly into both stage counts."""
    return a * b // np.gcd(a, b)


def split_sizes(n_units: int, n_stages: int) -> list[int]:
    """Pieces per stage as the benchmark models split them (earlier stages take the extra)."""
    base, extra = divmod(n_units, n_stages)
    return [base + (1 if i < extra else 0) for i in range(n_stages)]


def rescale_stages(per_stage: np.ndarray, n_units: int, n_stages: int) -> np.ndarray:
    """Per-stage costs (or any per-stage sum over pieces) of a split into ``n_stages`` from
    those of the calibrated split into ``len(per_stage)``, ``n_units`` equal pieces in all."""
    src = split_sizes(n_units, len(per_stage))
    if min(src) == 0 or min(split_sizes(n_units, n_stages)) == 0:
        raise TraceError(
            f"cannot split {n_units} model pieces into {max(len(per_stage), n_stages)} stages"
        )
    unit = np.repeat(per_stage / np.array(src), src)
    bounds = np.cumsum([0, *split_sizes(n_units, n_stages)])
    return np.array([unit[bounds[i] : bounds[i + 1]].sum() for i in range(n_stages)])

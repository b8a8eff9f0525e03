"""A plan's predictions with the error they were measured to have.

The tie band of :func:`vpipe.predict.plan.plan` is the measured error of its predictions
(:mod:`vpipe.predict.fidelity_runs`), or ``--tie`` when the user gives one; with the error
unknown, the default band (:data:`vpipe.predict.plan_ties.PREDICTION_ERROR`), said to be a
default. :func:`with_errors` adds to a plan's result what each prediction's error is, where it
comes from, and the best extrapolated candidate when it beats the recommendation by more than
both errors.
"""

from __future__ import annotations

from typing import Any

from vpipe.predict.fidelity import MeasuredError, interval_text
from vpipe.predict.fidelity_runs import PlanErrors
from vpipe.predict.plan_ties import PREDICTION_ERROR, candidate_label

__all__ = ["TIE_LIMIT", "alternative_note", "band", "error_lines", "tie_band", "with_errors"]

TIE_LIMIT = 0.99  # plan's tie is a fraction below 1: a larger measured error is capped there


def tie_band(errors: PlanErrors, user_tie: float | None) -> tuple[float, str]:
    """The tie band and where it comes from, in words: ``--tie`` given (the user's), else the
    measured error at the measured microbatch counts, else the default band."""
    if user_tie is not None:
        return user_tie, "--tie, yours"
    if errors.measured.value is not None:
        return min(errors.measured.value, TIE_LIMIT), "the error measured on the sweep"
    return PREDICTION_ERROR, "the default band, the error being unknown"


def band(c: dict[str, Any], errors: PlanErrors) -> MeasuredError:
    """The error of one candidate's prediction: the measured one at a measured M, the
    extrapolated one at any other."""
    measured = c.get("m_measured", True) is not False
    return errors.measured if measured else errors.extrapolated


def with_errors(result: dict[str, Any], errors: PlanErrors, tie_source: str) -> dict[str, Any]:
    """``result`` with each candidate's ``m_measured`` and ``error`` (relative, None when
    unknown), the plan's ``error`` and ``error_source`` (at the measured M), the same for
    extrapolated M, where the tie band comes from, and ``alternative``: the best fitting
    extrapolated candidate when it beats the recommendation by more than both errors."""
    swept = result.get("measured_m")
    for c in [*result["candidates"], *result["tied"], result["recommended"]]:
        c["m_measured"] = None if swept is None else c["microbatches"] in swept
        c["error"] = band(c, errors).value
    result.update(
        error=errors.measured.value,
        error_source=errors.measured.words(),
        extrapolated_error=errors.extrapolated.value,
        extrapolated_error_source=errors.extrapolated.words(),
        tie_source=tie_source,
        alternative=_alternative(result, errors),
    )
    return result


def _alternative(result: dict[str, Any], errors: PlanErrors) -> dict[str, Any] | None:
    rec = result["recommended"]
    e_m, e_x = errors.measured.value, errors.extrapolated.value
    out = [c for c in result["candidates"] if c["fits"] and c["m_measured"] is False]
    if not out or e_m is None or e_x is None:
        return None
    best = min(out, key=lambda c: c["predicted_step_s"])
    slowest_alt = best["predicted_step_s"] * (1 + e_x)
    return best if slowest_alt < rec["predicted_step_s"] * (1 - e_m) else None


def error_lines(result: dict[str, Any], shown: list[dict[str, Any]]) -> list[str]:
    """The plan's errors in words: at the measured M (the tie band's source), and at
    extrapolated M when ``shown`` rows have any."""
    lines = [f"predicted step times: {result['error_source']}; tie band "
             f"{result['tie']:.1%} ({result['tie_source']})"]  # fmt: skip
    if any(c.get("m_measured") is False for c in shown):
        lines.append(f"extrapolated M (not measured by the sweep: M="
                     f"{', '.join(map(str, result['measured_m']))}): "
                     f"{result['extrapolated_error_source']}")  # fmt: skip
    return lines


def alternative_note(result: dict[str, Any]) -> str:
    """The best extrapolated candidate in words, when it beats the recommendation by more
    than both errors (:func:`with_errors`); else empty."""
    alt = result.get("alternative")
    if alt is None:
        return ""
    error = MeasuredError(result["extrapolated_error"])
    return (f"alternative at an M the sweep did not measure: {candidate_label(alt)}, "
            f"{interval_text(alt['predicted_step_s'], error)}, faster than the recommendation "
            "by more than both errors; measure it before relying on it")  # fmt: skip

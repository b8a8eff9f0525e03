"""The bench report's "Plan for this host": the plan calibrated on one of the sweep's configs,
with the error its predictions were measured to have on the same sweep.

The tie band is that error (:mod:`vpipe.predict.plan_error`); the recommendation is made among
candidates at the microbatch counts the sweep measured; an extrapolated candidate is shown as
an alternative only when it beats the recommendation by more than both errors; and where the
plan's pick differs from the verdict's (measured) at a measured M, one sentence says why.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from vpipe.report.document import Section, table_section
from vpipe.sweep.results import BenchResults, has_actions

__all__ = ["plan_sections", "verdict_agreement"]


def plan_sections(
    res: BenchResults, fidelity: list[tuple[str, int, pd.DataFrame]], top: int = 10
) -> list[Section]:
    """The plan for the measured host: costs calibrated on the sweep's vpipe zbv config (else
    its first profiled vpipe config), every family x stages x M simulated for this sweep's
    ranks and batch, within the most memory any config of the sweep used."""
    from vpipe.predict.fidelity import interval_text
    from vpipe.predict.fidelity_runs import plan_errors
    from vpipe.predict.plan import Budget, PlanError, calibrated_costs, plan, plural, tie_note
    from vpipe.predict.plan_error import alternative_note, band, tie_band, with_errors
    from vpipe.report.dp_section import plan_dp
    from vpipe.schedules import make_schedule

    runs = res.measured
    vpipe_runs = runs[runs["impl"] == "vpipe"]
    traced = [
        r for r in vpipe_runs.itertuples()
        if (ev := res.events.get(r.run_id)) is not None and has_actions(ev)
    ]  # fmt: skip
    if not traced or res.ranks.empty:
        return []
    base = next((r for r in traced if r.schedule == "zbv"), traced[0])
    rank_rows = res.ranks[
        (res.ranks["schedule"] == base.schedule)
        & (res.ranks["microbatches"] == base.microbatches)
        & (res.ranks["impl"] == "vpipe")
    ]
    peaks = dict(zip(rank_rows["rank"], rank_rows["peak_bytes"], strict=True))
    schedule = make_schedule(base.schedule, res.spec.ranks, int(base.microbatches))
    meta = {"model": res.spec.model, "sizes": res.meta.get("model_sizes"), "batch": res.spec.batch,
            "dp": res.spec.dp}  # fmt: skip
    budget = Budget(float(res.ranks["peak_bytes"].max()))
    dp, dp_note = plan_dp(res.dp_sweep(), base.run_id)  # --dp: each step ends with its reductions
    loo = next((t for i, m, t in fidelity if i == "vpipe" and m == base.microbatches), None)
    swept = vpipe_runs[vpipe_runs["run_id"].isin([r.run_id for r in traced])]
    try:
        errors = plan_errors(swept, res.events.get, base, res.spec.ranks, meta, loo)
        tie, tie_source = tie_band(errors, None)
        own = {**meta, "comm_thread_cpu_s": getattr(base, "comm_thread_cpu_s", None),
               "split_backward_ratio": getattr(base, "split_backward_ratio", None)}  # fmt: skip
        costs = calibrated_costs(res.events[base.run_id], peaks, schedule, own,
                                 float(base.step_time_s))  # fmt: skip
        result = plan(costs, res.spec.ranks, res.spec.batch, budget, dp=dp, tie=tie,
                      measured_m=errors.measured_m,
                      microbatches=_planned_m(res, errors.measured_m))  # fmt: skip
    except PlanError as e:
        return [Section("Plan for this host", f'<p class="note">{e}</p>', str(e))]
    with_errors(result, errors, tie_source)
    rec = result["recommended"]
    tied = {_key(c) for c in result["tied"]}
    table = pd.DataFrame(
        {
            "schedule": c["schedule"],
            "stages/rank": c["stages_per_rank"],
            "M": c["microbatches"],
            "predicted step ms": interval_text(c["predicted_step_s"], band(c, errors), unit=""),
            "bubble": f"{c['bubble_ratio']:.3f}",
            "M measured": "yes" if c["m_measured"] else "extrapolated",
            "saved activations MiB/rank": f"{max(c['peak_activation_bytes']) / 2**20:.2f}",
            "fits": "yes" if c["fits"] else "no",
            "tie": "yes" if _key(c) in tied else "",
        }
        for c in result["candidates"][:top]
    )
    alt = alternative_note(result)
    note = (
        f"vpipe plan for {res.spec.ranks} ranks and batch {res.spec.batch}, costs calibrated on "
        f"{base.schedule} M={int(base.microbatches)} (vpipe; compute anchored to its timed "
        "median), budget: the most memory a config "
        f"of this sweep used ({budget.describe(budget.value)} per rank). Recommended: "
        f"{rec['schedule']} with {plural(rec['stages_per_rank'], 'stage')} per rank and "
        f"{plural(rec['microbatches'], 'microbatch')}, "
        f"{interval_text(rec['predicted_step_s'], band(rec, errors))} per step predicted"
        + (f" ({tie_note(result)})" if len(tied) > 1 else "")
        + f". Predicted step times: {errors.measured.words()}."
        + (f" The tie band is {result['tie']:.1%} ({tie_source})." if len(tied) <= 1 else "")
        + _worst_words(errors, fidelity)
        + (f" {verdict_agreement(res, result)}" if rec["m_measured"] else "")
        + (f" Alternative: {alt}." if alt else "")
        + f" Fastest {min(top, len(result['candidates']))} of "
        f"{len(result['candidates'])} candidates; `vpipe plan --from STORE --run "
        f"{base.run_id} --memory ...` plans for another budget."
        + dp_note
        + "".join(f" Left out {fam}: {why}." for fam, why in result["left_out"].items())
        + _plan_words(res, errors, table)
    )
    return [table_section("Plan for this host", table, note)]


def _key(c: dict[str, Any]) -> tuple:
    return c["schedule"], c["stages_per_rank"], c["microbatches"], c.get("recompute", "none")


def _worst_words(errors: Any, fidelity: list[tuple[str, int, pd.DataFrame]]) -> str:
    """The fidelity tables' largest |error| when it exceeds the plan's: the plan's error is
    its calibration config's row, other rows may err more."""
    from vpipe.predict.fidelity import fidelity_worst

    worst = [fidelity_worst(t) for _, _, t in fidelity]
    if not worst or errors.measured.value is None or max(worst) <= errors.measured.value:
        return ""
    return (f" Other calibration configs (Simulator fidelity) err up to {max(worst):.1%}, "
            "the plan's costs come from its own row.")  # fmt: skip


def _planned_m(res: BenchResults, measured: Any) -> list[int]:
    """The microbatch counts the plan weighs: `vpipe plan`'s choices up to twice the largest
    the sweep measured. Farther out, an extrapolation's error is not measured, and auto's
    searches there were most of the report's time."""
    from vpipe.predict.plan import microbatch_choices

    reach = 2 * max(measured or res.spec.microbatches)
    per_replica = res.spec.batch // max(1, int(res.spec.dp or 1))
    return [m for m in microbatch_choices(per_replica, res.spec.ranks) if m <= reach]


def _plan_words(res: BenchResults, errors: Any, table: pd.DataFrame) -> str:
    """What the plan's table needs beside it: its rows at microbatch counts the sweep did not
    run, with their error, and its auto rows."""
    swept = ", ".join(map(str, errors.measured_m or res.spec.microbatches))
    words = ""
    if (table["M measured"] == "extrapolated").any():
        words += (f" M measured: the sweep ran M={swept}; other counts, up to twice the "
                  "largest, are extrapolated (costs "
                  "calibrated at the swept M, compute and activations scaled per row): the "
                  f"recommendation is made among the measured M; extrapolated rows: "
                  f"{errors.extrapolated.words()}.")  # fmt: skip
    if (table["schedule"] == "auto").any():
        words += (" auto: the schedule vpipe searches for these costs and this budget "
                  "(vpipe.schedules.auto); where it ties a named family, it found that "
                  "family's order or one as fast.")  # fmt: skip
    return words


def verdict_agreement(res: BenchResults, result: dict[str, Any]) -> str:
    """One sentence on the plan's pick against the verdict's (measured) at the same M: that
    they agree, or why they differ. Empty when the sweep ran one schedule at that M."""
    from vpipe.predict.plan import candidate_label
    from vpipe.report.winner import standing_pick, standings
    from vpipe.schedules import catalogue

    rec = result["recommended"]
    m = rec["microbatches"]
    st = next((s for s in standings(res.steps) if s.impl == "vpipe" and s.microbatches == m), None)
    if st is None:
        return ""
    won = standing_pick(st, res.config_memory())
    mine = candidate_label(rec)
    as_run = rec["schedule"] in catalogue.names() and rec["stages_per_rank"] == catalogue.get(
        rec["schedule"]).stages_per_rank and rec.get("recompute", "none") == "none"  # fmt: skip
    if as_run and rec["schedule"] == won:
        return f"The plan's pick is the verdict's at M={m} (measured)."
    head = f"The verdict at M={m} runs {won} (measured); the plan picks {mine}"
    if not as_run:
        return f"{head}, a config the sweep did not run: measure it before preferring it."
    if rec["schedule"] in st.contenders:
        return (f"{head}, which the sweep measured as tied with it: either runs as fast, and "
                "the two tie rules weigh different memory (measured vs predicted).")  # fmt: skip
    v = catalogue.get(won).stages_per_rank
    theirs = next((c for c in result["candidates"] if c["schedule"] == won
                   and c["stages_per_rank"] == v and c["microbatches"] == m), None)  # fmt: skip
    if theirs is None:
        return f"{head}: the plan weighed no candidate like {won} (over the budget or left out)."
    gap = theirs["predicted_step_s"] / rec["predicted_step_s"] - 1
    if any(c["schedule"] == won and c["stages_per_rank"] == v and c["microbatches"] == m
           for c in result["tied"]):  # fmt: skip
        return (f"{head}: it predicts {won} {gap:+.1%} against it, within its tie band, and "
                f"its tie rule picked {mine}; measured, {won} is faster: run it.")  # fmt: skip
    return (f"{head}: it predicts {won} {gap:.1%} slower, beyond its tie band, yet {won} "
            "measured faster: here the prediction errs by more than it states; run what was "
            "measured.")  # fmt: skip

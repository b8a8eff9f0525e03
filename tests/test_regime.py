"""The regime figure (median compute per action / one message's send+recv cost) from event
tables, its runs-table column, and the report's overhead-bound warning, on synthetic events
with known span lengths."""

from __future__ import annotations

import pandas as pd
import pytest

from vpipe.events import events_frame
from vpipe.metrics.catalogue import Inputs, compute
from vpipe.metrics.per_run import regime_figure
from vpipe.report.document import REGIME_THRESHOLD, regime_section, regime_warning
from vpipe.sweep.driver import SweepSpec
from vpipe.sweep.results import collect
from vpipe.sweep.write import report_sections

WARNING = (
    "per-action overhead and communication dominate; the schedule ranking will not transfer "
    "to real hardware"
)


def _events(compute_ns: int, send_ns: int, recv_ns: int, ranks: int = 2) -> pd.DataFrame:
    """Each rank: receive, forward, send, then a wait and a backward, for four microbatches."""
    rows = []
    for rank in range(ranks):
        t = 0
        for mb in range(4):
            for kind, length in (
                ("RECV_F", recv_ns),
                ("F", compute_ns),
                ("SEND_F", send_ns),
                ("WAIT", 50 * compute_ns),  # blocking time is not a message's cost
                ("B", compute_ns),
            ):
                rows.append(
                    dict(run_id="r", source="measured", impl="vpipe", schedule="zbv", rank=rank,
                         step=0, stage=rank, microbatch=mb, kind=kind, name=f"{rank}{kind}{mb}",
                         start_ns=t, end_ns=t + length)
                )  # fmt: skip
                t += length
    return events_frame(rows)


def test_regime_figure_is_compute_per_action_over_send_plus_recv():
    assert regime_figure(_events(1000, 60, 140)) == pytest.approx(5.0)
    assert regime_figure(_events(20_000, 100, 100)) == pytest.approx(100.0)
    compute_only = _events(1000, 60, 140)
    compute_only = compute_only[compute_only["kind"].isin(["F", "B"])]
    assert regime_figure(compute_only) is None  # one rank, no messages: does not apply


def test_regime_is_a_runs_table_metric_from_events():
    assert compute(Inputs(events=_events(1000, 100, 100)))["regime"] == pytest.approx(5.0)
    assert compute(Inputs(steps=[0.1, 0.2]))["regime"] is None


def _runs(figures: dict[str, float]) -> pd.DataFrame:
    return pd.DataFrame(
        [dict(schedule=s, microbatches=4, impl="vpipe", regime=x) for s, x in figures.items()]
    )


def test_warning_when_every_config_is_overhead_bound():
    text = regime_warning(_runs({"interleaved-1f1b": 4.0, "zbv": 6.5}))
    assert text.startswith("Overhead-bound: every profiled config")
    assert "regime figure 4.0-6.5" in text and WARNING in text


def test_warning_names_the_overhead_bound_configs_of_a_mixed_sweep():
    text = regime_warning(_runs({"interleaved-1f1b": 40.0, "zbv": 6.5, "1f1b": float("nan")}))
    assert "1 of 2 profiled configs (zbv M=4 vpipe)" in text and WARNING in text


def test_no_warning_when_compute_bound():
    runs = _runs({"interleaved-1f1b": REGIME_THRESHOLD, "zbv": 60.0})
    assert regime_warning(runs) == ""
    assert regime_section(runs).markdown.startswith("Compute-bound: every profiled config")
    assert regime_section(_runs({"zbv": float("nan")})) is None  # no figure, no section


def _sweep(compute_ns: int) -> list[dict]:
    """What every rank of a one-config sweep returns, with synthetic events."""
    ev = _events(compute_ns, 100, 100)
    return [
        dict(rank=rank, host="h", threads=1, torch="t", sizes={}, tokens_per_sample=None,
             cpu_allocator="cached",
             n_stages={"zbv-m4-vpipe": 4}, times=[[0.01] * 4], rounds=[[0, 0, 1, 1]],
             memory={"zbv-m4-vpipe": {"peak_bytes": 1000, "samples": [(0, 5)]}},
             events={"zbv-m4-vpipe": ev[ev["rank"] == rank].reset_index(drop=True)})
        for rank in range(2)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("compute_ns", "bound"), [(500, "Overhead-bound"), (5000, "Compute-bound")]
)
def test_bench_report_states_the_regime_first(compute_ns, bound):
    spec = SweepSpec(schedules=("zbv",), microbatches=(4,), impls=("vpipe",), steps=2, rounds=2)
    res = collect(spec, _sweep(compute_ns), "b", 1.0, simulate=False)
    assert res.measured["regime"].iloc[0] == pytest.approx(compute_ns / 200)
    verdict, first = report_sections(res)[:2]  # the one-line verdict, then the regime
    assert verdict.title == "Verdict" and first.title == "Regime"
    assert first.markdown.startswith(bound)
    assert (WARNING in first.markdown) == (bound == "Overhead-bound")


def test_the_regime_section_states_the_profilers_overhead():
    from vpipe.report.document import profiler_overhead

    runs = pd.DataFrame(
        {"schedule": ["zbv", "1f1b", "x"], "microbatches": [8, 8, 8], "impl": ["vpipe"] * 3,
         "regime": [20.0, 30.0, None], "step_time_s": [0.10, 0.20, 0.30],
         "profiled_step_time_s": [0.12, 0.21, None], "device": ["cuda"] * 3}
    )  # fmt: skip
    line = profiler_overhead(runs)
    assert "1.12x the timed median" in line and "1.05-1.20" in line and "device intervals" in line
    assert line in regime_section(runs).markdown
    assert profiler_overhead(runs.drop(columns="profiled_step_time_s")) == ""

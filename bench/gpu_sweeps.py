"""The sweep figures of ``make gpu-check`` (bench/gpu_check.py): what one GPU's sweeps say.

- ``quick-sweep``: ``vpipe bench --device cuda --quick -p 1`` over four schedules on one GPU
  (GPT at the GPU defaults, bf16): with every stage on one rank nothing waits, so every bubble
  ratio must read under 0.05 and the simulator, calibrated on each config's own profiled steps,
  must predict its timed median within 10%; the profiler's overhead (profiled step over timed
  median) is printed beside it.
- ``a-a``: the same sweep launched again and ``vpipe report A B``: the same code on the same
  GPU a minute apart must not be called faster or slower.
- ``gloo-two-ranks``: ``vpipe bench --device cuda --backend gloo -p 2 --quick``: two ranks on
  the one GPU, every message through host copies; it must run (the torch baseline left out in
  one line) and its report names the regime.

Each step is skipped with one line once the session has run past its time budget.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BUDGET_S = 240.0  # the whole session, checks included: a few minutes of a GPU
SIM_GOAL = 0.10  # prediction error on a config the calibration did not see
BUBBLE_P1 = 0.05
P1_SCHEDULES = "1f1b,interleaved-1f1b,zbv,dualpipev"


def _bench(out: Path, *extra: str, timeout_s: float = 150.0) -> tuple[int, str]:
    argv = [sys.executable, "-m", "vpipe", "bench", "--device", "cuda", "--quick", "--force"]
    argv += ["--out", str(out), *extra]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return 124, f"vpipe bench did not finish in {timeout_s:.0f} s"
    return r.returncode, r.stdout + r.stderr


def _tail(text: str, n: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-n:])


def quick_sweep(out: Path) -> tuple[Any, str, dict[str, Any]]:
    """(ok, detail, figures) of the P=1 sweep at ``out``."""
    import pandas as pd

    from vpipe.predict.leave_one_out import leave_one_out_tables
    from vpipe.trace.store import Store

    rc, printed = _bench(out, "-p", "1", "--impl", "vpipe", "--schedules", P1_SCHEDULES)
    if rc != 0:
        return False, f"vpipe bench exited {rc}: {_tail(printed)}", {"printed": printed}
    runs = pd.read_parquet(out / "runs")
    m = runs[runs["source"].astype(str) == "measured"].sort_values("schedule")
    rows = []
    figures: dict[str, Any] = {}
    for r in m.to_dict("records"):
        overhead = r["profiled_step_time_s"] / r["step_time_s"]
        figures[r["schedule"]] = {
            k: r.get(k)
            for k in ("step_time_s", "profiled_step_time_s", "sim_step_time_s", "sim_error",
                      "bubble_ratio", "regime", "tokens_per_s", "peak_memory_bytes")
        }  # fmt: skip
        rows.append(
            f"{r['schedule']} {r['step_time_s'] * 1e3:.2f} ms (in-sample sim {r['sim_error']:+.1%}"
            f", bubble {r['bubble_ratio']:.3f}, profiled/timed {overhead:.2f}, "
            f"{(r['tokens_per_s'] or 0) / 1e3:.1f}k tokens/s)"
        )
    store = Store(out)
    meta = store.run_meta(str(m["run_id"].iloc[0])) if len(m) else {}
    events_of = lambda run_id: store.events([run_id])  # noqa: E731
    tables = leave_one_out_tables(m, events_of, 1, meta) if len(m) else []
    cross = cross_config_errors([t for _, _, t in tables])
    figures["cross_config_errors"] = [list(c) for c in cross]
    ok, verdict = cross_config_verdict(cross)
    bubbles_ok = bool(len(m)) and bool((m["bubble_ratio"] < BUBBLE_P1).all())
    detail = (
        f"P=1 on one GPU, {len(m)} configs: " + "; ".join(rows) + f"; {verdict}; bubble under "
        f"{BUBBLE_P1} in {int((m['bubble_ratio'] < BUBBLE_P1).sum())} of {len(m)}"
    )
    return ok and bubbles_ok, detail, figures


def cross_config_errors(tables: list[Any]) -> list[tuple[str, str, float]]:
    """(calibrated on, predicted, error) for every pair of two different configs of the
    leave-one-out tables (:func:`vpipe.predict.leave_one_out.leave_one_out`); the diagonal (a
    config predicted from its own calibration) is left out."""
    out = []
    for t in tables:
        for row in t.to_dict("records"):
            source = row.pop("calibrated on")
            out += [(source, target, float(e)) for target, e in row.items() if target != source]
    return out


def cross_config_verdict(cross: list[tuple[str, str, float]]) -> tuple[bool, str]:
    """Whether every out-of-sample prediction is within :data:`SIM_GOAL` of its timed median
    (none, or a missing one, fails); and the worst in words."""
    if not cross:
        return False, "no prediction of a config its calibration did not see (under two configs)"
    worst = max(cross, key=lambda c: abs(c[2]) if c[2] == c[2] else float("inf"))
    ok = all(abs(e) <= SIM_GOAL for _, _, e in cross)  # NaN compares False: a failure
    return ok, (f"out-of-sample prediction error worst {worst[2]:+.1%} ({worst[1]} from "
                f"{worst[0]}'s calibration; goal {SIM_GOAL:.0%}, {len(cross)} pairs)")  # fmt: skip


def a_a(first: Path, second: Path, report: Path) -> tuple[Any, str, dict[str, Any]]:
    """(ok, detail, figures): the P=1 sweep again, compared with the first by vpipe report."""
    rc, printed = _bench(second, "-p", "1", "--impl", "vpipe", "--schedules", P1_SCHEDULES)
    if rc != 0:
        return False, f"second launch exited {rc}: {_tail(printed)}", {}
    argv = [sys.executable, "-m", "vpipe", "report", str(first), str(second), "-o", str(report)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    md = report.with_suffix(".md")
    if r.returncode != 0 or not md.exists():
        return False, f"vpipe report exited {r.returncode}: {_tail(r.stdout + r.stderr)}", {}
    text = md.read_text()
    verdicts = markdown_verdicts(text)
    headline = r.stdout.strip().splitlines()[0] if r.stdout.strip() else ""
    ok, words = a_a_verdict(verdicts)
    return ok, f"vpipe report A B: {headline}; {words}", {"report_md": text}


def markdown_verdicts(text: str) -> list[str]:
    """The ``verdict`` column of every Markdown table in ``text`` that has one."""
    out: list[str] = []
    col = None
    for line in text.splitlines():
        if not line.startswith("|"):
            col = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if col is None:
            col = cells.index("verdict") if "verdict" in cells else -1
        elif col >= 0 and not set(line) <= set("|-") and col < len(cells):
            out.append(cells[col])
    return out


def a_a_verdict(verdicts: list[str]) -> tuple[bool, str]:
    """An A/A passes only when every config reads "within noise": "inconclusive", "device
    differed", "too few steps", faster or slower all fail it, as does no verdict at all."""
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v] = counts.get(v, 0) + 1
    ok = bool(verdicts) and set(counts) == {"within noise"}
    shown = ", ".join(f"{n} {v}" for v, n in counts.items()) or "no verdicts"
    return ok, f"{shown} of {len(verdicts)} configs (passes only on all within noise)"


def gloo_two_ranks(out: Path) -> tuple[Any, str, dict[str, Any]]:
    """(ok, detail, figures) of two ranks over gloo on the one GPU."""
    rc, printed = _bench(out, "-p", "2", "--backend", "gloo", "--schedules", "1f1b,zbv")
    if rc != 0:
        return False, f"vpipe bench exited {rc}: {_tail(printed)}", {"printed": printed}
    md = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    return (*gloo_verdict(printed, md), {})


def gloo_verdict(printed: str, report_md: str) -> tuple[bool, str]:
    """Whether a gloo sweep on one GPU left the torch baseline out in one line and its report
    names the regime; and both in words."""
    left_out = [line for line in printed.splitlines() if line.startswith("torch baseline left")]
    regime = next(
        (line for line in report_md.splitlines() if line.startswith(("Overhead", "Compute"))), ""
    )
    ok = len(left_out) == 1 and bool(regime)
    return ok, f"{regime or 'no regime line'}; {left_out[0] if left_out else 'torch not left out'}"


def session_outcomes(
    out: Path, say: Callable[[str], None], started: float
) -> list[tuple[str, Any, str, dict[str, Any]]]:
    """The three sweeps' (name, ok or None when skipped, detail, figures), in order, within
    the budget."""
    out.mkdir(parents=True, exist_ok=True)
    steps = [
        ("quick-sweep", lambda: quick_sweep(out / "sweep-a")),
        ("a-a", lambda: a_a(out / "sweep-a", out / "sweep-b", out / "a-a.html")),
        ("gloo-two-ranks", lambda: gloo_two_ranks(out / "sweep-gloo")),
    ]
    results = []
    for name, run in steps:
        spent = time.perf_counter() - started
        if spent > BUDGET_S:
            results.append((name, None, f"skipped: the session has run {spent:.0f} s", {}))
            continue
        say(f"  running {name} ...")
        results.append((name, *run()))
    return results

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
SIM_GOAL = 0.10  # own-config prediction error
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
            f"{r['schedule']} {r['step_time_s'] * 1e3:.2f} ms (sim {r['sim_error']:+.1%}, bubble "
            f"{r['bubble_ratio']:.3f}, profiled/timed {overhead:.2f}, "
            f"{(r['tokens_per_s'] or 0) / 1e3:.1f}k tokens/s)"
        )
    errors = m["sim_error"].abs()
    ok = bool(len(m)) and bool((errors <= SIM_GOAL).all() and (m["bubble_ratio"] < BUBBLE_P1).all())
    detail = (
        f"P=1 on one GPU, {len(m)} configs: " + "; ".join(rows)
        + f"; own-config prediction error worst {errors.max():.1%} (goal {SIM_GOAL:.0%}), "
        f"bubble under {BUBBLE_P1} in {int((m['bubble_ratio'] < BUBBLE_P1).sum())} of {len(m)}"
    )
    return ok, detail, figures


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
    verdicts = [line for line in text.splitlines() if line.startswith("|")]
    called = [v for v in verdicts if "| faster" in v or "| slower" in v]
    headline = r.stdout.strip().splitlines()[0] if r.stdout.strip() else ""
    return (not called, f"vpipe report A B: {headline}; {len(called)} configs called faster or "
            f"slower", {"report_md": text})  # fmt: skip


def gloo_two_ranks(out: Path) -> tuple[Any, str, dict[str, Any]]:
    """(ok, detail, figures) of two ranks over gloo on the one GPU."""
    rc, printed = _bench(out, "-p", "2", "--backend", "gloo", "--schedules", "1f1b,zbv")
    left_out = [line for line in printed.splitlines() if line.startswith("torch baseline left")]
    if rc != 0:
        return False, f"vpipe bench exited {rc}: {_tail(printed)}", {"printed": printed}
    md = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    regime = next((line for line in md.splitlines() if line.startswith(("Overhead", "Compute"))), "")
    ok = len(left_out) == 1 and bool(regime)
    return ok, f"{regime or 'no regime line'}; {left_out[0] if left_out else 'torch not left out'}", {}


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

"""The cells and headline of a cross-run comparison (``vpipe report A B``) from the sweeps'
timed steps, reference timings and host states, by the rules of :mod:`vpipe.report.crossrun`.

A sweep's steps table may hold ``block`` (independent launches) and ``ref_s`` (the
host-speed reference before each step); its ``host.parquet`` the host's state per round.
Older sweeps have neither: their configs compare raw, as one block, and the comparison says
that normalisation is unavailable.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from vpipe.report.crossrun import (
    LAUNCH_SD,
    MIN_BLOCKS,
    MIN_STEPS,
    RUN_SD,
    Block,
    CrossRatio,
    between_block_sd,
    blocks_to_settle,
    cross_ratio,
    family_confidence,
    launch_spread,
    noise_threshold,
    normalisable,
    rounds_to_settle,
    verdict,
)
from vpipe.stats import CONFIDENCE, OUTLIER_FACTOR, RESAMPLES, SEED
from vpipe.trace.host_state import summarise

DECIDED = ("faster", "slower")
MAX_BLOCKS_HINT = 20  # beyond this many blocks per run, vpipe ab is the cheaper answer
ANSWERS = (*DECIDED, "within noise")


def config_blocks(steps: pd.DataFrame, schedule: str, m: int, impl: str) -> list[Block]:
    """One config's timed steps as blocks (one per launch), each with its reference times
    when every step has one."""
    d = steps[
        (steps["schedule"] == schedule) & (steps["microbatches"] == m) & (steps["impl"] == impl)
    ]
    groups = d.groupby("block", sort=True) if "block" in d.columns else [(0, d)]
    out = []
    for _, g in groups:
        refs = g["ref_s"] if "ref_s" in g.columns else None
        known = refs is not None and refs.notna().all() and bool((refs > 0).all())
        out.append(Block.of(g["step_time_s"].to_numpy(), refs.to_numpy() if known else None))
    return out


def all_blocks(steps: pd.DataFrame | None) -> list[list[Block]]:
    """Every config's blocks of one sweep."""
    if steps is None or steps.empty:
        return []
    keys = steps[["schedule", "microbatches", "impl"]].drop_duplicates().itertuples(index=False)
    return [config_blocks(steps, *k) for k in keys]


@dataclass(frozen=True)
class RunToRun:
    """The launch-to-launch spread a comparison uses (sd in log, beyond each block's sampling
    noise), its degrees of freedom (None: the measured default, taken as known) and where it
    came from."""

    sd: float
    dof: int | None
    source: str


def run_to_run_sd(steps: Sequence[pd.DataFrame | None], normalise: bool) -> RunToRun:
    """The launch-to-launch spread for the comparison: pooled over every config with several
    blocks in any of the sweeps (:func:`vpipe.report.crossrun.launch_spread`), never below
    :data:`LAUNCH_SD` (a spread estimated from a few launches can come out far too small by
    chance), with its degrees of freedom; else the default alone."""
    configs = [c for s in steps for c in all_blocks(s)]
    measured = launch_spread(configs, normalise)
    if measured is None:
        return RunToRun(
            LAUNCH_SD, None, "the default measured by bench.false_alarms (no repeated blocks)"
        )
    sd, dof = measured
    floor = (
        f": under the floor ({LAUNCH_SD:.3f}, measured by bench.false_alarms), so the floor is used"
        if sd < LAUNCH_SD
        else ""
    )
    return RunToRun(
        max(sd, LAUNCH_SD),
        dof,
        f"the sweeps' repeated blocks measured sd {sd:.3f} with {dof} degrees of "
        f"freedom{floor}; Student's t",
    )


def choose_normalisation(steps: Sequence[pd.DataFrame | None], available: bool) -> tuple[bool, str]:
    """Whether to compare normalised figures: when available, unless the sweeps' repeated
    blocks show that normalising widens the run-to-run spread (the reference then tracks the
    host worse than the steps do, as on an oversubscribed host); and why, in words."""
    if not available:
        return False, "raw (normalisation unavailable)"
    configs = [c for s in steps for c in all_blocks(s)]
    norm, raw = between_block_sd(configs, True), between_block_sd(configs, False)
    if norm is not None and raw is not None and raw < norm:
        return False, (
            f"raw: normalising widened the run-to-run spread here (sd {norm:.3f} vs {raw:.3f})"
        )
    return True, "normalised by the host-speed reference"


def host_unknown(
    base: dict[str, Any], run: dict[str, Any], labels: tuple[str, str]
) -> str:
    """Why two sweeps' hosts cannot be judged, in words: a sweep that recorded neither its
    host's state nor a reference timing (older sweeps); empty when both did."""
    lacking = [
        label
        for label, h in zip(labels, (base, run), strict=True)
        if h.get("ref_s") is None or all(h.get(k) is None for k in ("other_cores", "load1"))
    ]
    if not lacking:
        return ""
    return f"no host state recorded for {' and '.join(lacking)}"


def device_summary(host: pd.DataFrame | None) -> dict[str, Any]:
    """A GPU sweep's device state (:func:`vpipe.trace.device_state.summarise`); empty for a
    CPU sweep or one from before vpipe read it."""
    from vpipe.trace.device_state import summarise as summarise_device

    return summarise_device(host.to_dict("records") if host is not None and len(host) else [])


def host_summary(host: pd.DataFrame | None, steps: pd.DataFrame | None) -> dict[str, Any]:
    """A sweep's host state (:func:`vpipe.trace.host_state.summarise`); the reference time from its
    steps when the host table lacks it; every figure None for an older sweep."""
    rows = host.to_dict("records") if host is not None and len(host) else []
    out = summarise(rows)
    if out.get("ref_s") is None and steps is not None and "ref_s" in steps.columns:
        ref = steps["ref_s"].dropna()
        out["ref_s"] = float(ref.median()) if len(ref) else None
    return out


def cross_cells(
    label: str,
    base: list[Block],
    run: list[Block],
    *,
    normalise: bool,
    spread: RunToRun,
    host_differences: Sequence[str],
    rounds: int,
    configs: int = 1,
    host_unknown: str = "",
    ab_hint: str = "vpipe ab A B",
) -> dict[str, Any]:
    """A config's cells: the ratio the verdict uses (normalised when both sides can be) with
    its interval, the raw ratio, the verdict and, for a verdict that is no answer, what would
    give one. ``configs``: how many configs the comparison holds, for
    :func:`vpipe.report.crossrun.family_confidence`. ``host_unknown``: why the hosts cannot be
    judged (a sweep that recorded no host state or reference): then the verdict is never
    faster, slower or within noise. ``ab_hint``: the ``vpipe ab`` command for these runs."""
    use = normalise and normalisable(base) and normalisable(run)
    model = {
        "launch_sd": spread.sd,
        "launch_dof": spread.dof,
        "confidence": family_confidence(configs),
        "run_sd": RUN_SD,
    }
    r = cross_ratio(base, run, normalise=use, **model)
    raw = r if not use else cross_ratio(base, run, normalise=False, **model)
    threshold = noise_threshold(r.noise_sd)
    word = verdict(r, threshold, host_differences)
    if host_unknown and word in ANSWERS:
        word = "inconclusive"
    if word in ANSWERS:
        settle = ""
    elif host_unknown:
        settle = f"{ab_hint} ({host_unknown}: runs made apart cannot be judged)"
    elif word == "host differed":
        settle = f"{ab_hint} (the same stretch of time for both)"
    elif not r.has_interval:
        settle = f"at least {MIN_STEPS} timed steps per config (vpipe bench --rounds N)"
    else:
        settle = _settle(r, threshold, rounds, ab_hint)
    return {
        label: _fmt(r.value),
        "95% CI": r.interval_text(),
        "verdict": word,
        "to settle": settle,
        "raw": _fmt(raw.value),
        "raw CI": raw.interval_text(),
        "figure": "normalised" if r.normalised else "raw",
        "blocks": f"{r.blocks[0]}+{r.blocks[1]}",
        "steps": f"{r.steps[0]}+{r.steps[1]}",
        "outliers (excluded)": r.outliers,
        "_ratio": r,
    }


def _settle(r: CrossRatio, threshold: float, rounds: int, ab_hint: str) -> str:
    """What would settle an inconclusive ratio, whichever times fewer steps: more rounds per
    block, or more blocks per run; or ``vpipe ab`` when the runs' own drift alone is too wide."""
    n = rounds_to_settle(r, threshold, rounds)
    k = blocks_to_settle(r, threshold)
    blocks_now = max(r.blocks)
    if n is not None and (k is None or n * blocks_now <= rounds * k):
        return f"~{n} rounds per block (vpipe bench --rounds {n}, both runs)"
    if k is not None and k <= MAX_BLOCKS_HINT:
        return f"{k} blocks per run (vpipe bench --blocks {k}, both runs)"
    if k is not None:
        return f"{ab_hint} (it would take {k} blocks per run)"
    return f"{ab_hint} (the runs' own drift alone is +-{math.expm1(r.drift):.0%})"


def _fmt(v: float) -> str:
    return "" if math.isnan(v) else f"{v:.2f}"


def headline(table: pd.DataFrame, base_label: str, label: str) -> str:
    """The comparison's first line: the winner with its interval when the decided verdicts
    agree, else "no winner at this noise" with what the configs said instead."""
    decided = table[table["verdict"].isin(DECIDED)]
    n = len(table)
    directions = set(decided["verdict"])
    if len(directions) == 1:
        slower = directions == {"slower"}
        figures = "; ".join(
            f"{r['schedule']} M={r['M']} {r['impl']}: {r[label]}x ({r['95% CI']})"
            for r in decided.head(3).to_dict("records")
        )
        runs = ", ".join(sorted(set(decided["run"])))
        who, than = (base_label, runs) if slower else (runs, base_label)
        faster = f"faster than {than} in {len(decided)} of {n} configs (base/run, 95% CI: {figures})"
        if len(decided) == n:
            return f"winner: {who}, {faster}"
        rest = _counts(table[~table["verdict"].isin(DECIDED)])
        return f"no winner over all configs: {who} {faster}; {rest}{_to_settle(table)}"
    mixed = " (faster in some configs, slower in others)" if len(directions) > 1 else ""
    return f"no winner at this noise{mixed}: {_counts(table)} of {n} configs{_to_settle(table)}"


def _counts(table: pd.DataFrame) -> str:
    return ", ".join(f"{int(c)} {v}" for v, c in table["verdict"].value_counts().items())


def _to_settle(table: pd.DataFrame) -> str:
    """What would settle the configs without an answer; each way named with its configs
    when they differ ("~12 pairs (...) for zbv M=4 vpipe")."""
    ways: dict[str, list[str]] = {}
    for r in table.to_dict("records"):
        s = r.get("to settle", "")
        if s:  # vpipe ab once, whatever each config's reason
            way = s.split(" (", 1)[0] if s.startswith("vpipe ab") else s
            ways.setdefault(way, []).append(f"{r['schedule']} M={r['M']} {r['impl']}")
    if len(ways) > 1:
        return "; to settle: " + ", ".join(f"{w} for {' and '.join(c)}" for w, c in sorted(ways.items()))
    return f"; to settle: {next(iter(ways))}" if ways else ""


def comparison_note(
    differs: str, notes: Iterable[str], why: str, spread: RunToRun, bare: Sequence[str]
) -> str:
    """What a cross-run comparison table's figures and verdicts mean: ``differs``, what of the
    setups differs (empty: a speedup); ``notes``, why normalisation is unavailable; ``why``,
    the figure compared; ``spread``, the launch spread used; ``bare``, the sweeps with a runs
    table only."""
    words = [f"Not a speedup ({differs}): the ratio measures the setup as much as the code."] if differs else []
    words.extend(f"Note: {n}." for n in sorted(notes))
    words.append(f"Figure compared: {why}.")
    words.append(
        "ratio = base figure / the run's (> 1: the run is faster); the figure is a block's "
        "median step time over its median reference time (normalised; raw when a sweep has no "
        f"reference timings, and on GPUs), averaged in log over blocks. {CONFIDENCE:.0%} "
        "interval, simultaneous over a run's n configs (each at 1 - 5%/n, Bonferroni): a "
        f"hierarchical bootstrap (blocks, then steps; {RESAMPLES} resamples, seed {SEED}) when "
        f"both sweeps have {MIN_BLOCKS}+ blocks, else estimate +- t x sd, where each block "
        "adds its steps' sampling variance (bootstrap, never below what their spread gives a "
        f"median of that many) and the launch-to-launch variance, sd {spread.sd:.3f} in log "
        f"({spread.source}), and each run the drift of a whole run that its back-to-back "
        f"blocks cannot show (sd {RUN_SD}, measured by bench.false_alarms). Verdict: "
        "faster/slower only when the interval excludes 1, the ratio is beyond the config's "
        "A/A noise band (1.96 x sqrt 2 x the sd of one launch's figure, at least "
        f"{noise_threshold(0.0):.0%}) and both hosts were judged alike; \"host differed\" "
        "(\"device differed\" on GPUs) when their states differed (see Host); \"within "
        "noise\" when the ratio is inside the band and the interval inside twice the band; "
        "else \"inconclusive\". A sweep that recorded no host state or reference gets no "
        "answer at all. Every verdict that is no answer says in \"to settle\" what would give "
        "one: more rounds per block, more blocks per run, or vpipe ab (both versions in the "
        f"same stretch of time). raw: the ratio of medians without normalisation. Steps over "
        f"{OUTLIER_FACTOR:g}x their block's median are outliers, counted and excluded."
    )
    if bare:
        words.append(
            f"{', '.join(bare)}: runs table only (no steps.parquet), so the ratio of its "
            "configs is of the runs tables' medians, without interval or verdict."
        )
    return " ".join(words)

"""The table and report of a ``vpipe ab`` session, from what its two sides reported: their
ready messages (configs, reference shape) and each launch's block message (timed steps,
reference times, host rounds) in the order the launches ran (:mod:`vpipe.sweep.paced`). The
statistics are :mod:`vpipe.report.pairs`'.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from vpipe.report.crossrun import Block, CrossRatio
from vpipe.report.crossrun_table import headline
from vpipe.report.document import render_html, render_markdown, table_section, text_section
from vpipe.report.looks import levels
from vpipe.report.pairs import (
    LAUNCHED_LAUNCH_SD,
    PAIR_LAUNCH_SD,
    Figure,
    Pair,
    Spread,
    busiest,
    differences,
    fit_figure,
    make_pair,
    overall_ratio,
    pair_verdict,
    paired_ratio,
    session_spread,
    settle_text,
)

SETTLED = ("faster", "slower", "within noise")
OVERALL = "all configs"  # the schedule column of the row over all configs (geometric mean)
Launch = tuple[str, Mapping[str, Any]]  # (side, block message)
Config = tuple[str, int, str]


def shared_configs(ready: Mapping[str, Mapping[str, Any]]) -> list[Config]:
    """The configs both sides run, in A's order."""
    b = {tuple(c) for c in ready["B"]["configs"]}
    return [(s, int(m), i) for s, m, i in ready["A"]["configs"] if (s, m, i) in b]


def _block(message: Mapping[str, Any], index: int) -> Block:
    refs = message.get("refs")
    row = refs[index] if refs else None
    known = row is not None and all(x is not None and x > 0 for x in row)
    return Block.of(message["steps"][index], row if known else None)


def session_pairs(
    ready: Mapping[str, Mapping[str, Any]], launches: Sequence[Launch]
) -> dict[Config, list[Pair]]:
    """Each shared config's pairs: launches 2i and 2i+1, A's block and B's, judged on their
    hosts (an unfinished last pair is left out); paired round by round where both launches
    were gated (:mod:`vpipe.sweep.gate`) with the same steps per round."""
    index = {k: {tuple(c): i for i, c in enumerate(r["configs"])} for k, r in ready.items()}
    out: dict[Config, list[Pair]] = {c: [] for c in shared_configs(ready)}
    for i in range(0, len(launches) - 1, 2):
        by_side = dict(launches[i : i + 2])
        a, b = by_side["A"], by_side["B"]
        host_a, host_b = busiest(a.get("host", [])), busiest(b.get("host", []))
        gated = a.get("gated") and b.get("gated") and a["gated"]["steps"] == b["gated"]["steps"]
        for c in out:
            out[c].append(
                make_pair(_block(a, index["A"][c]), _block(b, index["B"][c]), host_a, host_b,
                          a["gated"]["steps"] if gated else 0)  # fmt: skip
            )
    return out


def session_figure(
    ready: Mapping[str, Mapping[str, Any]], pairs: Mapping[Config, list[Pair]]
) -> tuple[Figure, Spread]:
    """The figure a session compares (:func:`vpipe.report.pairs.fit_figure`, the sides'
    reference shapes compared) and the spread its intervals use, from the kept pairs."""
    same = ready["A"].get("reference") == ready["B"].get("reference")
    figure = fit_figure(same, list(pairs.values()))
    kept = ([p for p in ps if not p.host_differences] for ps in pairs.values())
    launched = any(r.get("launched") for r in ready.values())  # vpipe.sweep.launched
    spread = session_spread(
        (differences(ps, figure.weight) for ps in kept if ps), figure.fitted,
        LAUNCHED_LAUNCH_SD if launched else PAIR_LAUNCH_SD,
    )  # fmt: skip
    return figure, spread


def session_table(
    ready: Mapping[str, Mapping[str, Any]],
    launches: Sequence[Launch],
    *,
    alpha: float,
    labels: Mapping[str, str],
    delay_b: str = "",
) -> tuple[pd.DataFrame, Spread, str]:
    """One row per shared config: A's and B's median step, A/B with its interval (> 1: B is
    faster), the verdict and what would settle it, the pairs used and left out; with several
    configs a last row over all of them (:data:`OVERALL`: the geometric mean of their ratios,
    :func:`vpipe.report.pairs.overall_ratio`); with the spread the configs' intervals used and
    the figure compared, in words. ``alpha``: the error rate this look spends over all its
    verdicts (:func:`vpipe.report.looks.look_alpha`, split by
    :func:`vpipe.report.looks.levels`); ``delay_b``: the delay injected into B alone, in words
    (e.g. "7 ms"), if any."""
    pairs = session_pairs(ready, launches)
    figure, spread = session_figure(ready, pairs)
    kept = {c: [p for p in ps if not p.host_differences] for c, ps in pairs.items()}
    overall_level, level = levels(alpha, len(pairs))

    def row(config: Config, r: CrossRatio, used: Sequence[Pair], left_out: int) -> dict[str, Any]:
        word = pair_verdict(r)
        schedule, m, impl = config
        return {
            "schedule": schedule,
            "M": m,
            "impl": impl,
            "run": labels["B"],
            "A ms": _ms([p.a for p in used]),
            "B ms": _ms([p.b for p in used]),
            "speedup": "" if math.isnan(r.value) else f"{r.value:.3f}",
            "95% CI": r.interval_text(3),
            "verdict": word,
            "to settle": settle_text(r, word, left_out),
            "pairs": r.blocks[0],
            "left out": left_out,
            "steps": f"{r.steps[0]}+{r.steps[1]}",
            "outliers (excluded)": r.outliers,
            "injected delay (B)": delay_b,
        }

    rows = []
    for config, ps in pairs.items():
        r = paired_ratio(ps, figure, spread, level)
        rows.append(row(config, r, kept[config], len(ps) - r.blocks[0]))
    if len(pairs) > 1:
        r = overall_ratio(list(pairs.values()), figure, spread, overall_level)
        left_out = len(next(iter(pairs.values()))) - r.blocks[0]
        rows.append(row((OVERALL, "", ""), r, [], left_out))
    return pd.DataFrame(rows), spread, figure.why


def settled(table: pd.DataFrame) -> bool:
    """Whether the session has its answer: B faster or slower over all configs, or every
    config's verdict an answer (faster, slower or within noise). "Within noise" over all does
    not end a session alone: configs that moved apart can average to nothing."""
    overall = table[table["schedule"] == OVERALL]
    if len(overall) and overall["verdict"].isin(("faster", "slower")).all():
        return True
    configs = table[table["schedule"] != OVERALL]
    return bool(len(configs)) and bool(configs["verdict"].isin(SETTLED).all())


def ab_headline(table: pd.DataFrame, label_a: str) -> str:
    """The session's first line: its verdict over all configs when it has one (with the
    configs' verdicts in brief), else what the configs said
    (:func:`vpipe.report.crossrun_table.headline`)."""
    configs = table[table["schedule"] != OVERALL]
    overall = table[table["schedule"] == OVERALL].to_dict("records")
    line = headline(configs, label_a, "speedup")
    if not overall or overall[0]["verdict"] not in SETTLED:
        if overall and overall[0]["speedup"]:
            o = overall[0]
            line += (f"; over all {len(configs)} configs {o['speedup']}x ({o['95% CI']}), "
                     f"{o['verdict']}" + (f": {o['to settle']}" if o["to settle"] else ""))  # fmt: skip
        return line
    o = overall[0]
    counts = ", ".join(f"{int(c)} {v}" for v, c in configs["verdict"].value_counts().items())
    figure = f"{o['speedup']}x ({o['95% CI']}), the geometric mean of the configs' A/B"
    if o["verdict"] == "within noise":
        return f"no difference beyond noise over all {len(configs)} configs: {figure}; per config: {counts}"
    who, than = (label_a, o["run"]) if o["verdict"] == "slower" else (o["run"], label_a)
    return f"winner: {who}, faster than {than} over all {len(configs)} configs: {figure}; per config: {counts}"


def _ms(blocks: Sequence[Block]) -> str:
    if not blocks:
        return ""
    return f"{np.median(np.concatenate([b.steps for b in blocks])) * 1e3:.2f}"


def left_out_table(
    ready: Mapping[str, Mapping[str, Any]], launches: Sequence[Launch]
) -> pd.DataFrame:
    """The pairs left out and why (the same for every config: they are judged per launch)."""
    first = next(iter(session_pairs(ready, launches).values()), [])
    return pd.DataFrame(
        [{"pair": i + 1, "hosts differed": "; ".join(p.host_differences)}
         for i, p in enumerate(first) if p.host_differences]  # fmt: skip
    )


def launch_table(launches: Sequence[Launch]) -> pd.DataFrame:
    """Each launch in the order it ran: side, wall time, its busiest round's host state."""
    rows = []
    for i, (side, m) in enumerate(launches):
        h = busiest(m.get("host", []))
        rows.append(
            {
                "launch": i + 1,
                "side": side,
                "wall s": f"{m.get('wall_s', float('nan')):.1f}",
                "other cores (max)": _num(h["other_cores"]),
                "cores left (min)": _num(h["free_cores"]),
                "steal (max)": _num(h["steal"], "{:.1%}"),
            }
        )
    return pd.DataFrame(rows)


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    return "" if v is None else fmt.format(v)


def ab_report(
    ready: Mapping[str, Mapping[str, Any]],
    launches: Sequence[Launch],
    *,
    alpha: float,
    labels: Mapping[str, str],
    stopped: str,
    delay_b: str = "",
) -> tuple[str, str, pd.DataFrame]:
    """HTML and Markdown of a session, headed by its one-line verdict, and its table."""
    table, spread, why = session_table(
        ready, launches, alpha=alpha, labels=labels, delay_b=delay_b
    )
    shown = table.drop(columns="run")
    configs = int((table["schedule"] != OVERALL).sum()) if len(table) else 0
    overall_level, config_level = levels(alpha, configs)
    line = ab_headline(table, labels["A"]) if len(table) else "no shared config"
    versions = [f"A = {labels['A']}", f"B = {labels['B']}"]
    delay = f" B alone was slowed by {delay_b} per step (an injected delay)." if delay_b else ""
    note = (
        f"speedup = A's figure / B's (> 1: B is faster), the inverse-variance weighted mean "
        f"over the pairs of adjacent launches (A B B A ...) of log(A/B); figure: {why}. "
        f"Interval: each pair's variance is its two launches' sampling variance (bootstrap of "
        f"their steps) plus the launches' spread, {spread.source}; {config_level:.4f} per config"
        + (f" and {overall_level:.4f} over all configs" if configs > 1 else "")
        + f" ({alpha:.4f} of the session's 5% spent at this look"
        + (f", half of it over all configs, the rest shared by the {configs} configs"
           if configs > 1 else "")
        + "; half of the 5% is kept for the last look, the rest shared by the looks before "
        f"it), "
        f"{'the normal quantile' if spread.dof is None else f'Student t, {spread.dof} dof'}. "
        "Verdict as in vpipe report: faster/slower when the interval excludes 1 and the ratio "
        "is beyond the A/A noise band of one launch; within noise when the interval lies "
        "inside twice that band (at most +-10%); else inconclusive, with the pairs that "
        f"would settle it. {OVERALL}: the geometric mean of the configs' A/B, from each "
        "pair's mean over the configs of log(A/B) with the configs' spread (the session stops once "
        "it is faster or slower, or once every config is settled). "
        "Pairs whose launches saw different hosts (a CPU hog that came or "
        f"went) are left out and counted.{delay}"
    )
    sections = [
        text_section("Verdict", [line, f"Session: {stopped}."]),
        text_section("Versions", versions),
        table_section("Paired comparison", shown, note),
    ]
    left = left_out_table(ready, launches)
    if len(left):
        sections.append(table_section("Pairs left out", left))
    sections.append(table_section("Launches", launch_table(launches)))
    title = "vpipe ab"
    return render_html(title, sections), render_markdown(title, sections), table

"""A sweep's verdict: per (microbatches, implementation), the schedule to run, or the schedules
it cannot tell apart, why, and which of them the tie rule picks.

In each group the leader is the schedule with the lowest median step time. Every other one is
set against it by the within-run paired ratio (its steps over the leader's, paired by round and
step index, measured back to back, with a bootstrap interval:
:func:`vpipe.report.document.paired_configs`) and is

- **slower** when the interval lies above 1 and not inside the tie band;
- **tied** when the interval lies inside the tie band (:data:`TIE_BAND`: within 2% either way,
  the least difference vpipe ever calls a speedup): whichever runs, the step is the same;
- **open** otherwise (the interval holds 1 but is wider than the band, or too few pairs):
  more rounds could still order them.

``vpipe bench`` keeps adding rounds to the configs of groups with open contenders (their
leader and the open ones: :func:`open_configs`) until none is open or its time budget runs
out. The verdict names the leader when every other schedule is slower; otherwise the leader,
the tied and the open ones are a tie, which :func:`vpipe.schedules.ties.break_tie` breaks
(less memory, then the simpler schedule), and the line says why they could not be told apart.
Each group is checked after every round, so the chance that a pair is called slower by noise
alone is somewhat above the 5% of one fixed-size interval.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import pandas as pd

from vpipe.report.crossrun import MIN_EFFECT, paired_rounds_to_settle
from vpipe.report.document import config_times, paired_configs
from vpipe.schedules.ties import Tied, break_tie
from vpipe.stats import Ratio

__all__ = ["TIE_BAND", "Standing", "open_configs", "standing_pick", "standings", "verdict_lines"]

TIE_BAND = MIN_EFFECT  # log half-width: ratios within exp(+-0.02) are the same step


@dataclass
class Standing:
    """One group's order: its leader, and each other schedule's ratio to it and status."""

    microbatches: int
    impl: str
    leader: str
    ratios: dict[str, Ratio] = field(default_factory=dict)  # schedule -> its step / leader's
    status: dict[str, str] = field(default_factory=dict)  # schedule -> slower | tied | open
    rounds: dict[str, int] = field(default_factory=dict)  # schedule -> rounds paired

    @property
    def where(self) -> str:
        return f"M={self.microbatches} {self.impl}"

    @property
    def open(self) -> list[str]:
        return [s for s, v in self.status.items() if v == "open"]

    @property
    def contenders(self) -> list[str]:
        """The leader and every schedule not known to be slower, in order of median."""
        return [self.leader, *(s for s, v in self.status.items() if v != "slower")]


def _status(r: Ratio) -> str:
    if not r.has_interval:
        return "open"
    if -TIE_BAND <= math.log(r.low) and math.log(r.high) <= TIE_BAND:
        return "tied"
    return "slower" if r.low > 1 else "open"


def standings(steps: pd.DataFrame) -> list[Standing]:
    """Every group's :class:`Standing` (groups of one schedule have nothing to order)."""
    out = []
    for (m, impl), d in steps.groupby(["microbatches", "impl"], sort=True, observed=True):
        medians = d.groupby("schedule", observed=True)["step_time_s"].median().sort_values()
        if len(medians) < 2:
            continue
        st = Standing(int(m), str(impl), str(medians.index[0]))
        lead = config_times(d, st.leader, m, impl)
        for s in medians.index[1:]:
            mine = config_times(d, s, m, impl)
            r = paired_configs(mine, lead)
            st.ratios[s], st.status[s] = r, _status(r)
            shared = mine.index.intersection(lead.index)
            st.rounds[s] = shared.get_level_values("round").nunique()
        out.append(st)
    return out


def open_configs(steps: pd.DataFrame) -> set[tuple[str, int, str]]:
    """(schedule, microbatches, impl) of every config that more rounds could still order:
    the open contenders of each group and its leader, whom they are paired with."""
    out = set()
    for st in standings(steps):
        if st.open:
            out |= {(s, st.microbatches, st.impl) for s in (st.leader, *st.open)}
    return out


def verdict_lines(
    steps: pd.DataFrame,
    memory: Mapping[tuple[str, int, str], float] | None = None,
    why_open: str = "",
) -> list[str]:
    """One line per group: "run X" and why. ``memory`` gives each config's peak bytes per
    rank (schedule, M, impl) for the tie rule; ``why_open`` says why open contenders stayed
    open (the time budget ran out, the rounds were fixed)."""
    memory = memory or {}
    lines = []
    for st in standings(steps):
        contenders = st.contenders
        if len(contenders) == 1:
            runner = next(iter(st.ratios))  # the second lowest median, as tables order them
            r = st.ratios[runner]
            lines.append(
                f"{st.where}: run {st.leader}: {r.value:.2f}x faster than {runner}, the next "
                f"fastest by median step time (paired ratio, 95% CI {r.interval_text()}); "
                "every other schedule is slower"
            )
            continue
        tied = [Tied(s, memory.get((s, st.microbatches, st.impl))) for s in contenders]
        pick = standing_pick(st, memory)
        parts = [f"{s} {st.ratios[s].value:.2f}x ({_interval(st.ratios[s])})"
                 for s in contenders[1:]]  # fmt: skip
        lines.append(
            f"{st.where}: run {pick}: a tie of {', '.join(contenders)}, step time against "
            f"{st.leader}'s (the lowest median): {', '.join(parts)}; {_why(st, why_open)}; "
            f"picked by the tie rule: less memory{_memories(tied)}, then the simpler schedule"
        )
    return lines or ["one schedule per group: nothing to rank"]


def standing_pick(st: Standing, memory: Mapping[tuple[str, int, str], float] | None = None) -> str:
    """The schedule a group's verdict says to run: its leader when every other is slower,
    else the one the tie rule picks from its contenders (``memory``: as for
    :func:`verdict_lines`)."""
    memory = memory or {}
    contenders = st.contenders
    return contenders[break_tie([Tied(s, memory.get((s, st.microbatches, st.impl)))
                                 for s in contenders])]  # fmt: skip


def _interval(r: Ratio) -> str:
    return f"95% CI {r.interval_text()}" if r.has_interval else "too few pairs"


def _why(st: Standing, why_open: str) -> str:
    if not st.open:
        return f"each within {math.exp(TIE_BAND) - 1:.0%} of it"
    worst = max(st.open, key=lambda s: _settle(st, s) or math.inf)
    n = _settle(st, worst)
    more = f"; about {n} rounds in all would settle {worst}" if n else ""
    told = f" {why_open}" if why_open else ""
    return f"{' and '.join(st.open)} not told apart from {st.leader}{told}{more}"


def _settle(st: Standing, s: str) -> int | None:
    r = st.ratios[s]
    return paired_rounds_to_settle(r.value, r.low, r.high, st.rounds[s], TIE_BAND)


def _memories(tied: list[Tied]) -> str:
    known = [t for t in tied if t.memory is not None and t.memory == t.memory]
    if not known:
        return ""
    return " (" + ", ".join(f"{t.schedule} {t.memory / 2**20:.2f} MiB" for t in known) + ")"

"""Paired comparisons of two versions launched alternately (``vpipe ab``): the ratio of each
config's figure with an interval from the pairs, and the verdict of :mod:`vpipe.report.crossrun`.

A session launches the two versions in the order A B B A A B ..., each launch one block of
the same sweep (:mod:`vpipe.sweep.ab`). Launch 2i and 2i+1 form pair i. Gated sides (the
default: :mod:`vpipe.sweep.gate`) have both of a pair's launches open at once and alternate
their timed rounds A B B A ..., so A's round j and B's ran a fraction of a second apart and
whatever the host did then hit both; older sides run the pair's launches one after the other,
seconds apart, and only the host's slower drift moves both. Either way the order alternates
so that a steady drift favours neither side.

- **Pair**: its difference d = log(A's figure) - log(B's figure) per config, a figure being
  log(a launch's median step time) - w x log(its median reference time), w the reference's
  weight fitted to the session's pairs (:func:`fit_figure`: 0 raw, 1 normalised; 0 where the
  versions timed different references or none). Its sampling variance v is the two
  launches' (:func:`vpipe.report.crossrun.block_variances`). A gated pair's d is instead the
  median of its rounds' differences, round j of A against round j of B, and v that of such a
  median (:func:`gated_differences`): what the host did over seconds is no longer in it.
- **Left out**: a pair whose two launches saw different hosts (other processes' CPU, the cores
  left to the sweep, steal or MHz beyond :data:`vpipe.trace.host_state.LIMITS`, judged on each
  launch's busiest round): a CPU hog that started between them, or in one of them. Counted.
  Never a gated pair: its launches ran in the same stretch of time (:func:`make_pair`).
- **Interval** (:func:`paired_ratio`): a random-effects model: d_i = delta + launch effects +
  sampling noise, with variance v_i + tau^2, tau^2 the pairs' spread beyond their sampling
  noise (:func:`pair_spread`, pooled over configs, never below two launches'
  :data:`PAIR_LAUNCH_SD`, nor for a pair under a hog below its :func:`launch_floor`). delta
  is the inverse-variance weighted mean (a noisy pair, such as one under a hog, counts less)
  and its interval delta +- q x its sd (with the fitted weight's error): q the normal
  quantile while floors give every pair's tau^2, Student's t for the pooled degrees of
  freedom (less one for a fitted weight) when the measured spread counts. The host's slow
  drift is what the pairs cancel, so no run drift is added (it is in
  :mod:`vpipe.report.crossrun` for runs made apart).
- **Confidence**: simultaneous over the configs and over the session's looks at its verdicts
  (:mod:`vpipe.report.looks`).
- **Over all configs** (:func:`overall_ratio`): the geometric mean of the configs' ratios,
  from each pair's mean over the configs of d (its variance the configs' summed over configs
  squared) and the configs' spread beyond sampling noise. A change that slows every config shows
  there first: the mean cancels much of each config's noise.
- **Verdict**: :func:`vpipe.report.crossrun.verdict`, with the A/A noise band of one launch;
  "inconclusive" says how many pairs would settle it (:func:`pairs_to_settle`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vpipe.report.crossrun import (
    LAUNCH_SD,
    Block,
    CrossRatio,
    _within_noise_band,
    block_variances,
    noise_threshold,
    t_quantile,
    verdict,
)
from vpipe.trace.host_state import LIMITS, judge_hosts

MIN_PAIRS = 2  # A B B A: the first look at the verdicts
# The floor of a launch's effect beyond its steps' sampling noise, per side of a pair:
# adjacent launches showed none (python -m bench.false_alarms --ab: 0.000 pooled over 30, 66
# and 42 degrees of freedom in three runs on this 2-core host, quiet to loaded), blocks
# launched back to back 0.024 (bench.false_alarms, 160 dof); the floor keeps that margin
PAIR_LAUNCH_SD = 0.02
# The floor per side for a pair whose host other processes loaded (a CPU hog in both its
# launches): how much of the cores a launch gets beside the hog varies from launch to launch,
# beyond its steps' own noise. Measured over the loaded pairs of python -m bench.false_alarms
# --ab, 2026-12-06: 0.052 per pair (92 dof) and 0.103 (18 dof), 0.063 pooled, against 0.000
# for the quiet pairs of the same sessions; with the quiet floor alone, 20 A/A sessions under
# a hog spread 1.45 standard errors (2 false verdicts over all configs, both in sessions that
# were under the hog almost from their start)
LOADED_LAUNCH_SD = 0.045
# The same for a gated pair: its launches ran beside the hog at once, their rounds alternating,
# so what the hog takes from them differs far less. python -m bench.gated_spread --sessions 8
# --pairs 6, 2026-12-06 (a quiet hour, the hog pinned to a core throughout): loaded gated pairs
# 0.040 per pair (72 dof, 95% upper bound 0.052), quiet gated pairs 0.029 (72 dof); with the
# in-turn floor, A/A sessions under the hog throughout sat 0.62 of their standard errors from
# 1 (sd over 6; 1 expected)
GATED_LOADED_LAUNCH_SD = 0.03
# The floor per side for a session of whole launches (vpipe.sweep.launched: a version without
# paced sides): its pair's launches are whole commands a command apart, as a sweep's blocks
# launched back to back, whose floor vpipe report takes (LAUNCH_SD: 0.024 measured by
# bench.false_alarms, 160 dof)
LAUNCHED_LAUNCH_SD = LAUNCH_SD
PAIR_LIMITS = {**LIMITS, "ref_ratio": math.inf}  # the reference's moves are what normalising undoes


def session_order(launches: int) -> list[str]:
    """The sides of a session's first ``launches`` launches: A B B A A B B A ..."""
    return [("A", "B")[(i + 1) // 2 % 2] for i in range(launches)]


def busiest(rounds: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """A launch's host state for the pair check: its busiest round's other processes' CPU,
    cores left and steal, and its median MHz (None where not recorded)."""
    rows = list(rounds)

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in rows if r.get(key) is not None and r[key] == r[key]]

    other, free, steal, mhz = (values(k) for k in ("other_cores", "free_cores", "steal", "mhz"))
    return {
        "other_cores": max(other) if other else None,
        "free_cores": min(free) if free else None,
        "steal": max(steal) if steal else None,
        "mhz": float(np.median(mhz)) if mhz else None,
    }


def loaded(hosts: Iterable[Mapping[str, Any]]) -> bool:
    """Whether other processes kept :data:`LIMITS`' other_cores (half a core) busy in any of
    the given launches' busiest rounds (:func:`busiest`)."""
    other = [h.get("other_cores") for h in hosts]
    return any(x is not None and x >= LIMITS["other_cores"] for x in other)


@dataclass(frozen=True)
class Pair:
    """One config's two launches of a pair: A's block and B's, what differed between the
    hosts they saw (empty: nothing), and whether other processes loaded the host in either
    (:func:`make_pair`)."""

    a: Block
    b: Block
    host_differences: tuple[str, ...] = ()
    loaded: bool = False
    # gated (both launches open at once, their rounds alternating: vpipe.sweep.gate): the
    # steps per round, which pairs the two blocks round by round; 0: launched one after the other
    steps_per_round: int = 0


def make_pair(
    a: Block, b: Block, host_a: Mapping[str, Any], host_b: Mapping[str, Any],
    steps_per_round: int = 0,
) -> Pair:  # fmt: skip
    """A pair of blocks with the host judgement of its launches (:data:`PAIR_LIMITS`), and
    whether either was :func:`loaded`. A gated pair (``steps_per_round``) is never left out: its launches'
    rounds alternated, so both saw the same stretch of host, and a difference between their
    busiest rounds is one of moments that the round by round comparison pairs anyway (CPU
    steal comes in bursts: gated pairs' busiest rounds differed by 8-28 points of steal, which
    left 3 of 5 out of a session, bench.false_alarms --ab, 2026-12-06)."""
    differed = () if steps_per_round else tuple(judge_hosts(host_a, host_b, PAIR_LIMITS))
    return Pair(a, b, differed, loaded((host_a, host_b)), steps_per_round)


def differences(pairs: Sequence[Pair], ref_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's log(A/B) of the figures (:meth:`vpipe.report.crossrun.Block.log_figure`
    with ``ref_weight``) and its sampling variance; for gated pairs, the round by round
    figure of :func:`gated_differences`."""
    if not pairs:
        return np.zeros(0), np.zeros(0)
    if all(p.steps_per_round for p in pairs):
        return gated_differences(pairs, ref_weight)
    a = [p.a.cleaned()[0] for p in pairs]
    b = [p.b.cleaned()[0] for p in pairs]
    d = np.array([x.log_figure(ref_weight) - y.log_figure(ref_weight) for x, y in zip(a, b, strict=True)])
    return d, block_variances(a, ref_weight) + block_variances(b, ref_weight)


def round_differences(pair: Pair, ref_weight: float) -> np.ndarray:
    """A gated pair's log(A/B) round by round: each round's log median step (less
    ``ref_weight`` x its log median reference), A's round j against B's, which ran next to it."""
    k = pair.steps_per_round

    def per_round(block: Block) -> np.ndarray:
        n = block.steps.size // k
        figure = np.median(np.log(block.steps[: n * k]).reshape(n, k), axis=1)
        if ref_weight and block.refs is not None:
            figure -= ref_weight * np.median(np.log(block.refs[: n * k]).reshape(n, k), axis=1)
        return figure

    a, b = per_round(pair.a), per_round(pair.b)
    m = min(a.size, b.size)
    return a[:m] - b[:m]


def gated_differences(pairs: Sequence[Pair], ref_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """Gated pairs' log(A/B), each the median of its rounds' (:func:`round_differences`:
    whatever the host did over a round's fraction of a second hit both versions), and its
    sampling variance, that of a median of that many: (1.2533 x sd)^2 / rounds, sd the
    rounds' robust spread about their pair's median, pooled over the pairs given (a config's)
    and apart for loaded ones (a hog spreads the rounds more); a pair of one round each takes
    the loaded or quiet pool's, and without any pool the pair itself is its own."""
    rounds = [round_differences(p, ref_weight) for p in pairs]
    d = np.array([float(np.median(e)) if e.size else math.nan for e in rounds])
    loaded = np.array([p.loaded for p in pairs], dtype=bool)
    spread = {}
    for group in (False, True):
        deviations = [np.abs(e - m) for e, m, g in zip(rounds, d, loaded, strict=True)
                      if g == group and e.size > 1]  # fmt: skip
        if deviations:
            spread[group] = 1.4826 * float(np.median(np.concatenate(deviations)))
    fallback = max(spread.values(), default=math.nan)
    sd = np.array([spread.get(bool(g), fallback) for g in loaded])
    sizes = np.array([max(e.size, 1) for e in rounds])
    return d, (1.2533 * sd) ** 2 / sizes


def log_ratios(pairs: Sequence[Pair]) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's log(A/B) of the median step time and of the median reference time (0 where
    a side has none) over the steps :func:`differences` keeps: a figure's log(A/B) is the
    first less the reference's weight times the second. No sampling variances: cheap."""

    def logs(block: Block) -> tuple[float, float]:
        kept = block.cleaned()[0]
        raw = kept.log_figure(0.0)
        return raw, 0.0 if kept.refs is None else raw - kept.log_figure(1.0)

    rows = np.array([[*logs(p.a), *logs(p.b)] for p in pairs]).reshape(-1, 4)
    return rows[:, 0] - rows[:, 2], rows[:, 1] - rows[:, 3]


# The reference's weight in a pair's figure before it can be fitted (fewer than FIT_PAIRS kept
# pairs in a config): between raw (0) and normalised (1), where the fits of quiet sessions on
# this 2-core host fell (0.30-0.55 over 7-24 pairs, vpipe ab HEAD HEAD, 2026-12-06)
PRIOR_WEIGHT = 0.5
FIT_PAIRS = 3


@dataclass(frozen=True)
class Figure:
    """How a launch's figure is formed: log(median step) - ``weight`` x log(median reference
    time) (0: raw, 1: normalised), the weight fitted to the session's pairs or fixed
    (``fitted``), the variance of the fitted weight, and why, in words."""

    weight: float
    fitted: bool = False
    weight_var: float = 0.0
    why: str = ""


RAW = Figure(0.0, why="raw")


def fit_figure(same_reference: bool, configs: Sequence[Sequence[Pair]]) -> Figure:
    """The figure a session compares (:class:`Figure`): raw where the versions time different
    references or none; else the reference's weight that leaves the pairs' differences the
    least spread, fitted once every config has :data:`FIT_PAIRS` kept pairs (a control
    variate: the slope of the steps' log(A/B) on the references', pooled over the configs,
    each about its own mean, bounded to [0, 1]). The reference is the same work in both versions, so any weight
    leaves the estimate unbiased; the fitted one takes as much of the host's moves out of the
    steps as the reference really follows, and no more of the reference's own noise. Its
    variance is the larger of the classical and the heteroscedasticity-robust (HC1) one, and
    every interval carries it (:func:`paired_ratio`)."""
    every = [p for ps in configs for p in ps]
    if not same_reference:
        return Figure(0.0, why="raw: the versions time different host-speed references")
    if not every or any(p.a.refs is None or p.b.refs is None for p in every):
        return Figure(0.0, why="raw: a side timed no host-speed reference")
    kept = [[p for p in ps if not p.host_differences] for ps in configs]
    prior = Figure(
        PRIOR_WEIGHT,
        why=f"log(step) - {PRIOR_WEIGHT} x log(reference), the reference's weight fixed until "
        f"every config has {FIT_PAIRS} pairs",
    )
    if min(len(ps) for ps in kept) < FIT_PAIRS:
        return prior
    ratios = [log_ratios(ps) for ps in kept]
    yc = np.concatenate([y - y.mean() for y, _ in ratios])
    xc = np.concatenate([x - x.mean() for _, x in ratios])
    sxx = float(xc @ xc)
    dof = xc.size - len(kept) - 1
    if sxx <= 0 or dof < 1:
        return prior
    slope = float(xc @ yc) / sxx
    resid = yc - slope * xc
    classical = float(resid @ resid) / dof / sxx
    robust = float((xc**2 * resid**2).sum()) / sxx**2 * xc.size / dof
    # a weight outside [0, 1] would have the steps follow the host more than fully or against
    # it: the fit is bounded there, which can only bring it nearer a true weight in [0, 1], so
    # its error is never beyond 1 (where the references barely moved, the slope is noise)
    weight = min(max(slope, 0.0), 1.0)
    var = min(max(classical, robust), 1.0)
    return Figure(
        weight, True, var,
        f"log(step) - w x log(reference), w = {weight:.2f} +- {math.sqrt(var):.2f} fitted to "
        f"{xc.size} pairs' differences (0: raw, 1: normalised; the share of the reference's "
        "moves that the steps followed)",
    )  # fmt: skip


def pair_spread(
    configs: Iterable[tuple[np.ndarray, np.ndarray]], fitted: int = 0
) -> tuple[float, int] | None:
    """tau^2, the variance of a pair's difference beyond its sampling noise, pooled over
    configs (each: differences and their sampling variances) by the method of moments: the
    squared deviations from each config's mean less what the sampling variances explain, at
    least 0; with its degrees of freedom (less ``fitted``, the parameters fitted to the same
    differences besides the configs' means). None without a degree of freedom."""
    excess, dof = 0.0, -fitted
    for d, v in configs:
        n = d.size
        if n < 2:
            continue
        excess += float(((d - d.mean()) ** 2).sum()) - (n - 1) / n * float(v.sum())
        dof += n - 1
    return (max(excess, 0.0) / dof, dof) if dof > 0 else None


@dataclass(frozen=True)
class Spread:
    """The pairs' spread beyond sampling noise a session uses: tau^2, its degrees of freedom
    (None: the floor, taken as known) and where it came from, in words."""

    tau2: float
    dof: int | None
    source: str


def session_spread(
    configs: Iterable[tuple[np.ndarray, np.ndarray]], fitted: int = 0,
    launch_sd: float = PAIR_LAUNCH_SD,
) -> Spread:  # fmt: skip
    """tau^2 for a session's intervals: measured from its pairs (:func:`pair_spread`,
    ``fitted`` parameters besides the configs' means fitted to them) when it exceeds the floor
    of two launches' ``launch_sd`` (:data:`PAIR_LAUNCH_SD`; :data:`LAUNCHED_LAUNCH_SD` for
    whole launches), else the floor (with the normal quantile: a spread measured from a few
    pairs can come out far too small by chance)."""
    floor = 2 * launch_sd**2
    measured = pair_spread(configs, fitted)
    if measured is None or measured[0] <= floor:
        seen = "" if measured is None else f"; the pairs showed sd {math.sqrt(measured[0]):.3f}"
        return Spread(floor, None, f"the floor, launch sd {launch_sd} per side{seen}")
    tau2, dof = measured
    return Spread(tau2, dof, f"measured from the pairs, sd {math.sqrt(tau2):.3f}, {dof} dof "
                  f"(above the floor, launch sd {launch_sd} per side)")  # fmt: skip


def paired_ratio(pairs: Sequence[Pair], figure: Figure, spread: Spread, level: float) -> CrossRatio:
    """A/B of a config's figure from its pairs (left-out pairs dropped) with its interval at
    ``level``, as a :class:`vpipe.report.crossrun.CrossRatio` (``blocks``: pairs used per side;
    ``within``/``between``: the half-width's parts from sampling noise and from the launches'
    spread and the fitted weight's error; ``noise_sd``: the sd of one launch's figure)."""
    kept = [p for p in pairs if not p.host_differences]
    d, v = differences(kept, figure.weight)
    floors = np.array([launch_floor(p) for p in kept])
    return _ratio(d, v, log_ratios(kept)[1], floors, _counts([kept]), figure, spread, level)


def overall_differences(
    kept: Sequence[Sequence[Pair]], ref_weight: float
) -> tuple[np.ndarray, np.ndarray]:
    """Each kept pair's mean over the configs of log(A/B) (the log of the geometric mean of
    the configs' ratios) and its sampling variance: the configs' summed over configs squared,
    their steps being different steps. ``kept``: each config's pairs that saw the same host,
    the same pairs in every config (hosts are judged per launch)."""
    parts = [differences(ps, ref_weight) for ps in kept]
    n = len(kept)
    return np.mean([d for d, _ in parts], axis=0), np.sum([v for _, v in parts], axis=0) / n**2


def overall_ratio(
    configs: Sequence[Sequence[Pair]], figure: Figure, spread: Spread, level: float
) -> CrossRatio:
    """A/B over all configs, the geometric mean of their ratios, from the pairs' means over
    the configs (:func:`overall_differences`) with its interval at ``level``. The launches'
    spread is the configs' (``spread``, pooled over them: :func:`session_spread`), not divided
    among them: a launch's effect may hit every config alike, and no mean of the configs
    varies more than they do. (Measured from the means alone it would rest on a few pairs' few
    degrees of freedom, and Student's t would widen the interval more than the mean narrows it.)"""
    kept = [[p for p in ps if not p.host_differences] for ps in configs]
    d, v = overall_differences(kept, figure.weight)
    refs = np.mean([log_ratios(ps)[1] for ps in kept], axis=0)
    floors = np.max([[launch_floor(p) for p in ps] for ps in kept], axis=0)
    return _ratio(d, v, refs, floors, _counts(kept), figure, spread, level)


def launch_floor(pair: Pair) -> float:
    """The least tau^2 a pair takes beyond the session's: two launches'
    :data:`LOADED_LAUNCH_SD` where other processes loaded the host (its launches one after the
    other) or :data:`GATED_LOADED_LAUNCH_SD` (gated), else none."""
    if not pair.loaded:
        return 0.0
    return 2 * (GATED_LOADED_LAUNCH_SD if pair.steps_per_round else LOADED_LAUNCH_SD) ** 2


def _counts(kept: Sequence[Sequence[Pair]]) -> tuple[int, tuple[int, int], int]:
    """Pairs, steps per side and outliers dropped, over the given configs' kept pairs."""
    every = [p for ps in kept for p in ps]
    steps = (sum(p.a.steps.size for p in every), sum(p.b.steps.size for p in every))
    # a gated pair drops no step: the median of its rounds' differences is its figure
    dropped = sum(p.a.cleaned()[1] + p.b.cleaned()[1] for p in every if not p.steps_per_round)
    return (len(kept[0]) if kept else 0), steps, dropped


def _ratio(
    d: np.ndarray, v: np.ndarray, refs: np.ndarray, floors: np.ndarray,
    counts: tuple[int, tuple[int, int], int], figure: Figure, spread: Spread, level: float,
) -> CrossRatio:  # fmt: skip
    """The random-effects estimate of the module's doc from pairs' differences ``d``, their
    sampling variances ``v``, their references' differences ``refs`` and the least tau^2 each
    takes (``floors``, :func:`launch_floor`). A floor is taken as known: Student's t only
    where some pair's tau^2 is the one measured. A fitted weight's error moves the estimate
    by the weighted mean of ``refs`` times that error, so its variance adds that mean squared
    times the weight's variance (an intercept's, in least squares; nothing where the
    references' differences average out)."""
    n, steps, dropped = counts
    nan = float("nan")
    normalised = figure.weight != 0
    if not d.size:
        return CrossRatio(nan, nan, nan, (0, 0), steps, normalised, dropped, nan, nan, False)
    tau2 = np.maximum(floors, spread.tau2)
    w = 1 / (v + tau2)
    estimate = float((w * d).sum() / w.sum())
    from_weight = float((w * refs).sum() / w.sum()) ** 2 * figure.weight_var
    q = t_quantile(spread.dof if bool((floors < spread.tau2).any()) else None, level)
    pooled = 1 / float(w.sum())
    half = q * math.sqrt(pooled + from_weight)
    share = float(v.mean()) / float((v + tau2).mean())  # sampling's part of the variance
    within = q * math.sqrt(pooled * share)
    noise_sd = math.sqrt(float((tau2 + v).mean()) / 2)
    return CrossRatio(
        math.exp(estimate),
        math.exp(estimate - half),
        math.exp(estimate + half),
        (n, n),
        steps,
        normalised,
        dropped,
        within,
        math.sqrt(max(half**2 - within**2, 0.0)),
        False,
        noise_sd,
    )


def pair_verdict(r: CrossRatio) -> str:
    """The verdict of a paired ratio (:func:`vpipe.report.crossrun.verdict`, no host
    judgement: the pairs that saw different hosts are left out)."""
    if not r.has_interval:
        return "inconclusive"
    return verdict(r, noise_threshold(r.noise_sd))


def pairs_to_settle(r: CrossRatio) -> int | None:
    """Pairs that would make an inconclusive interval decide (exclude 1, or fit inside twice
    the noise band), the half-width shrinking as 1/sqrt(pairs); None without an interval."""
    if not r.has_interval or r.blocks[0] < 1:
        return None
    d = abs(math.log(r.value))
    target = max(d, _within_noise_band(noise_threshold(r.noise_sd)) - d)
    half = math.hypot(r.within, r.between)
    return max(r.blocks[0] + 1, math.ceil(r.blocks[0] * (half / target) ** 2))


def settle_text(r: CrossRatio, word: str, left_out: int) -> str:
    """What would settle a verdict that is no answer, in words."""
    if word in ("faster", "slower", "within noise"):
        return ""
    if not r.has_interval:
        why = f"all {left_out} pairs saw different hosts" if left_out else "no pair yet"
        return f"{why}: more pairs on a steadier host (vpipe ab --pairs N)"
    n = pairs_to_settle(r)
    return f"~{n} pairs (vpipe ab --pairs {n})" if n else "more pairs (vpipe ab --pairs N)"

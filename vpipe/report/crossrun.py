"""Cross-run statistics: the ratio of one config's step times between two sweeps, with an
interval that holds when the host changed between them, and the verdict rules.

- **Blocks**: a sweep of ``vpipe bench --blocks K`` holds K independent launches of every
  config; each launch's timed steps of a config are one :class:`Block`. A sweep without the
  column is one block.
- **Normalisation**: every timed step comes with the time of a fixed reference workload
  measured just before it on every rank (:mod:`vpipe.sweep.reference`). A block's figure is
  median(step times) / median(reference times) over the same steps, so a host that is uniformly
  slower (another job, a lower clock) cancels out. Where a sweep has no reference timings (an
  older store) the raw medians are used and the comparison says so.
- **Interval** (:func:`cross_ratio`): a random-effects model in log space. A block's figure
  is the config's true figure plus a launch effect (sd ``launch_sd``: thread placement,
  memory layout, the host in that minute) plus the sampling noise of a median of its steps
  (its variance from a bootstrap of the block's steps, references paired with their steps).
  A side's figure is the mean over its blocks, so the difference's variance is
  ``sum over sides of (launch_sd^2 + mean sampling variance) / blocks``, and the interval is
  the estimate +- t x its sd (Student's t for ``launch_sd``'s degrees of freedom). The launch
  sd is estimated from the sweeps' own repeated blocks (:func:`launch_spread`: their spread
  less what their sampling noise explains), never below :data:`LAUNCH_SD` (measured by
  ``python -m bench.false_alarms``), since few launches can show far too small a spread by
  chance. Keeping the two parts apart matters: a block of many steps is precise, and
  charging it a fixed run-to-run sd measured on noisy short blocks hides real slowdowns.
  With at least :data:`MIN_BLOCKS` blocks per side, a hierarchical percentile bootstrap
  (blocks, then steps) replaces the model.
- **Drift of whole runs** (:data:`RUN_SD`): a run's blocks are launched back to back, so the
  host's state of that quarter of an hour moves them together and their spread cannot show
  it; each side adds it, and no number of rounds or blocks shrinks it.
- **Several configs** (:func:`family_confidence`): a comparison of n configs gives each a
  1 - 0.05/n interval (Bonferroni), so that an A/A comparison shows any false verdict at most
  5% of the time, however many configs the sweep has.
- **Verdict** (:func:`verdict`): "faster"/"slower" only when the interval excludes 1 and the
  estimate is beyond the A/A noise band (:func:`noise_threshold`: 95% of two single launches
  of the same code differ by less); "within noise" when the estimate is inside the band and
  the interval leaves no effect of twice the band possible; "host differed" whenever the hosts'
  states differed (:func:`vpipe.trace.host_state.judge_hosts`); otherwise "inconclusive", with how many rounds per block would settle it
  (:func:`rounds_to_settle`).

Like pyperf (several processes, a significance test, "not significant") and criterion (a
bootstrap interval plus a noise threshold, "change within noise threshold"), but with the
between-launch variance in the interval itself, normalised by a host-speed reference, and an
explicit "inconclusive" with the sample size that would settle it. Seeded like
:mod:`vpipe.stats`, so a report's figures are the same on every rendering.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from vpipe.stats import CONFIDENCE, RESAMPLES, SEED, interval_text, outliers

# A percentile bootstrap over few blocks understates their spread (3 blocks: by a factor of
# sqrt(2/3), with 10 distinct outcomes); below this many per side the interval is the
# analytic one, with Student's t for the spread's degrees of freedom.
MIN_BLOCKS = 8
# Launch-to-launch sd (log) beyond the blocks' own sampling noise: assumed when the sweeps have
# no repeated blocks, and the floor of a measured one; measured by bench.false_alarms
# (docs/comparing.md).
LAUNCH_SD = 0.03
# Drift of a whole run's figure (log sd) beyond what its blocks' spread shows: blocks are
# launched back to back, so a host that is a little slower for that quarter of an hour moves
# all of them together. Quiet runs of bench.false_alarms measured it (docs/comparing.md); it
# cannot be estimated from the two runs being compared, so it is assumed for every comparison.
RUN_SD = 0.02
MIN_EFFECT = 0.02  # never call a difference under 2% (log) a speedup or a slowdown
# A median's spread needs three steps; beyond that the evidence a comparison needs follows the
# noise it measures (a block's sampling variance: :func:`_sampling_variances`): four steps
# spread 0.1% (a GPU) decide what four steps spread 15% (a busy CPU) cannot
MIN_STEPS = 3
# "within noise" rules out effects this large at most (log ~10%): with a wider noise band the
# honest answer is "inconclusive", not that nothing changed
MAX_WITHIN_NOISE = 0.10
Z = 1.959963984540054  # two-sided 95% normal quantile


def t_quantile(dof: int | None, confidence: float = CONFIDENCE) -> float:
    """The two-sided ``confidence`` quantile of Student's t with ``dof`` degrees of freedom;
    the normal one when the spread is known (None). Exact for 1 and 2 degrees of freedom, a
    four-term Cornish-Fisher expansion from 3: within 0.1% of the exact value from 6 degrees,
    0.4% at 4 degrees and 99.5%, 2.4% low at 3 degrees and 99.75%."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    p = 1 - (1 - confidence) / 2  # one-sided
    z = NormalDist().inv_cdf(p)
    if dof is None:
        return z
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    if dof == 1:
        return math.tan(math.pi * (p - 0.5))
    if dof == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    n = float(dof)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / n + g2 / n**2 + g3 / n**3 + g4 / n**4


def family_confidence(configs: int) -> float:
    """Each config's confidence so that a comparison of ``configs`` configs has at most a 5%
    chance of any false "faster"/"slower" (Bonferroni): an A/A run of a 10-config sweep would
    otherwise show a false verdict in one comparison of three."""
    return 1 - (1 - CONFIDENCE) / max(configs, 1)


@dataclass(frozen=True)
class Block:
    """One launch's timed steps of one config, with the reference time before each step
    (None where the sweep has no reference timings)."""

    steps: np.ndarray
    refs: np.ndarray | None = None

    @staticmethod
    def of(steps: npt.ArrayLike, refs: npt.ArrayLike | None = None) -> Block:
        s = np.asarray(steps, dtype=float)
        r = None if refs is None else np.asarray(refs, dtype=float)
        if r is not None and r.shape != s.shape:
            raise ValueError(f"{s.size} steps but {r.size} reference times")
        return Block(s, r)

    def cleaned(self) -> tuple[Block, int]:
        """The block without outlier steps (:func:`vpipe.stats.outliers`) and their
        references, and how many steps were dropped."""
        keep = ~outliers(self.steps)
        refs = None if self.refs is None else self.refs[keep]
        return Block(self.steps[keep], refs), int((~keep).sum())

    def log_figure(self, ref_weight: float) -> float:
        """log of median(steps) less ``ref_weight`` x log of median(refs): 1 (True) the figure
        normalised by the reference, 0 (False) raw; between, a partial normalisation (the
        weight :mod:`vpipe.report.pairs` fits to a session's pairs)."""
        value = math.log(float(np.median(self.steps)))
        if ref_weight and self.refs is not None:
            value -= ref_weight * math.log(float(np.median(self.refs)))
        return value


@dataclass(frozen=True)
class CrossRatio:
    """base / run of a config's figure (> 1: the run is faster), its 95% interval, the blocks
    and steps behind each side, whether normalised, the outliers dropped, the interval's
    half-widths (log) from the blocks' sampling noise (``within``: shrinks with
    more steps) and from the launch-to-launch spread (``between``: shrinks only with more
    blocks), ``drift``: the half-width from the runs' own drift (:data:`RUN_SD`: no number
    of rounds or blocks shrinks it), and ``noise_sd``: the sd of one launch's figure of this
    config (all three parts), from which the A/A noise band follows (:func:`noise_threshold`)."""

    value: float
    low: float
    high: float
    blocks: tuple[int, int]
    steps: tuple[int, int]
    normalised: bool
    outliers: int
    within: float
    between: float
    hierarchical: bool
    noise_sd: float = float("nan")
    drift: float = 0.0

    @property
    def has_interval(self) -> bool:
        return not (math.isnan(self.low) or math.isnan(self.high))

    def interval_text(self, digits: int = 2) -> str:
        return interval_text(self.low, self.high, digits) if self.has_interval else ""


def normalisable(blocks: Iterable[Block]) -> bool:
    """Whether every block has a reference time for every step."""
    return all(b.refs is not None and np.all(b.refs > 0) for b in blocks)


def _within_draws(block: Block, ref_weight: float, rng: np.random.Generator) -> np.ndarray:
    """RESAMPLES bootstrap draws of one block's log figure (:meth:`Block.log_figure`; steps
    and refs resampled as pairs, so the reference's own variation is carried)."""
    n = block.steps.size
    idx = rng.integers(0, n, size=(RESAMPLES, n))
    out = np.log(np.median(block.steps[idx], axis=1))
    if ref_weight and block.refs is not None:
        out -= ref_weight * np.log(np.median(block.refs[idx], axis=1))
    return out


def median_variance(values: np.ndarray) -> float:
    """The variance of the log of the median of ``values`` from their robust spread: (1.2533
    x sd)^2 / n, sd = 1.4826 x the median absolute deviation of their logs (normal errors)."""
    logs = np.log(values)
    sd = 1.4826 * float(np.median(np.abs(logs - np.median(logs))))
    return (1.2533 * sd) ** 2 / max(logs.size, 1)


def _sampling_variances(
    blocks: Sequence[Block], ref_weight: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Each block's bootstrap draws (blocks x RESAMPLES) and the variance of its log figure
    from its own steps: the sampling noise of a median of that many steps, never below what
    the steps' robust spread says (:func:`median_variance`; a bootstrap of a few steps has
    few distinct outcomes and understates it)."""
    draws = np.stack([_within_draws(b, ref_weight, rng) for b in blocks])
    floors = [
        median_variance(b.steps)
        + (ref_weight**2 * median_variance(b.refs) if ref_weight and b.refs is not None else 0.0)
        for b in blocks
    ]
    return draws, np.maximum(draws.var(axis=1), floors)


def block_variances(blocks: Sequence[Block], ref_weight: float) -> np.ndarray:
    """Each block's sampling variance of its log figure (:meth:`Block.log_figure`,
    :func:`_sampling_variances`)."""
    if not blocks:
        return np.zeros(0)
    return _sampling_variances(blocks, ref_weight, np.random.default_rng(SEED))[1]


def cross_ratio(
    base: Sequence[Block],
    run: Sequence[Block],
    *,
    normalise: bool,
    launch_sd: float,
    launch_dof: int | None = None,
    confidence: float = CONFIDENCE,
    run_sd: float = 0.0,
) -> CrossRatio:
    """base / run of a config's (normalised) figure with a 95% interval under the
    random-effects model of the module's doc: each side's figure is the mean of its blocks',
    whose variance is the launch-to-launch ``launch_sd``^2 (estimated with ``launch_dof``
    degrees of freedom, None: known) plus the block's own sampling variance; hierarchical
    bootstrap instead when both sides have :data:`MIN_BLOCKS` blocks. ``confidence``: the
    interval's level (:func:`family_confidence` for one of several configs). ``run_sd``: the
    drift of a whole run's figure that its blocks, launched back to back, cannot show
    (:data:`RUN_SD`), added once per side."""
    cleaned = [[b.cleaned() for b in side] for side in (base, run)]
    dropped = sum(n for side in cleaned for _, n in side)
    sides = [[b for b, _ in side if b.steps.size] for side in cleaned]
    normalise = normalise and all(normalisable(s) for s in sides)
    blocks = (len(sides[0]), len(sides[1]))
    steps = tuple(sum(b.steps.size for b in s) for s in sides)
    nan = float("nan")
    if min(blocks) == 0:
        return CrossRatio(nan, nan, nan, blocks, steps, normalise, dropped, nan, nan, False, nan)
    figures = [np.mean([b.log_figure(normalise) for b in s]) for s in sides]
    log_value = float(figures[0] - figures[1])
    if min(steps) < MIN_STEPS:
        return CrossRatio(
            math.exp(log_value), nan, nan, blocks, steps, normalise, dropped, nan, nan, False, nan
        )
    rng = np.random.default_rng(SEED)
    (draws_a, var_a), (draws_b, var_b) = (_sampling_variances(s, normalise, rng) for s in sides)
    q = t_quantile(launch_dof, confidence)
    within = q * math.sqrt(var_a.sum() / blocks[0] ** 2 + var_b.sum() / blocks[1] ** 2)
    between = q * launch_sd * math.sqrt(1 / blocks[0] + 1 / blocks[1])
    drift = q * run_sd * math.sqrt(2)
    sampling = float(np.concatenate([var_a, var_b]).mean())
    noise_sd = math.sqrt(run_sd**2 + launch_sd**2 + sampling)
    hierarchical = min(blocks) >= MIN_BLOCKS
    if hierarchical:  # the bootstrap's interval, widened by the runs' drift it cannot see
        draws = _hierarchical(draws_a, rng) - _hierarchical(draws_b, rng)
        tail = (1 - confidence) / 2 * 100
        lo, hi = (float(x) for x in np.percentile(draws, [tail, 100 - tail]))
        centre, half = (lo + hi) / 2, math.hypot((hi - lo) / 2, drift)
    else:
        centre, half = log_value, math.sqrt(within**2 + between**2 + drift**2)
    lo, hi = centre - half, centre + half
    return CrossRatio(
        math.exp(log_value),
        math.exp(lo),
        math.exp(hi),
        blocks,
        steps,
        normalise,
        dropped,
        within,
        between,
        hierarchical,
        noise_sd,
        drift,
    )


def _hierarchical(draws: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Hierarchical bootstrap draws of a side's log figure from its blocks' own draws
    (blocks x R): resample blocks with replacement, then a fresh resample of each picked
    block's steps; the side's figure is the mean over its picked blocks."""
    nb, resamples = draws.shape
    pick = rng.integers(0, nb, size=(resamples, nb))
    column = rng.integers(0, resamples, size=(resamples, nb))
    return draws[pick, column].mean(axis=1)


def between_block_sd(configs: Iterable[Sequence[Block]], normalise: bool) -> float | None:
    """The pooled sd of blocks' log figures around their config's mean (launch-to-launch
    spread and sampling noise together), over every config with at least two blocks; None
    when no config has two."""
    squares, dof = 0.0, 0
    for kept in _repeated(configs, normalise):
        logs = np.array([b.log_figure(normalise) for b in kept])
        squares += float(((logs - logs.mean()) ** 2).sum())
        dof += len(logs) - 1
    return math.sqrt(squares / dof) if dof else None


def launch_spread(
    configs: Iterable[Sequence[Block]], normalise: bool
) -> tuple[float, int] | None:
    """The launch-to-launch sd (log) beyond each block's sampling noise, pooled over every
    config with at least two blocks (an A/A measurement: the same code launched several
    times), with its degrees of freedom: the blocks' squared deviations from their config's
    mean, less what the blocks' own sampling variances explain (method of moments, at least
    0). None when no config has two blocks."""
    rng = np.random.default_rng(SEED)
    excess, dof = 0.0, 0
    for kept in _repeated(configs, normalise):
        logs = np.array([b.log_figure(normalise) for b in kept])
        _, var = _sampling_variances(kept, normalise, rng)
        excess += float(((logs - logs.mean()) ** 2).sum()) - (len(kept) - 1) * float(var.mean())
        dof += len(kept) - 1
    return (math.sqrt(max(excess, 0.0) / dof), dof) if dof else None


def run_drift(runs: Sequence[Sequence[Sequence[Block]]], normalise: bool) -> float | None:
    """The drift of whole runs (log sd; what :data:`RUN_SD` stands for) from several runs of
    the same sweep, each a list of configs' blocks in the same order: the variance of the runs'
    mean figures per config less what their blocks' spread explains (method of moments, at
    least 0), pooled over configs. None with fewer than two runs or blocks."""
    excess, dof = 0.0, 0
    for per_run in zip(*runs, strict=True):
        means, shares = [], []
        for blocks in per_run:
            kept = next(iter(_repeated([blocks], normalise)), None)
            if kept is None:
                return None
            logs = [b.log_figure(normalise) for b in kept]
            means.append(float(np.mean(logs)))
            shares.append(float(np.var(logs, ddof=1)) / len(logs))
        if len(means) < 2:
            return None
        n = len(means) - 1
        excess += n * (float(np.var(means, ddof=1)) - float(np.mean(shares)))
        dof += n
    return math.sqrt(max(excess, 0.0) / dof) if dof else None


def _repeated(configs: Iterable[Sequence[Block]], normalise: bool) -> Iterable[list[Block]]:
    """Each config's non-empty blocks without outliers, for configs with at least two (all
    normalisable when ``normalise``)."""
    for blocks in configs:
        kept = [b.cleaned()[0] for b in blocks]
        kept = [b for b in kept if b.steps.size]
        if len(kept) >= 2 and not (normalise and not normalisable(kept)):
            yield kept


def noise_threshold(single_sd: float) -> float:
    """The A/A noise band (log) of a config whose single launch's figure has sd ``single_sd``
    (:attr:`CrossRatio.noise_sd`): 95% of comparisons of two single launches of the same code
    differ by less (``z * sd * sqrt(2)``), at least :data:`MIN_EFFECT`. A difference inside it
    is within noise even when its interval excludes 1."""
    if math.isnan(single_sd):
        return MIN_EFFECT
    return max(MIN_EFFECT, Z * single_sd * math.sqrt(2))


def verdict(r: CrossRatio, threshold: float, host_differences: Sequence[str] = ()) -> str:
    """The verdict of a cross-run ratio against the noise band ``threshold`` (log):

    - "host differed" whenever the hosts' states differed: normalising by the reference can
      hide a real change as well as invent one (a 15% delay measured on a loaded host against
      a quiet one came out "within noise"), so neither a difference nor its absence is claimed;
    - interval excludes 1: "within noise" when the estimate is inside the band (at most half
      of :data:`MAX_WITHIN_NOISE`: the interval holds the run-to-run spread already), else
      "faster"/"slower";
    - interval holds 1: "within noise" when it lies inside twice the band (no effect the
      size of the noise is left possible; never wider than :data:`MAX_WITHIN_NOISE`), else
      "inconclusive".

    "too few steps" without an interval.
    """
    if not r.has_interval:
        return f"too few steps (< {MIN_STEPS})"
    if host_differences:
        return "host differed"
    lo, hi, d = math.log(r.low), math.log(r.high), math.log(r.value)
    if lo > 0 or hi < 0:
        # the interval already carries the run-to-run spread, so the noise band only keeps
        # tiny differences from being called changes: capped at half of MAX_WITHIN_NOISE (a
        # 15% delay inside a 21% band, measured on a quiet host, was called "within noise")
        if abs(d) <= min(threshold, MAX_WITHIN_NOISE / 2):
            return "within noise"
        return "faster" if lo > 0 else "slower"
    band = _within_noise_band(threshold)
    if -band <= lo and hi <= band:
        return "within noise"
    return "inconclusive"


def rounds_to_settle(r: CrossRatio, threshold: float, rounds: int) -> int | None:
    """Rounds per block that would make an inconclusive interval decide (exclude 1, or fit
    inside twice the noise band), from the observed spread: the within-run half-width shrinks
    as 1/sqrt(rounds), the launch-to-launch part and the runs' drift do not. None when no
    number of rounds can (those parts alone are too wide)."""
    if not r.has_interval or rounds < 1:
        return None
    target = _deciding_half_width(r, threshold)
    room = target**2 - r.between**2 - r.drift**2
    if room <= 0 or r.within <= 0:
        return None
    return max(rounds + 1, math.ceil(rounds * r.within**2 / room))


def blocks_to_settle(r: CrossRatio, threshold: float) -> int | None:
    """Blocks per side (``vpipe bench --blocks K`` for both runs) that would make an
    inconclusive interval decide, from the observed spread: both parts of the half-width
    shrink as 1/sqrt(blocks) (from the harmonic mean of the two sides' blocks now), the runs'
    drift does not. None without an interval, or when the drift alone is too wide."""
    if not r.has_interval:
        return None
    target = _deciding_half_width(r, threshold)
    room = target**2 - r.drift**2
    if room <= 0:
        return None
    now = 2 / (1 / r.blocks[0] + 1 / r.blocks[1])
    shrinking = r.within**2 + r.between**2
    return max(math.floor(now) + 1, math.ceil(now * shrinking / room))


def _deciding_half_width(r: CrossRatio, threshold: float) -> float:
    """The half-width at which the interval around the current estimate would decide:
    exclude 1, or fit inside twice the noise band, whichever is nearer."""
    d = abs(math.log(r.value))
    return max(d, _within_noise_band(threshold) - d)


def _within_noise_band(threshold: float) -> float:
    """The half-width an interval must fit inside to be "within noise": twice the noise
    band, at least twice :data:`MIN_EFFECT`, at most :data:`MAX_WITHIN_NOISE`."""
    return max(2 * MIN_EFFECT, min(2 * threshold, MAX_WITHIN_NOISE))


def paired_rounds_to_settle(
    value: float, low: float, high: float, rounds: int, band: float = 0.0
) -> int | None:
    """Rounds that would make a within-run paired ratio's interval decide, from its observed
    half-width (shrinking as 1/sqrt(rounds)): exclude 1, or fit inside the tie band ``band``
    (log half-width; 0: none), whichever is nearer. None when the ratio is unknown, or 1
    without a band."""
    if any(math.isnan(x) for x in (value, low, high)) or value <= 0 or rounds < 1:
        return None
    effect = abs(math.log(value))
    half = (math.log(high) - math.log(low)) / 2
    target = max(effect, band - effect)
    if target <= 0 or half <= 0:
        return None
    return max(rounds + 1, math.ceil(rounds * (half / target) ** 2))

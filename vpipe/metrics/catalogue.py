"""The metric registry: each run-level benchmark metric once, so that the runs table's columns,
the report's summary table, the ``vpipe analyze`` printout and the asv ``track_`` suite are all
generated from one list.

A :class:`Metric` names its runs-table column, table label, unit, which way is better, what it
means, and how to compute it from each source a run may have (:class:`Inputs`):

- ``steps``: the timed steps of a sweep (step times in seconds);
- ``events``: an event table of profiled steps (measured or simulated alike);
- ``sim``: a simulation result (:class:`Simulated`);
- ``memory``: per-rank peak bytes by kind of sample (:func:`vpipe.metrics.per_run.peak_memory`);
- ``simulated``: the metrics of the run's simulation, to set beside the measured ones;
- ``row``: the metrics computed before it for the same run (throughput, errors).

A metric's ``compute`` maps a source, or a tuple of sources that must all be present, to a
function of the inputs; :func:`compute` tries them in order and keeps the first value that is
not None. A metric no source gives is None ("does not apply"); NaN means it applies but is
undefined (say, a ratio over no busy time). Adding a metric is one :func:`register` call.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import pandas as pd

from vpipe.metrics.per_run import (
    combine_ranks,
    headline_peak,
    peak_memory,
    quartiles,
    rank_metrics,
    regime_figure,
)

if TYPE_CHECKING:
    from vpipe.sim import SimResult

SOURCES = ("steps", "refs", "events", "sim", "memory", "simulated", "row")


@dataclass(frozen=True)
class Simulated:
    """A simulation result and the seconds one of its time units lasts."""

    result: SimResult
    unit_s: float

    @property
    def step_time_s(self) -> float:
        return self.result.makespan * self.unit_s


@dataclass
class Inputs:
    """What one run's metrics are computed from; any source may be missing (None)."""

    steps: Sequence[float] | None = None
    refs: Sequence[float] | None = None  # host-speed reference time before each step
    blocks: Sequence[int] | None = None  # each step's launch (``vpipe bench --blocks``)
    events: pd.DataFrame | None = None
    sim: Simulated | None = None
    memory: pd.DataFrame | None = None
    simulated: Mapping[str, Any] | None = None
    batch: int | None = None
    tokens_per_sample: int | None = None
    row: dict[str, Any] = field(default_factory=dict)

    def has(self, source: str | tuple[str, ...]) -> bool:
        """Whether every named source is present (``row`` always is)."""
        names = (source,) if isinstance(source, str) else source
        return all(n == "row" or getattr(self, n) is not None for n in names)

    @cached_property
    def ranks(self) -> pd.DataFrame:
        """Per (run, step, rank) figures of the events (:func:`vpipe.metrics.per_run.rank_metrics`)."""
        return rank_metrics(self.events)

    @cached_property
    def step_frame(self) -> pd.DataFrame:
        """Per (run, step) figures of the events (:func:`vpipe.metrics.per_run.step_metrics`)."""
        return combine_ranks(self.ranks)

    def step_median(self, column: str) -> float:
        """Median over the profiled steps of a :attr:`step_frame` column."""
        return quartiles(self.step_frame[column])[1]


@dataclass(frozen=True)
class Spread:
    """The interquartile range shown next to a median: the q1 and q3 metrics, and the
    header of its table column."""

    q1: str
    q3: str
    label: str
    table: bool = True  # a column of the report's summary table (else the printout's only)


@dataclass(frozen=True)
class Show:
    """How report tables and the ``vpipe analyze`` printout show a metric."""

    scale: float = 1.0  # shown value = stored value * scale
    unit: str = ""  # unit of the shown value
    digits: int = 2  # decimals in report tables
    text_digits: int | None = None  # decimals in the printout (default: digits)
    group: str = ""  # printout line; metrics of one line share it (default: the label)
    note: str = ""  # printout words after the value
    spread: Spread | None = None
    baseline: str = ""  # name of the ratio-to-baseline table column ("thru": "thru vs ...")
    optional: bool = False  # the table column is left out when no row has a value
    table: bool = True  # a column of the report's summary table
    text: bool = True  # a figure of the printout


@dataclass(frozen=True)
class Track:
    """An asv ``track_<name>`` benchmark of a metric; asv prints only seconds and bytes with
    their unit, so any other unit is in the name (``normalised_step_in_ref_units``). asv takes
    lower as better, so a
    higher-is-better metric is tracked through its reciprocal (``reciprocal=True``). asv
    compares one value per commit against a factor, so only figures that hold when the host
    changes are tracked (the normalised step, peak bytes): raw seconds and bubble ratios move
    with other jobs on the host and raised false alarms."""

    name: str
    unit: str
    reciprocal: bool = False
    # whether other processes on the host move the figure (a timing does, peak bytes do not):
    # the suite takes no sample of it from a sweep on a busy host
    host_bound: bool = True

    def value(self, v: Any) -> Any:
        """The tracked value of metric value ``v`` (None when missing)."""
        if v is None or pd.isna(v):
            return None
        return 1 / v if self.reciprocal else v


@dataclass(frozen=True)
class Metric:
    """One metric: its runs-table column ``name`` and how to compute and show it."""

    name: str
    label: str  # header in report tables
    unit: str  # unit of the stored values
    better: Literal["lower", "higher", "zero"]  # "zero": signed, nearer zero is better
    description: str
    compute: Mapping[str | tuple[str, ...], Callable[[Inputs], Any]]
    dtype: str = "Float64"  # pandas dtype of the runs-table column
    show: Show | None = None  # None: stored, not shown
    asv: Track | None = None

    def __post_init__(self) -> None:
        for key in self.compute:
            names = (key,) if isinstance(key, str) else key
            if not set(names) <= set(SOURCES):
                raise ValueError(f"metric {self.name}: unknown source in {key!r}")
        if self.asv and (self.better == "zero" or self.asv.reciprocal != (self.better == "higher")):
            raise ValueError(
                f"metric {self.name}: asv tracks lower-is-better values; track a "
                "higher-is-better metric through its reciprocal, and no signed one"
            )

    def value(self, x: Inputs) -> Any:
        """The first value a present source gives, or None."""
        for source, fn in self.compute.items():
            if x.has(source):
                v = fn(x)
                if v is not None:
                    return v
        return None


_REGISTRY: dict[str, Metric] = {}


def register(metric: Metric) -> Metric:
    """Add a metric (after the ones already there); its name must be new."""
    if metric.name in _REGISTRY:
        raise ValueError(f"metric {metric.name!r} is already registered")
    _REGISTRY[metric.name] = metric
    return metric


def unregister(name: str) -> None:
    """Remove a metric (tests that register toy metrics)."""
    del _REGISTRY[name]


def registry() -> list[Metric]:
    """The registered metrics, in order: the runs table's, tables' and printout's order."""
    return list(_REGISTRY.values())


def compute(x: Inputs) -> dict[str, Any]:
    """Every registered metric of one run from its inputs (None where none applies)."""
    for m in registry():
        x.row[m.name] = m.value(x)
    return dict(x.row)


# ---------------------------------------------------------------------------------------------
# The metrics


def _per_second(amount: Callable[[Inputs], int | None]) -> Callable[[Inputs], float | None]:
    """Per-second rate of an amount per step, from the run's step time."""

    def rate(x: Inputs) -> float | None:
        n, t = amount(x), x.row.get("step_time_s")
        return n / t if n and t is not None and t > 0 else None

    return rate


def _tokens(x: Inputs) -> int | None:
    return x.batch * x.tokens_per_sample if x.batch and x.tokens_per_sample else None


def _sim_error(x: Inputs) -> float | None:
    """Against the run's own step time: the timed median where it has timed steps (one
    profiled step can be an outlier), the profiled median otherwise."""
    sim = x.row.get("sim_step_time_s")
    measured = x.row.get("step_time_s")
    if measured is None or pd.isna(measured):
        measured = x.row.get("profiled_step_time_s")
    ok = sim is not None and measured is not None and not pd.isna(measured) and measured != 0
    return sim / measured - 1 if ok else None


def _step_time(i: int) -> dict[str | tuple[str, ...], Callable[[Inputs], Any]]:
    """Quartile ``i`` (0: q1, 1: median, 2: q3) of the step time: of the timed steps, or the
    simulated step. Never of profiled steps: those are :func:`_profiled_step_time`'s."""
    return {
        "steps": lambda x: quartiles(x.steps)[i],
        "sim": lambda x: x.sim.step_time_s,
    }


def _profiled_step_time(i: int) -> dict[str | tuple[str, ...], Callable[[Inputs], Any]]:
    """Quartile ``i`` of the step time of the profiled steps (measured or simulated events)."""
    return {"events": lambda x: quartiles(x.step_frame["step_time_s"])[i]}


def _normalised_step(x: Inputs) -> float | None:
    """Median step time over median reference time per launch, then the median over launches
    (in log: with two launches, their geometric mean), so one disturbed launch of three does
    not move it."""
    steps = pd.Series(x.steps, dtype="float64")
    refs = pd.Series(x.refs, dtype="float64")
    if len(refs) != len(steps) or not len(steps) or not (refs > 0).all():
        return None
    launch = pd.Series(x.blocks if x.blocks is not None else [0] * len(steps))
    logs = [
        math.log(steps[launch == b].median() / refs[launch == b].median()) for b in launch.unique()
    ]
    return math.exp(statistics.median(logs))


_MS = {"scale": 1e3, "unit": "ms"}

BUILTIN = (
    Metric(
        "step_time_s", "step ms (median)", "s", "lower",
        "time of one training step (slowest rank), median over the run's timed steps (not "
        "profiled: those are profiled_step_time_s), or the simulated step of a simulated run",
        _step_time(1),
        show=Show(**_MS, text_digits=3, group="step time", note="median",
                  spread=Spread("step_time_q1_s", "step_time_q3_s", "step ms IQR")),
    ),
    Metric(
        "normalised_step", "step / reference", "reference units", "lower",
        "median step time over the median time of the host-speed reference timed before each "
        "step (vpipe.sweep.reference), the median over the run's launches: a figure that "
        "a uniformly slower or faster host leaves unchanged, for comparisons across runs",
        {("steps", "refs"): _normalised_step},
        show=Show(digits=2, group="step time", note="in units of the host-speed reference",
                  table=False),
        asv=Track("normalised_step_in_ref_units", "host-speed reference units"),
    ),
    Metric("step_time_q1_s", "step ms q1", "s", "lower", "first quartile of the step time",
           _step_time(0)),
    Metric("step_time_q3_s", "step ms q3", "s", "lower", "third quartile of the step time",
           _step_time(2)),
    Metric(
        "samples_per_s", "samples/s", "samples/s", "higher",
        "throughput: samples per step (the batch) over the step time (step_time_s)",
        {"row": _per_second(lambda x: x.batch)},
        show=Show(unit="samples/s", digits=1, group="throughput", baseline="thru"),
    ),
    Metric(
        "tokens_per_s", "tokens/s", "tokens/s", "higher",
        "throughput of token models: batch x tokens per sample over the step time",
        {"row": _per_second(_tokens)},
        show=Show(unit="tokens/s", digits=0, group="throughput", optional=True),
    ),
    Metric(
        "peak_memory_bytes", "peak MiB", "bytes", "lower",
        "peak memory, max over ranks, of the first kind measured among CUDA allocator peak, "
        "CUDA allocated, CPU allocated, RSS and bytes saved for backward",
        {"memory": lambda x: headline_peak(x.memory)},
        dtype="Int64",
        show=Show(scale=2**-20, unit="MiB", group="peak memory", baseline="mem", text=False),
        asv=Track("peak_bytes_per_rank", "bytes", host_bound=False),
    ),
    Metric(
        "bubble_ratio", "bubble", "ratio", "lower",
        "idle / (idle + busy) over each rank's whole step, 1 - total busy / total window over "
        "ranks; median over steps",
        {"events": lambda x: x.step_median("bubble_ratio"),
         "sim": lambda x: x.sim.result.bubble_ratio},
        show=Show(digits=3, group="bubble ratio", note="whole step"),
    ),
    Metric(
        "bubble_ratio_excl_skew", "bubble excl. skew", "ratio", "lower",
        "the bubble ratio over each rank's span from its first compute start to its last "
        "compute end (start-up and drain skew not counted)",
        {"events": lambda x: x.step_median("bubble_ratio_excl_skew"),
         "sim": lambda x: x.sim.result.bubble_ratio_excl_skew},
        show=Show(digits=3, group="bubble ratio", note="excluding start-up skew", table=False),
    ),
    Metric(
        "comm_wait_s", "comm wait ms", "s", "lower",
        "time blocked on communication (WAIT spans), longest rank, median over steps",
        {"events": lambda x: x.step_median("comm_wait_s")},
        show=Show(**_MS, digits=3, group="comm wait", note="(longest rank, median step)",
                  table=False),
    ),
    Metric(
        "regime", "compute/comm", "ratio", "higher",
        "regime figure: median compute span per action over the median send plus receive span "
        "(one message's posts), in the profiled steps; below 10 a sweep is overhead-bound",
        {"events": lambda x: regime_figure(x.events)},
        show=Show(digits=1, group="regime", note="compute per action / send+recv cost",
                  optional=True),
    ),
    Metric(
        "profiled_step_time_s", "profiled step ms", "s", "lower",
        "step time (slowest rank) of the steps recorded under torch.profiler, median: slower "
        "than the timed steps (profiling costs time per span), the only step time of a run "
        "converted from traces",
        _profiled_step_time(1),
        show=Show(**_MS, text_digits=3, group="profiled step", note="median",
                  spread=Spread("profiled_step_time_q1_s", "profiled_step_time_q3_s",
                                "profiled step ms IQR", table=False)),
    ),
    Metric("profiled_step_time_q1_s", "profiled step ms q1", "s", "lower",
           "first quartile of the profiled steps' time", _profiled_step_time(0)),
    Metric("profiled_step_time_q3_s", "profiled step ms q3", "s", "lower",
           "third quartile of the profiled steps' time", _profiled_step_time(2)),
    Metric(
        "sim_step_time_s", "sim step ms", "s", "lower",
        "step time the simulator predicts with costs calibrated from the profiled steps",
        {"simulated": lambda x: x.simulated["step_time_s"]},
        show=Show(**_MS, group="sim step"),
    ),
    Metric(
        "sim_error", "sim err %", "ratio", "zero",
        "relative error of the simulated step time against the timed median of the same "
        "config (simulated / timed - 1; the profiled median where no step was timed)",
        {"row": _sim_error},
        show=Show(scale=100, unit="%", digits=1, group="sim error", note="vs the step time"),
    ),
    Metric(
        "peak_stage_activations", "peak stage activations", "stage activations", "lower",
        "most activations a rank holds at once in the simulated schedule, max over ranks, "
        "counted in stage activations (one stage's saved tensors for one microbatch; a V stage "
        "is half a rank's share)",
        {"sim": lambda x: max(x.sim.result.peak_stage_activations)},
        dtype="Int64",
    ),
)  # fmt: skip
for _metric in BUILTIN:
    register(_metric)


def summarize(
    events: pd.DataFrame,
    memory: pd.DataFrame | None = None,
    *,
    batch: int | None = None,
    tokens_per_sample: int | None = None,
    missing: Any = float("nan"),
) -> dict[str, Any]:
    """Run-level metrics of one run from its events and memory samples: every metric of the
    registry (the runs table's names; ``missing`` where one does not
    apply, such as throughput without a batch), ``steps`` (how many) and ``peak_<kind>_bytes``
    per kind of memory sample."""
    peaks = peak_memory(memory) if memory is not None else pd.DataFrame()
    x = Inputs(
        events=events,
        memory=peaks if len(peaks.columns) else None,
        batch=batch,
        tokens_per_sample=tokens_per_sample,
    )
    out = {k: missing if v is None else v for k, v in compute(x).items()}
    out["steps"] = int(len(x.step_frame))
    for what in peaks.columns:
        out[f"peak_{what}_bytes"] = int(peaks[what].max())
    return out

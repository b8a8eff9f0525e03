"""Turn a sweep's per-rank results into tables: the runs table (measured and simulated rows,
metrics from :mod:`vpipe.metrics.catalogue`), every timed step, per-rank peak memory, and each config's
events and memory samples (:class:`BenchResults`). :mod:`vpipe.sweep.write` writes them out.

The output directory of ``vpipe bench`` is a :class:`vpipe.trace.store.Store` (one run per
config, measured and simulated, each with its events and memory samples) plus
``steps.parquet`` (every timed step), ``ranks.parquet`` (per-rank peak memory),
``meta.json``, ``plots/*.png``, ``report.html`` (self-contained) and ``report.md``.
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd

from vpipe.events import COMPUTE_KINDS, events_frame, memory_frame
from vpipe.metrics.catalogue import Inputs, Simulated, compute
from vpipe.metrics.per_run import SAVED_ACTIVATIONS
from vpipe.report.document import failure_lines, summary_table
from vpipe.report.dp_section import DPSweep
from vpipe.sweep.driver import Config, SweepSpec, spec_dict
from vpipe.sweep.harness import default_dtype


@dataclass
class BenchResults:
    """Everything a sweep produced, as tables."""

    spec: SweepSpec
    bench_id: str
    meta: dict[str, Any]
    runs: pd.DataFrame  # measured and simulated rows (column "source")
    steps: pd.DataFrame  # one row per timed step
    ranks: pd.DataFrame  # per-rank peak memory per config
    events: dict[str, pd.DataFrame] = field(default_factory=dict)  # run_id -> events
    memory: dict[str, pd.DataFrame] = field(default_factory=dict)  # run_id -> memory samples
    host: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per (block, round)
    # --dp N: every rank's reductions per timed step (vpipe.sweep.dp_bench.steps_frame)
    dp_steps: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def measured(self) -> pd.DataFrame:
        """The measured rows of the configs that ran (not the torch configs that failed)."""
        ran = self.runs["source"] == "measured"
        if "status" in self.runs:
            ran &= self.runs["status"].fillna("ok") != "failed"
        return self.runs[ran].reset_index(drop=True)

    def failure_lines(self) -> list[str]:
        """One line per torch config that failed to run, with its cause
        (:mod:`vpipe.sweep.torch_failures`)."""
        return failure_lines(self.runs)

    def summary_text(self) -> str:
        """The summary table as plain text for the terminal."""
        return summary_table(self.measured).to_string(index=False)

    def dp_sweep(self) -> DPSweep:
        """What the data-parallel report sections read (:mod:`vpipe.report.dp_section`)."""
        spec = self.spec
        return DPSweep(
            spec.dp, spec.ranks, spec.batch, spec.dp_bucket_bytes,
            tuple((c.schedule, c.microbatches) for c in spec.configs()), self.runs, self.dp_steps,
        )  # fmt: skip

    def verdict(self) -> list[str]:
        """The sweep's verdict, one line per (M, impl) (:mod:`vpipe.report.winner`): the
        schedule to run, or the tie it was picked from by the tie rule and why."""
        from vpipe.report.winner import verdict_lines

        return verdict_lines(self.steps, self.config_memory(), rounds_note(self.meta))

    def precision_line(self) -> str:
        """How well the configs' median step times are known (95%, :func:`vpipe.stats.
        median_precision`), and which are looser than ``--timing-precision`` asked."""
        from vpipe.stats import looser_than, median_precision

        times = {f"{k[0]}-m{k[1]}-{k[2]}": g["step_time_s"]
                 for k, g in self.steps.groupby(["schedule", "microbatches", "impl"])}  # fmt: skip
        known = [median_precision(t) * 100 for t in times.values()]
        finite = [v for v in known if not math.isnan(v)]
        if not finite:
            return "medians: too few timed steps to bound any"
        line = f"medians known to +-{min(finite):.1f}% to +-{max(finite):.1f}% (95%)"
        target = self.spec.timing_precision  # rounds were added for it only within a budget
        loose = looser_than(times, target) if target and self.spec.max_minutes else []
        return line + (f"; looser than --timing-precision {target:g}: {', '.join(loose)}"
                       if loose else "")  # fmt: skip

    def config_memory(self) -> dict[tuple[str, int, str], float | None]:
        """Each measured config's peak bytes per rank by (schedule, M, impl): what the
        verdict's tie rule weighs."""
        return {
            (r["schedule"], r["microbatches"], r["impl"]):
                None if pd.isna(r["peak_memory_bytes"]) else float(r["peak_memory_bytes"])
            for r in self.measured.to_dict("records")
        }  # fmt: skip


def rounds_note(meta: dict[str, Any]) -> str:
    """Why a sweep's rounds ended, in words, for the verdict."""
    n, stop = meta.get("rounds_run"), meta.get("rounds_stop", "fixed")
    if stop == "budget":
        return f"in {n} rounds, when the time budget (--max-minutes {meta['max_minutes']:g}) ran out"
    if stop == "decided":
        return f"in {n} rounds"
    return f"in {n} fixed rounds (--max-minutes 0 adds none)"


def git_commit(cwd: str | Path | None = None) -> str | None:
    """The current commit of the checkout holding vpipe (None outside git)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=cwd or Path(__file__).parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _config_events(results: list[dict[str, Any]], cfg: Config, run_id: str) -> pd.DataFrame:
    frames = [r["events"][cfg.key] for r in results if r["events"].get(cfg.key) is not None]
    if not frames:
        return events_frame([])
    ev = pd.concat(
        [f.astype({c: "object" for c in f.select_dtypes("category")}) for f in frames],
        ignore_index=True,
    )
    ev["run_id"], ev["source"], ev["impl"], ev["schedule"] = (
        run_id,
        "measured",
        cfg.impl,
        cfg.schedule,
    )
    return events_frame(ev)


def _config_memory(results: list[dict[str, Any]], cfg: Config, run_id: str) -> pd.DataFrame:
    rows = [
        {
            "run_id": run_id,
            "source": "measured",
            "rank": r["rank"],
            "step": 0,
            "t_ns": t,
            "bytes": b,
            "what": SAVED_ACTIVATIONS,
        }
        for r in results
        for t, b in r["memory"][cfg.key]["samples"]
    ]
    return memory_frame(rows)


def collect(
    spec: SweepSpec,
    results: list[dict[str, Any]],
    bench_id: str,
    sweep_s: float,
    simulate: bool = True,
) -> BenchResults:
    """Tables of a finished sweep (``results``: every rank's return value); with ``simulate``,
    each profiled config is also simulated with costs calibrated from its measured events.

    With ``spec.dp`` replicas, events and memory are those of replica 0's P pipeline ranks
    (the replicas run the same program); the reductions' figures come from every rank of every
    replica (:mod:`vpipe.sweep.dp_bench`)."""
    from vpipe.sweep.dp_bench import measured_dp, steps_frame

    everyone = sorted(results, key=lambda r: r["rank"])
    results = everyone[: spec.ranks]  # replica 0
    r0 = results[0]
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    hosts = sorted({r["host"] for r in everyone})
    meta = {
        "bench_id": bench_id,
        "created": created,
        "commit": git_commit(),
        "hosts": hosts,
        "python": platform.python_version(),
        "torch": r0["torch"],
        "threads_per_rank": r0["threads"],
        "model_sizes": r0["sizes"],
        "sweep_wall_s": round(sweep_s, 2),
        "reference": r0.get("reference"),
        **spec_dict(spec),
        # how many timed rounds ran, and why they ended (fixed, decided or budget)
        "rounds_run": 1 + max((x for rounds in r0["rounds"] for x in rounds), default=-1),
        "rounds_stop": r0.get("stop", "fixed"),
        "cpu_allocator": r0["cpu_allocator"],  # in effect: system where malloc is not glibc's
    }
    meta.pop("trace_dir", None)
    meta.pop("progress", None)
    common = {
        "created": created,
        "commit": meta["commit"],
        "host": ",".join(hosts),
        "torch": r0["torch"],
        "device": spec.device,
        "backend": spec.backend,
        "dtype": spec.dtype or default_dtype(spec.device),
        "ranks": spec.ranks,
        "model": spec.model,
        "sizes": json.dumps(r0["sizes"], sort_keys=True),  # resolved: vpipe analyze re-splits it
        "tokens_per_sample": r0["tokens_per_sample"],
        "batch": spec.batch,
        "bench_id": bench_id,
        "threads": r0["threads"],
        "cpu_allocator": r0["cpu_allocator"],
        "blocks": spec.blocks,
        "inject_delay_ms": spec.inject_delay_ms,
        "inject_delay_pct": spec.inject_delay_pct,
        **({"dp": spec.dp} if spec.dp > 1 else {}),
    }
    dp_records = [x for r in everyone for x in r.get("dp_steps", [])]
    dp_steps = steps_frame(dp_records)
    runs, steps, ranks = [], [], []
    events: dict[str, pd.DataFrame] = {}
    memory: dict[str, pd.DataFrame] = {}
    for i, cfg in enumerate(spec.configs()):
        run_id, sim_id = cfg.run_id(bench_id), cfg.run_id(bench_id, simulated=True)
        times = r0["times"][i]
        refs = r0["refs"][i] if "refs" in r0 else [None] * len(times)
        rounds = r0["rounds"][i]
        blocks = r0["blocks"][i] if "blocks" in r0 else [0] * len(times)  # one launch
        for j, (t, ref) in enumerate(zip(times, refs, strict=True)):
            steps.append(
                {
                    "schedule": cfg.schedule,
                    "microbatches": cfg.microbatches,
                    "impl": cfg.impl,
                    "block": blocks[j],
                    "round": rounds[j],  # counted on across blocks
                    "step": j % spec.steps,
                    "step_time_s": t,
                    "samples_per_s": spec.batch / t,
                    "ref_s": ref,
                }
            )
        for r in results:
            m = r["memory"][cfg.key]
            ranks.append(
                {
                    "schedule": cfg.schedule,
                    "microbatches": cfg.microbatches,
                    "impl": cfg.impl,
                    "rank": r["rank"],
                    "peak_bytes": m["peak_bytes"],
                    "runtime_peak_bytes": m.get("runtime_peak_bytes"),
                    "cuda_peak_bytes": m.get("cuda_peak_bytes"),
                }
            )
        ev = _config_events(results, cfg, run_id)
        events[run_id] = ev
        memory[run_id] = _config_memory(results, cfg, run_id)
        traced = has_actions(ev)
        sim_row = None
        mine = [x for x in dp_records if x["config"] == i]
        if simulate and has_actions(ev, named=True):  # else runs of operators (Schedule1F1B)
            sim_row, events[sim_id] = simulate_config(spec, cfg, ev, sim_id, mine or None)
        config = {
            **common,
            "impl": cfg.impl,
            "schedule": cfg.schedule,
            "microbatches": cfg.microbatches,
            "stages": r0["n_stages"][cfg.key],
        }
        per_block = spec.rounds * spec.steps  # with --blocks the rounds are fixed
        measured = Inputs(
            steps=times,
            refs=None if None in refs else refs,
            blocks=blocks,
            events=ev if traced else None,
            memory=_rank_peaks(results, cfg),
            simulated=sim_row,
            batch=spec.batch,
            tokens_per_sample=r0["tokens_per_sample"],
        )
        dp_figures = (
            measured_dp(dp_steps[dp_steps["config"] == i], times, per_block) if mine else {}
        )
        runs.append(
            {
                **config,
                "measured_steps": len(times),
                **compute(measured),
                **dp_figures,
                **_memory_kinds(results, cfg),
                "comm_thread_cpu_s": _comm_thread_cpu_s(r0, i),
                "split_backward_ratio": _split_ratio(results, cfg.key),
                "forward_alone_us": _forwards_alone(results, cfg.key),
                "run_id": run_id,
                "source": "measured",
                "status": "ok",
            }
        )
        if sim_row is not None:
            runs.append(
                {**config, **sim_row, "run_id": sim_id, "source": "simulated", "status": "ok"}
            )
    runs += failed_rows(spec, common, bench_id)
    from vpipe.trace.store import runs_frame

    return BenchResults(
        spec,
        bench_id,
        meta,
        runs_frame(runs),
        pd.DataFrame(steps),
        pd.DataFrame(ranks),
        events,
        memory,
        host_table(r0.get("host_rounds", []), pd.DataFrame(steps)),
        dp_steps,
    )


def failed_rows(spec: SweepSpec, common: dict[str, Any], bench_id: str) -> list[dict[str, Any]]:
    """A runs-table row per torch config that failed to run (``spec.failed``): its metadata,
    status ``failed`` and the cause in ``error``; no metrics."""
    from vpipe.schedules import make_schedule

    rows = []
    for cfg in replace(spec, failed={}).configs():
        if cfg.key in spec.failed:
            stages = make_schedule(cfg.schedule, spec.ranks, cfg.microbatches).n_stages
            rows.append({
                **common, "impl": cfg.impl, "schedule": cfg.schedule,
                "microbatches": cfg.microbatches, "stages": stages, "run_id": cfg.run_id(bench_id),
                "source": "measured", "status": "failed", "error": spec.failed[cfg.key],
            })  # fmt: skip
    return rows


def host_table(rounds: list[dict[str, Any]], steps: pd.DataFrame) -> pd.DataFrame:
    """The host's state per (block, round) (:mod:`vpipe.trace.host_state`), with the median
    reference time of the round's steps."""
    rows = []
    for state in rounds:
        ref = steps.loc[steps["round"] == state["round"], "ref_s"] if "ref_s" in steps else None
        known = ref is not None and ref.notna().any()
        rows.append({**state, "ref_s": ref.median() if known else None})
    return pd.DataFrame(rows)


def has_actions(events: pd.DataFrame, *, named: bool = False) -> bool:
    """Whether an event table holds compute rows (F, B, I, W) to analyse; ``named``: compute
    actions to calibrate from on every rank with compute rows, not only runs of operators
    (torch's Schedule1F1B where its runs follow no program: :mod:`vpipe.trace.run_actions`)."""
    from vpipe.trace.operators import RUN_NAME

    compute = events["kind"].isin(COMPUTE_KINDS)
    if not named:
        return bool(compute.any())
    actions = compute & (events["name"].astype(str) != RUN_NAME)
    ranks = set(events.loc[compute, "rank"])
    return bool(actions.any()) and set(events.loc[actions, "rank"]) == ranks


def simulate_config(
    spec: SweepSpec,
    cfg: Config,
    events: pd.DataFrame,
    run_id: str,
    dp_records: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Simulate a config's schedule with the cost model calibrated from its own measured
    events (per-stage F/I/W medians, overhead, comm latency): its metrics and events. With
    ``dp_records`` (``--dp``: its measured reductions), the step ends with its reductions
    (:func:`vpipe.sweep.dp_bench.simulate_dp`) and the row holds the predicted DP figures."""
    from vpipe.predict.calibrate import calibrate, predict
    from vpipe.schedules import make_schedule

    schedule = make_schedule(cfg.schedule, spec.ranks, cfg.microbatches)
    sim = predict(calibrate(events), schedule, recv_lookahead=spec.recv_lookahead)
    dp_figures: dict[str, Any] = {}
    if dp_records:
        from vpipe.sweep.dp_bench import simulate_dp

        sim, dp_figures = simulate_dp(spec.dp, schedule, sim, dp_records)
    ev = sim.to_events(run_id, schedule, time_unit_ns=1000)
    ev = ev.astype({"impl": "object"}).assign(impl=cfg.impl)  # whose costs were simulated
    # the calibrated cost model is in microseconds
    row = compute(Inputs(sim=Simulated(sim, 1e-6), batch=spec.batch))
    return {**row, **dp_figures}, events_frame(ev)


def _comm_thread_cpu_s(r0: dict[str, Any], i: int) -> float | None:
    """Config ``i``'s communication threads' CPU seconds per timed step, summed over the ranks,
    the median over its rounds (:mod:`vpipe.trace.thread_cpu`); None where they were not
    measured (a GPU, a host with cores to spare, --dp, a rank without /proc)."""
    import numpy as np

    per_round = np.asarray(r0["comm_thread_cpu_s"][i] if "comm_thread_cpu_s" in r0 else [])
    per_round = per_round[np.isfinite(per_round)]
    return float(np.median(per_round)) if len(per_round) else None


def _split_ratio(results: list[dict[str, Any]], key: str) -> float | None:
    """A config's split probe (:mod:`vpipe.sweep.split_probe`): the median of every rank's
    (I + W) / B repeats; None where no rank probed (torch's runtime, a recomputing run)."""
    import numpy as np

    ratios = [x for r in results for x in r.get("split_probe", {}).get(key, [])]
    return float(np.median(ratios)) if ratios else None


def _forwards_alone(results: list[dict[str, Any]], key: str) -> str | None:
    """A config's forward probe as the runs table's ``forward_alone_us`` (JSON text:
    :func:`vpipe.sweep.split_probe.forwards_us`)."""
    from vpipe.sweep.split_probe import forwards_us

    per_stage = forwards_us(r.get("forward_probe", {}).get(key, {}) for r in results)
    return None if per_stage is None else json.dumps(per_stage)


def _memory_kinds(results: list[dict[str, Any]], cfg: Config) -> dict[str, int | None]:
    """A config's peak of each kind of memory measured, max over ranks, as the runs table's
    ``peak_<kind>_bytes`` (the report shows each in its own column): bytes saved for
    backward, and the CUDA allocator's peak where it was measured (None elsewhere)."""
    mem = [r["memory"][cfg.key] for r in results]
    cuda = [m["cuda_peak_bytes"] for m in mem if m.get("cuda_peak_bytes") is not None]
    return {
        f"peak_{SAVED_ACTIVATIONS}_bytes": int(max(m["peak_bytes"] for m in mem)),
        "peak_cuda_peak_bytes": int(max(cuda)) if cuda else None,
    }


def _rank_peaks(results: list[dict[str, Any]], cfg: Config) -> pd.DataFrame:
    """Each rank's peak bytes saved for backward in a config (the metrics' memory source)."""
    return pd.DataFrame(
        {SAVED_ACTIVATIONS: [r["memory"][cfg.key]["peak_bytes"] for r in results]},
        index=pd.Index([r["rank"] for r in results], name="rank"),
    )

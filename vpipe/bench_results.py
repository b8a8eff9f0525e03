"""Turn a sweep's per-rank results into tables, simulations, a results store, plots and reports.

The output directory of ``vpipe bench`` is a :class:`vpipe.trace.store.Store` (one run per
config, measured and simulated, each with its events and memory samples) plus
``steps.parquet`` (every timed step), ``ranks.parquet`` (per-rank peak memory),
``meta.json``, ``plots/*.png``, ``report.html`` (self-contained) and ``report.md``.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from vpipe.analysis import SAVED_ACTIVATIONS
from vpipe.bench import Config, SweepSpec, spec_dict
from vpipe.events import COMPUTE_KINDS, events_frame, memory_frame
from vpipe.metrics import Inputs, Simulated, compute
from vpipe.report import (
    STATS_NOTE,
    Section,
    impl_table,
    meta_table,
    regime_section,
    render_html,
    render_markdown,
    slug,
    summary_table,
    table_section,
    v_vs_baseline,
)


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

    @property
    def measured(self) -> pd.DataFrame:
        return self.runs[self.runs["source"] == "measured"].reset_index(drop=True)

    def summary_text(self) -> str:
        """The summary table as plain text for the terminal."""
        return summary_table(self.measured).to_string(index=False)


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
    each profiled config is also simulated with costs calibrated from its measured events."""
    results = sorted(results, key=lambda r: r["rank"])
    r0 = results[0]
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    hosts = sorted({r["host"] for r in results})
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
        **spec_dict(spec),
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
        "ranks": spec.ranks,
        "model": spec.model,
        "sizes": json.dumps(r0["sizes"], sort_keys=True),  # resolved: vpipe analyze re-splits it
        "tokens_per_sample": r0["tokens_per_sample"],
        "batch": spec.batch,
        "bench_id": bench_id,
        "threads": r0["threads"],
        "measured_steps": spec.rounds * spec.steps,
    }
    runs, steps, ranks = [], [], []
    events: dict[str, pd.DataFrame] = {}
    memory: dict[str, pd.DataFrame] = {}
    for i, cfg in enumerate(spec.configs()):
        run_id, sim_id = cfg.run_id(bench_id), cfg.run_id(bench_id, simulated=True)
        times = r0["times"][i]
        for j, t in enumerate(times):
            steps.append(
                {
                    "schedule": cfg.schedule,
                    "microbatches": cfg.microbatches,
                    "impl": cfg.impl,
                    "round": j // spec.steps,
                    "step": j % spec.steps,
                    "step_time_s": t,
                    "samples_per_s": spec.batch / t,
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
        traced = has_actions(ev)  # torch's single-stage classes record no per-action spans
        sim_row = None
        if traced and simulate:
            sim_row, events[sim_id] = simulate_config(spec, cfg, ev, sim_id)
        config = {
            **common,
            "impl": cfg.impl,
            "schedule": cfg.schedule,
            "microbatches": cfg.microbatches,
            "stages": r0["n_stages"][cfg.key],
        }
        measured = Inputs(
            steps=times,
            events=ev if traced else None,
            memory=_rank_peaks(results, cfg),
            simulated=sim_row,
            batch=spec.batch,
            tokens_per_sample=r0["tokens_per_sample"],
        )
        runs.append(
            {**config, **compute(measured), "run_id": run_id, "source": "measured", "status": "ok"}
        )
        if sim_row is not None:
            runs.append(
                {**config, **sim_row, "run_id": sim_id, "source": "simulated", "status": "ok"}
            )
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
    )


def has_actions(events: pd.DataFrame) -> bool:
    """Whether an event table holds compute spans (F, B, I, W) to analyse."""
    return bool(events["kind"].isin(COMPUTE_KINDS).any())


def simulate_config(
    spec: SweepSpec, cfg: Config, events: pd.DataFrame, run_id: str
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Simulate a config's schedule with the cost model calibrated from its own measured
    events (per-stage F/I/W medians, overhead, comm latency): its metrics and events."""
    from vpipe.calibrate import calibrate, predict
    from vpipe.schedules import make_schedule

    schedule = make_schedule(cfg.schedule, spec.ranks, cfg.microbatches)
    sim = predict(calibrate(events), schedule)
    ev = sim.to_events(run_id, schedule, time_unit_ns=1000)
    ev = ev.astype({"impl": "object"}).assign(impl=cfg.impl)  # whose costs were simulated
    # the calibrated cost model is in microseconds
    row = compute(Inputs(sim=Simulated(sim, 1e-6), batch=spec.batch))
    return row, events_frame(ev)


def _rank_peaks(results: list[dict[str, Any]], cfg: Config) -> pd.DataFrame:
    """Each rank's peak bytes saved for backward in a config (the metrics' memory source)."""
    return pd.DataFrame(
        {SAVED_ACTIVATIONS: [r["memory"][cfg.key]["peak_bytes"] for r in results]},
        index=pd.Index([r["rank"] for r in results], name="rank"),
    )


# ---------------------------------------------------------------------------------------------
# Writing


def write_outputs(res: BenchResults, out: str | Path) -> dict[str, Path]:
    """Store, tables, plots and reports under ``out``; returns the main paths."""
    from vpipe.trace.store import Store, write_parquet

    out = Path(out)
    store = Store(out)
    for row in res.runs.to_dict("records"):
        rid = row["run_id"]
        store.append_run(row, res.events.get(rid), res.memory.get(rid))
    meta = {"table": "steps", "bench_id": res.bench_id}
    write_parquet(res.steps, out / "steps.parquet", meta)
    write_parquet(res.ranks, out / "ranks.parquet", {**meta, "table": "ranks"})
    (out / "meta.json").write_text(json.dumps(res.meta, indent=1, default=str) + "\n")
    sections = report_sections(res)
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    for s in sections:
        for name, png in s.images.items():
            (plots / f"{slug(name)}.png").write_bytes(png)
    title = f"vpipe bench {res.bench_id}"
    html_path, md_path = out / "report.html", out / "report.md"
    html_path.write_text(render_html(title, sections), encoding="utf-8")
    md_path.write_text(render_markdown(title, sections, image_dir="plots"), encoding="utf-8")
    return {"html": html_path, "markdown": md_path, "store": out}


def report_sections(res: BenchResults) -> list[Section]:
    """The report of one sweep: setup, summary tables, then figures."""
    from vpipe.plots import plot_memory, plot_pareto, plot_throughput, to_png
    from vpipe.report import vpipe_only_note

    runs = res.measured
    regime = regime_section(runs)
    sections = [regime] if regime else []
    sections.append(table_section("Setup", meta_table(res.meta)))
    sections.append(
        table_section(
            "Summary",
            summary_table(runs),
            "step time: slowest rank, median over interleaved timed steps (IQR shown); peak: "
            "bytes of tensors saved for backward, max over ranks; bubble: idle/(idle+busy) per rank "
            "over the whole profiled step (1 - total busy / total window over ranks); profiled step: "
            "the median of the steps recorded under torch.profiler (slower than the timed "
            "steps: profiling costs time per span); sim: simulator calibrated from those "
            "profiled steps, error vs the timed median. torch's single-stage schedule classes (gpipe, "
            "1f1b) record no per-action profiler spans, so they have no bubble, timeline or "
            "simulation." + vpipe_only_note(res.spec.schedules, res.spec.impls),
        )
    )
    vv = v_vs_baseline(runs, res.steps)
    if len(vv):
        sections.append(
            table_section(
                "V-schedules vs interleaved-1f1b",
                vv,
                "ratios > 1: more throughput / more memory than the "
                "interleaved-1f1b config of the same impl and M. " + STATS_NOTE,
            )
        )
    it = impl_table(res.steps)
    if len(it):
        sections.append(
            table_section(
                "vpipe vs torch.distributed.pipelining",
                it,
                "torch step time / vpipe step time: > 1 means vpipe is faster. " + STATS_NOTE,
            )
        )
    sections.extend(fidelity_sections(res))
    figs = Section("Throughput and memory")
    figs.images["Throughput per schedule"] = to_png(plot_throughput(res.steps))
    figs.images["Peak memory per schedule"] = to_png(plot_memory(res.ranks))
    figs.images["Throughput vs peak memory"] = to_png(plot_pareto(runs))
    sections.append(figs)
    sections.extend(_timeline_sections(res))
    sections.extend(plan_sections(res))
    return sections


def fidelity_sections(res: BenchResults) -> list[Section]:
    """Leave-one-out fidelity per implementation and M: calibrate on each profiled config in
    turn, predict every config, and compare with the timed medians."""
    from vpipe.calibrate import Case, leave_one_out, model_units
    from vpipe.schedules import make_schedule

    runs = res.measured
    out = []
    for (impl, m), group in runs.groupby(["impl", "microbatches"], sort=True):
        cases = [
            Case(r.schedule, make_schedule(r.schedule, res.spec.ranks, int(m)), ev, r.step_time_s)
            for r in group.itertuples()
            if (ev := res.events.get(r.run_id)) is not None and has_actions(ev)
        ]
        if len(cases) < 2:
            continue
        units = model_units(
            {"model": res.spec.model, "sizes": res.meta.get("model_sizes"),
             "stages": max(c.schedule.n_stages for c in cases)}
        )  # fmt: skip
        table = leave_one_out(cases, units)
        worst = float(table.drop(columns="calibrated on").abs().max().max())
        shown = table.assign(**{c.label: table[c.label].map(lambda e: f"{e * 100:+.1f}%")
                                for c in cases})  # fmt: skip
        out.append(
            table_section(
                f"Simulator fidelity ({impl}, M={int(m)})",
                shown,
                "error of the predicted step time against the timed median of each config "
                "(columns), calibrated on the profiled steps of one config (rows: per-action "
                f"medians over {res.spec.profile_steps} profiled steps); the diagonal is in "
                f"sample. Largest |error|: {worst * 100:.1f}% (goal: within 5%)."
                + (
                    ""
                    if impl == "vpipe"
                    else " torch's traces have no wait spans, so posting "
                    "and communication costs cannot be calibrated from them."
                ),
            )
        )
    return out


def plan_sections(res: BenchResults, top: int = 10) -> list[Section]:
    """The plan for the measured host: costs calibrated on the sweep's vpipe zbv config (else
    its first profiled vpipe config), every family x stages x M simulated for this sweep's
    ranks and batch, within the most memory any config of the sweep used."""
    from vpipe.plan import Budget, PlanError, calibrated_costs, plan
    from vpipe.schedules import make_schedule

    runs = res.measured
    traced = [
        r for r in runs[runs["impl"] == "vpipe"].itertuples()
        if (ev := res.events.get(r.run_id)) is not None and has_actions(ev)
    ]  # fmt: skip
    if not traced or res.ranks.empty:
        return []
    base = next((r for r in traced if r.schedule == "zbv"), traced[0])
    rank_rows = res.ranks[
        (res.ranks["schedule"] == base.schedule)
        & (res.ranks["microbatches"] == base.microbatches)
        & (res.ranks["impl"] == "vpipe")
    ]
    peaks = dict(zip(rank_rows["rank"], rank_rows["peak_bytes"], strict=True))
    schedule = make_schedule(base.schedule, res.spec.ranks, int(base.microbatches))
    meta = {"model": res.spec.model, "sizes": res.meta.get("model_sizes"), "batch": res.spec.batch}
    budget = Budget(float(res.ranks["peak_bytes"].max()))
    try:
        costs = calibrated_costs(res.events[base.run_id], peaks, schedule, meta)
        result = plan(costs, res.spec.ranks, res.spec.batch, budget)
    except PlanError as e:
        return [Section("Plan for this host", f'<p class="note">{e}</p>', str(e))]
    rec = result["recommended"]
    table = pd.DataFrame(
        {
            "schedule": c["schedule"],
            "stages/rank": c["stages_per_rank"],
            "M": c["microbatches"],
            "predicted step ms": f"{c['predicted_step_s'] * 1e3:.2f}",
            "bubble": f"{c['bubble_ratio']:.3f}",
            "peak MiB/rank": f"{max(c['peak_activation_bytes']) / 2**20:.2f}",
            "fits": "yes" if c["fits"] else "no",
        }
        for c in result["candidates"][:top]
    )
    note = (
        f"vpipe plan for {res.spec.ranks} ranks and batch {res.spec.batch}, costs calibrated on "
        f"{base.schedule} M={int(base.microbatches)} (vpipe), budget: the most memory a config "
        f"of this sweep used ({budget.describe(budget.value)} per rank). Recommended: "
        f"{rec['schedule']} with {rec['stages_per_rank']} stages per rank and "
        f"{rec['microbatches']} microbatches, {rec['predicted_step_s'] * 1e3:.2f} ms per step "
        f"predicted. Fastest {min(top, len(result['candidates']))} of "
        f"{len(result['candidates'])} candidates; `vpipe plan --from STORE --run "
        f"{base.run_id} --memory ...` plans for another budget."
    )
    return [table_section("Plan for this host", table, note)]


def _timeline_sections(res: BenchResults) -> list[Section]:
    from vpipe.plots import plot_gantt, plot_memory_timeline, schedule_order, to_png

    runs = res.measured
    if not res.events or runs.empty:
        return []
    m = int(runs["microbatches"].max())
    gantt = Section(
        f"Timelines (M={m}): measured vs simulated",
        '<p class="note">One profiled step per config; simulated with the cost '
        "model calibrated from the same step.</p>",
        "One profiled step per config; simulated with the calibrated cost model.",
    )
    mem = Section(f"Memory over time (M={m})")
    mems = []
    for sched in schedule_order(runs["schedule"].unique()):
        panels = []
        for impl in ("vpipe", "torch"):
            ev = res.events.get(Config(sched, m, impl).run_id(res.bench_id))
            if ev is not None and has_actions(ev):
                panels.append((f"{sched} {impl} measured", _one_step(ev)))
        sim = res.events.get(Config(sched, m, "vpipe").run_id(res.bench_id, simulated=True))
        if sim is not None and len(sim):
            panels.append((f"{sched} simulated (vpipe costs)", sim))
        if panels:
            gantt.images[f"Gantt {sched} M={m}"] = to_png(plot_gantt(panels))
        for impl in ("vpipe", "torch"):
            x = res.memory.get(Config(sched, m, impl).run_id(res.bench_id))
            if x is not None and len(x):
                mems.append(x.assign(label=f"{sched} {impl}"))
    if mems:
        mem.images[f"Saved activations over time M={m}"] = to_png(
            plot_memory_timeline(
                pd.concat(mems, ignore_index=True),
                "Bytes saved for backward during one step, per rank",
            )
        )
    return [s for s in (gantt, mem) if s.images]


def _one_step(ev: pd.DataFrame) -> pd.DataFrame:
    """The events of the last profiled step (spans outside a step are dropped)."""
    ev = ev[ev["step"] >= 0]
    return ev[ev["step"] == ev["step"].max()] if len(ev) else ev

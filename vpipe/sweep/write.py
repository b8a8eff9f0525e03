"""Write a sweep's outputs: the results store, steps and ranks tables, plots and the report.

:func:`write_outputs` fills ``vpipe bench``'s output directory from the tables that
:func:`vpipe.sweep.results.collect` made; :func:`report_sections` builds the report of one
sweep (regime, setup, summary, comparisons with intervals, simulator fidelity, figures,
timelines, and the plan for the measured host).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from vpipe.predict.fidelity import fidelity_worst
from vpipe.predict.timing_noise import sweep_timing_sentence
from vpipe.report.document import (
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
    text_section,
    v_vs_baseline,
)
from vpipe.sweep.driver import Config
from vpipe.sweep.plan_section import plan_sections
from vpipe.sweep.results import BenchResults, has_actions


def write_outputs(res: BenchResults, out: str | Path) -> dict[str, Path]:
    """Store, tables, plots and reports under ``out``; returns the main paths."""
    from vpipe.trace.store import Store, write_parquet

    out = Path(out)
    store = Store(out)
    for k in range(len(res.runs)):  # one-row frames keep the columns' types (text stays text)
        row = res.runs.iloc[[k]]
        rid = row["run_id"].iloc[0]
        store.append_run(row, res.events.get(rid), res.memory.get(rid))
    meta = {"table": "steps", "bench_id": res.bench_id}
    write_parquet(res.steps, out / "steps.parquet", meta)
    write_parquet(res.ranks, out / "ranks.parquet", {**meta, "table": "ranks"})
    if len(res.host):
        write_parquet(res.host, out / "host.parquet", {**meta, "table": "host"})
    if len(res.dp_steps):  # --dp: every rank's reductions per timed step
        write_parquet(res.dp_steps, out / "dp_steps.parquet", {**meta, "table": "dp_steps"})
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
    from vpipe.report.document import vpipe_only_note
    from vpipe.report.dp_section import dp_sections
    from vpipe.report.plots import plot_memory, plot_pareto, plot_throughput, to_png

    runs = res.measured
    regime = regime_section(runs)
    verdict = text_section("Verdict", res.verdict())
    sections = [verdict, regime] if regime else [verdict]
    if failed := res.failure_lines():  # torch configs that could not run, one line each
        sections.append(text_section("Configs that failed", failed))
    sections.append(table_section("Setup", meta_table(res.meta)))
    sections.append(
        table_section(
            "Summary",
            summary_table(runs),
            "step time: slowest rank, median over interleaved timed steps (IQR shown); saved "
            "activations: bytes of tensors saved for backward, the most live at once, max over "
            "ranks; allocator peak (measured on GPUs only): the CUDA caching allocator's peak, "
            "max over ranks; mem vs interleaved-1f1b: the ratio of saved activations; bubble: "
            "idle/(idle+busy) per rank "
            "over the whole profiled step (1 - total busy / total window over ranks); profiled step: "
            "the median of the steps recorded under torch.profiler (slower than the timed "
            "steps: profiling costs time per span); sim: simulator calibrated from those "
            "profiled steps, error vs the timed median. torch's Schedule1F1B records no "
            "per-action spans: its actions are its runs of operators, named where they follow "
            "the 1f1b program (else it has a bubble and waits but no simulation)."
            + vpipe_only_note(res.spec.schedules, res.spec.impls),
        )
    )
    vv = v_vs_baseline(runs, res.steps)
    if len(vv):
        sections.append(
            table_section(
                "V-schedules vs interleaved-1f1b",
                vv,
                "ratios > 1: more throughput / more memory than the "
                "interleaved-1f1b config of the same impl and M (memory: saved "
                "activations). " + STATS_NOTE,
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
    sections.extend(dp_sections(res.dp_sweep()))
    fidelity = fidelity_tables(res)
    sections.extend(fidelity_sections(res, fidelity))
    figs = Section("Throughput and memory")
    figs.images["Throughput per schedule"] = to_png(plot_throughput(res.steps))
    figs.images["Peak memory per schedule"] = to_png(plot_memory(res.ranks))
    figs.images["Throughput vs peak memory"] = to_png(plot_pareto(runs))
    sections.append(figs)
    sections.extend(_timeline_sections(res))
    sections.extend(plan_sections(res, fidelity))
    return sections


def fidelity_sections(
    res: BenchResults, tables: list[tuple[str, int, pd.DataFrame]]
) -> list[Section]:
    """Leave-one-out fidelity per implementation and M: calibrate on each profiled config in
    turn, predict every config, and compare with the timed medians."""
    out = []
    for impl, m, table in tables:
        out.append(
            table_section(
                f"Simulator fidelity ({impl}, M={m})",
                fidelity_shown(table),
                "error of the predicted step time against the timed median of each config "
                "(columns), calibrated on the profiled steps of one config (rows: per-action "
                f"medians over {res.spec.profile_steps} profiled steps, compute anchored to "
                "that config's timed median, so the diagonal is 0 by construction). Largest "
                f"|error|: {fidelity_worst(table) * 100:.1f}% (goal: within 5%). "
                + sweep_timing_sentence(res.steps, res.measured, impl, m, table)
                + comm_thread_sentence(res.measured, impl, m)
                + split_sentence(res.measured, impl, m)
                + (
                    ""
                    if impl == "vpipe"
                    else " torch's traces mark no waits: vpipe reads them from the operators "
                    "(the time in an action before its first operator; for Schedule1F1B, "
                    "between two runs of operators, across a communication call)."
                ),
            )
        )
    return out


def comm_thread_sentence(runs: pd.DataFrame, impl: str, m: int) -> str:
    """What the communication threads took of the cores compute needed, per step, where the
    sweep measured it (:mod:`vpipe.trace.thread_cpu`); "" elsewhere."""
    if "comm_thread_cpu_s" not in runs.columns:
        return ""
    mine = runs[(runs["impl"] == impl) & (runs["microbatches"] == m)]
    ms = pd.to_numeric(mine["comm_thread_cpu_s"], errors="coerce").dropna() * 1e3
    if ms.empty:
        return ""
    rows = mine.loc[ms.index]
    share = ms / (rows["step_time_s"].astype(float) * 1e3 * rows["ranks"].astype(float))
    return (
        f" The communication threads ran {ms.min():.1f}-{ms.max():.1f} ms of CPU per step, "
        f"all ranks together ({share.min() * 100:.1f}-{share.max() * 100:.1f}% of the ranks' "
        "time), on cores the compute threads needed; each prediction charges them per message "
        "posted."
    )


def split_sentence(runs: pd.DataFrame, impl: str, m: int) -> str:
    """What a split backward cost over a fused B on the configs' stages, where the sweep
    probed it (:mod:`vpipe.sweep.split_probe`); "" elsewhere."""
    if "split_backward_ratio" not in runs.columns:
        return ""
    mine = runs[(runs["impl"] == impl) & (runs["microbatches"] == m)]
    ratio = pd.to_numeric(mine["split_backward_ratio"], errors="coerce").dropna()
    if ratio.empty:
        return ""
    return (
        f" A split backward (I, then W) cost {ratio.min():.2f}-{ratio.max():.2f}x a fused B "
        "on the configs' stages (each config's probe, before its profiled steps); predictions "
        "between schedules that split and schedules that do not charge it."
    )


def fidelity_tables(res: BenchResults) -> list[tuple[str, int, pd.DataFrame]]:
    """The sweep's leave-one-out tables (:func:`vpipe.predict.leave_one_out.leave_one_out_tables`):
    (impl, M, table) each."""
    from vpipe.predict.leave_one_out import leave_one_out_tables

    meta = {"model": res.spec.model, "sizes": res.meta.get("model_sizes")}
    return list(leave_one_out_tables(res.measured, res.events.get, res.spec.ranks, meta))


def fidelity_shown(table: pd.DataFrame) -> pd.DataFrame:
    """A leave-one-out table with its errors as signed percentages."""
    return table.assign(
        **{c: table[c].map(lambda e: "" if pd.isna(e) else f"{e * 100:+.1f}%")
           for c in table.columns[1:]}
    )  # fmt: skip


def _timeline_sections(res: BenchResults) -> list[Section]:
    from vpipe.report.gantt import plot_gantt, plot_memory_timeline
    from vpipe.report.plots import to_png
    from vpipe.schedules.catalogue import display_order

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
    for sched in display_order(runs["schedule"].unique()):
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
                row = runs[(runs["schedule"] == sched) & (runs["microbatches"] == m)
                           & (runs["impl"] == impl)]  # fmt: skip
                timed = float(row["step_time_s"].iloc[0]) * 1e3 if len(row) else None
                mems.append(x.assign(label=f"{sched} {impl}", timed_ms=timed))
    if mems:
        mem.images[f"Saved activations over time M={m}"] = to_png(
            plot_memory_timeline(
                pd.concat(mems, ignore_index=True),
                "Bytes saved for backward during one metered step, per rank (one more step, "
                "with hooks counting the saved tensors: its length is not the step time)",
            )
        )
    return [s for s in (gantt, mem) if s.images]


def _one_step(ev: pd.DataFrame) -> pd.DataFrame:
    """The events of the last profiled step (spans outside a step are dropped)."""
    ev = ev[ev["step"] >= 0]
    return ev[ev["step"] == ev["step"].max()] if len(ev) else ev

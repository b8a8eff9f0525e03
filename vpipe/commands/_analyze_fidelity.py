"""``vpipe analyze STORE --fidelity``: the leave-one-out fidelity of every sweep in a store, as
the bench report shows it."""

from __future__ import annotations

from pathlib import Path

from vpipe.errors import TraceError


def fidelity_text(source: str) -> str:
    """Leave-one-out fidelity of every sweep in a store, as the bench report has it."""
    import pandas as pd

    from vpipe.predict.leave_one_out import leave_one_out_tables
    from vpipe.predict.timing_noise import sweep_timing_sentence
    from vpipe.sweep.write import fidelity_shown, fidelity_worst
    from vpipe.trace.store import Store

    if not (Path(source) / "runs").is_dir():
        raise TraceError(f"{source}: --fidelity needs a results store (a vpipe bench output)")
    store = Store(source)
    runs = store.runs()
    runs = runs[runs["source"].fillna("measured") == "measured"]
    sweeps = runs.groupby(runs["bench_id"].fillna(""), sort=True)
    steps_file = Path(source) / "steps.parquet"  # a bench output: its one sweep's timed steps
    steps = pd.read_parquet(steps_file) if steps_file.is_file() and len(sweeps) == 1 else None
    lines = []
    for bench_id, sweep in sweeps:
        meta = store.run_meta(str(sweep["run_id"].iloc[0]))
        events_of = lambda run_id: store.events([run_id])  # noqa: E731
        for impl, m, table in leave_one_out_tables(sweep, events_of, int(meta["ranks"]), meta):
            lines += [
                f"{bench_id or 'runs'} {impl} M={m}: largest |error| "
                f"{fidelity_worst(table) * 100:.1f}% (rows: calibrated on; columns: predicted; "
                "errors vs timed medians)",
                fidelity_shown(table).to_string(index=False),
            ]
            if steps is not None:
                lines.append(sweep_timing_sentence(steps, sweep, impl, m, table))
            lines.append("")
    if not lines:
        raise TraceError(f"{source}: no sweep with two profiled configs of one impl and M")
    return "\n".join(lines).rstrip()

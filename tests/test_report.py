"""Reports and plots from synthetic tables: ratios, comparisons, self-contained HTML, and a
headless-Chromium screenshot of a report (skipped where Chromium is not installed)."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pandas as pd
import pytest

from vpipe.cli import main
from vpipe.events import events_frame, memory_frame
from vpipe.report.comparison import Sweep, comparison_table
from vpipe.report.document import (
    ReportError,
    Section,
    impl_table,
    render_html,
    summary_table,
    v_vs_baseline,
)
from vpipe.report.gantt import plot_gantt, plot_memory_timeline
from vpipe.report.plots import (
    plot_memory,
    plot_throughput,
    to_png,
)
from vpipe.schedules.catalogue import display_order
from vpipe.trace.store import Store, write_parquet


def _runs(
    scale: float = 1.0, commit: str = "aaaa", host: str = "h1", threads: int = 1
) -> pd.DataFrame:
    rows = []
    for sched, t, mem in (
        ("interleaved-1f1b", 0.10, 400),
        ("zbv", 0.08, 300),
        ("dualpipev", 0.09, 600),
    ):
        for impl, f in (("vpipe", 1.0), ("torch", 1.25)):
            st = t * f * scale
            rows.append(
                dict(
                    run_id=f"b-{sched}-m4-{impl}",
                    source="measured",
                    commit=commit,
                    host=host,
                    torch="2.13.0+cpu",
                    threads=threads,
                    device="cpu",
                    backend="gloo",
                    ranks=2,
                    model="mlp",
                    sizes='{"d_model": 256}',
                    batch=32,
                    bench_id=f"b{commit}",
                    schedule=sched,
                    microbatches=4,
                    impl=impl,
                    step_time_s=st,
                    step_time_q1_s=st * 0.95,
                    step_time_q3_s=st * 1.1,
                    samples_per_s=32 / st,
                    peak_memory_bytes=mem * 2**20,
                    bubble_ratio=0.2,
                )
            )
    return pd.DataFrame(rows)


def _timed(
    runs: pd.DataFrame, rounds: int = 3, steps: int = 3, seed: int = 0, refs: bool = True
) -> pd.DataFrame:
    """Timed steps of every config of ``runs`` around its median: step k of round r is the
    config's median times one machine-state factor per (r, k), as back-to-back configs see;
    with the host-speed reference before each (``refs``; a fixed 5 ms: the same host)."""
    noise = 1 + 0.02 * np.random.default_rng(seed).standard_normal((rounds, steps))
    return pd.DataFrame(
        [
            dict(
                schedule=row.schedule,
                microbatches=row.microbatches,
                impl=row.impl,
                round=r,
                step=k,
                step_time_s=row.step_time_s * noise[r, k],
                **({"ref_s": 0.005} if refs else {}),
            )
            for row in runs.itertuples()
            for r in range(rounds)
            for k in range(steps)
        ]
    )


def _host(rounds: int = 3, other: float = 0.05) -> pd.DataFrame:
    """A quiet host's state per round, as vpipe bench records it."""
    return pd.DataFrame(
        [{"load1": 0.2, "mhz": 2600.0, "other_cores": other, "free_cores": 2 - other,
          "steal": 0.0, "block": 0, "round": r, "ref_s": 0.005} for r in range(rounds)]
    )  # fmt: skip


def _sweep(label: str, runs: pd.DataFrame, seed: int) -> Sweep:
    """A sweep whose host can be judged: timed steps, references and host state."""
    return Sweep(label, runs, _timed(runs, seed=seed), _host())


def _steps(rng: np.random.Generator) -> pd.DataFrame:
    rows = []
    for sched in ("interleaved-1f1b", "zbv"):
        for r in range(2):
            for k in range(3):
                for impl, f in (("vpipe", 1.0), ("torch", 2.0)):
                    t = 0.05 * f * (1 + 0.01 * rng.random())
                    rows.append(
                        dict(
                            schedule=sched,
                            microbatches=4,
                            impl=impl,
                            round=r,
                            step=k,
                            step_time_s=t,
                            samples_per_s=16 / t,
                        )
                    )
    return pd.DataFrame(rows)


def _events() -> pd.DataFrame:
    rows = []
    for rank in range(2):
        t = 1000 * rank
        for mb in range(3):
            for kind in ("F", "I", "W"):
                rows.append(
                    dict(
                        run_id="r",
                        source="measured",
                        impl="vpipe",
                        schedule="zbv",
                        rank=rank,
                        step=0,
                        stage=rank,
                        microbatch=mb,
                        kind=kind,
                        name=f"{rank}{kind}{mb}",
                        start_ns=t,
                        end_ns=t + 800,
                    )
                )
                t += 1000
    return events_frame(rows)


def test_display_order_puts_baselines_first():
    assert display_order(["zbv", "custom", "interleaved-1f1b", "1f1b"]) == [
        "1f1b",
        "interleaved-1f1b",
        "zbv",
        "custom",
    ]


def test_summary_and_v_ratios():
    runs = _runs()
    table = summary_table(runs)
    assert len(table) == 6
    zbv = table[(table["schedule"] == "zbv") & (table["impl"] == "vpipe")].iloc[0]
    assert zbv["thru vs interleaved-1f1b"] == "1.25"  # 0.10 / 0.08
    assert zbv["mem vs interleaved-1f1b"] == "0.75"
    vv = v_vs_baseline(runs, _timed(runs)).set_index(["impl", "schedule"])
    assert vv.loc[("torch", "dualpipev"), "peak memory ratio"] == "1.50"
    # paired steps share the machine's noise: every pairwise ratio is 0.10 / 0.09
    dualpipev = vv.loc[("vpipe", "dualpipev")]
    assert dualpipev["throughput ratio"] == "1.11" and dualpipev["95% CI"] == "1.11-1.11"
    assert dualpipev["verdict"] == "faster" and dualpipev["pairs"] == 9
    assert dualpipev["outliers (excluded)"] == 0


def test_v_vs_baseline_says_no_significant_difference_and_excludes_outliers():
    runs = _runs().assign(step_time_s=0.1)  # every schedule as fast as interleaved-1f1b
    steps = _timed(runs).assign(
        step_time_s=lambda d: (
            d["step_time_s"] * (1 + 0.05 * np.random.default_rng(3).random(len(d)))
        )
    )
    hiccup = (steps["schedule"] == "zbv") & (steps["round"] == 1) & (steps["step"] == 0)
    steps.loc[hiccup, "step_time_s"] *= 10
    vv = v_vs_baseline(runs, steps).set_index(["impl", "schedule"])
    assert (vv["verdict"] == "no significant difference").all()
    for impl in ("vpipe", "torch"):
        lo, hi = (float(x) for x in vv.loc[(impl, "zbv"), "95% CI"].split("-"))
        assert lo < 1 < hi
        assert vv.loc[(impl, "zbv"), "outliers (excluded)"] == 1
        assert vv.loc[(impl, "zbv"), "pairs"] == 8  # the hiccup's pair is left out
        assert vv.loc[(impl, "dualpipev"), "pairs"] == 9


def test_impl_table_pairs_steps(tmp_path):
    table = impl_table(_steps(np.random.default_rng(0)))
    assert list(table["schedule"]) == ["interleaved-1f1b", "zbv"]
    assert (table["pairs"] == 6).all()
    assert all(abs(float(v) - 2.0) < 0.05 for v in table["torch/vpipe step time"])
    assert (table["verdict"] == "vpipe faster").all()
    assert all(float(ci.split("-")[0]) > 1 for ci in table["95% CI"])


def test_comparison_ratio_interval_and_verdict():
    base, fast = _runs(1.0, "aaaa"), _runs(0.5, "bbbb")
    sweeps = [_sweep("aaaa", base, 1), _sweep("bbbb", fast, 2)]
    table = comparison_table(sweeps)
    assert len(table) == 6
    assert all(abs(float(v) - 2.0) < 0.1 for v in table["speedup"])
    assert (table["verdict"] == "faster").all() and (table["steps"] == "9+9").all()
    assert set(table["to settle"]) == {""}  # every verdict is an answer
    assert all(float(ci.split("-")[0]) > 1.5 for ci in table["95% CI"])
    same = comparison_table([sweeps[0], _sweep("again", base, 1)])
    # one launch each of precise steps: the default launch spread (3%) and the runs' drift
    # (2%) leave +-13.5% at the 99.2% each of 6 configs needs (Bonferroni), wider than the
    # noise band's +-10%; the launch part shrinks with blocks: (0.112^2) / (0.10^2 - 0.075^2)
    # = 2.9 -> 3 each
    assert (same["verdict"] == "inconclusive").all()
    assert set(same["to settle"]) == {"3 blocks per run (vpipe bench --blocks 3, both runs)"}
    assert set(same["speedup"]) == {"1.00"}
    one = comparison_table([_sweep("aaaa", base.head(1), 1), _sweep("again", base.head(1), 1)])
    # one config alone: +-10.0% at 95% (launch 8.3%, drift 5.5%), just over the band
    assert list(one["verdict"]) == ["inconclusive"]
    assert list(one["to settle"]) == ["2 blocks per run (vpipe bench --blocks 2, both runs)"]
    slower = base.assign(step_time_s=base.step_time_s * 1.06)
    six = comparison_table([sweeps[0], _sweep("six", slower, 1)])
    # a 6% difference inside +-13.5%: the runs' drift alone (2.64 x 0.02 x sqrt 2 = 7.5%)
    # is wider than 6%, so neither rounds nor blocks can settle it: only the same stretch of
    # time can
    assert (six["verdict"] == "inconclusive").all()
    assert set(six["to settle"]) == {
        "vpipe ab aaaa aaaa [same options] (the runs' own drift alone is +-8%)"
    }
    # runs tables only: the ratio of the recorded medians, no interval
    bare = comparison_table([Sweep("aaaa", base), Sweep("bbbb", fast)])
    assert set(bare["speedup"]) == {"2.00"} and set(bare["95% CI"]) == {""}
    assert set(bare["verdict"]) == {"no interval: runs table only"}
    assert all("vpipe ab aaaa bbbb" in t for t in bare["to settle"])
    with pytest.raises(ReportError, match="at least two"):
        comparison_table([Sweep("aaaa", base)])
    other = base.assign(schedule="gpipe")
    with pytest.raises(ReportError, match="share no"):
        comparison_table([Sweep("aaaa", base), Sweep("x", other)])


def test_runs_whose_host_cannot_be_judged_are_never_faster_or_slower():
    """Sweeps from before vpipe recorded its host (no reference, no host state): a 2x ratio
    with a tight interval is still no verdict, and the table says what would give one."""
    base, fast = _runs(1.0, "aaaa"), _runs(0.5, "bbbb")
    old = [Sweep("aaaa", base, _timed(base, seed=1, refs=False)), Sweep("bbbb", fast, _timed(fast, seed=2, refs=False))]
    table = comparison_table(old)
    assert set(table["verdict"]) == {"inconclusive"}
    assert set(table["host"]) == {"no host state recorded for aaaa and bbbb"}
    assert set(table["to settle"]) == {
        "vpipe ab aaaa bbbb [same options] (no host state recorded for aaaa and bbbb: runs "
        "made apart cannot be judged)"
    }
    half = comparison_table([old[0], _sweep("bbbb", fast, 2)])  # one side recorded
    assert set(half["host"]) == {"no host state recorded for aaaa"}
    assert not set(half["verdict"]) & {"faster", "slower", "within noise"}


def test_few_precise_steps_decide_what_few_noisy_ones_cannot():
    """The evidence a comparison needs follows the noise it measures: four steps spread 0.1%
    give an interval as narrow as the runs' drift allows, four spread 20% one far wider, and
    neither is "too few steps"."""
    base = _runs(1.0, "aaaa").head(1)
    widths = {}
    for spread in (0.001, 0.2):
        steps = []
        for seed in (1, 2):
            d = _timed(base, rounds=2, steps=2, seed=seed)
            noise = np.exp(spread * np.random.default_rng(seed).standard_normal(len(d)))
            steps.append(d.assign(step_time_s=0.1 * noise))
        sweeps = [Sweep("a", base, steps[0], _host()), Sweep("b", base, steps[1], _host())]
        row = comparison_table(sweeps).iloc[0]
        assert row["steps"] == "4+4" and not row["verdict"].startswith("too few")
        low, high = map(float, row["95% CI"].split("-"))
        widths[spread] = np.log(high / low) / 2
        assert (row["verdict"] in ("within noise", "inconclusive")) and (
            row["to settle"] != "" or row["verdict"] == "within noise"
        )
    assert widths[0.001] < 0.11 < 0.25 < widths[0.2], widths


def _store(path, runs: pd.DataFrame, steps: pd.DataFrame | None = None) -> None:
    """A results store of ``runs``, with ``steps.parquet`` as vpipe bench writes it."""
    store = Store(path)
    for row in runs.to_dict("records"):
        store.append_run(row)
    if steps is not None:
        bench_id = runs["bench_id"].iloc[0]
        write_parquet(steps, path / "steps.parquet", {"table": "steps", "bench_id": bench_id})


def _compare(tmp_path, a: pd.DataFrame, b: pd.DataFrame, judged: bool = True) -> tuple[str, str]:
    """``vpipe report A B`` in-process on stores of ``a`` and ``b`` with their timed steps (and
    reference timings and host state when ``judged``)."""
    for name, runs, seed in (("a", a, 1), ("b", b, 2)):
        _store(tmp_path / name, runs, _timed(runs, seed=seed, refs=judged))
        if judged:
            write_parquet(_host(), tmp_path / name / "host.parquet", {"table": "host"})
    out = tmp_path / "cmp.html"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out)]) == 0
    return out.read_text(), out.with_suffix(".md").read_text()


def test_report_cli_compares_two_stores(tmp_path, capsys):
    text, md = _compare(tmp_path, _runs(1.0, "aaaa", "h1"), _runs(0.8, "bbbb", "h1"))
    assert "Speedup over aaaa@h1" in text and "bbbb@h1" in text
    table = md.split("## Speedup over aaaa@h1")[1]
    assert "| speedup | 95% CI | verdict |" in table and "| faster |" in table
    assert "not a speedup" not in md and "runs table only" not in md
    assert md.split("## Verdict\n\n")[1].startswith("winner: bbbb@h1, faster than aaaa@h1")
    assert "| timed steps per config |" in md and "| 9+9 |" in md  # the tables agree
    # stores from before the host-speed reference: compared raw, said so, and no winner
    _, old = _compare(tmp_path / "old", _runs(1.0, "aaaa", "h1"), _runs(0.8, "bbbb", "h1"), judged=False)
    assert "normalisation unavailable: no reference timings in aaaa@h1 and bbbb@h1" in old
    assert old.split("## Verdict\n\n")[1].startswith("no winner at this noise: 6 inconclusive")
    assert "to settle: vpipe ab aaaa bbbb [same options]" in old
    # one run: its summary
    assert main(["report", str(tmp_path / "a"), "-o", str(tmp_path / "one.html")]) == 0
    assert "Summary" in (tmp_path / "one.html").read_text()


def test_report_cli_refuses_a_speedup_across_hosts(tmp_path, capsys):
    text, md = _compare(tmp_path, _runs(1.0, "aaaa", "h1"), _runs(0.8, "bbbb", "h2"))
    assert "Speedup over" not in md and "## Step-time ratio (not a speedup) over aaaa@h1" in md
    assert "| ratio (not a speedup: host differs: h1 vs h2) |" in md
    assert "Not a speedup (host differs: h1 vs h2): the ratio measures the setup" in md
    assert "| faster |" not in md and "not comparable: setup differs" in md
    assert "ratio (not a speedup: host differs: h1 vs h2)" in text


def test_report_cli_refuses_a_speedup_across_thread_counts(tmp_path, capsys):
    _, md = _compare(tmp_path, _runs(1.0, "aaaa", "h1"), _runs(0.8, "bbbb", "h1", threads=2))
    assert "| ratio (not a speedup: threads per rank differs: 1 vs 2) |" in md
    assert "host differs" not in md and "| faster |" not in md


def test_comparison_names_every_setting_that_differs_or_is_missing():
    base, other = _runs(1.0, "aaaa"), _runs(0.5, "bbbb").assign(batch=64)
    table = comparison_table([Sweep("aaaa", base), Sweep("bbbb", other.drop(columns="torch"))])
    assert (
        "ratio (not a speedup: torch version not recorded for bbbb; batch differs: 32 vs 64)"
        in (table.columns)
    )
    assert set(table["verdict"]) == {"not comparable: setup differs"}


def test_report_cli_on_a_bare_runs_file_says_it_has_no_steps(tmp_path, capsys):
    a, b = _runs(1.0, "aaaa", "h1"), _runs(0.8, "bbbb", "h1").assign(regime=4.0)
    _store(tmp_path / "a", a, _timed(a))
    b.to_parquet(tmp_path / "b.parquet")
    out = tmp_path / "cmp.html"
    assert main(["report", str(tmp_path / "a"), str(tmp_path / "b.parquet"), "-o", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "bbbb@h1: runs table only (no steps.parquet)" in md
    assert "| none: runs table only |" in md and "no interval: runs table only" in md
    assert "| 1.25 |" in md  # the runs tables' ratio of medians
    assert "bbbb@h1: Overhead-bound: every profiled config" in md.split("## Runs")[0]


def test_runs_with_profiled_steps_only_compare_profiled_with_profiled(tmp_path, capsys):
    """Runs converted from traces have no timed step: their profiled medians are set against
    each other, never against another run's timed median, and say so by their column."""
    def traced(scale: float, commit: str) -> pd.DataFrame:
        r = _runs(scale, commit, "h1")
        return r.assign(profiled_step_time_s=r["step_time_s"] * 1.1, step_time_s=float("nan"),
                        step_time_q1_s=float("nan"), step_time_q3_s=float("nan"),
                        samples_per_s=float("nan"))  # fmt: skip

    traced(1.0, "aaaa").to_parquet(tmp_path / "a.parquet")
    traced(0.8, "bbbb").to_parquet(tmp_path / "b.parquet")
    _runs(0.8, "cccc", "h1").to_parquet(tmp_path / "c.parquet")  # timed
    out = tmp_path / "cmp.html"
    argv = ["report", str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"),
            str(tmp_path / "c.parquet"), "-o", str(out)]  # fmt: skip
    assert main(argv) == 0
    md = out.with_suffix(".md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| zbv | 4 | vpipe |")]
    assert len(rows) == 2 and "| 1.25 |" in rows[0]  # profiled against profiled
    assert "nan" not in md.lower()
    no_step = traced(1.0, "dddd").assign(profiled_step_time_s=float("nan"))
    no_step.to_parquet(tmp_path / "d.parquet")
    assert main(["report", str(tmp_path / "d.parquet"), "-o", str(out)]) == 2
    assert "no values for ['step_time_s or profiled_step_time_s']" in capsys.readouterr().err


def test_report_cli_bad_input_is_one_line_error(tmp_path, capsys):
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    assert main(["report", str(tmp_path / "junk.parquet"), "-o", str(tmp_path / "x.html")]) == 2
    err = capsys.readouterr().err.strip()
    assert "junk.parquet" in err and "\n" not in err
    assert main(["report", str(tmp_path / "nowhere"), "-o", str(tmp_path / "x.html")]) == 2
    assert "no runs table" in capsys.readouterr().err


def _report_html() -> str:
    rng = np.random.default_rng(1)
    steps = _steps(rng)
    ranks = pd.DataFrame(
        [
            dict(schedule=s, microbatches=4, impl=i, rank=r, peak_bytes=(r + 1) * 2**20)
            for s in ("interleaved-1f1b", "zbv")
            for i in ("vpipe", "torch")
            for r in range(2)
        ]
    )
    mem = memory_frame(
        [
            dict(
                run_id="r-vpipe",
                source="measured",
                rank=r,
                step=0,
                t_ns=i * 1000,
                bytes=(i % 7) * 10**6,
                what="saved_activations",
            )
            for r in range(2)
            for i in range(30)
        ]
    )
    sec = Section("Figures")
    sec.images["throughput"] = to_png(plot_throughput(steps))
    sec.images["memory"] = to_png(plot_memory(ranks))
    sec.images["gantt"] = to_png(plot_gantt([("measured", _events()), ("simulated", _events())]))
    sec.images["memory over time"] = to_png(plot_memory_timeline(mem))
    return render_html("test report", [Section("Summary", "<p>hello</p>", "hello"), sec])


def test_html_is_self_contained():
    text = _report_html()
    assert text.count('src="data:image/png;base64,') == 4
    assert not re.search(r"https?://", text)
    assert "<link" not in text and "<script" not in text


def _chromium() -> str | None:
    return (
        shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )


@pytest.mark.skipif(_chromium() is None, reason="chromium not installed (apt-get install chromium)")
def test_html_renders_in_headless_chromium(tmp_path):
    page = tmp_path / "report.html"
    page.write_text(_report_html())
    shot = tmp_path / "shot.png"
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--proxy-server=127.0.0.1:9",
        "--window-size=1200,2400",
        f"--screenshot={shot}",
        page.as_uri(),
    ]
    subprocess.run(cmd, capture_output=True, timeout=90, check=False)
    assert shot.exists(), "chromium wrote no screenshot"
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)[..., :3]
    # the embedded plots (colored bars) must be visible: many non-gray pixels, high variance
    colorful = (img.max(axis=2) - img.min(axis=2)) > 0.2
    assert img.std() > 0.05
    assert colorful.mean() > 0.01, f"screenshot looks blank ({colorful.mean():.4f} colored)"


def test_a_data_parallel_sweep_is_not_a_speedup_over_a_pipeline_only_one(tmp_path, capsys):
    """A pipeline-only sweep records no dp column: it compares as dp 1."""
    _, md = _compare(tmp_path, _runs(1.0, "aaaa", "h1"), _runs(0.8, "bbbb", "h1").assign(dp=2))
    assert "| ratio (not a speedup: data-parallel replicas differs: 1 vs 2) |" in md
    assert "| faster |" not in md

"""``vpipe ab A B [bench options] --out DIR``: two versions compared in the same stretch of time,
their launches alternating (:mod:`vpipe.sweep.ab`), with the verdicts of ``vpipe report``."""

from __future__ import annotations

import argparse
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ab",
        help="compare two versions (git revisions or checkouts) with alternating launches",
        description="Run the same vpipe bench sweep for two versions, A and B (each a git "
        "revision of this repository or a directory holding a vpipe checkout, each in its own "
        "cached worktree and environment), alternating their launches A B B A A B ... until "
        "every config's verdict is settled or a limit is reached. Any option not listed here "
        "goes to both sides' vpipe bench (e.g. --schedules, --sizes, --batch, --rounds). "
        "DIR gets both sides' stores (DIR/A, DIR/B), report.md, report.html and session.json.",
    )
    p.add_argument("a", metavar="A", help="git revision or vpipe checkout directory")
    p.add_argument("b", metavar="B", help="git revision or vpipe checkout directory")
    p.add_argument("bench", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run_ab)


def own_options() -> argparse.ArgumentParser:
    """vpipe ab's own options, taken out of the arguments that follow A and B."""
    p = argparse.ArgumentParser(prog="vpipe ab", add_help=False)
    p.add_argument("--out", required=True, metavar="DIR", help="where the session goes")
    p.add_argument("--pairs", type=int, default=8, help="at most this many pairs (default 8)")
    p.add_argument(
        "--max-minutes", type=float, default=20.0, help="stop after this long (default 20)"
    )
    p.add_argument(
        "--inject-delay-ms-b",
        type=float,
        default=0.0,
        metavar="MS",
        help="slow B alone by MS per step (a known slowdown, to check that one is caught)",
    )
    p.add_argument("--force", action="store_true", help="empty DIR first if it holds anything")
    p.add_argument(
        "--cache",
        default=None,
        metavar="DIR",
        help="worktrees and environments (default: .vpipe-ab at the repository's top)",
    )
    return p


def run_ab(args: argparse.Namespace) -> int:
    import shutil
    from pathlib import Path

    from vpipe.outputs import atomic_write, check_output_dir
    from vpipe.sweep.ab import AbError, check_bench_args, run_session, session_record
    from vpipe.sweep.envs import CACHE, EnvError, prepare, repo_root

    mine, bench = own_options().parse_known_args(args.bench)
    check_bench_args(bench)
    if mine.pairs < 2 or mine.max_minutes <= 0 or mine.inject_delay_ms_b < 0:
        raise AbError("--pairs must be >= 2, --max-minutes and --inject-delay-ms-b positive")
    if mine.inject_delay_ms_b and any(a.startswith("--inject-delay-ms") for a in bench):
        raise AbError("give --inject-delay-ms (both sides) or --inject-delay-ms-b, not both")
    out = check_output_dir(mine.out, append=False, force=mine.force)
    if mine.force and out.exists():
        shutil.rmtree(out)
    try:
        repo: Path | None = repo_root(Path.cwd())
    except EnvError:  # versions must then be directories
        repo = None
    cache = Path(mine.cache) if mine.cache else (repo or Path.cwd()) / CACHE
    versions = {}
    for label, name in (("A", args.a), ("B", args.b)):
        t0 = time.perf_counter()
        v = prepare(label, name, repo, cache)
        how = "reused" if v.reused else f"made in {time.perf_counter() - t0:.0f} s"
        print(f"{v.describe}: environment {how}", flush=True)
        versions[label] = v
    out.mkdir(parents=True, exist_ok=True)
    delay = ["--inject-delay-ms", f"{mine.inject_delay_ms_b:g}"] if mine.inject_delay_ms_b else []
    looks = mine.pairs - 1  # a look after every pair from the second

    def table_of(session: object) -> object:
        from vpipe.report.ab_report import session_table

        return session_table(
            session.ready, session.launches, looks=looks, labels=labels,
            delay_b_ms=mine.inject_delay_ms_b,
        )[0]  # fmt: skip

    def settled(session: object) -> bool:
        from vpipe.report.ab_report import settled as all_settled

        return all_settled(table_of(session))

    labels = {k: v.describe.split(" = ", 1)[1] for k, v in versions.items()}
    session, wrote = run_session(
        versions,
        {"A": bench, "B": bench + delay},
        out,
        pairs=mine.pairs,
        max_minutes=mine.max_minutes,
        settled=settled,
        progress=lambda line: print(line, flush=True),
    )
    line = write_report(out, session, labels, looks, mine.inject_delay_ms_b)
    atomic_write(out / "session.json", lambda p: p.write_text(session_record(session, versions, bench)))
    print(line)
    print(f"{session.stopped}; {'; '.join(wrote)}; {session.wall_s:.0f} s; report: {out / 'report.html'}")
    if session.interrupted:
        raise KeyboardInterrupt("; ".join(wrote))
    if session.error:
        raise AbError(session.error)
    return 0


def write_report(out, session, labels, looks, delay_b_ms) -> str:  # noqa: ANN001
    """report.html and report.md of the session's finished pairs; its one-line verdict."""
    from vpipe.outputs import atomic_write
    from vpipe.report.ab_report import ab_report

    if len(session.ready) < 2:
        return "no verdict: a side did not start"
    html, md, _ = ab_report(
        session.ready, session.launches, looks=looks, labels=labels, stopped=session.stopped,
        delay_b_ms=delay_b_ms,
    )  # fmt: skip
    atomic_write(out / "report.html", lambda p: p.write_text(html, encoding="utf-8"))
    atomic_write(out / "report.md", lambda p: p.write_text(md, encoding="utf-8"))
    return md.split("## Verdict\n\n", 1)[1].split("\n", 1)[0]

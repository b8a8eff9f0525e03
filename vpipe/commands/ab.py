"""``vpipe ab A B [bench options] --out DIR``: two versions compared in the same stretch of time,
their launches alternating (:mod:`vpipe.sweep.ab`), with the verdicts of ``vpipe report``."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vpipe.sweep.ab import Session


# A gated session's rounds (vpipe.sweep.gate) unless the sweep options set them: the default
# sweep's 9 timed steps per config as 9 rounds of one, so that the two versions alternate
# every round (a fraction of a second) and each pair has 9 round-by-round differences
GATED_ROUNDS = ("--rounds", "9", "--steps", "1")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ab",
        help="compare two versions (git revisions or checkouts) with alternating launches",
        description="Run the same vpipe bench sweep for two versions, A and B (each a git "
        "revision of this repository or a directory holding a vpipe checkout, each in its own "
        "cached worktree and environment), alternating their launches A B B A A B ... until "
        "B is faster or slower over all configs, or every config's verdict is settled, or a "
        "limit is reached. Any option not listed here "
        "goes to both sides' vpipe bench (e.g. --schedules, --sizes, --batch, --rounds). "
        "DIR gets both sides' stores (DIR/A, DIR/B), report.md, report.html and session.json.",
    )
    p.add_argument("a", metavar="A", help="git revision or vpipe checkout directory")
    p.add_argument("b", metavar="B", help="git revision or vpipe checkout directory")
    p.add_argument("bench", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run_ab)


def own_options() -> argparse.ArgumentParser:
    """vpipe ab's own options, taken out of the arguments that follow A and B (whole names
    only: --inject-delay-ms is vpipe bench's, for both sides, not --inject-delay-ms-b)."""
    p = argparse.ArgumentParser(prog="vpipe ab", add_help=False, allow_abbrev=False)
    p.add_argument("--out", required=True, metavar="DIR", help="where the session goes")
    p.add_argument("--pairs", type=int, default=8, help="at most this many pairs (default 8)")
    p.add_argument(
        "--max-minutes",
        type=float,
        default=20.0,
        help="the session's time limit, from the command's start (less any time spent making "
        "an environment): no pair starts that would not end within it, judged by the pairs so "
        "far (default 20; the first two pairs always run)",
    )
    p.add_argument(
        "--inject-delay-ms-b",
        type=float,
        default=0.0,
        metavar="MS",
        help="slow B alone by MS per step (a known slowdown, to check that one is caught)",
    )
    p.add_argument(
        "--inject-delay-pct-b",
        type=float,
        default=0.0,
        metavar="PCT",
        help="slow B alone by PCT%% of its step (a sleep of PCT%% of the previous step, so the "
        "slowdown stays that share of the step under any load, as extra work would)",
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

    from vpipe.outputs import atomic_write, check_output_dir
    from vpipe.sweep.ab import (
        AbError,
        check_bench_args,
        process_start,
        run_session,
        session_record,
    )
    from vpipe.sweep.envs import CACHE, EnvError, prepare, repo_root

    mine, bench = own_options().parse_known_args(args.bench)
    check_bench_args(bench)
    if mine.pairs < 2 or mine.max_minutes <= 0:
        raise AbError("--pairs must be >= 2 and --max-minutes positive")
    if min(mine.inject_delay_ms_b, mine.inject_delay_pct_b) < 0:
        raise AbError("--inject-delay-ms-b and --inject-delay-pct-b must be >= 0")
    delay, delay_b = [], []
    for flag, value, unit in (("--inject-delay-ms", mine.inject_delay_ms_b, " ms"),
                              ("--inject-delay-pct", mine.inject_delay_pct_b, "% of the step")):  # fmt: skip
        if not value:
            continue
        if any(a.split("=", 1)[0] == flag for a in bench):
            raise AbError(f"give {flag} (both sides) or {flag}-b, not both")
        delay += [flag, f"{value:g}"]
        delay_b.append(f"{value:g}{unit}")
    given = {a.split("=", 1)[0] for a in bench}
    if not given & {"--rounds", "--steps"}:
        bench = [*bench, *GATED_ROUNDS]
    out = check_output_dir(mine.out, append=False, force=mine.force)
    if mine.force and out.exists():
        shutil.rmtree(out)
    try:
        repo: Path | None = repo_root(Path.cwd())
    except EnvError:  # versions must then be directories
        repo = None
    cache = Path(mine.cache) if mine.cache else (repo or Path.cwd()) / CACHE
    versions = {}
    making = 0.0  # seconds spent making (installing) environments: not the session's time
    for label, name in (("A", args.a), ("B", args.b)):
        t0 = time.perf_counter()
        v = prepare(label, name, repo, cache)
        took = time.perf_counter() - t0
        making += 0.0 if v.reused else took
        how = "reused" if v.reused else f"made in {took:.0f} s"
        print(f"{v.describe}: environment {how}", flush=True)
        versions[label] = v
    out.mkdir(parents=True, exist_ok=True)

    def table_of(session: Session, alpha: float) -> Any:
        from vpipe.report.ab_report import session_table

        return session_table(
            session.ready, session.launches, alpha=alpha, labels=labels,
            delay_b=" + ".join(delay_b),
        )[0]  # fmt: skip

    def settled(session: Session, alpha: float) -> bool:
        from vpipe.report.ab_report import settled as all_settled

        return all_settled(table_of(session, alpha))

    from vpipe.sweep.launched import method

    notes = [n for n in (same_version(versions), method(versions)) if n]
    for n in notes:
        print(n, flush=True)
    labels = {k: v.describe.split(" = ", 1)[1] for k, v in versions.items()}
    if labels["A"] == labels["B"]:  # the same version twice: the verdict names the side
        labels = {k: f"{k}: {v}" for k, v in labels.items()}
    session, wrote = run_session(
        versions,
        {"A": bench, "B": bench + delay},
        out,
        pairs=mine.pairs,
        max_minutes=mine.max_minutes,
        settled=settled,
        progress=lambda line: print(line, flush=True),
        started=process_start() + making,  # the command's time, but for making environments
        launched=bool(method(versions)),
    )
    line = write_report(out, session, labels, " + ".join(delay_b), notes)
    atomic_write(out / "session.json", lambda p: p.write_text(session_record(session, versions, bench)))
    print(line)
    print(f"{session.stopped}; {'; '.join(wrote)}; {session.wall_s:.0f} s; report: {out / 'report.html'}")
    if session.interrupted:
        raise KeyboardInterrupt("; ".join(wrote))
    if session.error:
        raise AbError(session.error)
    return 0


def same_version(versions: dict[str, Any]) -> str:
    """A line saying that A and B are one commit (or one checkout), so the session is an A/A
    comparison; empty otherwise."""
    a, b = versions["A"], versions["B"]
    if a.commit and a.commit == b.commit:
        what = f"the same commit, {a.commit[:12]}"
    elif a.checkout == b.checkout:
        what = f"the same checkout, {a.checkout}"
    else:
        return ""
    return f"A ({a.name}) and B ({b.name}) are {what}: an A/A comparison, of noise only"


def write_report(
    out: Path, session: Session, labels: dict[str, str], delay_b: str, notes: Sequence[str] = ()
) -> str:
    """report.html and report.md of the session's finished pairs, at the error rate of the look
    that ended it (:func:`vpipe.report.looks.report_alpha`); its one-line verdict."""
    from vpipe.outputs import atomic_write
    from vpipe.report.ab_report import ab_report
    from vpipe.report.looks import report_alpha

    if len(session.ready) < 2:
        return "no verdict: a side did not start"
    html, md, _ = ab_report(
        session.ready, session.launches, alpha=report_alpha(session.looks), labels=labels,
        stopped="; ".join([session.stopped, *notes]), delay_b=delay_b,
    )  # fmt: skip
    atomic_write(out / "report.html", lambda p: p.write_text(html, encoding="utf-8"))
    atomic_write(out / "report.md", lambda p: p.write_text(md, encoding="utf-8"))
    return md.split("## Verdict\n\n", 1)[1].split("\n", 1)[0]

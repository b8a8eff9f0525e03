"""How much gated pairs spread beyond their sampling noise, quiet and under a CPU hog
(``python -m bench.gated_spread``): the input behind :data:`vpipe.report.pairs`' floors.

    python -m bench.gated_spread [--sessions 6] [--pairs 6] [--sweep "--impl vpipe ..."]
                                 [--kinds quiet,hog] [--keep DIR]

Runs ``vpipe ab HEAD HEAD``'s session (:func:`vpipe.sweep.ab.run_session`, gated rounds) on
this checkout's HEAD with a fixed number of pairs (no look ends it early), the kinds
interleaved session by session: ``quiet``, and ``hog`` (a busy loop pinned to core 0 from
before the first launch to the end). Per kind it prints, pooled over configs and sessions
(the figure fitted per session, as the report does): tau, the sd of a pair's log(A/B)
beyond its sampling noise (:func:`vpipe.report.pairs.pair_spread`) with its degrees of
freedom and a one-sided 95% upper bound; the pairs' sampling sd; their total sd; and how
many pairs counted as loaded. A/A, so every pair's true difference is 0.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SWEEP = "--impl vpipe --schedules 1f1b,zbv --microbatches 4 --sizes d_model=512,d_hidden=2048 --batch 128"
HOG = "import os\nif hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, {0})\nwhile True: pass"


def one_session(version: Any, bench: list[str], out: Path, pairs: int, hog: bool) -> dict[str, Any]:
    """A session of exactly ``pairs`` gated pairs (A/A); its record (as ``session.json``)."""
    from vpipe.sweep.ab import run_session, session_record

    proc = subprocess.Popen([sys.executable, "-c", HOG]) if hog else None
    try:
        session, _ = run_session(
            {"A": version, "B": version}, {"A": bench, "B": bench}, out, pairs=pairs,
            max_minutes=1e6, settled=lambda s, a: False, progress=lambda line: None,
        )  # fmt: skip
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=10)
    if session.error or session.pairs_done() < pairs:
        raise SystemExit(f"session stopped: {session.stopped}")
    return json.loads(session_record(session, {"A": version, "B": version}, bench))


def spreads(records: list[dict[str, Any]]) -> dict[str, Any]:
    """tau^2 pooled over the records' configs (:func:`vpipe.report.pairs.pair_spread`, less the
    fitted weights), the mean sampling variance, the pooled variance about the configs' means,
    and the loaded share of the pairs."""
    from vpipe.report.ab_report import session_figure, session_pairs
    from vpipe.report.pairs import differences, pair_spread

    configs, fitted, loaded, total = [], 0, 0, 0
    for rec in records:
        pairs = session_pairs(rec["ready"], [(x["side"], x) for x in rec["launches"]])
        figure, _ = session_figure(rec["ready"], pairs)
        fitted += figure.fitted
        for ps in pairs.values():
            configs.append(differences(ps, figure.weight))
            loaded += sum(p.loaded for p in ps)
            total += len(ps)
    measured = pair_spread(configs, fitted)
    about_mean = sum(float(((d - d.mean()) ** 2).sum()) for d, _ in configs)
    dof = sum(d.size - 1 for d, _ in configs) - fitted
    return {
        "tau2": measured[0] if measured else math.nan,
        "dof": measured[1] if measured else 0,
        "sampling_var": float(np.mean(np.concatenate([v for _, v in configs]))),
        "total_var": about_mean / dof if dof > 0 else math.nan,
        "loaded": loaded,
        "pairs": total,
    }


def upper_bound(tau2: float, dof: int, total_var: float) -> float:
    """A one-sided 95% upper bound of tau, from the pairs' total variance's chi-square bound
    less the sampling part (a normal approximation of the chi-square quantile)."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.05)
    low = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3  # Wilson-Hilferty
    sampling = total_var - tau2 if tau2 > 0 else 0.0
    return math.sqrt(max(total_var * dof / low - sampling, 0.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gated_spread", description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=6, help="sessions of each kind")
    ap.add_argument("--pairs", type=int, default=6, help="pairs per session")
    ap.add_argument("--sweep", default=SWEEP, help="the sweep options of both sides")
    ap.add_argument("--kinds", default="quiet,hog", help="quiet, hog or both, interleaved")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep every session.json here")
    args = ap.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or set(kinds) - {"quiet", "hog"}:
        ap.error("--kinds: quiet, hog or quiet,hog")
    from vpipe.commands.ab import GATED_ROUNDS
    from vpipe.sweep.envs import CACHE, prepare, repo_root

    repo = repo_root(ROOT)
    version = prepare("A", "HEAD", repo, repo / CACHE)
    bench = [*shlex.split(args.sweep), *GATED_ROUNDS]
    records: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.sessions):
            for kind in kinds:
                out = Path(tmp) / f"{kind}{i}"
                rec = one_session(version, bench, out, args.pairs, kind == "hog")
                records[kind].append(rec)
                s = spreads([rec])
                print(f"{kind} {i + 1}: {s['pairs']} pair-configs, {s['loaded']} loaded; "
                      f"total sd {math.sqrt(s['total_var']):.4f}, tau "
                      f"{math.sqrt(s['tau2']):.4f} ({s['dof']} dof)", flush=True)  # fmt: skip
                if args.keep:
                    Path(args.keep).mkdir(parents=True, exist_ok=True)
                    (Path(args.keep) / f"{kind}{i:02d}.json").write_text(json.dumps(rec))
    print()
    for kind, recs in records.items():
        s = spreads(recs)
        print(f"{kind}: {len(recs)} sessions of {args.pairs} pairs; {s['loaded']} of "
              f"{s['pairs']} pair-configs loaded; tau (sd of a pair's log A/B beyond sampling "
              f"noise) {math.sqrt(s['tau2']):.4f} over {s['dof']} dof, 95% upper bound "
              f"{upper_bound(s['tau2'], s['dof'], s['total_var']):.4f}; sampling sd "
              f"{math.sqrt(s['sampling_var']):.4f}; total sd {math.sqrt(s['total_var']):.4f}")  # fmt: skip
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``vpipe ab``: two versions of vpipe compared in the same stretch of time.

Each version (:mod:`vpipe.sweep.envs`: a git revision or a checkout, with its own environment)
runs as one paced ``vpipe bench`` process (:mod:`vpipe.sweep.paced`) with the same sweep
options. Both start together; then their launches alternate A B B A A B ... (one block each),
so whatever the host does in the meantime hits both, and each adjacent pair of launches gives
a ratio per config (:mod:`vpipe.report.pairs`). Where both sides can (their ``ready`` says
``gated``), a pair's two launches are open at once and their timed rounds alternate A B B A
... (:func:`_gated_pair`, :mod:`vpipe.sweep.gate`): the versions then run a fraction of a
second apart, not a launch apart, and the pair is compared round by round. After each pair
from the second on, the session looks at its verdicts and stops once B is faster or slower over all configs, or every
config's verdict is settled (faster, slower or within noise), or at its last look: when
``pairs`` pairs are done, or when another pair would not end within ``max_minutes`` (the
session's time limit, start, stores and report included). Each side
then writes its finished blocks as one store (``DIR/A``, ``DIR/B``: ``vpipe bench
--blocks K`` outputs, which ``vpipe report`` also reads), and the session its report
(``DIR/report.md`` with a ``verdict`` column, ``DIR/report.html``, ``DIR/session.json``).

Ctrl-C stops the launch in progress (that block is dropped), and both sides still write what
finished; a side that fails to start or to launch is reported in one line, and the other side's
finished blocks are written all the same.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from vpipe.errors import VpipeError
from vpipe.sweep.envs import Version
from vpipe.sweep.launched import LaunchedSide, LaunchError
from vpipe.sweep.paced import PREFIX, parse_reply

FORBIDDEN = ("--out", "--append", "--force", "--blocks", "--traces", "--paced", "--profile-steps")
READY_TIMEOUT_S = 600.0
BLOCK_TIMEOUT_S = 1800.0
# both sides writing their stores at once (about 2 s on 2 cores), then the session's report
# (about 1 s), then the command's exit; a session under a hog ran 1 s past a 58 s limit with
# 3 s kept, and with 4 s, 4 of 60 sessions ran 0.3-1 s past 65-88 s limits on 2026-12-06, when
# CPU steal took 20-44% of the host for minutes at a time
FINISH_RESERVE_S = 5.0
# ... and twice that after a pair that other processes loaded: with a one-core hog on from
# their first seconds, sessions' sides took 7.5 s to write their stores, and 2 of 2 ran 1.5 s
# past a 76 s limit (python -m bench.false_alarms --ab --hog-throughout, 2026-12-06)
LOADED_FINISH_FACTOR = 2.0


class AbError(VpipeError, RuntimeError):
    """A session that cannot go on: which side, and why, in one line."""


def check_bench_args(args: list[str]) -> None:
    """Refuse sweep options that the session sets itself."""
    for a in args:
        flag = a.split("=", 1)[0]
        if flag in FORBIDDEN:
            raise AbError(f"{flag}: vpipe ab sets it itself (each side's store is DIR/A, DIR/B)")


@dataclass
class SideProcess:
    """One version's paced ``vpipe bench``: its process, the protocol messages read from its
    stdout (a reader thread; other output goes to its log) and its log file."""

    version: Version
    proc: subprocess.Popen[str]
    log: IO[str]
    messages: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    busy: bool = False  # a launch in progress (or open): what a Ctrl-C stops (an error ends it)

    @staticmethod
    def start(version: Version, bench_args: list[str], out: Path, log_path: Path) -> SideProcess:
        """Start the side in its own session (a Ctrl-C at the terminal reaches only vpipe ab,
        which decides what each side does), from its checkout, without PYTHONPATH."""
        log = log_path.open("w", encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        cmd = [str(version.python), "-m", "vpipe", "bench", *bench_args, "--no-profile",
               "--out", str(out), "--paced"]  # fmt: skip
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=version.checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=log, text=True, start_new_session=True,
        )  # fmt: skip
        side = SideProcess(version, proc, log)
        threading.Thread(target=side._read, daemon=True).start()
        return side

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = parse_reply(line) if line.startswith(PREFIX) else None
            if message is None:
                self.log.write(line)
                self.log.flush()
            else:
                self.messages.put(message)
        self.messages.put(None)  # end of output: the side exited

    def expect(self, key: str, timeout_s: float) -> dict[str, Any]:
        """The next message, which must hold ``key``; AbError naming the side otherwise."""
        try:
            message = self.messages.get(timeout=timeout_s)
        except queue.Empty:
            raise AbError(f"{self.version.describe}: no answer in {timeout_s:.0f} s") from None
        if message is None:
            raise AbError(f"{self.version.describe}: {self.exit_reason()}")
        if key not in message:
            what = message.get("failed") or (
                "the launch was interrupted" if "aborted" in message else message
            )
            raise AbError(f"{self.version.describe}: {what}")
        return message

    def exit_reason(self) -> str:
        """Why the side's process ended: the last line of its log (its one-line error)."""
        code = self.proc.wait(timeout=30)
        self.log.flush()
        text = Path(self.log.name).read_text(encoding="utf-8", errors="replace").strip()
        last = text.splitlines()[-1] if text else ""
        return f"exited with status {code}: {last}" if last else f"exited with status {code}"

    def send(self, word: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(word + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass  # it exited; expect() says why

    def block(self) -> dict[str, Any]:
        """One launch of this side; its block message."""
        self.busy = True
        self.send("block")
        message = self.expect("block", BLOCK_TIMEOUT_S)
        self.busy = False
        return message

    def open(self) -> None:
        """Open a launch (its ranks built and warm, waiting for rounds: :mod:`vpipe.sweep.gate`)."""
        self.busy = True
        self.send("open")
        self.expect("opened", BLOCK_TIMEOUT_S)

    def round(self) -> None:
        """One timed round of the open launch."""
        self.send("round")
        self.expect("round", BLOCK_TIMEOUT_S)

    def close(self) -> None:
        """End the open launch; its block message follows (:meth:`closed`)."""
        self.send("close")

    def closed(self) -> dict[str, Any]:
        message = self.expect("block", BLOCK_TIMEOUT_S)
        self.busy = False
        return message

    def interrupt(self) -> None:
        """Stop the launch in progress, if any (its block is dropped; the side keeps the
        others)."""
        if self.busy and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGINT)

    def end(self) -> None:
        """Ask the side to write its finished blocks (and exit); :meth:`finish` waits for it."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.send("end")
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass  # it exited; finish() says why

    def finish(self) -> str:
        """Have the side write its finished blocks (:meth:`end`, unless asked already) and wait
        for it; what it wrote, in words. A side that has exited is judged by what the reader
        thread reads of its output up to its end, not by whether that was read yet."""
        self.end()
        try:
            while True:  # skip the answer to an interrupted launch
                message = self.messages.get(timeout=READY_TIMEOUT_S)
                if message is None:
                    return f"{self.version.label}: nothing written ({self.exit_reason()})"
                if "written" in message:
                    break
        except queue.Empty:
            return f"{self.version.label}: no answer while writing"
        finally:
            self.proc.wait(timeout=60)
            self.log.close()
        n = message["written"]
        return f"{self.version.label}: {n} block{'s' * (n != 1)} in {message['out']}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


@dataclass
class Session:
    """What a session measured: each side's ready message, its launches' messages in the
    order they ran and its looks, why it stopped, and the error that stopped it or whether
    Ctrl-C did."""

    ready: dict[str, dict[str, Any]]
    launches: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    # each look at the verdicts: pairs done, the error rate it spent (vpipe.report.pairs), and
    # whether it was the last the session could take and whether every verdict had settled
    looks: list[dict[str, Any]] = field(default_factory=list)
    stopped: str = ""
    wall_s: float = 0.0
    error: str | None = None
    interrupted: bool = False
    launched: bool = False  # whole launches in turn (vpipe.sweep.launched), not paced blocks

    def pairs_done(self) -> int:
        return len(self.launches) // 2


def pairs_that_fit(seconds_left: float, pair_seconds: list[float], loaded: bool = False) -> int:
    """How many more pairs end within ``seconds_left``, keeping :data:`FINISH_RESERVE_S` for
    the sides to write their stores and the session its report (:data:`LOADED_FINISH_FACTOR`
    times it when the last pair was ``loaded``): a pair is expected to take as long as the
    slower of the last two (a host that slows down, a hog that starts, shows there first)."""
    if not pair_seconds:
        return 0
    expected = max(pair_seconds[-2:])
    reserve = FINISH_RESERVE_S * (LOADED_FINISH_FACTOR if loaded else 1.0)
    return max(0, math.floor((seconds_left - reserve) / expected))


def last_pair_loaded(session: Session) -> bool:
    """Whether other processes loaded either of the last pair's launches
    (:func:`vpipe.report.pairs.loaded`)."""
    from vpipe.report.pairs import busiest, loaded

    return loaded(busiest(m.get("host", [])) for _, m in session.launches[-2:])


def process_start() -> float:
    """The :func:`time.monotonic` moment this process started (Linux: from /proc, so its
    interpreter start and imports count); now where that cannot be read."""
    now = time.monotonic()
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, the 22nd field: clock ticks after boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return now
    return now - age if 0 <= age < 3600 else now


def run_session(
    versions: dict[str, Version],
    bench_args: dict[str, list[str]],
    out: Path,
    *,
    pairs: int,
    max_minutes: float,
    settled: Callable[[Session, float], bool],
    progress: Callable[[str], object] = print,
    started: float | None = None,
    launched: bool = False,
) -> tuple[Session, list[str]]:
    """Start both sides, alternate their launches, and after every pair from the
    :data:`~vpipe.report.pairs.MIN_PAIRS`-th look at the verdicts (``settled(session, alpha)``,
    alpha the error rate the look spends: :func:`vpipe.report.looks.look_alpha`). The session
    ends at a look that settles, or at the last look: after ``pairs`` pairs, or when another
    pair would not end within ``max_minutes`` of the start (:func:`pairs_that_fit`); then both
    sides write their stores. Returns the session and what each side wrote. A side that fails,
    or Ctrl-C, ends the session early (``session.error``, ``session.interrupted``; the launch
    in progress is dropped), and both sides still write what finished. ``started``: the
    :func:`time.monotonic` moment the session's time counts from (the command's start, so that
    preparing the versions counts too); now by default. ``launched``: every block a whole
    ``vpipe bench`` command (:mod:`vpipe.sweep.launched`), for versions that cannot pace."""
    from vpipe.report.looks import look_alpha
    from vpipe.report.pairs import MIN_PAIRS, session_order

    session = Session(ready={}, launched=launched)
    t0 = time.monotonic() if started is None else started
    sides: dict[str, SideProcess | LaunchedSide] = {}
    out.mkdir(parents=True, exist_ok=True)
    try:
        for k, v in versions.items():
            start = LaunchedSide if launched else SideProcess.start
            sides[k] = start(v, bench_args[k], out / k, out / f"{k}.log")
        for k, side in sides.items():
            session.ready[k] = side.expect("ready", READY_TIMEOUT_S)
        order = session_order(2 * pairs)
        gated = {k: r.get("gated") for k, r in session.ready.items()}
        pair_seconds: list[float] = []
        pair_start = time.monotonic()
        for i in range(pairs):
            first, second = order[2 * i], order[2 * i + 1]
            if all(gated.values()):
                for k, message in _gated_pair(sides, (first, second), gated):
                    session.launches.append((k, message))
            else:
                for k in (first, second):
                    message = sides[k].block()
                    for key in ("configs", "reference"):  # a launched side's, from its store
                        if key in message:
                            session.ready[k].setdefault(key, message.pop(key))
                    session.launches.append((k, message))
            now = time.monotonic()
            pair_seconds.append(now - pair_start)
            pair_start = now
            n = session.pairs_done()
            progress(f"pair {n}/{pairs} done at {now - t0:.0f} s")
            if n < MIN_PAIRS:
                continue
            left = max_minutes * 60 - (now - t0)
            last = min(pairs, n + pairs_that_fit(left, pair_seconds, last_pair_loaded(session)))
            alpha = look_alpha(sum(x["alpha"] for x in session.looks), last - n)
            if alpha <= 0:  # the looks before the last spent their share (the time limit had
                continue  # seemed nearer than it is): none until the last
            done = settled(session, alpha)
            session.looks.append({"pairs": n, "alpha": alpha, "last": last == n, "settled": done})
            if done:
                session.stopped = f"settled after {n} pairs"
                break
            if last == n:
                session.stopped = (
                    f"--pairs {pairs} done"
                    if n == pairs
                    else f"--max-minutes {max_minutes:g}: "
                    f"another pair would not end in time, after {n} pairs"
                )
                break
    except KeyboardInterrupt:
        session.interrupted = True
        session.stopped = f"interrupted after {session.pairs_done()} pairs"
        for side in sides.values():  # the launch in progress (or both open ones) is dropped
            side.interrupt()
    except (AbError, LaunchError) as e:
        session.error = str(e)
        session.stopped = f"stopped after {session.pairs_done()} pairs: {e}"
    wrote = _finish(sides)
    session.wall_s = time.monotonic() - t0
    return session, wrote


def _gated_pair(
    sides: dict[str, SideProcess], order: tuple[str, str], gated: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """One pair with both launches open at once: their timed rounds alternate (A B B A ...
    from the pair's first side), so the two versions' rounds are a fraction of a second apart
    instead of a launch; the launches' block messages, in ``order``."""
    for k in order:
        sides[k].open()
    left = {k: int(gated[k]["rounds"]) for k in order}
    j = 0
    while any(left.values()):
        for k in order if j % 2 == 0 else order[::-1]:
            if left[k]:
                sides[k].round()
                left[k] -= 1
        j += 1
    for k in order:
        sides[k].close()
    return [(k, {**sides[k].closed(), "gated": gated[k]}) for k in order]


def _finish(sides: dict[str, SideProcess]) -> list[str]:
    """Every side writes its finished blocks (a second Ctrl-C meanwhile is held); then none is
    left running."""
    from vpipe.outputs import sigint_held

    with sigint_held():
        try:
            for side in sides.values():  # both write at once (an exited side's end is a no-op)
                side.end()
            return [side.finish() for side in sides.values()]
        finally:
            for side in sides.values():
                side.kill()


def session_record(session: Session, versions: dict[str, Version], args: list[str]) -> str:
    """``session.json``: the versions, the sweep options, the sides' ready messages, every
    launch's message (steps, reference times, host rounds) in the order they ran, its looks
    and why the session stopped: enough to compute the report again."""
    return json.dumps(
        {
            "versions": {
                k: {"name": v.name, "commit": v.commit, "checkout": str(v.checkout)}
                for k, v in versions.items()
            },
            "bench_args": args,
            "ready": session.ready,
            "launches": [{"side": k, **m} for k, m in session.launches],
            "looks": session.looks,
            "stopped": session.stopped,
            "wall_s": round(session.wall_s, 1),
        },
        indent=1,
    )

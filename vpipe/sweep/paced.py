"""One side of a paced session (``vpipe bench --paced``): the sweep's blocks run one at a time,
each when asked, so that another process can alternate two versions' launches (``vpipe ab``,
:mod:`vpipe.sweep.ab`).

The protocol is line-based. After validating the sweep the side prints ``ready`` with its
configs and reference shape, then reads commands from stdin:

- ``block``: launch the ranks once (a block: warm-up and every config's timed rounds, no
  profiling), print ``block`` with its timed steps, reference times and host rounds;
- ``open``: launch the ranks and build and warm every config, print ``opened``; then each
  ``round`` runs one timed round (every config's steps) and prints ``round``, and ``close``
  ends the launch (its memory step, when it is the first block) and prints its ``block``.
  ``vpipe ab`` alternates the two versions' rounds this way, both launches open
  (:mod:`vpipe.sweep.gate`); ``ready`` says so (``gated``: the rounds and steps a launch has).
- ``end`` (or end of input): write every finished block to ``--out`` as one sweep of that many
  blocks (``vpipe bench --blocks K``'s layout, so ``vpipe report`` reads it), print
  ``written``, exit.

A Ctrl-C (SIGINT) during a block (or an open launch) abandons that block only (its ranks
are stopped, the finished blocks are kept) and prints ``aborted``; a block that fails prints
``failed`` with the one-line error; either way the side waits for the next command. Every reply is one line,
``vpipe-paced {json}``, so that anything else a rank prints on stdout is ignored by the reader.
The side starts the ranks from one fork server, so a block costs its steps, not a new
interpreter and a torch import.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from vpipe.sweep.driver import SweepSpec

PREFIX = "vpipe-paced "
INTERRUPTED = "the launch was interrupted"


def reply(message: dict[str, Any], out: IO[str] | None = None) -> None:
    """One protocol line on stdout."""
    stream = out or sys.stdout
    stream.write(PREFIX + json.dumps(message) + "\n")
    stream.flush()


def parse_reply(line: str) -> dict[str, Any] | None:
    """The message of a protocol line; None for any other output."""
    if not line.startswith(PREFIX):
        return None
    return json.loads(line[len(PREFIX) :])


def block_message(results: list[dict[str, Any]], index: int, wall_s: float) -> dict[str, Any]:
    """What ``block`` reports: per config (in sweep order) its timed steps and reference times
    (the slowest rank's, as the sweep records them), the host's rounds and the block's wall time."""
    r0 = min(results, key=lambda r: r["rank"])
    return {
        "block": index,
        "wall_s": round(wall_s, 3),
        "steps": r0["times"],
        "refs": r0.get("refs"),
        "host": r0.get("host_rounds", []),
    }


def serve(spec: SweepSpec, out: str | Path, commands: IO[str] | None = None) -> int:
    """Run ``spec``'s blocks as asked on ``commands`` (stdin), then write the finished ones to
    ``out``; see the module's doc. Returns the exit status."""
    from vpipe.outputs import check_output_dir
    from vpipe.runtime import launch
    from vpipe.sweep.driver import BenchError, new_run_id, sweep_reference_shape

    commands = commands or sys.stdin
    target = check_output_dir(out, append=False, force=True)
    once = replace(spec, blocks=1, profile=False, progress=False)
    bench_id = new_run_id()
    if launch.in_torchrun():
        raise BenchError("--paced launches its own ranks: run it without torchrun")
    launch.fork_server(start=True)
    reply(
        {
            "ready": True,
            "configs": [[c.schedule, c.microbatches, c.impl] for c in spec.configs()],
            "reference": sweep_reference_shape(spec, spec.rank_specs()),
            "device": spec.device,
            # open / round / close (vpipe.sweep.gate): this many rounds of this many steps
            "gated": {"rounds": spec.rounds, "steps": spec.steps},
        }
    )
    blocks: list[list[dict[str, Any]]] = []
    sweep_s = 0.0
    while line := commands.readline():
        word = line.strip()
        if word == "end":
            break
        if word not in ("block", "open"):
            reply({"failed": f"unknown command {word!r} (expected block, open or end)"})
            continue
        t0 = time.perf_counter()
        # memory is measured once, in the first block that finishes (the one kept)
        launch_spec = replace(once, memory_step=not blocks)
        if word == "open":
            results, ended = open_launch(launch_spec, bench_id, commands)
        else:
            results, why = _launch(launch_spec, bench_id)
            ended = False
            if results is None:
                reply(why)
        if results is not None:
            wall = time.perf_counter() - t0
            sweep_s += wall
            blocks.append(results)
            reply(block_message(results, len(blocks) - 1, wall))
        if ended:
            break
    reply({"written": write_blocks(spec, blocks, bench_id, target, sweep_s), "out": str(target)})
    return 0


def _launch(spec: SweepSpec, bench_id: str) -> tuple[list[dict[str, Any]] | None, dict]:
    """One launch's results, or None and the reply that says why not (``aborted`` after a
    Ctrl-C, ``failed`` with the one-line error)."""
    from vpipe.errors import VpipeError, one_line
    from vpipe.sweep.driver import run_sweep

    try:
        return run_sweep(spec, bench_id), {}
    except KeyboardInterrupt:
        return None, {"aborted": True}
    except (VpipeError, OSError, RuntimeError) as e:
        return None, {"failed": one_line(e)}


def open_launch(
    spec: SweepSpec, bench_id: str, commands: IO[str]
) -> tuple[list[dict[str, Any]] | None, bool]:
    """An ``open`` launch: its ranks start, build and warm up (``opened``), then run one timed
    round per ``round`` (each answered ``round``) until ``close``, which finishes the launch
    (its ``block`` follows). The launch runs on this thread (a Ctrl-C reaches it here); a
    relay thread reads the commands meanwhile. ``end`` or the end of input while it is open
    drops it. Returns its results (None when dropped, interrupted or failed) and whether the
    session ended."""
    import tempfile
    import threading

    from vpipe.sweep.gate import Gate, GateError

    ended, closed, told = threading.Event(), threading.Event(), threading.Event()

    def relay(gate: Gate) -> None:
        try:
            gate.wait()
            reply({"opened": True})
            rounds = 0
            while word := commands.readline().strip():
                if word != "round":
                    break
                gate.round()
                rounds += 1
                reply({"round": rounds})
            else:
                word = "end"  # end of input
            if word == "close":
                closed.set()
            elif word == "end":
                ended.set()
            else:
                reply({"failed": f"unknown command {word!r} in an open launch (expected "
                       "round or close): launch dropped"})  # fmt: skip
        except GateError as e:  # the launch failed or was interrupted: say so now
            reply({"failed": str(e)} if str(e) != INTERRUPTED else {"aborted": True})
            told.set()
        finally:
            gate.stop()

    with tempfile.TemporaryDirectory(prefix="vpipe-gate-") as directory:
        gate = Gate(directory, spec.world_size)
        relaying = threading.Thread(target=relay, args=(gate,), daemon=True)
        relaying.start()
        try:
            results, why = _launch(replace(spec, gate=directory), bench_id)
            if results is None:  # wake the relay if it waits for a round
                gate.fail(why.get("failed", INTERRUPTED))
            relaying.join()
        finally:
            gate.close()
    if results is None and not told.is_set() and not ended.is_set():
        reply(why)  # it failed after close (its memory step, its results)
    return (results if closed.is_set() else None), ended.is_set()


def write_blocks(
    spec: SweepSpec, blocks: list[list[dict[str, Any]]], bench_id: str, out: Path, sweep_s: float
) -> int:
    """Every finished block written to ``out`` as one sweep of that many blocks (swapped in
    whole, as ``vpipe bench --force`` does); nothing is written without a block. Returns how
    many blocks were written."""
    if not blocks:
        return 0
    from vpipe.outputs import staged_dir
    from vpipe.sweep.blocks import merge_blocks
    from vpipe.sweep.results import collect
    from vpipe.sweep.write import write_outputs

    done = replace(spec, blocks=len(blocks), profile=False, progress=False)
    with staged_dir(out) as staging:
        res = collect(done, merge_blocks(blocks), bench_id, sweep_s, simulate=False)
        write_outputs(res, staging)
    return len(blocks)

"""``vpipe bench`` under torchrun across two "hosts": two torchrun processes (one rank each,
``--nnodes 2``) meeting at a c10d rendezvous on loopback. Rank 0 gathers every rank's results
over the process group (no shared files) and writes the store and report."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.multihost


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_torchrun_on_loopback(tmp_path):
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    for node in range(2):
        out = tmp_path / f"node{node}"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"vpipe-test-{port}",
            "--max-restarts",
            "0",
            "-m",
            "vpipe",
            "bench",
            "--ranks",
            "2",
            "--schedules",
            "zbv",
            "--microbatches",
            "2",
            "--impl",
            "vpipe",
            "--sizes",
            "d_model=16,d_hidden=32",
            "--batch",
            "4",
            "--warmup",
            "1",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--profile-steps",
            "1",
            "--timing-precision",
            "0",
            "--out",
            str(out),
        ]
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 (closed below)
        procs.append(
            (
                subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=tmp_path,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # so a stop reaches the launcher's worker too
                ),
                log,
            )
        )
    # Wait on both nodes together: when one fails the other would wait at the rendezvous, so
    # it is stopped at once and both logs are shown; a hang shows both logs too.
    deadline = time.monotonic() + 240
    try:
        while any(p.poll() is None for p, _ in procs):
            failed = [p for p, _ in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    logs = "\n".join(
        f"--- node{n} (exit {p.returncode}) ---\n{(tmp_path / f'node{n}.log').read_text()[-2500:]}"
        for n, (p, _) in enumerate(procs)
    )
    assert all(p.returncode == 0 for p, _ in procs), logs

    from vpipe.trace.store import Store

    runs = Store(tmp_path / "node0").runs()
    row = runs[runs["source"] == "measured"].iloc[0]
    assert row["ranks"] == 2 and row["schedule"] == "zbv" and row["step_time_s"] > 0
    ev = Store(tmp_path / "node0").events([row["run_id"]])
    assert set(ev["rank"]) == {0, 1}  # rank 1's events came over the process group
    assert (tmp_path / "node0" / "report.html").exists()
    assert not (tmp_path / "node1" / "runs").exists()  # only the coordinator writes

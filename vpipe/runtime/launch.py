"""Start the ranks of a pipeline: local processes (``spawn``) or a torchrun job
(``in_torchrun`` / ``init_from_env``).

``spawn`` hosts the rendezvous store in the parent (no port race, and it outlives any rank),
starts one process per rank from a fork server that has imported torch once (so a launch costs
about a second, not a torch import per rank), and polls them: a rank that raises
reports its one-line error, a rank that dies is noticed by its exit code, and in both cases the
other ranks are terminated at once and PipelineError names the failed rank. The process group
gets a finite timeout too, so a rank blocked on a dead peer cannot wait forever.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from vpipe.errors import PipelineError, one_line

__all__ = ["in_torchrun", "init_from_env", "leave_job", "local_device", "spawn", "usable_cores"]

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def in_torchrun() -> bool:
    """True when torchrun's environment variables are present."""
    return all(v in os.environ for v in _TORCHRUN_VARS)


def usable_cores() -> int:
    """The cores this process's local ranks divide among themselves (torch threads per rank =
    this // ranks): ``VPIPE_CORES`` when set (a share of the host, as each parallel test worker
    sets it, so that two jobs at once do not each take every core), else the CPUs this process
    may run on (its affinity, as taskset or a container limits it)."""
    value = os.environ.get("VPIPE_CORES", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise PipelineError(f"VPIPE_CORES={value!r}: expected a whole number of cores, 1 or more")
        return int(value)
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def local_device(kind: str, rank: int) -> Any:
    """cpu, or this process's GPU: LOCAL_RANK under torchrun, else the rank (local spawn), modulo
    the GPUs: with fewer GPUs than local ranks (gloo only) ranks share them, all on cuda:0 with
    one."""
    import torch

    if kind == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def check_gpus(n_ranks: int, backend: str) -> None:
    """Raise unless this machine can place ``n_ranks`` local CUDA ranks: one GPU each for NCCL
    (it refuses two ranks on one device); with gloo, ranks share GPUs (:func:`local_device`)."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        raise PipelineError("--device cuda but this machine has no CUDA device")
    if have < n_ranks and backend != "gloo":
        raise PipelineError(
            f"--device cuda with {backend} needs one CUDA device per local rank: {n_ranks} "
            f"ranks, {have} devices (with --backend gloo ranks may share a device)"
        )


def init_from_env(
    device: str = "cpu", backend: str | None = None, timeout_s: float = 300.0
) -> tuple[int, int, Any]:
    """Join a torchrun job: init the default process group from the environment (with device
    cuda: NCCL unless ``backend`` says gloo, on the rank's GPU as :func:`local_device` picks it;
    NCCL needs one GPU per local rank) and set torch's threads to :func:`usable_cores` // local
    ranks. Returns (rank, world size, torch.device)."""
    import torch
    import torch.distributed as dist

    if not in_torchrun():
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise PipelineError(f"not under torchrun: environment lacks {', '.join(missing)}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if device == "cuda":
        if not torch.cuda.is_available():
            raise PipelineError(f"rank {rank}: --device cuda but CUDA is not available")
        backend = backend or "nccl"
        n_gpus = torch.cuda.device_count()
        if backend != "gloo" and local_rank >= n_gpus:
            raise PipelineError(
                f"rank {rank}: local rank {local_rank} but this host has {n_gpus} CUDA "
                f"device(s): {backend} needs one per local rank (--backend gloo shares them)"
            )
        dev = local_device("cuda", rank)
    else:
        dev = torch.device(device)
        backend = backend or "gloo"
    torch.set_num_threads(max(1, usable_cores() // local_world))
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    return rank, world, dev


def fork_server(start: bool = False) -> Any:
    """The forkserver context ranks start from: the fork server imports torch once, and every
    later rank process forks from it, ready (symbolic_shapes, sympy, is what
    torch.autograd.backward imports on its first call; pandas is what every sweep rank
    imports, 0.2 s a rank and launch otherwise). ``start``: start the server now, with
    SIGINT blocked as :func:`spawn` starts it, and wait until it has imported them (one
    empty process forked from it): a paced side does so before it says it is ready, so that
    neither its first launch nor the other side's launches meanwhile share the cores with the
    1-2 s of imports."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "pandas",
         "vpipe.runtime"]
    )  # fmt: skip
    if start:
        from multiprocessing import forkserver

        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            forkserver.ensure_running()
            probe = ctx.Process(target=int, daemon=True)  # forks once the preload is done
            probe.start()
            probe.join()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    return ctx


def spawn(
    fn: Callable[..., Any],
    n_ranks: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    pg_timeout_s: float = 60.0,
) -> list[Any]:
    """Run ``fn(rank, n_ranks, *args)`` in ``n_ranks`` local processes with a process group
    initialised and torch threads set to :func:`usable_cores` // n_ranks; return the per-rank
    results.

    ``fn`` and ``args`` must be picklable (a module-level function). If a rank raises or dies,
    the others are terminated and PipelineError names the failed rank and its error; the whole
    run is also bounded by ``timeout_s``. ``pg_timeout_s`` bounds every collective/P2P wait.
    """
    import torch.distributed as dist

    if n_ranks < 1:
        raise PipelineError(f"n_ranks must be >= 1, got {n_ranks}")
    threads = max(1, usable_cores() // n_ranks)
    store = dist.TCPStore("127.0.0.1", 0, n_ranks + 1, True, timedelta(seconds=pg_timeout_s), False)
    ctx = fork_server()
    results_q = ctx.SimpleQueue()
    # Plain pickle, not torch's fd-sharing reductions: tensors in args and results travel as
    # bytes, so neither side has to outlive the transfer and no file descriptors pile up.
    payload = pickle.dumps((fn, args))
    procs = [
        ctx.Process(
            target=_worker,
            args=(payload, rank, n_ranks, store.port, backend, pg_timeout_s, threads, results_q),
            daemon=True,
        )
        for rank in range(n_ranks)
    ]
    # SIGINT is blocked while they start: the fork server and the ranks inherit the mask, so a
    # Ctrl-C reaches only this process (which then stops them) and no traceback comes from the
    # fork server's preload or a rank. This process holds a Ctrl-C until every rank has started
    # (one raised mid-start would leave a rank no one stops), then raises it, inside the block
    # that stops them.
    from vpipe.outputs import sigint_held

    try:
        with sigint_held() as held:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                for p in procs:
                    p.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if held:
            raise KeyboardInterrupt
        results = _collect(procs, results_q, n_ranks, timeout_s)
        deadline = time.monotonic() + 5.0
        for p in procs:  # let them leave the process group cleanly
            p.join(max(0.0, deadline - time.monotonic()))
        return results
    finally:
        _stop(procs)
        results_q.close()
        del store


def _collect(procs: list, results_q: Any, n_ranks: int, timeout_s: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < n_ranks:
        while not results_q.empty():
            rank, ok, value = results_q.get()
            if ok:
                value = pickle.loads(value)
            else:
                _raise_failure(procs, results_q, rank, value, set(results))
            results[rank] = value
        dead = _dead_without_report(procs, results)
        if dead is not None and results_q.empty():
            raise PipelineError(_death_message(procs, dead))
        if time.monotonic() > deadline:
            waiting = [r for r in range(n_ranks) if r not in results]
            raise PipelineError(f"timed out after {timeout_s:.0f} s waiting for rank(s) {waiting}")
        time.sleep(0.02)
    return [results[r] for r in range(n_ranks)]


def _dead_without_report(procs: list, reported: dict | set) -> int | None:
    for rank, p in enumerate(procs):
        if rank not in reported and p.exitcode is not None:
            return rank
    return None


def _raise_failure(procs: list, results_q: Any, rank: int, message: str, done: set) -> None:
    """Raise for a rank's reported error, unless another rank died first: a peer's death
    makes the survivors fail with connection errors, so the death is the cause to name."""
    reported = done | {rank}
    grace = time.monotonic() + 1.0
    while time.monotonic() < grace:
        while not results_q.empty():
            reported.add(results_q.get()[0])
        dead = _dead_without_report(procs, reported)
        if dead is not None and dead != rank:
            raise PipelineError(
                f"{_death_message(procs, dead)}; rank {rank} then failed: {message}"
            )
        time.sleep(0.02)
    named = message.startswith(f"rank {rank}:")
    raise PipelineError(message if named else f"rank {rank} failed: {message}")


def _death_message(procs: list, rank: int) -> str:
    return f"rank {rank} died ({_exit_reason(procs[rank].exitcode)}) without a result"


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _stop(procs: list) -> None:
    procs = [p for p in procs if p.pid is not None]  # the started ones
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def leave_job() -> None:
    """Destroy the default process group after collecting garbage first. Runtimes and harnesses
    hold the group in reference cycles; left to interpreter shutdown, gloo's worker threads are
    torn down after Python is gone and the process aborts ("terminate called without an active
    exception") although every step succeeded."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _worker(
    payload: bytes,
    rank: int,
    n_ranks: int,
    port: int,
    backend: str,
    pg_timeout_s: float,
    threads: int,
    results_q: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        kwargs = {}
        if backend == "nccl":  # one GPU per rank
            kwargs["device_id"] = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(kwargs["device_id"])
        store = dist.TCPStore(
            "127.0.0.1", port, n_ranks + 1, False, timedelta(seconds=pg_timeout_s)
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=n_ranks,
            timeout=timedelta(seconds=pg_timeout_s),
            **kwargs,
        )
        fn, args = pickle.loads(payload)
        value = fn(rank, n_ranks, *args)
    except BaseException as e:  # report, then exit non-zero
        results_q.put((rank, False, one_line(e)))
        raise SystemExit(1) from None
    try:
        results_q.put((rank, True, pickle.dumps(value)))
    except Exception as e:
        results_q.put((rank, False, f"result not picklable: {one_line(e)}"))
        raise SystemExit(1) from None
    leave_job()

"""Record traces the way a torch user does, with torch.distributed.pipelining's own schedule
classes: torch.profiler with a wait/warmup/active schedule and its default operator recording,
one ``rank<N>_trace.json`` per rank (torchtitan's name), gloo ranks on CPU. vpipe takes no part
in the recording, so the traces carry none of its metadata or spans.

Each stage is a stack of residual MLP blocks (``--width`` wide, ``--rows`` rows a microbatch);
``--slow S:K`` gives stage S K times the blocks of the others (``--both``: each schedule
balanced too). One launch records every schedule given, each into ``OUT/<schedule>/`` (with a
slow stage ``OUT/<schedule>-slow/``).

``--dp N`` records a job of N pipelines, as torchtitan lays one out: a ``DeviceMesh`` with
dims ("pp", "dp"), so the pipeline of global rank 0 is ranks 0, N, 2N, ...; each step ends with
an all-reduce of every stage's gradients across the N replicas. There is one trace per global
rank, P x N in all, and the profiler's ``distributedInfo`` lists each rank's process groups.

Run: ``python -m bench.torch_traces OUT --ranks 4 [--schedules ZBVZeroBubble 1F1B] [--slow 1:3]
[--dp 2]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

# torch's class (less "Schedule") -> its placement: one stage per rank, loop or V.
CLASSES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}


def stages_of(placement: str, rank: int, n_ranks: int) -> list[int]:
    """The stages ``rank`` holds under ``placement`` (single, loop or v)."""
    if placement == "single":
        return [rank]
    if placement == "loop":
        return [rank, rank + n_ranks]
    return [rank, 2 * n_ranks - 1 - rank]


def _block(width: int):  # noqa: ANN202 (torch is imported lazily)
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.tanh(self.up(x)))

    return Block()


def _rank(rank: int, n_ranks: int, out: str, init: str, opts: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.set_num_threads(1)
    dp = opts["dp"]
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=n_ranks * dp
    )
    mesh = init_device_mesh("cpu", (n_ranks, dp), mesh_dim_names=("pp", "dp")) if dp > 1 else None
    pp_group, pp_rank = (mesh.get_group("pp"), mesh.get_local_rank("pp")) if mesh else (None, rank)
    try:
        m, width, rows = opts["microbatches"], opts["width"], opts["rows"]
        for name, slow in opts["configs"]:
            placement = CLASSES[name]
            n_stages = n_ranks if placement == "single" else 2 * n_ranks
            torch.manual_seed(0)
            mine = stages_of(placement, pp_rank, n_ranks)
            stages = []
            for s in mine:
                blocks = opts["blocks"] * (slow[1] if slow and s == slow[0] else 1)
                module = torch.nn.Sequential(*(_block(width) for _ in range(blocks)))
                stages.append(
                    pipelining.PipelineStage(
                        module, s, n_stages, torch.device("cpu"), group=pp_group
                    )
                )
            cls = getattr(pipelining, f"Schedule{name}")
            sched = cls(
                stages[0] if placement == "single" else stages,
                m,
                loss_fn=lambda y, t: ((y - t) ** 2).mean(),
            )
            x, t = torch.randn(m * rows, width), torch.randn(m * rows, width)
            first, last = 0 in mine, n_stages - 1 in mine
            where = Path(out) / (f"{name}-slow" if slow else name)
            where.mkdir(parents=True, exist_ok=True)
            file = str(where / f"rank{rank}_trace.json")
            steps = opts["wait"] + 1 + opts["active"]
            plan = schedule(wait=opts["wait"], warmup=1, active=opts["active"])
            with profile(
                activities=[ProfilerActivity.CPU],
                schedule=plan,
                on_trace_ready=lambda p, f=file: p.export_chrome_trace(f),
            ) as prof:
                for _ in range(steps):
                    kw = {"target": t, "losses": []} if last else {}
                    sched.step(*((x,) if first else ()), **kw)
                    if mesh is not None:
                        _average_gradients(stages, mesh.get_group("dp"), dp)
                    prof.step()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _average_gradients(stages: list, group: object, dp: int) -> None:
    """Each stage's gradients averaged over the replicas: one all-reduce per stage."""
    import torch
    import torch.distributed as dist

    for stage in stages:
        grads = [p.grad for p in stage.submod.parameters() if p.grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            for g, part in zip(grads, flat.div_(dp).split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))


def record(
    out: str | os.PathLike[str],
    n_ranks: int,
    schedules: Sequence[str] = tuple(CLASSES),
    *,
    microbatches: int = 8,
    width: int = 256,
    rows: int = 32,
    blocks: int = 2,
    slow: tuple[int, int] | None = None,
    both: bool = False,
    active: int = 1,
    wait: int = 1,
    dp: int = 1,
) -> Path:
    """Record ``schedules`` (torch class names less "Schedule") on ``n_ranks`` spawned gloo
    ranks into ``out/<schedule>/rank<N>_trace.json`` (``<schedule>-slow`` with ``slow``'s
    stage S K times slower; ``both``: each also balanced; ``dp``: that many pipelines, see the
    module docstring); returns ``out``."""
    import torch.multiprocessing as mp

    unknown = [s for s in schedules if s not in CLASSES]
    if unknown:
        raise SystemExit(f"unknown torch schedule {unknown[0]!r}: choose from {', '.join(CLASSES)}")
    variants = ([None] if both or not slow else []) + ([slow] if slow else [])
    configs = [(name, v) for v in variants for name in schedules]
    opts = dict(configs=configs, microbatches=microbatches, width=width, rows=rows,
                blocks=blocks, active=active, wait=wait, dp=dp)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.start_processes(_rank, args=(n_ranks, str(out), init, opts), nprocs=n_ranks * dp,
                           start_method="spawn")  # fmt: skip
    return Path(out)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=list(CLASSES), choices=list(CLASSES))
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=2, help="residual blocks per stage")
    ap.add_argument("--slow", metavar="S:K", help="stage S has K times the blocks")
    ap.add_argument("--both", action="store_true", help="with --slow: each balanced too")
    ap.add_argument("--active", type=int, default=1, help="profiled steps")
    ap.add_argument("--dp", type=int, default=1, help="pipelines (data-parallel replicas)")
    a = ap.parse_args(argv)
    slow = tuple(int(v) for v in a.slow.split(":")) if a.slow else None
    record(a.out, a.ranks, a.schedules, microbatches=a.microbatches, width=a.width, rows=a.rows,
           blocks=a.blocks, slow=slow, both=a.both, active=a.active, dp=a.dp)  # fmt: skip
    for p in sorted(Path(a.out).rglob("*.json")):
        print(f"{p}: {p.stat().st_size:,} bytes")


if __name__ == "__main__":
    main()

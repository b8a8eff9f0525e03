"""Record tests/data/torch_zbv/rank{0,1}.json.gz: torch.distributed.pipelining's
ScheduleZBVZeroBubble at P=2 (4 Linear(16, 16) stages, V placement, M=4, gloo on CPU), one
active profiled step (the second), via vpipe's StepProfiler. Each rank's program (torch's
``pipeline_order_with_comms``) is embedded in the metadata as ``torch_program`` so that the test
can check the conversion against it. Run: ``python tests/data/record_torch_zbv.py``."""

import gzip
import json
import os
import tempfile
from pathlib import Path

from vpipe.trace.record import trace_file_name

P, M, D = 2, 4, 16
OUT = Path(__file__).parent / "torch_zbv"


def _rank(rank: int, tmp: str, init_file: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    from vpipe.trace.record import StepProfiler

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=P)
    try:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(D, D) for _ in range(2 * P)]
        mine = [rank, 2 * P - 1 - rank]  # rank 0 holds the first and the loss stage
        stages = [PipelineStage(layers[s], s, 2 * P, torch.device("cpu")) for s in mine]
        sched = ScheduleZBVZeroBubble(stages, M, loss_fn=lambda out, y: ((out - y) ** 2).mean())
        program = [str(a) for a in sched.pipeline_order_with_comms[rank] if a is not None]
        x, y = torch.randn(2 * M, D), torch.randn(2 * M, D)
        meta = {"schedule": "zbv", "impl": "torch", "ranks": P, "microbatches": M,
                "torch_program": program}  # fmt: skip
        with StepProfiler(tmp, rank, wait=0, warmup=1, active=1, metadata=meta) as prof:
            for _ in range(2):
                if rank == 0:
                    sched.step(x, target=y, losses=[])
                else:
                    sched.step()
                prof.step()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank, args=(tmp, os.path.join(tmp, "init")), nprocs=P, start_method="spawn"
        )
        OUT.mkdir(exist_ok=True)
        for r in range(P):
            raw = (Path(tmp) / trace_file_name(r)).read_bytes()
            json.loads(raw)  # a complete trace
            (OUT / f"rank{r}.json.gz").write_bytes(gzip.compress(raw, 9))
    print(*(f"{p}: {p.stat().st_size} bytes" for p in sorted(OUT.iterdir())), sep="\n")

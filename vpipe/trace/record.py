"""Record a pipeline run with torch.profiler, one Kineto JSON file per rank.

:class:`StepProfiler` wraps ``torch.profiler.profile`` with a wait/warmup/active schedule and
writes ``out_dir/rank{rank}.pt.trace.json`` (:func:`trace_file_name`: the ``*.pt.trace.json``
files TensorBoard's profiler plugin looks for; they open in Perfetto too). The run metadata
(run_id, schedule, impl, ranks, microbatches, model, ...) is embedded in the trace under the
top-level key ``"vpipe"`` so that :mod:`vpipe.trace.kineto` can label the events without side
files. Memory figures that the profiler does not record itself (process RSS, the CUDA
allocator's per-step peak of the run's own device, the runtime's live-activation bytes) are
sampled after every active step and embedded under ``"vpipe_samples"``, with wall-clock times
on the trace's own clock. CUDA activity and statistics are recorded only for a run on a CUDA
``device``: a CPU run on a machine with GPUs never reads them.
The profiler's own trace-point lines on stderr are filtered out unless ``verbose``
(:mod:`vpipe.trace.quiet`). Only user spans are recorded unless ``ops``
(:mod:`vpipe.trace.scopes`): every aten op besides is for reading a trace, and slows the step.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any

from vpipe.trace.quiet import filtered_stderr
from vpipe.trace.scopes import user_scope_only

META_KEY = "vpipe"
SAMPLES_KEY = "vpipe_samples"


def trace_file_name(rank: int) -> str:
    """The trace file of ``rank``: ``rank{rank}.pt.trace.json``, a name TensorBoard's profiler
    plugin lists and from which :mod:`vpipe.trace.kineto` reads the rank."""
    return f"rank{rank}.pt.trace.json"


def current_rss_bytes() -> int | None:
    """Resident set size of this process (Linux /proc), or None where unavailable."""
    try:
        with open("/proc/self/statm", "rb") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def cuda_device(device: Any) -> Any:
    """``device`` as a ``torch.device`` with its index (the current one if it names none) when
    it is a CUDA device, else None (and then CUDA is never touched)."""
    import torch

    d = torch.device(device)
    if d.type != "cuda":
        return None
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def take_cuda_peak(device: Any) -> int:
    """The CUDA allocator's peak bytes on ``device`` (a CUDA ``torch.device`` with its index)
    since the last call, and a fresh start for the next."""
    import torch

    peak = int(torch.cuda.max_memory_allocated(device))
    torch.cuda.reset_peak_memory_stats(device)
    return peak


class StepProfiler:
    """Context manager profiling a window of pipeline steps; call :meth:`step` after each.

    ``wait`` steps are skipped, ``warmup`` steps are traced and discarded, ``active`` steps are
    recorded; the trace is written when the active window closes (or at exit, if the run ends
    inside it). With ``out_dir=None`` every method is a no-op, so callers need no branches.
    ``verbose`` lets the profiler's trace-point lines (``USDT: ... profiler_start``) through.
    ``ops`` records every aten op besides the user spans (for reading the trace: it slows the
    steps it records); the trace's metadata says which (``profiler_ops``). ``device`` is the
    run's (``"cuda:1"``, a ``torch.device``): on CUDA the profiler records device activity (the
    actions' device spans) and each step's allocator peak of that device, by its index.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike[str] | None,
        rank: int,
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        metadata: Mapping[str, Any] | None = None,
        verbose: bool = False,
        ops: bool = False,
        device: Any = "cpu",
    ) -> None:
        if min(wait, warmup) < 0 or active < 1:
            raise ValueError(
                f"need wait, warmup >= 0 and active >= 1, got {wait}/{warmup}/{active}"
            )
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.rank = rank
        self.path = None if self.out_dir is None else self.out_dir / trace_file_name(rank)
        self.written = False
        self.verbose = verbose
        self._window = (wait, warmup, active)
        self._options = dict(
            record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack
        )
        self._meta: dict[str, Any] = dict(metadata or {})
        self._meta.update(
            rank=rank,
            profiler_wait=wait,
            profiler_warmup=warmup,
            profiler_active=active,
            **self._options,
        )
        self._samples: list[dict[str, Any]] = []
        self._steps = 0
        self._prof: Any = None
        self._device = str(device)  # a CUDA device is resolved (and torch imported) at entry
        self._cuda: Any = None  # the run's torch.device when it is a CUDA one
        self._ops = ops
        self._scopes = ExitStack()

    @property
    def enabled(self) -> bool:
        return self.out_dir is not None

    def __enter__(self) -> StepProfiler:
        if not self.enabled:
            return self
        from torch.profiler import ProfilerActivity, profile, schedule

        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._cuda = cuda_device(self._device)
        if self._cuda is not None:  # the converter keeps this device's memory events only
            self._meta["device_index"] = self._cuda.index
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if self._cuda is not None else []
        )
        wait, warmup, active = self._window
        user_only = not self._ops and self._scopes.enter_context(user_scope_only())
        self._meta["profiler_ops"] = "user spans" if user_only else "all"
        try:
            with warnings.catch_warnings():  # a caller's warmup=0 is deliberate (profiled_step)
                warnings.filterwarnings("ignore", "Profiler won't be using warmup")
                steps = schedule(wait=wait, warmup=warmup, active=active, repeat=1)
            prof = profile(
                activities=activities,
                schedule=steps,
                on_trace_ready=self._write,
                **self._options,
            )
            prof.preset_metadata_json(META_KEY, json.dumps(self._meta, default=str))
            with self._quiet():
                prof.start()
        except BaseException:
            self._scopes.close()
            raise
        self._prof = prof
        return self

    def step(self, memory: Mapping[str, int] | None = None) -> None:
        """Mark the end of one pipeline step.

        ``memory`` adds named byte counts for this step (e.g. ``{"activations":
        pipe.stats["peak_live_activation_bytes"]}``) to the memory samples.
        """
        if self._prof is None:
            return
        if self._prof.current_action.name.startswith("RECORD"):
            self._sample(memory or {})
            self._prof.add_metadata_json(SAMPLES_KEY, json.dumps(self._samples))
        self._steps += 1
        with self._quiet():  # trace windows open and close (and the trace is written) in here
            self._prof.step()

    def _quiet(self) -> AbstractContextManager[None]:
        return nullcontext() if self.verbose else filtered_stderr()

    def _sample(self, memory: Mapping[str, int]) -> None:
        t_ns = time.time_ns()  # Kineto's clock: baseTimeNanoseconds + ts is wall-clock ns
        values: dict[str, int | None] = {"rss": current_rss_bytes()}
        if self._cuda is not None:
            values["cuda_peak"] = take_cuda_peak(self._cuda)
        values.update({k: int(v) for k, v in memory.items() if v is not None})
        for what, value in values.items():
            if value is not None:
                self._samples.append(
                    {"step": self._steps, "t_ns": t_ns, "what": what, "bytes": value}
                )

    def _write(self, prof: Any) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, self.path)
        self.written = True

    def __exit__(self, *exc: object) -> None:
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        with self._quiet(), self._scopes:
            prof.stop()
        if not self.written and exc[0] is None:
            wait, warmup, _ = self._window
            warnings.warn(
                f"rank {self.rank}: no profiler trace written: the run had {self._steps} steps, "
                f"fewer than wait+warmup+1 = {wait + warmup + 1}",
                stacklevel=2,
            )

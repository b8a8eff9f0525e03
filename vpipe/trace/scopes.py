"""Record only user spans (``record_function``) while profiling, not every aten op.

vpipe's analysis reads the ``PP:`` action and wait spans, the step spans and the ``[memory]``
events; both vpipe's runtime and torch.distributed.pipelining emit their spans with
``record_function`` (RecordFunction's user scope). Recording every operator besides costs time
inside the step it measures: on an overhead-bound CPU step (P=2, 4-row microbatches) about
2,000 events per rank and step against 100, and a profiled step's median over unprofiled ones
of 1.17 against 1.08 (``python -m bench.profiler_cost``, medians of 12 A/Bs). torch.profiler has no
public switch for RecordFunction scopes, but the call that enables the profiler takes them;
:func:`user_scope_only` passes ``{USER_SCOPE}`` to it while it is active. Where this torch lacks
that call or argument, it changes nothing and says so (every op is then recorded, as before).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def user_scope_only() -> Iterator[bool]:
    """While active, profilers started (or whose schedule starts recording) record user
    spans only; yields whether that took effect."""
    try:
        import torch.autograd.profiler as autograd_profiler
        from torch._C._profiler import RecordScope

        enable = autograd_profiler._enable_profiler
        takes_scopes = "scopes" in (enable.__doc__ or "")
    except (ImportError, AttributeError):
        takes_scopes = False
    if not takes_scopes:
        yield False
        return
    user = {RecordScope.USER_SCOPE}

    def enable_user_spans(config, activities, *_):  # noqa: ANN001 (torch's own signature)
        return enable(config, activities, user)

    autograd_profiler._enable_profiler = enable_user_spans
    try:
        yield True
    finally:
        autograd_profiler._enable_profiler = enable

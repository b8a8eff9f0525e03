"""User-facing errors. The CLI prints any VpipeError as one line and exits non-zero."""


class VpipeError(Exception):
    """Base of errors caused by input or environment, reported without a traceback."""


class ScheduleError(VpipeError, ValueError):
    """A schedule, action string or CSV file is invalid; the message names where and why."""


class PipelineError(VpipeError, RuntimeError):
    """A pipeline run failed; the message names the rank, stage and action."""


class TraceError(VpipeError, ValueError):
    """A profiler trace or results file is unreadable; the message names the file."""


def one_line(e: BaseException) -> str:
    """An exception as one line: a VpipeError's own message, else ``Type: message``; only the
    first line of either (rank failures travel and print as one line)."""
    text = str(e) if isinstance(e, VpipeError) else f"{type(e).__name__}: {e}"
    lines = text.strip().splitlines()
    return lines[0].rstrip(": ") if lines else type(e).__name__

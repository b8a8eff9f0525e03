"""User-facing errors. The CLI prints any VpipeError as one line and exits non-zero."""


class VpipeError(Exception):
    """Base of errors caused by input or environment, reported without a traceback."""


class ScheduleError(VpipeError, ValueError):
    """A schedule, action string or CSV file is invalid; the message names where and why."""


class PipelineError(VpipeError, RuntimeError):
    """A pipeline run failed; the message names the rank, stage and action."""


class TraceError(VpipeError, ValueError):
    """A profiler trace or results file is unreadable; the message names the file."""

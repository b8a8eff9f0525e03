"""A pytest plugin: with ``VPIPE_STRICT_SKIPS=1`` (CI sets it) a test skipped for any reason
outside :data:`ALLOWED` fails the session, so a tool missing from PATH cannot silently turn a
passing test into a skip. The allowed reasons are the machine's, not the project's: no
Chromium for the screenshot test, no GPU (or a GPU where a test needs none)."""

from __future__ import annotations

import os
import re

import pytest

ALLOWED = re.compile(r"chromium|\bgpu\b|cuda", re.IGNORECASE)


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    text = str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
    return text.removeprefix("Skipped: ")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("VPIPE_STRICT_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    bad = [r for r in skipped if not ALLOWED.search(_reason(r))]
    if bad:
        reporter.ensure_newline()
        for r in bad:
            reporter.write_line(f"skip not allowed in CI: {r.nodeid}: {_reason(r)}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

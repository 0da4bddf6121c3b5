"""The rule on skipped tests: with ``CI=true`` a skipped test fails the run, unless it
is listed in ``ALLOWED`` below with the reason it may skip there.

Off CI a test may skip when a tool it needs is missing (it says which and where the
package list is); on CI every tool is installed (``.ci/run`` installs
``scripts/*-packages.txt``), so a skip there means a test did not run and nobody would
see it: the run fails and names each such test with its skip reason.
"""

from __future__ import annotations

import fnmatch
import os

import pytest

# Test id pattern (fnmatch, against the node id pytest prints) -> why it may skip on CI.
# Empty: on CI every test runs.
ALLOWED: dict[str, str] = {}


class SkipRule:
    """A pytest plugin: collects the skips of the run, and at its end fails a CI run
    that had a skip not listed in ``allowed``."""

    def __init__(self, allowed: dict[str, str]) -> None:
        self.allowed = allowed
        self.skipped: list[tuple[str, str]] = []

    def _record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        if not any(fnmatch.fnmatchcase(report.nodeid, pattern) for pattern in self.allowed):
            self.skipped.append((report.nodeid, skip_reason(report)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if os.environ.get("CI") != "true" or not self.skipped:
            return
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"CI=true: {len(self.skipped)} test(s) skipped and not listed in tests/skips.py ALLOWED:",
                red=True,
            )
            for nodeid, reason in self.skipped:
                reporter.write_line(f"  {nodeid}: {reason}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason pytest keeps for a skip: ``(path, line, "Skipped: why")``."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)

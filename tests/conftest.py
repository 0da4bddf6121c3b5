"""Suite-wide rules.

Integration tests (``@pytest.mark.integration``) talk to real components: a fresh venv
install, systemd tools, the lab cluster. Off CI they may skip when something is missing;
with ``CI=true`` a skipped integration test fails the whole run, so a green CI always
means they ran.
"""

from __future__ import annotations

import os

import pytest

_skipped_integration: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "integration" in report.keywords:
        _skipped_integration.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI") == "true" and _skipped_integration:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"CI=true: {len(_skipped_integration)} integration test(s) skipped, which CI forbids:",
                red=True,
            )
            for nodeid in _skipped_integration:
                reporter.write_line(f"  {nodeid}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

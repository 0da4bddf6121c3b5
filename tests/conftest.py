"""Suite-wide rules.

Integration tests (``@pytest.mark.integration``) talk to real components: a fresh venv
install, systemd tools, the lab cluster. Off CI they may skip when something is missing;
with ``CI=true`` a skipped integration test fails the whole run, so a green CI always
means they ran.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import pytest

from tests.integration.conftest import NODES, STATE, Lab, LabNode, lab_unavailable, llmgw

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


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    """The session's lab cluster (``tests/integration/conftest.py`` says what it holds),
    shared by every module that asks for it: only one lab fits on a machine."""
    reason = lab_unavailable()
    if reason:
        pytest.skip(reason)
    llmgw("lab", "down", "--state", str(STATE), check=False)  # a stale lab from a crashed run
    llmgw("lab", "up", "--nodes", str(NODES), "--state", str(STATE))
    try:
        record = json.loads((STATE / "lab.json").read_text())
        nodes = [LabNode(n["name"], n["index"], n["ip"], n["pid1"]) for n in record["nodes"]]
        yield Lab(
            state=STATE,
            nodes=nodes,
            key=STATE / "id_ed25519",
            known_hosts=STATE / "known_hosts",
            ssh_config=STATE / "ssh_config",
            cluster_file=STATE / "cluster.yaml",
        )
    finally:
        llmgw("lab", "down", "--state", str(STATE))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that boot their own lab go first, before the session lab is up."""
    items.sort(key=lambda item: 0 if item.path.name == "test_lab_lifecycle.py" else 1)

"""The journals the doctor reads of a node's failing replica units: only those units,
through the node helper as root, the engine key replaced, systemd's own lines left out."""

from __future__ import annotations

import asyncio
from typing import cast

from llmgw_cli.core.engine.engine_access import engine_env_text
from llmgw_cli.remote.doctor import failing_journals
from llmgw_cli.remote.transport import CommandResult, Transport
from tests.unit.doctor.conftest import collected, spec
from tests.unit.doctor.test_checks import LABELS, LOOPING_UNIT

KEY = "k3y-" + "a" * 40
JOURNAL = (
    "INFO loading with LLMGW_ENGINE_KEY=" + KEY + "\n"
    "vllm serve: error: unrecognized arguments: --no-such-flag \x1b[2J\n"
    "llmgw-a-0.service: Main process exited, code=exited, status=2/INVALIDARGUMENT\n"
    "llmgw-a-0.service: Failed with result 'exit-code'.\n"
)


class Node:
    """A node whose helper answers ``journal`` with JOURNAL, and whose key file holds KEY."""

    node = "gpu1"

    def __init__(self) -> None:
        self.asked: list[tuple[str, bool]] = []

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        self.asked.append((command, root))
        if command.startswith("cat /etc/llmgw/engine.env"):
            return CommandResult(0, engine_env_text(KEY), "")
        if " journal " in command:
            return CommandResult(0, JOURNAL, "")
        return CommandResult(1, "", "not expected")


def test_a_failing_unit_s_journal_is_read_as_root_with_the_engine_key_replaced() -> None:
    s = spec()
    node = Node()
    found = asyncio.run(
        failing_journals(collected(s, units=LOOPING_UNIT, labels=LABELS), cast(Transport, node))
    )
    assert found == {
        "llmgw-a-0.service": (
            "INFO loading with LLMGW_ENGINE_KEY=[engine key]",
            "vllm serve: error: unrecognized arguments: --no-such-flag \\x1b[2J",
        )
    }
    assert all(root for _, root in node.asked)
    assert any("node-helper journal llmgw-a-0.service" in command for command, _ in node.asked)


def test_a_node_without_failing_units_is_not_asked() -> None:
    s = spec()
    running = LOOPING_UNIT.replace("activating", "active").replace("auto-restart", "running")
    running = running.replace("NRestarts=7", "NRestarts=0").replace("Result=exit-code", "Result=success")
    node = Node()
    assert (
        asyncio.run(failing_journals(collected(s, units=running, labels=LABELS), cast(Transport, node))) == {}
    )
    assert node.asked == []

"""The order of a gateway hand-over on its host (remote/gateway_install.py), against a fake
systemd: the hand-over instance serves before the primary restarts, the primary is READY
again before the hand-over instance stops, and a hand-over that does not start leaves the
running gateway alone."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.hosts.units import GATEWAY_HANDOVER_UNIT, GATEWAY_UNIT
from llmgw_cli.errors import NodeError
from llmgw_cli.remote import gateway_install
from llmgw_cli.remote.transport import CommandResult

SPEC = parse_cluster("cluster: {name: c}\ngateway: {host: localhost}\n")


class FakeSystemd:
    """A gateway host's systemd: each queued job takes effect at once (the fake's
    ``systemctl show`` after it sees the result), except a start of a unit in ``broken``,
    which fails."""

    def __init__(self, broken: frozenset[str] = frozenset()) -> None:
        self.node = "gw"
        self.broken = broken
        self.pids = itertools.count(100)
        self.units = {
            GATEWAY_UNIT: {"ActiveState": "active", "SubState": "running", "MainPID": str(next(self.pids))},
            GATEWAY_HANDOVER_UNIT: {"ActiveState": "inactive", "SubState": "dead", "MainPID": "0"},
        }
        self.jobs: list[str] = []  # "start X", "restart X", "stop X" in order

    def _start(self, unit: str) -> None:
        if unit in self.broken:
            self.units[unit] = {"ActiveState": "failed", "SubState": "failed", "MainPID": "0"}
        else:
            self.units[unit] = {
                "ActiveState": "active",
                "SubState": "running",
                "MainPID": str(next(self.pids)),
            }

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        words = command.split()
        if command.startswith("systemctl show"):
            unit = words[-1]
            state = {
                "Id": unit,
                "LoadState": "loaded",
                "Result": "success",
                "NRestarts": "0",
                **self.units[unit],
            }
            return CommandResult(0, "".join(f"{k}={v}\n" for k, v in state.items()), "")
        if words[0] == "systemctl" and words[1] in ("start", "restart", "stop"):
            verb, unit = words[1], words[-1]
            self.jobs.append(f"{verb} {unit}")
            if verb == "stop":
                self.units[unit] = {"ActiveState": "inactive", "SubState": "dead", "MainPID": "0"}
            else:
                self._start(unit)
            return CommandResult(0, "", "")
        if command.startswith("date"):
            return CommandResult(0, "1000\n", "")
        if "journalctl" in command:
            return CommandResult(0, "Traceback: the new gateway crashed\n", "")
        raise AssertionError(f"unexpected command: {command}")

    async def write_file(self, path: str, content: str, *, mode: int = 0o644, root: bool = False) -> None:
        raise AssertionError("no file is written here")

    async def close(self) -> None:
        pass


def test_the_hand_over_serves_while_the_gateway_restarts() -> None:
    host = FakeSystemd()
    seen: list[str] = []
    asyncio.run(gateway_install._hand_over(host, SPEC, lambda _who, what: seen.append(what)))
    assert host.jobs == [
        f"start {GATEWAY_HANDOVER_UNIT}",
        f"restart {GATEWAY_UNIT}",
        f"stop {GATEWAY_HANDOVER_UNIT}",
    ]
    assert host.units[GATEWAY_UNIT]["ActiveState"] == "active"
    assert host.units[GATEWAY_HANDOVER_UNIT]["ActiveState"] == "inactive"
    assert seen[-1] == "handed over"


def test_a_hand_over_that_does_not_start_leaves_the_running_gateway_alone() -> None:
    host = FakeSystemd(broken=frozenset({GATEWAY_HANDOVER_UNIT}))
    primary = dict(host.units[GATEWAY_UNIT])
    with pytest.raises(NodeError) as caught:
        asyncio.run(gateway_install._hand_over(host, SPEC, lambda _who, _what: None))
    assert "the new gateway did not start; the running one keeps serving" in caught.value.reason
    assert "Traceback: the new gateway crashed" in caught.value.reason  # its journal says why
    assert host.jobs == [f"start {GATEWAY_HANDOVER_UNIT}", f"stop {GATEWAY_HANDOVER_UNIT}"]
    assert host.units[GATEWAY_UNIT] == primary  # never restarted


def test_a_primary_that_does_not_come_back_leaves_the_hand_over_serving() -> None:
    host = FakeSystemd(broken=frozenset({GATEWAY_UNIT}))
    with pytest.raises(NodeError, match=f"{GATEWAY_HANDOVER_UNIT} keeps serving meanwhile"):
        asyncio.run(gateway_install._hand_over(host, SPEC, lambda _who, _what: None))
    assert host.jobs == [f"start {GATEWAY_HANDOVER_UNIT}", f"restart {GATEWAY_UNIT}"]
    assert host.units[GATEWAY_HANDOVER_UNIT]["ActiveState"] == "active"

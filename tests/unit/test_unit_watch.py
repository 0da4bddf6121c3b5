"""The unit watch behind apply's readiness wait and the gateway's starts: a unit that went
wrong is reported with its journal, read through the node helper's verbs of a fake node."""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.planning.drain import DRAIN_DIR
from llmgw_cli.core.planning.plan import Action, Plan, UnitFile
from llmgw_cli.progress import silent
from llmgw_cli.remote import execute as execute_mod
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import NOT_READY, UnitWatch, execute
from llmgw_cli.remote.executor import one_plan
from llmgw_cli.remote.nodeops import NodeOps
from llmgw_cli.remote.transport import CommandResult, Transport

UNIT = "llmgw-m-0.service"
KEY = "ab" * 32
JOURNAL = "vllm: error: unrecognized arguments: --no-such-flag"


@dataclass
class FakeNode:
    """A node's helper as the watch sees it: ``systemctl show`` of one unit whose
    properties the test sets, its journal, the clock and the engine key file."""

    node: str = "a"
    props: dict[str, str] = field(default_factory=dict)
    journal: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)  # drain markers the helper removed, by path

    def set(self, active: str, sub: str, result: str = "success", restarts: int = 0, status: int = 0) -> None:
        self.props = {
            "Id": UNIT,
            "LoadState": "loaded",
            "ActiveState": active,
            "SubState": sub,
            "Result": result,
            "MainPID": "0" if active != "active" else "4242",
            "NRestarts": str(restarts),
            "ExecMainCode": "1",
            "ExecMainStatus": str(status),
        }

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        self.commands.append(command)
        words = shlex.split(command)
        if words[0].endswith("node-helper"):
            verb = words[1]
            if verb == "date":
                return CommandResult(0, "1700000000\n", "")
            if verb == "show":
                return CommandResult(0, "".join(f"{k}={v}\n" for k, v in self.props.items()), "")
            if verb == "journal":
                return CommandResult(0, "".join(f"{line}\n" for line in self.journal), "")
            if verb == "drain-clear":
                self.removed += [f"{DRAIN_DIR}/{unit}" for unit in words[2:]]
            return CommandResult(0, "", "")
        if words[:2] == ["cat", "/etc/llmgw/engine.env"]:
            return CommandResult(0, f"LLMGW_ENGINE_KEY={KEY}\n", "")
        return CommandResult(1, "", f"unexpected: {command}")

    async def write_file(self, path: str, content: str, *, mode: int = 0o644, root: bool = False) -> None:
        raise AssertionError(f"the watch writes nothing ({path})")

    async def close(self) -> None:
        pass


def watched(node: FakeNode) -> UnitWatch:
    return asyncio.run(UnitWatch.start(NodeOps(node), UNIT))


def failure(watch: UnitWatch) -> str | None:
    return asyncio.run(watch.failure())


def test_an_engine_that_exited_is_reported_while_systemd_waits_to_restart_it() -> None:
    """Restart=on-failure with RestartSec: the unit sits in auto-restart, NRestarts not yet
    grown; the watch reports it at once, with the journal line that says why."""
    node = FakeNode()
    node.set("active", "running")
    watch = watched(node)
    assert failure(watch) is None
    node.set("activating", "auto-restart", result="exit-code", status=2)
    node.journal = ["INFO starting", JOURNAL, f"the key was {KEY}"]
    reason = failure(watch)
    assert reason is not None
    assert reason.startswith(f"{UNIT} activating/auto-restart (exit-code, exit status 2, 0 restart(s))")
    assert JOURNAL in reason
    assert KEY not in reason and "[engine key]" in reason  # the key never reaches apply's output
    # the journal is asked for from the watch's start on, not the unit's earlier lives
    assert any(shlex.split(c)[1:3] == ["journal", UNIT] and "1700000000" in c for c in node.commands)


def test_a_journal_still_empty_when_the_exit_is_seen_is_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd can see an engine exit before journald has read its last line from the
    engine's output: an empty journal is asked again, briefly, so the reason is there."""
    monkeypatch.setattr(execute_mod, "JOURNAL_RETRY_EVERY", 0.0)
    node = FakeNode()
    node.set("active", "running")
    watch = watched(node)
    node.set("activating", "auto-restart", result="exit-code", status=2)
    asked = 0
    run = node.run

    async def late_journal(command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        nonlocal asked
        if shlex.split(command)[1:2] == ["journal"]:
            asked += 1
            node.journal = [JOURNAL] if asked >= 3 else []
        return await run(command, root=root, stdin=stdin)

    monkeypatch.setattr(node, "run", late_journal)
    reason = failure(watch)
    assert reason is not None and JOURNAL in reason and asked == 3


def test_a_journal_that_stays_empty_is_given_up_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execute_mod, "JOURNAL_RETRY_EVERY", 0.0)
    node = FakeNode()
    node.set("active", "running")
    watch = watched(node)
    node.set("failed", "failed", result="exit-code", status=1)
    reason = failure(watch)
    assert reason is not None and reason.startswith(f"{UNIT} failed/failed")
    journals = [c for c in node.commands if shlex.split(c)[1:2] == ["journal"]]
    assert len(journals) == 1 + execute_mod.JOURNAL_RETRIES


def test_newer_systemd_queued_restart_is_reported_too() -> None:
    node = FakeNode()
    node.set("active", "running")
    watch = watched(node)
    node.set("activating", "auto-restart-queued", result="exit-code", status=1)
    assert failure(watch) is not None


def test_restarts_before_the_watch_began_are_not_a_failure() -> None:
    node = FakeNode()
    node.set("active", "running", restarts=3)
    watch = watched(node)
    assert failure(watch) is None
    node.set("active", "running", restarts=4)  # restarted since, and up again
    reason = failure(watch)
    assert reason is not None and "1 restart(s)" in reason


@pytest.mark.parametrize(
    ("active", "sub", "result"),
    [
        ("failed", "failed", "exit-code"),  # systemd gave up on it
        ("deactivating", "stop-sigterm", "exit-code"),  # exited; the rest of its cgroup goes
        ("inactive", "dead", "success"),  # exited 0: on-failure does not restart it
    ],
)
def test_a_unit_that_ended_is_reported(active: str, sub: str, result: str) -> None:
    node = FakeNode()
    node.set("active", "running")
    watch = watched(node)
    node.set(active, sub, result=result)
    reason = failure(watch)
    assert reason is not None and reason.startswith(f"{UNIT} {active}/{sub} ({result}, ")


@pytest.mark.parametrize(("active", "sub"), [("active", "running"), ("reloading", "reload")])
def test_a_unit_that_runs_is_not_reported(active: str, sub: str) -> None:
    node = FakeNode()
    node.set("active", "running")
    watch = watched(node)
    node.set(active, sub)
    assert failure(watch) is None


CLUSTER = """
cluster: {name: t}
ssh: {connect_timeout: 1s}
gateway: {install: false}
nodes:
  - {name: a, address: 192.0.2.1}
profiles:
  vllm: {engine: vllm, command: [/opt/vllm/bin/vllm, serve]}
models: []
"""


@pytest.mark.parametrize("fetch", [True, False])
def test_execute_brings_weights_unless_told_its_caller_did(
    monkeypatch: pytest.MonkeyPatch, fetch: bool
) -> None:
    calls: list[Plan] = []

    async def ensure_for_plan(spec: object, plan: Plan, conns: object, report: object) -> dict[str, str]:
        calls.append(plan)
        return {}

    monkeypatch.setattr(execute_mod, "ensure_for_plan", ensure_for_plan)
    spec = parse_cluster(CLUSTER)
    node = FakeNode()
    stop = one_plan(
        [Action(op="-", model="m", replica=0, nodes=("a",), reason="idle", remove=(("a", UNIT),))]
    )

    def opener(*_args: object) -> Transport:
        return node

    async def scenario() -> None:
        async with Connections(spec, Path(), opener=opener) as conns:
            outcomes = await execute(spec, conns, stop, silent, wait=False, fetch=fetch)
            assert [o.ok for o in outcomes] == [True]

    asyncio.run(scenario())
    assert calls == ([stop] if fetch else [])
    # a removed unit takes its drain marker with it: a later replica of the same name is not retired
    assert node.removed == [f"{DRAIN_DIR}/{UNIT}"]


def test_the_journal_is_read_from_before_the_start_when_the_watch_began_later() -> None:
    """An engine that exited before its watch began: its journal lines are older than
    the watch, so the watch reads from the clock its node gave before the start."""
    node = FakeNode()
    node.set("activating", "auto-restart", "exit-code", status=2)
    node.journal = [JOURNAL]
    watch = asyncio.run(UnitWatch.start(NodeOps(node), UNIT, "1699999990"))
    assert failure(watch)
    journal = [c for c in node.commands if " journal " in c]
    assert journal and shlex.split(journal[-1])[-2] == "1699999990", journal
    assert not any(" date" in c for c in node.commands)  # the node's clock now is not asked
    later = watched(FakeNode(props=node.props))
    assert later.since == "1700000000"  # without one: the node's clock when the watch began


class StartJobFails(FakeNode):
    """A node whose engine exits before systemd's start job ends: ``start`` fails and the
    unit waits to be restarted; the node's other commands (accounts, key file) succeed."""

    async def run(self, command: str, *, root: bool = False, stdin: str | None = None) -> CommandResult:
        words = shlex.split(command)
        if words[0].endswith("node-helper") and words[1] == "start":
            self.commands.append(command)
            self.set("activating", "auto-restart", result="exit-code", status=2)
            self.journal = [JOURNAL]
            return CommandResult(1, "", f"Job for {UNIT} failed because the control process exited")
        if words[0].endswith("node-helper") or words[:2] == ["cat", "/etc/llmgw/engine.env"]:
            return await super().run(command, root=root, stdin=stdin)
        self.commands.append(command)
        return CommandResult(1 if words[:1] == ["timeout"] else 0, "", "")  # nothing answers HTTP

    async def write_file(self, path: str, content: str, *, mode: int = 0o644, root: bool = False) -> None:
        pass


def test_an_engine_that_fails_its_start_job_is_a_replica_not_ready_and_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether systemd sees an engine's exit before its start job ends is a race; either
    way apply says the same: the node's units are in place, the replica was not ready (with
    its journal) and it is stopped, not left for systemd to restart forever."""

    async def no_weights(*_args: object) -> dict[str, str]:
        return {}

    monkeypatch.setattr(execute_mod, "ensure_for_plan", no_weights)
    spec = parse_cluster(CLUSTER.replace("models: []", "models:\n  - {name: m, source: /w/m, profile: vllm}"))
    node = StartJobFails()
    node.set("inactive", "dead")
    start = one_plan(
        [
            Action(
                op="+",
                model="m",
                replica=0,
                nodes=("a",),
                reason="min",
                port=8000,
                write=(UnitFile(node="a", name=UNIT, text="[Service]\n"),),
            )
        ]
    )

    async def scenario() -> list[tuple[str, bool, str]]:
        async with Connections(spec, Path(), opener=lambda *_: node) as conns:
            outcomes = await execute(spec, conns, start, silent, engine_keys={"a": KEY})
        return [(o.subject, o.ok, o.message) for o in outcomes]

    (placed, replica) = asyncio.run(scenario())
    assert placed == ("a", True, "units in place")
    assert replica[:2] == ("m#0", False)
    assert replica[2].startswith(f"{NOT_READY}: {UNIT} activating/auto-restart"), replica
    assert JOURNAL in replica[2]
    helper = [shlex.split(c)[1:] for c in node.commands if shlex.split(c)[0].endswith("node-helper")]
    assert helper.index(["start", UNIT]) < helper.index(["stop", UNIT])  # stopped after the failed start

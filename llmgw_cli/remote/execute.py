"""Run a Plan on the nodes, then wait until each started replica is ready.

Per node, in this order: service accounts and the engine key file; stop and remove what
goes; write every unit atomically (temporary file + rename); one ``daemon-reload``;
enable and (re)start what comes. Nodes are worked on in parallel; a node that fails is
reported with its reason and the others carry on. Nothing is half-written by an
interruption, and the next ``apply`` reads the nodes again and converges.

Readiness follows the engines' semantics (REFERENCE.md 4.4): connection refused means
starting, 503 means loading, 200 means ready; a unit that fails meanwhile is reported
with the last lines of its journal.
"""

from __future__ import annotations

import asyncio
import secrets
import shlex
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmgw_cli.core.engines import ENGINE_ENV_FILE, ENGINE_KEY_VAR, UNIT_DIR
from llmgw_cli.core.facts import UnitState
from llmgw_cli.core.parse.systemctl import parse_show, unit_state
from llmgw_cli.core.plan import Action, Plan
from llmgw_cli.core.spec import ClusterSpec
from llmgw_cli.errors import LlmgwError, NodeError
from llmgw_cli.remote.connect import transport_for
from llmgw_cli.remote.fetch import ensure_for_plan
from llmgw_cli.remote.transport import Transport

Report = Callable[[str, str], None]
"""Called with (subject, message) as work progresses."""


@dataclass(frozen=True)
class Outcome:
    subject: str  # a node, or "model#replica"
    ok: bool
    message: str


@dataclass
class _NodeWork:
    remove: list[str]
    write: dict[str, str]
    start: list[str]
    restart: list[str]
    users: set[str]


def _work_by_node(spec: ClusterSpec, plan: Plan) -> dict[str, _NodeWork]:
    work: dict[str, _NodeWork] = defaultdict(lambda: _NodeWork([], {}, [], [], set()))
    for action in plan.changes:
        model = next((m for m in spec.models if m.name == action.model), None)
        for node, name in action.remove:
            work[node].remove.append(name)
        for unit in action.write:
            w = work[unit.node]
            w.write[unit.name] = unit.text
            (w.restart if action.op == "~" else w.start).append(unit.name)
            if model is not None:
                w.users.add(spec.profiles[model.profile].user)
    return work


def new_engine_key() -> str:
    """A new engine key: 64 hex digits. Never URL-safe base64, which starts with `-` once
    in 64 keys: engines read `--api-key -xyz` as a missing value and exit."""
    return secrets.token_hex(32)


async def _read_engine_key(t: Transport) -> str | None:
    """The key in the host's engine env file; None when absent or the host is unreachable."""
    try:
        result = await t.run(f"cat {ENGINE_ENV_FILE} 2>/dev/null", root=True)
    except NodeError:
        return None
    for line in result.stdout.splitlines():
        if line.startswith(f"{ENGINE_KEY_VAR}="):
            return line.split("=", 1)[1].strip()
    return None


async def cluster_engine_key(transports: list[Transport]) -> str:
    """The cluster's engine key, read from every host given (nodes and the gateway host):
    the one they hold, a new one when none holds any. Hosts that disagree are an error,
    since the gateway can only hold one key."""
    found = await asyncio.gather(*(_read_engine_key(t) for t in transports))
    holders: dict[str, list[str]] = defaultdict(list)
    for t, key in zip(transports, found, strict=True):
        if key:
            holders[key].append(t.node)
    if len(holders) > 1:
        groups = "; ".join(", ".join(sorted(nodes)) for nodes in holders.values())
        raise LlmgwError(
            f"the hosts hold different engine keys in {ENGINE_ENV_FILE} ({groups}): copy one "
            "file to every node and to the gateway host, then restart the replicas"
        )
    return next(iter(holders)) if holders else new_engine_key()


async def ensure_account(t: Transport, user: str) -> None:
    """A system account without login for ``user``, unless it exists."""
    q = shlex.quote(user)
    await must(
        t,
        f"id -u {q} >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin {q}",
        f"create the account {user}",
    )


async def ensure_engine_key(t: Transport, key: str, other_key_hint: str) -> None:
    """Write ``key`` to the host's engine env file (0600, root) when it has none. A file
    with another key is an error (``other_key_hint`` says what to do): the replicas on a
    host take their key from it, so a second key would lock the gateway out of some."""
    present = await t.run(f"cat {ENGINE_ENV_FILE} 2>/dev/null", root=True)
    if not present.stdout.strip():
        await t.write_file(ENGINE_ENV_FILE, f"{ENGINE_KEY_VAR}={key}\n", mode=0o600, root=True)
    elif f"{ENGINE_KEY_VAR}={key}" not in present.stdout.splitlines():
        raise NodeError(
            t.node,
            "failed",
            f"{ENGINE_ENV_FILE} holds another engine key than the one in use; {other_key_hint}",
        )


async def _apply_node(t: Transport, w: _NodeWork, key: str) -> None:
    q = shlex.quote
    for user in sorted(w.users):
        await ensure_account(t, user)
    await ensure_engine_key(
        t, key, "copy the cluster's key there (or remove the file when no replica runs on the node)"
    )
    for name in w.remove + w.restart:
        await t.run(f"systemctl stop {q(name)}", root=True)
    for name in w.remove:
        if name not in w.write:
            await t.run(
                f"systemctl disable {q(name)} 2>/dev/null; rm -f {q(f'{UNIT_DIR}/{name}')}", root=True
            )
    for name, text in sorted(w.write.items()):
        await t.write_file(f"{UNIT_DIR}/{name}", text, mode=0o644, root=True)
    await must(t, "systemctl daemon-reload", "systemctl daemon-reload")
    units = sorted(set(w.start + w.restart))
    if units:
        await must(t, "systemctl enable --now " + " ".join(q(u) for u in units), "start units")


async def must(t: Transport, command: str, what: str) -> None:
    """Run ``command`` as root; a non-zero exit is a NodeError saying ``what`` failed."""
    result = await t.run(command, root=True)
    if not result.ok:
        raise NodeError(t.node, "failed", f"{what}: {(result.stderr or result.stdout).strip()}")


async def _wait_ready(
    spec: ClusterSpec, action: Action, transports: dict[str, Transport], report: Report
) -> Outcome:
    model = spec.model(action.model)
    profile = spec.profiles[model.profile]
    head = action.nodes[0]
    unit = next(w.name for w in action.write if w.node == head)
    url = f"http://{spec.node(head).address}:{action.port}{profile.readiness.path}"
    subject = f"{action.model}#{action.replica}"
    watch = await UnitWatch.start(transports[head], unit)
    report(subject, "starting")
    deadline = time.monotonic() + profile.readiness.start_timeout
    last = "starting"
    async with httpx.AsyncClient(timeout=5.0) as client:
        while time.monotonic() < deadline:
            try:
                response = await client.get(url)
                state = "ready" if response.status_code == 200 else f"loading ({response.status_code})"
            except httpx.TransportError:
                state = "starting"
            if state == "ready":
                report(subject, "ready")
                return Outcome(subject, True, f"ready on {head}:{action.port}")
            if state != last:
                report(subject, state)
                last = state
            failed = await watch.failure()
            if failed:
                return Outcome(subject, False, failed)
            await asyncio.sleep(0.5)
    return Outcome(subject, False, f"not ready after {profile.readiness.start_timeout:g}s ({last}); {url}")


@dataclass
class UnitWatch:
    """Notices a unit that failed or restarted since the watch began (systemd keeps NRestarts
    and the journal across a unit's earlier lives, so both are taken relative to the start)."""

    transport: Transport
    unit: str
    restarts: int
    since: str

    @classmethod
    async def start(cls, transport: Transport, unit: str) -> UnitWatch:
        state = await cls._state(transport, unit)
        clock = await transport.run("date +%s")
        since = clock.stdout.strip() if clock.ok else ""
        return cls(transport, unit, state.n_restarts if state else 0, since)

    @staticmethod
    async def _state(t: Transport, unit: str) -> UnitState | None:
        show = await t.run(
            f"systemctl show -p Id,ActiveState,SubState,Result,NRestarts,ExecMainStatus {shlex.quote(unit)}"
        )
        blocks = parse_show(show.stdout)
        return unit_state(blocks[0]) if blocks else None

    async def failure(self, lines: int = 15) -> str | None:
        """The reason and the last ``lines`` of its journal if the unit failed or
        restarted, else None."""
        state = await self._state(self.transport, self.unit)
        if state is None or (state.active_state != "failed" and state.n_restarts <= self.restarts):
            return None
        since = f"--since @{self.since}" if self.since.isdigit() else ""
        journal = await self.transport.run(
            f"journalctl -u {shlex.quote(self.unit)} {since} -n {lines} --no-pager -o cat", root=True
        )
        restarts = state.n_restarts - self.restarts
        why = f"{self.unit} {state.active_state} ({state.result}, exit status {state.exec_main_status}, {restarts} restart(s))"
        return why + "\n" + journal.stdout.strip()


async def execute(
    spec: ClusterSpec,
    base: Path,
    plan: Plan,
    report: Report,
    *,
    wait: bool = True,
    engine_key: str | None = None,
) -> list[Outcome]:
    """Carry out ``plan``; one Outcome per node worked on and per replica waited for.
    ``engine_key``: the key the engines must take (the gateway's); by default the one
    already on a node, else a new one."""
    work = _work_by_node(spec, plan)
    transports = {name: transport_for(spec, spec.node(name), base) for name in work}
    outcomes: list[Outcome] = []
    try:
        key = engine_key or await cluster_engine_key(list(transports.values()))
        # Weights first: a replica whose URL-sourced file is missing on a node waits for it.
        no_weights = await ensure_for_plan(spec, base, plan, transports, report)

        async def one(node: str) -> Outcome:
            if node in no_weights:
                report(node, f"failed: {no_weights[node]}")
                return Outcome(node, False, no_weights[node])
            try:
                await _apply_node(transports[node], work[node], key)
            except NodeError as exc:
                report(node, f"failed: {exc.reason}")
                return Outcome(node, False, exc.reason)
            report(node, "units in place")
            return Outcome(node, True, "units in place")

        outcomes = list(await asyncio.gather(*(one(n) for n in sorted(work))))
        broken = {o.subject for o in outcomes if not o.ok}
        if wait:
            started = [a for a in plan.changes if a.write and not set(a.nodes) & broken]
            outcomes += await asyncio.gather(*(_wait_ready(spec, a, transports, report) for a in started))
    finally:
        await asyncio.gather(*(t.close() for t in transports.values()))
    return outcomes

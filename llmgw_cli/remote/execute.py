"""Run a Plan on the nodes, then wait until each started replica is ready.

Per node, in this order: service accounts and the engine key file; stop and remove what
goes; write every unit atomically (temporary file + rename); one ``daemon-reload``;
enable and (re)start what comes. Nodes are worked on in parallel; a node that fails is
reported with its reason and the others carry on. Nothing is half-written by an
interruption, and the next ``apply`` reads the nodes again and converges.

Readiness follows the engines' semantics (vLLM, SGLang and llama-server listen only once
loaded, and answer /health with 503 while loading): connection refused means
starting, 503 means loading, 200 means ready; a unit that fails meanwhile is reported
with the last lines of its journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shlex
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.engine.engine_access import (
    engine_env_text,
    secret_env_file,
    secret_env_text,
    sglang_key_file,
    sglang_key_text,
)
from llmgw_cli.core.engine.engines import ENGINE_ENV_FILE
from llmgw_cli.core.observe.parse.engine_env import engine_key
from llmgw_cli.core.observe.unit_state import UnitState
from llmgw_cli.core.planning.drain import REPLICA_UNIT
from llmgw_cli.core.planning.plan import Action, Plan
from llmgw_cli.errors import NodeError
from llmgw_cli.polling import attempts
from llmgw_cli.progress import Phase, Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.nodeops import NodeOps, ShellOps
from llmgw_cli.remote.transport import Transport
from llmgw_cli.remote.weights import ensure_for_plan


@dataclass(frozen=True)
class Outcome:
    subject: str  # a node, or "model#replica"
    ok: bool
    message: str
    # The node's clock (epoch seconds) just before it started units, "" when it started
    # none: a watch of a unit that exited at once reads its journal from there.
    since: str = ""


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
    in 64 keys: an engine given `--api-key -xyz` would read a missing value and exit."""
    return secrets.token_hex(32)


async def read_engine_key(t: Transport) -> str | None:
    """The key in the host's engine env file; None when absent or the host is unreachable."""
    try:
        result = await t.run(f"cat {ENGINE_ENV_FILE} 2>/dev/null", root=True)
    except NodeError:
        return None
    return engine_key(result.stdout)


async def node_engine_keys(transports: list[Transport], *, rotate: bool = False) -> dict[str, str]:
    """Each node's engine key: the one it holds, a new one for a node that holds none (or
    for every node with ``rotate``). Keys are per node, so a key read on one node opens
    only that node's engines."""
    found = await asyncio.gather(*(read_engine_key(t) for t in transports))
    return {
        t.node: key if key and not rotate else new_engine_key()
        for t, key in zip(transports, found, strict=True)
    }


async def ensure_engine_key(t: Transport, key: str, sglang_users: Iterable[str] = ()) -> bool:
    """Make the node's key files hold ``key``; True when they were written. The env file is
    0600 root (systemd reads it before it drops privileges); SGLang's file, one per SGLang
    engine account, is 0440 root:account (SGLang opens it itself)."""
    sglang = {user: sglang_key_file(user) for user in sglang_users}
    missing = [
        u for u, path in sglang.items() if not (await t.run(f"test -f {shlex.quote(path)}", root=True)).ok
    ]
    if await read_engine_key(t) == key and not missing:
        return False
    for user, path in sglang.items():
        await ensure_account(t, user)
        gid = (await t.run(f"id -g {shlex.quote(user)}")).stdout.strip()
        if not gid.isdigit():
            raise NodeError(t.node, "failed", f"give {user} its key: no group id for {user}")
        await t.write_file(path, sglang_key_text(key), mode=0o440, root=True, group=gid)
    await t.write_file(ENGINE_ENV_FILE, engine_env_text(key), mode=0o600, root=True)
    return True


async def ensure_secret_env(t: Transport, spec: ClusterSpec) -> None:
    """Every model's secret environment file (0600, root), on every node that may host it:
    the gateway starts on-demand replicas anywhere and never writes secrets itself."""
    for model in spec.models:
        text = secret_env_text(spec, model)
        if text is not None:
            await t.write_file(secret_env_file(model.name), text, mode=0o600, root=True)


def redact_keys(text: str, keys: Iterable[str]) -> str:
    """``text`` (a journal tail) with every engine key replaced: a second guard, since no
    engine gets its key in argv any more, for an engine that prints its environment."""
    for key in keys:
        if key:
            text = text.replace(key, "[engine key]")
    return text


async def ensure_account(t: Transport, user: str) -> None:
    """A system account without login for ``user``, unless it exists."""
    q = shlex.quote(user)
    await must(
        t,
        f"id -u {q} >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin {q}",
        f"create the account {user}",
    )


async def _apply_node(t: Transport, w: _NodeWork, key: str | None, *, operator: bool = True) -> str:
    """Accounts and the key file (the operator only: the gateway finds them made by apply),
    then the units through the node helper's verbs, the one path both callers share."""
    if operator:
        for user in sorted(w.users):
            await ensure_account(t, user)
    if key is not None:  # apply brings keys; the gateway's on-demand starts find them there
        await ensure_engine_key(t, key)
    ops = NodeOps(t, root=operator)
    await ops.stop(w.remove + w.restart)
    if operator:
        # a replica retired by a rolling replace leaves with its drain marker; a unit
        # started again under the same name must not read as being retired
        await clear_markers(t, w.remove + w.restart)
    await ops.remove([name for name in w.remove if name not in w.write])
    for name, text in sorted(w.write.items()):
        await ops.write_unit(name, text)
    await ops.daemon_reload()
    units = sorted(set(w.start + w.restart))
    since = await ops.date() if units else ""
    try:
        await ops.start(units)
    except NodeError as exc:
        # An engine that exits at once (or cannot be executed) can fail its start job, or
        # not, depending on whether systemd sees the exit before the job ends. Either way it
        # is a replica that never became ready: the readiness wait reports it with its
        # journal and stops it. A start that failed with every unit up is the node's failure.
        if not [unit for unit in units if await _went_wrong_now(ops, unit)]:
            raise NodeError(t.node, exc.kind, exc.reason) from None
    return since


async def _went_wrong_now(ops: NodeOps, unit: str) -> bool:
    state = await ops.show(unit)
    return state is not None and went_wrong(state)


async def clear_markers(t: Transport, units: list[str]) -> None:
    """Remove the drain markers of ``units`` (``core/planning/drain.py``), through the
    node helper."""
    replicas = [u for u in units if REPLICA_UNIT.fullmatch(u)]
    if replicas:
        await NodeOps(t).must("drain-clear", *replicas)


async def must(t: Transport, command: str, what: str) -> None:
    """Run ``command`` as root; a non-zero exit is a NodeError saying ``what`` failed."""
    result = await t.run(command, root=True)
    if not result.ok:
        raise NodeError(t.node, "failed", f"{what}: {(result.stderr or result.stdout).strip()}")


async def _wait_ready(
    spec: ClusterSpec, action: Action, transports: dict[str, Transport], report: Report, since: str
) -> Outcome:
    model = spec.model(action.model)
    profile = spec.profiles[model.profile]
    head = action.nodes[0]
    unit = next(w.name for w in action.write if w.node == head)
    host = spec.node(head).engine_host
    url = f"http://{host}:{action.port}{profile.readiness.path}"
    subject = f"{action.model}#{action.replica}"
    watch = await UnitWatch.start(NodeOps(transports[head]), unit, since)
    report(subject, "starting")
    last = "starting"

    async def step() -> Outcome | None:
        nonlocal last
        # Polled on the head node itself: the engine's firewall lets in only its nodes and the gateway.
        status = await ready_status(transports[head], host, action.port or 0, profile.readiness.path)
        state = "starting" if status is None else "ready" if status == 200 else f"loading ({status})"
        if state == "ready":
            report(subject, "ready", Phase.done)
            return Outcome(subject, True, f"ready on {head}:{action.port}")
        if state != last:
            report(subject, state)
            last = state
        failed = await watch.failure()
        if failed:
            report(subject, f"failed: {failed}", Phase.failed)
            await _stop_not_ready(action, transports)
            return Outcome(subject, False, f"{NOT_READY}: {failed}")
        return None

    done = None
    async for _ in attempts(profile.readiness.start_timeout, 0.5):
        if (done := await step()) is not None:
            break
    if done is not None:
        return done
    report(subject, f"failed: not ready after {profile.readiness.start_timeout:g}s ({last})", Phase.failed)
    await _stop_not_ready(action, transports)
    why = f"not ready after {profile.readiness.start_timeout:g}s ({last}); {url}"
    return Outcome(subject, False, f"{NOT_READY}: {why}")


NOT_READY = "not ready, stopped"
"""How a readiness wait's Outcome begins when the replica failed and was stopped."""


async def _stop_not_ready(action: Action, transports: dict[str, Transport]) -> None:
    """Stop the units of a replica that did not become ready, so systemd stops restarting
    an engine that fails and its cards are free; its unit files stay, and the next
    ``apply`` starts it again once (``core/observe/health.py``: it is then failed)."""
    for node in action.nodes:
        unit = next((w.name for w in action.write if w.node == node), None)
        if unit is not None and node in transports:
            # a node that stopped answering: its next probe says what runs
            with contextlib.suppress(NodeError):
                await NodeOps(transports[node]).stop([unit])


async def ready_status(t: Transport, host: str, port: int, path: str) -> int | None:
    """The HTTP status of ``http://host:port/path`` asked from the node itself (bash's
    /dev/tcp: nothing to install); None when nothing answers. apply polls this over SSH
    rather than over HTTP from the operator's machine, so the engines' firewall needs to
    let in only the gateway and the replica's peers, never wherever apply runs from."""
    script = (
        f"exec 3<>/dev/tcp/{host}/{port} || exit 1; "
        f"printf 'GET %s HTTP/1.0\\r\\nHost: %s\\r\\n\\r\\n' {shlex.quote(path)} {host} >&3; "
        "head -n 1 <&3"
    )
    result = await t.run(f"timeout 5 bash -c {shlex.quote(script)} 2>/dev/null")
    words = result.stdout.split()
    return int(words[1]) if result.ok and len(words) > 1 and words[1].isdigit() else None


METRICS_BYTES = 1024 * 1024  # the most of an engine's /metrics page read (a vLLM page is about 50 kB)


async def metrics_page(t: Transport, host: str, port: int, key: str | None) -> str | None:
    """The page of ``http://host:port/metrics`` asked from the node itself, as
    ``ready_status`` asks, with the node's engine key; None when it does not answer 200
    within 5 s or the page is over ``METRICS_BYTES``. The key goes in the script on stdin,
    never on a command line another account can read."""
    auth = "Authorization: Bearer %s\\r\\n" if key else ""
    args = " ".join(shlex.quote(a) for a in (host, *([key] if key else [])))
    script = (
        f"exec 3<>/dev/tcp/{host}/{port} || exit 1\n"
        f"printf 'GET /metrics HTTP/1.0\\r\\nHost: %s\\r\\n{auth}\\r\\n' {args} >&3\n"
        f"head -c {METRICS_BYTES + 64 * 1024} <&3\n"
    )
    result = await t.run("timeout 5 bash -s 2>/dev/null", stdin=script)
    return response_body(result.stdout) if result.ok else None


def response_body(raw: str) -> str | None:
    """The body of an HTTP/1.0 response read whole (``metrics_page``): None unless its
    status is 200 and the body is at most ``METRICS_BYTES``."""
    head, sep, body = raw.replace("\r\n", "\n").partition("\n\n")
    words = head.split(None, 2)
    if not sep or len(words) < 2 or words[1] != "200" or len(body.encode()) > METRICS_BYTES:
        return None
    return body


def went_wrong(state: UnitState, restarts: int | None = None) -> bool:
    """Whether a unit that was started has failed since: systemd gave up on it
    (``failed``), it waits to be restarted (``auto-restart``: an engine that exits at once
    sits there for the unit's ``RestartSec`` before NRestarts grows), it ended with a
    Result other than success and is not active, it stopped (``inactive``: a start ends
    in ``active`` for ``Type=exec``, so only an exit or a stop leaves it), or it was
    restarted more than ``restarts`` times (None: restarts are not counted)."""
    return (
        state.active_state in ("failed", "inactive")
        or state.sub_state.startswith("auto-restart")  # auto-restart-queued on newer systemd
        or (state.result not in ("", "success") and state.active_state != "active")
        or (restarts is not None and state.n_restarts > restarts)
    )


JOURNAL_RETRIES = 12
# seconds: at most 3 s more for a failure's journal lines (a loaded node's journald lags)
JOURNAL_RETRY_EVERY = 0.25


async def unit_failure(
    ops: NodeOps | ShellOps, unit: str, since: str, *, restarts: int | None = None, lines: int = 15
) -> str | None:
    """If ``unit`` went wrong (``went_wrong``): its state and the last ``lines`` of its
    journal since ``since`` (``ops.date()``, taken before the start), else None."""
    state = await ops.show(unit)
    if state is None or not went_wrong(state, restarts):
        return None
    # A second guard: no engine takes its key in argv, but one that prints its
    # environment would put it in the journal, and this text ends up in apply's output.
    key = await read_engine_key(ops.transport)
    journal = await ops.journal(unit, since, lines)
    for _ in range(JOURNAL_RETRIES):
        if journal.strip():
            break
        # An engine that exits at once: systemd may see the exit before journald has read
        # the engine's last words from its output stream (`journalctl --sync` does not wait
        # for those); the reason is worth a second.
        await asyncio.sleep(JOURNAL_RETRY_EVERY)
        journal = await ops.journal(unit, since, lines)
    tail = redact_keys(journal, [key] if key else [])
    how = [state.result or "no result", f"exit status {state.exec_main_status}"]
    if restarts is not None:
        how.append(f"{state.n_restarts - restarts} restart(s)")
    return f"{unit} {state.active_state}/{state.sub_state} ({', '.join(how)})\n{tail.strip()}"


@dataclass
class UnitWatch:
    """Notices a unit that failed, exited or restarted since the watch began (systemd keeps
    NRestarts and the journal across a unit's earlier lives, so both are taken relative to
    the start; see ``went_wrong``). Begin it once the unit was started. It reads through
    ``ops``: the node helper's verbs, or plain commands on a gateway host."""

    ops: NodeOps | ShellOps
    unit: str
    restarts: int
    since: str

    @property
    def transport(self) -> Transport:
        return self.ops.transport

    @classmethod
    async def start(cls, ops: NodeOps | ShellOps, unit: str, since: str = "") -> UnitWatch:
        """Watch ``unit`` from now on. ``since``: the node's clock before the unit was
        started (``Outcome.since``), so the journal of an engine that exited before the
        watch began is read whole; "" takes the node's clock now."""
        state = await ops.show(unit)
        return cls(ops, unit, state.n_restarts if state else 0, since or await ops.date())

    async def failure(self, lines: int = 15) -> str | None:
        """The reason and the last ``lines`` of its journal if the unit went wrong, else None."""
        return await unit_failure(self.ops, self.unit, self.since, restarts=self.restarts, lines=lines)


async def execute(
    spec: ClusterSpec,
    conns: Connections,
    plan: Plan,
    report: Report,
    *,
    wait: bool = True,
    engine_keys: dict[str, str] | None = None,
    fetch: bool = True,
) -> list[Outcome]:
    """Carry out ``plan`` through the nodes' connections in ``conns``; one Outcome per node
    worked on and per replica waited for. ``engine_keys``: each node's key
    (``node_engine_keys``), written where a node lacks it; None (the gateway's on-demand
    starts): the keys apply left on the nodes. Connections with the gateway's access reach
    only the node helper; the operator's work as root."""
    work = _work_by_node(spec, plan)
    operator = conns.access is None
    transports = {name: conns.to(name) for name in work}
    keys = engine_keys or {}
    # Weights first: a replica whose URL-sourced file is missing on a node waits for it; a
    # node without a path source's file or folder fails here, before any unit is written.
    no_weights = await ensure_for_plan(spec, plan, conns, report) if fetch else {}

    async def one(node: Node, t: Transport) -> Outcome:
        if node.name in no_weights:
            report(node.name, f"failed: {no_weights[node.name]}", Phase.failed)
            return Outcome(node.name, False, no_weights[node.name])
        try:
            since = await _apply_node(t, work[node.name], keys.get(node.name), operator=operator)
        except NodeError as exc:
            report(node.name, f"failed: {exc.reason}", Phase.failed)
            return Outcome(node.name, False, exc.reason)
        report(node.name, "units in place", Phase.done)
        return Outcome(node.name, True, "units in place", since)

    outcomes = await conns.each([spec.node(n) for n in sorted(work)], one)
    if wait:
        outcomes += await _wait_all(spec, plan, outcomes, transports, report)
    return outcomes


async def _wait_all(
    spec: ClusterSpec, plan: Plan, outcomes: list[Outcome], transports: dict[str, Transport], report: Report
) -> list[Outcome]:
    """The readiness wait of every replica ``plan`` started on nodes that did not fail."""
    broken = {o.subject for o in outcomes if not o.ok}
    since = {o.subject: o.since for o in outcomes}
    started = [a for a in plan.changes if a.write and not set(a.nodes) & broken]
    return list(
        await asyncio.gather(
            *(_wait_ready(spec, a, transports, report, since.get(a.nodes[0], "")) for a in started)
        )
    )


async def wait_started(
    spec: ClusterSpec, conns: Connections, plan: Plan, outcomes: list[Outcome], report: Report
) -> list[Outcome]:
    """The readiness wait of ``execute`` on its own: one Outcome per replica ``plan``
    started on nodes that did not fail in ``outcomes``. For a caller that ran ``execute``
    with ``wait=False`` under the cluster lock and waits after releasing it."""
    transports = {name: conns.to(name) for a in plan.changes if a.write for name in a.nodes}
    return await _wait_all(spec, plan, outcomes, transports, report)

"""Replace serving replicas without refusing or cutting a request: apply's rolling steps.

A ``~`` action with ``retire`` set replaces a replica that may be serving. With ``surge``
(its successor has a new replica number, port and cards):

1. under the cluster lock: check that the successor's cards and port are still free (a
   probe of its nodes: the gateway may have started something there since the plan),
   write and start its units (``execute`` on a one-action plan); release; wait until
   it is ready (``wait_started``);
2. wait until every live gateway routes it (it is in ``ready[model]`` of each routes
   file on every gateway host; each gateway is told to probe at once with
   ``PROBE_NOW_SIGNAL``), at most ``ROUTED_BOUND`` seconds, then go on with a warning;
3. under the lock: write the drain marker on every member node of the old replica (its
   deadline: the node's clock plus ``drain_seconds``); release; tell the gateways to
   probe, and wait until none routes the old replica any more (bound: the deadline);
4. wait until the old engine has no established TCP connection on its API port (counted
   with ``ss`` on its head node every ``POLL`` seconds), or the deadline: connections
   still open then are the requests cut, said in the outcome;
5. under the lock: stop and remove the old units and their markers, daemon-reload.

Without ``surge`` (no free cards: the successor takes the old one's): steps 3 and 4
first, then stop the old units and write and start the new ones in ONE lock hold, then
wait until ready and routed (step 2: the gateways told to probe at once, so the model
is unserved for its load time, not up to a discovery round more). The lock is taken for each write step and never held during a wait,
so the gateway's own starts and stops go on meanwhile.

The order of those steps and what a failed one leaves serving are the executor's
(``remote/executor.py``, which the gateway's controller uses too); this module gives it
apply's seams: the cluster lock, ``execute`` over SSH (``ApplySteps``), the gateways'
routes files, the drain markers and the connection count (``ApplyRouting``).

The replacements of one model run one after another (the plan counts on the cards each
one frees), the models' at the same time. The other actions go through ``execute`` as
before; a ``+`` that takes cards or a port of a replica being replaced starts once the
replacements are done (``carry_out``).

Where no gateway writes a routing view (none runs on any gateway host, or an older one),
apply says so once and goes by health checks only: a successor counts as routed two
gateway health-check rounds after it is ready, an old replica as drained by its
connection count alone.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import shlex
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.drain import (
    PROBE_NOW_SIGNAL,
    Routes,
    drain_seconds,
    parse_routes,
    routes_dir,
)
from llmgw_cli.core.planning.plan import Action, Plan, Retired, conflicts, running_replicas
from llmgw_cli.core.serving.routing import serving_address
from llmgw_cli.errors import LlmgwError, NodeError
from llmgw_cli.polling import attempts
from llmgw_cli.progress import Phase, Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome, execute, wait_started
from llmgw_cli.remote.executor import Drained, Executor, Rolled, one_plan, subject
from llmgw_cli.remote.gateway_install import gateway_transport
from llmgw_cli.remote.nodeops import NodeOps
from llmgw_cli.remote.probe import gather
from llmgw_cli.remote.transport import Transport
from llmgw_cli.remote.weights import ensure_for_plan

POLL = 0.5  # seconds between two looks at the routes files or the connection count
ROUTED_BOUND = 60.0  # seconds a started successor may take to be routed by every gateway
HEALTH_INTERVAL = 2.0  # the gateway's health checks: a ready replica is taken within two
SIGNAL_AGAIN = 5.0  # seconds: tell the gateways again (one may have started meanwhile)


class Held(Protocol):
    """The cluster lock as held (``ApplyHold``)."""

    async def release(self) -> None: ...


class Locking(Protocol):
    """How a write step takes the cluster lock (``LockTerms``): data the steps use
    themselves, not a callable of the command that started them."""

    async def take(self, spec: ClusterSpec, conns: Connections, step: str) -> Held: ...


def is_roll(action: Action) -> bool:
    """Whether ``action`` replaces a replica through the rolling steps."""
    return action.op == "~" and action.retire is not None


def rolling(facts: dict[str, NodeFacts], actions: Sequence[Action]) -> list[Action]:
    """The actions of ``actions`` that go through the rolling steps: the ``~`` whose old
    replica serves (as ``facts`` say; one they do not know is taken to serve). A ``~`` of
    a replica that serves nothing is replaced in place as any action is, without a drain."""
    running = {(r.model, r.replica): r for r in running_replicas(facts)}

    def serves(action: Action) -> bool:
        assert action.retire is not None
        found = running.get((action.model, action.retire.replica))
        return found is None or found.serving()

    return [a for a in actions if is_roll(a) and serves(a)]


# --- the gateways' routing views -----------------------------------------------------


def as_folder_owner(directory: str, script: str) -> str:
    """Shell that runs ``script`` as the account that owns ``directory``: root only when
    the folder is root's and no one else may write in it; ``nobody`` when it is writable
    by group or others, or is a link. The routes folder belongs to the gateway's account,
    which can put any file name and content there: read and acted on as that account, a
    planted pid or a link to a root file gains it nothing it could not do itself (the
    kernel refuses a signal to another account's process)."""
    d, inner = shlex.quote(directory), shlex.quote(script)
    return (
        f"o=$(stat -c %U {d} 2>/dev/null) || exit 0; "
        f'[ -n "$(find {d} -maxdepth 0 \\( -type l -o -perm /022 \\) 2>/dev/null)" ] && o=nobody; '
        f'if [ "$o" = root ]; then sh -c {inner}; else runuser -u "$o" -- sh -c {inner}; fi'
    )


def _views_script(directory: str) -> str:
    """Shell printing ``PID BASE64`` for each routes file whose process is alive and is an
    llmgw process (a pid a dead gateway left may have been given to anything since), run
    as the folder's owner (``as_folder_owner``)."""
    d = shlex.quote(directory)
    return as_folder_owner(
        directory,
        f'for f in {d}/*.json; do [ -f "$f" ] || continue; p=$(basename "$f" .json); '
        'case "$p" in ""|*[!0-9]*) continue;; esac; kill -0 "$p" 2>/dev/null || continue; '
        'tr "\\000" " " < /proc/$p/cmdline 2>/dev/null | grep -q llmgw || continue; '
        'printf "%s " "$p"; base64 -w0 "$f"; echo; done; true',
    )


def parse_views(text: str) -> list[Routes]:
    """The output of ``_views_script``: the routes files that parse and whose content names
    the process their file name does."""
    found = []
    for line in text.splitlines():
        pid, _, encoded = line.strip().partition(" ")
        try:
            routes = parse_routes(base64.b64decode(encoded, validate=True).decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError):
            continue
        if routes is not None and pid.isdigit() and routes.pid == int(pid):
            found.append(routes)
    return found


@dataclass
class Gateways:
    """Every live gateway process's routing view, read as root on every gateway host
    (``gateway.all_hosts``), and the probe-now signal sent to each process on its own
    host. ``transports``: (host, transport) for each host that can be asked."""

    transports: list[tuple[str, Transport]]
    hosts: list[str]
    directory: str
    report: Report
    said: bool = False
    # where each view last read came from (``id`` of the Routes -> its host's transport)
    _from: dict[int, Transport] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: ClusterSpec, conns: Connections, report: Report) -> Gateways:
        found: list[tuple[str, Transport]] = []
        for host in spec.gateway.all_hosts:
            try:
                found.append((host, gateway_transport(conns, host)))
            except LlmgwError:
                continue
        return cls(found, spec.gateway.all_hosts, routes_dir(spec.gateway.state_dir), report)

    async def views(self) -> list[Routes]:
        """The live gateways' views on every host; none from a host that cannot be read."""

        async def one(t: Transport) -> list[Routes]:
            try:
                result = await t.run(_views_script(self.directory), root=True)
            except NodeError:
                return []
            return parse_views(result.stdout) if result.ok else []

        found = await asyncio.gather(*(one(t) for _, t in self.transports))
        self._from = {id(v): t for (_, t), views in zip(self.transports, found, strict=True) for v in views}
        return [v for views in found for v in views]

    async def probe_now(self, views: Sequence[Routes]) -> None:
        """Tell each gateway process to probe the nodes at once (not at its next round),
        on the host its view was read from."""
        by_host: dict[int, tuple[Transport, list[int]]] = {}
        for v in views:
            t = self._from.get(id(v))
            if t is not None:
                by_host.setdefault(id(t), (t, []))[1].append(v.pid)

        async def one(t: Transport, pids: list[int]) -> None:
            with contextlib.suppress(NodeError):
                kill = f"kill -{PROBE_NOW_SIGNAL} {' '.join(map(str, pids))} 2>/dev/null; true"
                await t.run(as_folder_owner(self.directory, kill), root=True)

        await asyncio.gather(*(one(t, pids) for t, pids in by_host.values()))

    def none_seen(self) -> None:
        if not self.said:
            self.said = True
            where = ", ".join(self.hosts)
            self.report("gateway", f"no gateway's routing view on {where}; going by health checks only")

    async def until(self, holds: Callable[[Routes], bool], *, timeout: float) -> bool | None:
        """Wait until ``holds`` is true of every live gateway's view: True when it came
        true, False when it did not within ``timeout``, None when no gateway has a view."""
        views = await self.views()
        if not views:
            self.none_seen()
            return None
        await self.probe_now(views)
        signalled = time.monotonic()

        async def step() -> bool | None:
            nonlocal signalled
            now = await self.views()
            if not now:
                return False  # every gateway went away meanwhile: nothing routes anything
            if all(holds(v) for v in now):
                return True
            if time.monotonic() - signalled >= SIGNAL_AGAIN:
                await self.probe_now(now)
                signalled = time.monotonic()
            return None

        done = None
        async for _ in attempts(max(timeout, 0.0), POLL):
            if (done := await step()) is not None:
                break
        if done is False and not await self.views():
            self.none_seen()
            return None
        return bool(done)


# --- the engine's connections ----------------------------------------------------------


async def in_flight(t: Transport, port: int) -> int | None:
    """Established TCP connections to ``port`` on the node (the requests an engine still
    serves: the gateway closes its idle ones to a replica it no longer routes); None when
    they cannot be counted."""
    try:
        result = await t.run(f"ss -Htn state established '( sport = :{int(port)} )'", root=True)
    except NodeError:
        return None
    if not result.ok:
        return None
    return sum(1 for line in result.stdout.splitlines() if line.strip())


# --- apply's seams of the executor -----------------------------------------------------


@dataclass
class ApplySteps:
    """apply's ``Steps``: the cluster lock (one holder in this process at a time: the
    models' steps take turns rather than wait for each other on the gateway host), a
    probe of the nodes under it, ``execute`` and ``wait_started`` over SSH."""

    spec: ClusterSpec
    conns: Connections
    take_lock: Locking | None
    engine_keys: dict[str, str] | None
    fetch: bool
    _one_at_a_time: asyncio.Lock = field(default_factory=asyncio.Lock)

    @contextlib.asynccontextmanager
    async def locked(self, why: str) -> AsyncIterator[None]:
        async with self._one_at_a_time:
            held = (
                await self.take_lock.take(self.spec, self.conns, why) if self.take_lock is not None else None
            )
            try:
                yield
            finally:
                if held is not None:
                    await held.release()

    async def weights(self, action: Action, report: Report) -> str | None:
        if not self.fetch:
            return None
        missing = await ensure_for_plan(self.spec, one_plan([action]), self.conns, report)
        return "; ".join(f"{node}: {why}" for node, why in sorted(missing.items())) or None

    async def placed(self, action: Action) -> Action | str:
        """Its cards and port still free (a probe of its nodes now: the gateway may have
        started something there since the plan)."""
        snapshot = await gather(self.spec, self.conns, list(action.nodes))
        return conflicts({f.node: f for f in snapshot.nodes}, action) or action

    async def write(self, actions: Sequence[Action], report: Report) -> list[Outcome]:
        keys = self.engine_keys if any(a.write for a in actions) else None
        return await execute(
            self.spec, self.conns, one_plan(actions), report, wait=False, engine_keys=keys, fetch=False
        )

    async def ready(self, actions: Sequence[Action], done: list[Outcome], report: Report) -> list[Outcome]:
        return await wait_started(self.spec, self.conns, one_plan(actions), done, report)


@dataclass
class ApplyRouting:
    """apply's ``Routing``: every gateway's routes file (``Gateways``), the drain markers
    on the old replica's nodes and its connection count."""

    spec: ClusterSpec
    conns: Connections
    gateways: Gateways

    def address(self, node: str, port: int) -> str:
        return serving_address(self.spec.node(node).engine_host, port)

    async def routed(self, action: Action, report: Report) -> list[Outcome]:
        """Until every live gateway routes the replica ``action`` started (told to probe at
        once); a warning outcome when one does not within ``ROUTED_BOUND``."""
        who = subject(action.model, action.replica)
        address = self.address(action.nodes[0], action.port or 0)
        routed = await self.gateways.until(lambda v: v.routes(action.model, address), timeout=ROUTED_BOUND)
        if routed is None:
            await asyncio.sleep(2 * HEALTH_INTERVAL)
        elif routed:
            report(who, "routed by the gateway", Phase.done)
        else:
            warning = f"not routed by every gateway {ROUTED_BOUND:g}s after it was ready; went on"
            report(who, warning, Phase.done)
            return [Outcome(who, True, warning)]
        return []

    async def mark(self, model: str, old: Retired) -> str | None:
        """The drain marker on every member node (deadline: the node's clock plus the
        drain bound); on a failure those written are taken back."""
        seconds = drain_seconds(self.spec, self.spec.model(model))

        async def one(node: str) -> str | None:
            try:  # the node helper writes it, with the node's own clock
                await NodeOps(self.conns.to(node)).must("drain-mark", old.unit, f"{seconds:.3f}")
            except NodeError as exc:
                return f"{node}: {exc.reason}"
            return None

        failed = [why for why in await asyncio.gather(*(one(n) for n in old.nodes)) if why]
        if not failed:
            return None
        for node in old.nodes:
            with contextlib.suppress(NodeError):
                await NodeOps(self.conns.to(node)).call("drain-clear", old.unit)
        return "; ".join(failed)

    async def drained(self, model: str, old: Retired, report: Report) -> Drained:
        """Out of every gateway's rotation, then its connections closed, or the bound."""
        seconds = drain_seconds(self.spec, self.spec.model(model))
        until = time.monotonic() + seconds
        who = subject(model, old.replica)
        address = self.address(old.nodes[0], old.port)
        await self.gateways.until(lambda v: not v.routes(model, address), timeout=until - time.monotonic())
        head = self.conns.to(old.nodes[0])
        last: list[int | None] = [-1]

        async def idle() -> int | None:
            count = await in_flight(head, old.port)
            if count != last[0]:
                last[0] = count
                said = "?" if count is None else str(count)
                report(who, f"draining ({said} in flight)")
            return 0 if count == 0 else None

        done = None
        async for _ in attempts(max(until - time.monotonic(), 0.0), POLL):
            if (done := await idle()) is not None:
                break
        left = 0 if done == 0 else last[0]
        return Drained(-1 if left is None else left, seconds)


def apply_executor(
    spec: ClusterSpec,
    conns: Connections,
    report: Report,
    *,
    take_lock: Locking | None,
    engine_keys: dict[str, str] | None,
    fetch: bool,
    gateways: Gateways | None,
) -> Executor:
    """apply's executor: its seams over SSH (``ApplySteps``, ``ApplyRouting``). ``engine_keys``
    is read when a unit is written: a map ``Executor.whole`` fills at its engine key step."""
    gateways = gateways or Gateways.of(spec, conns, report)
    steps = ApplySteps(spec, conns, take_lock, engine_keys, fetch)
    executor = Executor(steps, ApplyRouting(spec, conns, gateways), report)
    gateways.report = executor.event  # what the routing views say is the executor's too
    return executor


async def roll_each(
    spec: ClusterSpec,
    conns: Connections,
    actions: Sequence[Action],
    report: Report,
    *,
    take_lock: Locking | None,
    engine_keys: dict[str, str] | None = None,
    fetch: bool = True,
    gateways: Gateways | None = None,
) -> list[Rolled]:
    """Carry out the rolling ``~`` actions (``is_roll``) through the executor: each
    model's one after another in the order given, the models at the same time.
    ``take_lock``: takes the cluster lock for one write step (None: no lock,
    ``--no-lock``). ``engine_keys``: as ``execute``'s. ``fetch``: bring each successor's
    weights first (False: they were brought)."""
    executor = apply_executor(
        spec, conns, report, take_lock=take_lock, engine_keys=engine_keys, fetch=fetch, gateways=gateways
    )
    return await executor.replace_all(actions)


# --- the whole plan ---------------------------------------------------------------------


def after_rolls(facts: dict[str, NodeFacts], rolls: Sequence[Action], actions: Sequence[Action]) -> list[int]:
    """Indices in ``actions`` of the ``+`` that take a card or a port one of the rolling
    replacements ``rolls`` frees (the plan places them around the state once those are
    done)."""
    retiring = {(a.model, a.retire.replica) for a in rolls if a.retire is not None}
    held: set[tuple[str, str]] = set()
    ports: set[tuple[str, int]] = set()
    for r in running_replicas(facts):
        if (r.model, r.replica) in retiring:
            held |= {(node, g) for node, gs in r.gpus.items() for g in gs}
            ports |= {(r.members[0], r.port), (r.members[0], r.port + 1)}
    later = []
    for i, a in enumerate(actions):
        if a.op != "+":
            continue
        cards = {(node, g) for node, gs in a.gpus.items() for g in gs}
        mine = {(a.nodes[0], a.port), (a.nodes[0], a.port + 1)} if a.port is not None else set()
        if cards & held or mine & ports:
            later.append(i)
    return later


async def carry_out(
    spec: ClusterSpec,
    conns: Connections,
    plan: Plan,
    report: Report,
    *,
    facts: dict[str, NodeFacts],
    lock: Held | None,
    take_lock: Locking | None,
    engine_keys: dict[str, str] | None,
    fetch: bool = True,
    wait: bool = True,
    gateways: Gateways | None = None,
    executor: Executor | None = None,
) -> list[Outcome]:
    """apply's replica changes through ``executor`` (made here when None): the plan's plain actions through ``execute`` under ``lock`` (the
    cluster lock, held; released once they are written and started), then their readiness
    wait and, at the same time, the rolling replacements (``roll_each``), which take the lock
    for each write step with ``take_lock``; a ``+`` that needs what those free starts after
    them. ``facts``: what the plan was made from."""
    changes = plan.changes
    rolls = rolling(facts, changes)
    later_at = set(after_rolls(facts, rolls, changes))
    later = [a for i, a in enumerate(changes) if i in later_at]
    rest = [a for i, a in enumerate(changes) if i not in later_at and not any(a is r for r in rolls)]
    now = one_plan(rest, plan.facts_digest)
    executor = executor or apply_executor(
        spec, conns, report, take_lock=take_lock, engine_keys=engine_keys, fetch=fetch, gateways=gateways
    )
    done: list[Outcome] = []
    try:
        if now.changes:
            done = await execute(
                spec, conns, now, executor.event, wait=False, engine_keys=engine_keys, fetch=fetch
            )
    finally:
        if lock is not None:
            await lock.release()

    async def waited() -> list[Outcome]:
        return await wait_started(spec, conns, now, done, executor.event) if wait and now.changes else []

    async def rolled() -> list[Outcome]:
        outcomes = [o for r in await executor.replace_all(rolls) for o in r.outcomes]
        if later:
            outcomes += (await executor.start(later, "starting replicas after the replacements", wait=wait))[
                1
            ]
        return outcomes

    first, second = await asyncio.gather(waited(), rolled())
    return [*done, *first, *second]

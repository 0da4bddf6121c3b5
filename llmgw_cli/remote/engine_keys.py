"""Engine keys on the nodes: one per node, put there by `apply`, rotated on request.

Every node of the cluster file gets its key file (and every model's secret environment
file), not only the nodes a plan touches: the gateway starts on-demand replicas on any
node and never writes keys or secrets itself. A node that already holds a key keeps it.

Rotation (``llmgw apply --rotate-engine-key``) loses no request that reaches a replica
before or after its restart:

1. the gateway is given both keys of every node, old first (it re-reads its map within
   seconds; an installed one is also reloaded, SIGHUP keeping its listeners and
   connections), and apply waits that long; an engine answers 401 to a key it does not
   hold before doing any work, and the gateway then sends the request once more with
   the node's other key;
2. every node's key files get the new key (replicas keep the key they started with);
3. the running replicas are restarted one at a time, each waited for until it answers
   its readiness path and then until the gateway's health checks have taken it back, so
   a model with two replicas or more keeps serving throughout;
4. the gateway is given only the new keys, and reloaded.

A model with a single replica is unavailable while that replica restarts (requests wait
in the gateway's queue up to ``load_wait``); requests in flight on a replica when it is
stopped end with it, as with any restart.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections.abc import Awaitable, Callable, Mapping

from llmgw_cli.core.engine_access import sglang_users
from llmgw_cli.core.facts import NodeFacts
from llmgw_cli.core.parse.probe import parse_section, section_script
from llmgw_cli.core.plan import running_replicas
from llmgw_cli.core.spec import ClusterSpec, Node
from llmgw_cli.errors import NodeError
from llmgw_cli.polling import poll_until
from llmgw_cli.progress import Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import (
    Outcome,
    ensure_engine_key,
    ensure_secret_env,
    must,
    node_engine_keys,
    ready_status,
)
from llmgw_cli.remote.transport import Transport

KeyMap = dict[str, tuple[str, ...]]
GATEWAY_PICKUP = 7.0  # seconds: the gateway's key timer (5 s), health checks (2 s) and a margin
ENGINE_KEY = "engine-key"  # the probe's section
UNIT_NAME = re.compile(r"llmgw-[a-z0-9.-]+-[0-9]+\.service")


async def distribute_engine_keys(
    spec: ClusterSpec, transports: list[Transport], report: Report, *, rotate: bool = False
) -> tuple[dict[str, str], list[Outcome]]:
    """Each reachable node's key (new ones with ``rotate``), written where missing, and the
    secret environment files; one failed Outcome per node that could not be written."""
    keys = await node_engine_keys(transports, rotate=rotate)

    async def one(t: Transport) -> Outcome | None:
        try:
            if await ensure_engine_key(t, keys[t.node], sglang_users(spec)):
                report(t.node, "engine key written")
            await ensure_secret_env(t, spec)
        except NodeError as exc:
            report(t.node, f"failed: {exc.reason}")
            return Outcome(t.node, False, f"engine key or secrets: {exc.reason}")
        return None

    failed = [o for o in await asyncio.gather(*(one(t) for t in transports)) if o is not None]
    return keys, failed


async def nodes_without_key(
    spec: ClusterSpec, conns: Connections, names: list[str], facts: Mapping[str, NodeFacts] | None = None
) -> list[str]:
    """The nodes among ``names`` that hold no engine key yet (shown in the plan), as the
    probe's ``facts`` say; a node whose probe could not tell (it did not run as root) is
    asked with the probe's own engine-key section, through sudo. Only whether a key is
    there is ever read, never the key."""
    known = {n: facts[n].engine_key_present for n in names if facts and n in facts}

    async def present(node: Node, t: Transport) -> bool:
        try:
            result = await t.run("sh -s", root=True, stdin=section_script(ENGINE_KEY, spec, node))
        except NodeError:
            return False
        return parse_section(ENGINE_KEY, node, result.stdout).engine_key_present is True

    ask = [n for n in names if known.get(n) is None]
    asked = dict(zip(ask, await conns.each([spec.node(n) for n in ask], present), strict=True))
    return [n for n in names if not (asked[n] if n in asked else known[n])]


def _replicas(facts: dict[str, NodeFacts]) -> dict[tuple[str, str], list[tuple[str, str, int]]]:
    """Running llmgw replicas by (model, replica): [(node, unit, port)], rank 0 first."""
    found: dict[tuple[str, str], list[tuple[str, str, int]]] = {}
    for r in running_replicas(facts):
        # Names and labels come from the nodes: used only when they look like ours.
        if not UNIT_NAME.fullmatch(r.unit) or not r.port or not r.members:
            continue
        if r.up:
            found[(r.model, str(r.replica))] = [(node, r.unit, r.port) for node in r.members]
    return found


async def rotate_engine_keys(
    spec: ClusterSpec,
    facts: dict[str, NodeFacts],
    transports: dict[str, Transport],
    give_gateway: Callable[[KeyMap], Awaitable[Outcome]],
    report: Report,
) -> list[Outcome]:
    """New keys on every node in ``transports``, with no request lost (module docstring)."""
    ts = list(transports.values())
    old = await node_engine_keys(ts)
    new = await node_engine_keys(ts, rotate=True)
    both: KeyMap = {node: (old[node], new[node]) for node in new}
    first = await give_gateway(both)
    if not first.ok:
        return [first]
    # The gateway re-reads its map every few seconds (and a reload is a signal, not an
    # answer): give it that long before any engine takes the new key.
    await asyncio.sleep(GATEWAY_PICKUP)
    failed = await _write_all(ts, new, sglang_users(spec), report)
    if failed:  # the gateway keeps both keys: nothing is locked out; apply again to finish
        return [first, *failed]
    outcomes = [first]
    behind: set[str] = set()  # nodes with a replica still on its old key: they keep both
    for (model, replica), members in sorted(_replicas(facts).items()):
        nodes = {node for node, _, _ in members}
        if not nodes <= transports.keys():
            behind |= nodes
            why = f"not restarted: {', '.join(sorted(nodes - transports.keys()))} unreachable"
            outcomes.append(Outcome(f"{model}#{replica}", False, f"{why}; run the rotation again"))
            continue
        if len(outcomes) > 1:
            # The replica restarted last is ready, but the gateway takes it back only at
            # its next health check: restarting the next one sooner would leave a model
            # with no replica in rotation.
            await asyncio.sleep(GATEWAY_PICKUP)
        done = await _restart(
            spec, model=model, replica=replica, members=members, transports=transports, report=report
        )
        outcomes.append(done)
        if not done.ok:
            behind |= nodes
    final: KeyMap = {node: (key,) if node not in behind else (key, old[node]) for node, key in new.items()}
    outcomes.append(await give_gateway(final))
    return outcomes


async def _write_all(
    ts: list[Transport], keys: dict[str, str], users: list[str], report: Report
) -> list[Outcome]:
    async def one(t: Transport) -> Outcome | None:
        try:
            await ensure_engine_key(t, keys[t.node], users)
            report(t.node, "new engine key written")
        except NodeError as exc:
            return Outcome(t.node, False, f"engine key: {exc.reason}")
        return None

    return [o for o in await asyncio.gather(*(one(t) for t in ts)) if o is not None]


async def _restart(
    spec: ClusterSpec,
    *,
    model: str,
    replica: str,
    members: list[tuple[str, str, int]],
    transports: dict[str, Transport],
    report: Report,
) -> Outcome:
    """Restart one replica (every member, so they meet again) and wait until it is ready."""
    subject = f"{model}#{replica}"
    head, _, port = members[0]
    try:
        await asyncio.gather(
            *(
                must(transports[node], f"systemctl restart {shlex.quote(unit)}", f"restart {unit}")
                for node, unit, _ in members
            )
        )
    except NodeError as exc:
        return Outcome(subject, False, f"restart with the new key: {exc.reason}")
    report(subject, "restarted with the new engine key")
    known = next((m for m in spec.models if m.name == model), None)
    profile = spec.profiles[known.profile] if known else None
    path = profile.readiness.path if profile else "/health"
    timeout = profile.readiness.start_timeout if profile else 600.0
    host = spec.node(head).engine_host

    async def ready() -> bool | None:
        return True if await ready_status(transports[head], host, port, path) == 200 else None

    if await poll_until(ready, timeout=timeout, interval=0.5):
        report(subject, "ready")
        return Outcome(subject, True, "ready with the new engine key")
    return Outcome(subject, False, f"not ready {timeout:g}s after its restart with the new engine key")

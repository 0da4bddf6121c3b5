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
3. every running replica is replaced as ``apply`` replaces one (``remote/rollout.py``):
   its successor starts with the new key, on free cards when there are some, and the
   old one leaves the gateways' rotation, finishes its requests and is stopped once the
   successor is routed; each model's replicas one after another;
4. the gateway is given only the new keys, and reloaded; a node where a replica could
   not be replaced keeps both.

A replica with no free cards for its successor is replaced in place (drained, then
stopped and started again): a model with no other serving replica is then unavailable
for its load time, which ``apply`` does only with ``--allow-downtime``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.engine.engine_access import sglang_users
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.observe.parse.probe import parse_section, section_script
from llmgw_cli.core.planning.plan import Plan, make_plan, running_replicas
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import Phase, Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.execute import Outcome, ensure_engine_key, ensure_secret_env, node_engine_keys
from llmgw_cli.remote.executor import subject
from llmgw_cli.remote.rollout import Locking, is_roll, roll_each
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
                report(t.node, "engine key written", Phase.done)
            await ensure_secret_env(t, spec)
        except NodeError as exc:
            report(t.node, f"failed: {exc.reason}", Phase.failed)
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


def rotation_plan(
    spec: ClusterSpec, facts: dict[str, NodeFacts], cordoned: frozenset[str] = frozenset()
) -> Plan:
    """The plan that replaces every running replica of the cluster file's models (each
    one's successor starts with the node's new key), as ``apply`` replaces any replica:
    the downtime it would cause is in ``Plan.downtime``. No successor goes to a node of
    ``cordoned``."""
    models = {m.name for m in spec.models}
    replace = frozenset((r.model, r.replica) for r in running_replicas(facts) if r.model in models and r.up)
    return make_plan(spec, facts, replace=replace, cordoned=cordoned)


async def rotate_engine_keys(
    spec: ClusterSpec,
    conns: Connections,
    facts: dict[str, NodeFacts],
    give_gateway: Callable[[KeyMap], Awaitable[Outcome]],
    report: Report,
    *,
    transports: dict[str, Transport],
    take_lock: Locking | None,
    allow_downtime: bool = False,
    cordoned: frozenset[str] = frozenset(),
) -> list[Outcome]:
    """New keys on every node in ``transports`` (the reachable ones), with no request lost
    (module docstring). ``take_lock``: the cluster lock for each write step of the replacements (None: none).
    ``allow_downtime``: also replace the replicas whose replacement leaves their model with
    no serving replica (otherwise they keep their old key, and their nodes both keys)."""
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
    plan = rotation_plan(spec, facts, cordoned)
    rolls = []
    for action in plan.changes:
        if not is_roll(action) or action.retire is None:
            continue
        old_nodes = set(action.retire.nodes)
        who = subject(action.model, action.retire.replica)
        if not old_nodes | set(action.nodes) <= transports.keys():
            behind |= old_nodes
            why = f"not replaced: {', '.join(sorted((old_nodes | set(action.nodes)) - transports.keys()))} unreachable"
            outcomes.append(Outcome(who, False, f"{why}; run the rotation again"))
        elif action.downtime and not allow_downtime:
            behind |= old_nodes
            outcomes.append(Outcome(who, False, f"not replaced: {action.downtime}; pass --allow-downtime"))
        else:
            rolls.append(action)
    replaced = {(a.model, a.retire.replica) for a in plan.changes if a.retire is not None}
    for r in running_replicas(facts):
        if (r.model, r.replica) in replaced:
            continue
        behind |= set(r.members)  # down, or no room for its successor: on its old key
        if r.up and any(m.name == r.model for m in spec.models):
            why = "not replaced: no cards for its successor, nor its own (see `llmgw plan`)"
            outcomes.append(Outcome(subject(r.model, r.replica), False, f"{why}; it keeps its old key"))
    for done in await roll_each(spec, conns, rolls, report, take_lock=take_lock, engine_keys=new):
        outcomes += done.outcomes
        assert done.action.retire is not None
        if done.retired:
            report(
                subject(done.action.model, done.action.retire.replica),
                "replaced with the new engine key",
                Phase.done,
            )
        else:
            behind |= set(done.action.retire.nodes)
    final: KeyMap = {node: (key,) if node not in behind else (key, old[node]) for node, key in new.items()}
    outcomes.append(await give_gateway(final))
    return outcomes


async def _write_all(
    ts: list[Transport], keys: dict[str, str], users: list[str], report: Report
) -> list[Outcome]:
    async def one(t: Transport) -> Outcome | None:
        try:
            await ensure_engine_key(t, keys[t.node], users)
            report(t.node, "new engine key written", Phase.done)
        except NodeError as exc:
            report(t.node, f"failed: {exc.reason}", Phase.failed)
            return Outcome(t.node, False, f"engine key: {exc.reason}")
        return None

    return [o for o in await asyncio.gather(*(one(t) for t in ts)) if o is not None]

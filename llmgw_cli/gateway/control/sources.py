"""Where the gateway learns which replicas exist: a ``ReplicaSource``.

``ProbeSource`` reads the truth from the nodes (units and their labels, like ``llmgw
status``); ``StaticSource`` is a fixed list (tests, benchmarks, an engine outside llmgw);
``PublishedSource`` reads what the leading gateway process published in the store (a
follower: it needs no access to the nodes). Health is not their business: the gateway
checks every replica they name.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

import yaml

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.observe.facts import NodeFacts
from llmgw_cli.core.planning.plan import running_replicas
from llmgw_cli.core.serving.routing import endpoints, serving_address
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.store.sqlite import Published, Store
from llmgw_cli.remote.connect import Connections, GatewayAccess, Opener, transport_for
from llmgw_cli.remote.probe import gather

log = logging.getLogger("llmgw.gateway")


class ReplicaSource(Protocol):
    async def discover(self, spec: ClusterSpec) -> dict[str, list[str]]:
        """Serving addresses (``host:port``) by model name."""
        ...

    async def close(self) -> None:
        """Let go of what discovery holds (connections); the gateway is stopping."""
        ...


class StaticSource:
    def __init__(self, replicas: dict[str, list[str]]) -> None:
        self.replicas = replicas

    @classmethod
    def from_file(cls, path: Path) -> StaticSource:
        """A YAML or JSON mapping ``model: [host:port, ...]``."""
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError) as exc:
            raise InputError(f"{path}: cannot read replicas: {exc}") from None
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(a, str) for a in v)
            for k, v in data.items()
        ):
            raise InputError(f"{path}: expected a mapping of model name to a list of host:port")
        return cls({k: list(v) for k, v in data.items()})

    async def discover(self, spec: ClusterSpec) -> dict[str, list[str]]:
        return self.replicas

    async def close(self) -> None:
        return None


class ProbeSource:
    """Probe every node over SSH and take the replicas that may serve (``Running.serving``:
    not one whose unit is down, nor one ``apply`` is draining, which leaves the pool at the
    round that sees its drain marker).

    The connections to the nodes are held from one round to the next (and lent to the
    model controller's starts and stops), opened again when one broke, and closed by ``close``.
    The latest snapshot stays in ``facts`` (the gateway's Summary reads it), with the
    monotonic time of each node's last successful probe in ``probed``."""

    def __init__(
        self, base: Path, access: GatewayAccess | None = None, *, opener: Opener = transport_for
    ) -> None:
        self.base = base
        self.access = access  # the gateway's own key (None: the cluster file's ssh settings)
        self._opener = opener
        self._conns: Connections | None = None
        self.last: dict[str, list[str]] = {}
        self.facts: dict[str, NodeFacts] = {}  # of the last probe (the controller plans on them)
        self.probed: dict[str, float] = {}  # node -> monotonic time of its last good probe
        self.since = time.monotonic()  # the age of a node never reached counts from here
        self._asked: dict[str, float] = {}  # node -> monotonic time its kept facts were asked for

    async def connections(self, spec: ClusterSpec) -> Connections:
        """The connections to ``spec``'s nodes, held between rounds."""
        if self._conns is None:
            self._conns = Connections(spec, self.base, self.access, opener=self._opener)
        elif self._conns.spec is not spec:
            await self._conns.use(spec)  # the cluster file was read again
        return self._conns

    async def close(self) -> None:
        if self._conns is not None:
            await self._conns.close()

    async def probe(self, spec: ClusterSpec, *, skip_lost: bool = False) -> dict[str, NodeFacts]:
        """Every node's facts now. ``skip_lost``: a node the last probe could not read is
        not asked again and keeps that answer (a start or stop, which probes several times,
        must not wait out the SSH timeouts of a lost node each time); discovery's rounds
        ask every node, so a node that came back is seen at the next one."""
        lost = {n for n, f in self.facts.items() if f.error} if skip_lost else set()
        asked = [n.name for n in spec.nodes if n.name not in lost]
        began = time.monotonic()
        snapshot = await gather(spec, await self.connections(spec), asked)
        # Probes overlap (discovery's rounds, the controller's starts and stops), and one
        # that waited on a lost node can end after a later one that saw a unit written or
        # started meanwhile: a node's facts are replaced only by facts asked for later.
        facts = dict(self.facts)
        fresh = []
        for f in snapshot.nodes:
            if self._asked.get(f.node, float("-inf")) <= began:
                facts[f.node] = f
                self._asked[f.node] = began
                fresh.append(f)
        facts = {n.name: facts[n.name] for n in spec.nodes if n.name in facts}  # the spec's order
        for name, f in facts.items():  # say so when a node stops (or starts) answering
            before = self.facts.get(name)
            if f.error and (before is None or before.error != f.error):
                log.warning("node %s: %s", name, f.error)
            elif not f.error and before is not None and before.error:
                log.info("node %s: reachable again", name)
        now = time.monotonic()
        self.probed.update({f.node: now for f in fresh if f.reachable})
        self.facts = facts
        return facts

    async def discover(self, spec: ClusterSpec) -> dict[str, list[str]]:
        facts = await self.probe(spec)
        cut_off = frozenset(f.node for f in facts.values() if f.error)
        running = [
            (r.model, r.port, r.members, r.serving(cut_off)) for r in running_replicas(facts) if r.members
        ]
        found = endpoints(spec, running)
        # A node that could not be probed keeps the replicas it had: an SSH hiccup must not
        # take healthy engines out of rotation (the health checks still judge them).
        unreachable = {spec.node(f.node).engine_host for f in facts.values() if f.error}
        for model, addresses in self.last.items():
            for address in addresses:
                host = address.rsplit(":", 1)[0].strip("[]")
                if host in unreachable and address not in found.get(model, []):
                    found.setdefault(model, []).append(address)
        self.last = found
        return found


class PublishedSource:
    """The replica set the leader published (``Store.published``). What is read is hostile
    data: only the catalog's models are taken, and only addresses on one of the cluster
    file's nodes (``engine_host:port``), so a store written by someone else cannot send
    requests (and the engine keys with them) anywhere else. The publication read last stays
    in ``latest`` (its models' states, the addresses being drained)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.latest: Published | None = None

    async def discover(self, spec: ClusterSpec) -> dict[str, list[str]]:
        published = await self.store.published()
        if published is None:
            self.latest = None
            return {}
        hosts = {n.engine_host for n in spec.nodes}
        catalog = {m.name for m in spec.models}
        found: dict[str, list[str]] = {}
        for model, addresses in published.replicas.items():
            if model not in catalog:
                continue
            kept = [a for a in addresses if _on_a_node(a, hosts)]
            if kept:
                found[model] = sorted(set(kept))
        self.latest = published
        return found

    async def close(self) -> None:
        return None


def _on_a_node(address: object, hosts: set[str]) -> bool:
    """``address`` is ``host:port`` with a node's engine host and a port."""
    if not isinstance(address, str) or len(address) > 300:
        return False
    host, _, port = address.rpartition(":")
    if not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return False
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return bare in hosts and serving_address(bare, int(port)) == address

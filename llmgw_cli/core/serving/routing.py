"""Which replica gets a request, and when a replica leaves or rejoins rotation (pure).

The gateway owns one ``Pool``; every method takes the current time instead of reading a
clock, so the policy is tested with plain numbers. ``Pool`` is mutable but does no I/O.

Contract (concurrency): the gateway runs on one asyncio loop and calls these methods
from it only; nothing here blocks or awaits, so no call interleaves with another.

Policy:
- a replica is *ready* when its last health check passed and it is in rotation;
- ``choose`` serves requests: the model's routing policy (core/serving/affinity.py) over
  the ready replicas, each seen with the gateway's in-flight count and its engine's last
  scraped signals (none once they are older than ``stale_after``);
- ``pick`` returns the ready replica with the fewest outstanding requests (ties: the
  one picked least recently, so equal replicas take turns): for the controller, which
  waits for any ready replica and has no request to key;
- ``failed`` counts consecutive connection failures; at ``max_failures`` the replica
  leaves rotation until a health check passes again;
- a health check that fails takes the replica out at once (the engine said so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model
from llmgw_cli.core.serving import affinity
from llmgw_cli.core.serving.affinity import Candidate, Policy, Reason, Thresholds
from llmgw_cli.core.serving.engine_signals import Signals


class Health(StrEnum):
    unknown = "unknown"  # discovered, not checked yet
    loading = "loading"  # refused or 503 while its unit is up: the engine is starting
    ready = "ready"
    failing = "failing"  # left rotation after repeated failures


@dataclass
class RoutedReplica:
    """One replica as the router sees it: the address of its rank 0 (which serves HTTP),
    its health and its request counters."""

    model: str
    address: str  # host:port
    health: Health = Health.unknown
    outstanding: int = 0
    failures: int = 0
    last_pick: float = 0.0
    changed: float = 0.0
    requests: int = 0
    last_used: float | None = None  # Unix time the last request to it ended; None: unknown
    signals: Signals | None = None  # its engine's own /metrics at the last good scrape
    signals_at: float | None = None  # monotonic time of that scrape
    # LoRA adapters the gateway loaded onto it (``core/serving/adapters.py``); forgotten
    # whenever its health changes: an engine that restarted holds none
    adapters: set[str] = field(default_factory=set)

    def fresh_signals(self, now: float, stale_after: float) -> Signals | None:
        """The engine's signals if scraped within ``stale_after`` seconds, else None."""
        if self.signals is None or self.signals_at is None or now - self.signals_at > stale_after:
            return None
        return self.signals

    def as_dict(self, now: float | None = None) -> dict[str, object]:
        """``now`` (monotonic) adds the signals' age in seconds."""
        age = None if now is None or self.signals_at is None else round(max(0.0, now - self.signals_at), 3)
        return {
            "model": self.model,
            "address": self.address,
            "health": self.health.value,
            "outstanding": self.outstanding,
            "failures": self.failures,
            "requests": self.requests,
            "last_used": self.last_used,
            "signals": None if self.signals is None else asdict(self.signals),
            "signals_age": age,
            "adapters": sorted(self.adapters),  # LoRA adapters the gateway loaded onto it
        }


def route_settings(model: Model) -> tuple[Policy, Thresholds]:
    """The routing policy and overload thresholds the cluster file gives ``model``."""
    r = model.routing
    return Policy(r.policy.value), Thresholds(r.max_waiting, r.max_kv_usage, r.load_factor)


@dataclass
class Pool:
    """Every known replica, by model."""

    max_failures: int = 3
    replicas: dict[str, dict[str, RoutedReplica]] = field(default_factory=dict)
    turns: dict[str, int] = field(default_factory=dict)  # choices made per model: round robin's turn

    def replace(self, found: dict[str, list[str]], now: float) -> None:
        """Set the replicas discovered now: new ones start ``unknown``; known ones keep
        their state and counters; vanished ones are dropped (requests in flight to them
        finish on their own connection)."""
        updated: dict[str, dict[str, RoutedReplica]] = {}
        for model, addresses in found.items():
            known = self.replicas.get(model, {})
            updated[model] = {a: known.get(a) or RoutedReplica(model, a, changed=now) for a in addresses}
        self.replicas = updated

    def all(self) -> list[RoutedReplica]:
        return [r for by_addr in self.replicas.values() for r in by_addr.values()]

    def of(self, model: str) -> list[RoutedReplica]:
        return list(self.replicas.get(model, {}).values())

    def ready_count(self, model: str) -> int:
        return sum(r.health is Health.ready for r in self.replicas.get(model, {}).values())

    def add(self, model: str, address: str, now: float) -> RoutedReplica:
        """A replica the gateway itself just started (before the next discovery finds it)."""
        found = self.replicas.setdefault(model, {})
        if address not in found:
            found[address] = RoutedReplica(model, address, changed=now)
        return found[address]

    def remove(self, model: str, address: str) -> RoutedReplica | None:
        """Out of rotation now (it is being stopped): no new request is sent to it."""
        return self.replicas.get(model, {}).pop(address, None)

    def pick(self, model: str, now: float, exclude: frozenset[str] = frozenset()) -> RoutedReplica | None:
        """The ready replica with the fewest outstanding requests, or None."""
        best: RoutedReplica | None = None
        for r in self.replicas.get(model, {}).values():
            if r.health is not Health.ready or r.address in exclude:
                continue
            if best is None or (r.outstanding, r.last_pick) < (best.outstanding, best.last_pick):
                best = r
        if best is not None:
            best.last_pick = now
        return best

    def choose(
        self,
        model: str,
        now: float,
        *,
        key: str | None,
        policy: Policy,
        thresholds: Thresholds,
        exclude: frozenset[str] = frozenset(),
        stale_after: float,
        prefer: str | None = None,
    ) -> tuple[RoutedReplica, Reason] | None:
        """The ready replica (not in ``exclude``) for a request of routing key ``key`` and
        why, or None when none is ready. ``prefer``: an adapter's name; the replicas that
        have it loaded are chosen among, unless each of them is overloaded
        (``loaded_first``): another replica then loads it too."""
        known = self.replicas.get(model)
        if not known:
            return None
        ready = [r for r in known.values() if r.health is Health.ready and r.address not in exclude]
        if prefer is not None:
            ready = loaded_first(ready, prefer, thresholds, now, stale_after)
        candidates = [Candidate(r.address, r.outstanding, r.fresh_signals(now, stale_after)) for r in ready]
        turn = self.turns.get(model, 0)
        choice = affinity.choose(policy, key, candidates, thresholds, turn)
        if choice is None:
            return None
        self.turns[model] = turn + 1
        replica = known[choice.address]
        replica.last_pick = now
        return replica, choice.reason

    def scraped(self, replica: RoutedReplica, signals: Signals, now: float) -> None:
        """A good scrape of the replica's /metrics at monotonic time ``now``."""
        replica.signals = signals
        replica.signals_at = now

    def failed(self, replica: RoutedReplica, now: float) -> None:
        """A connection to the replica failed (nothing was received)."""
        replica.failures += 1
        if replica.failures >= self.max_failures and replica.health is Health.ready:
            replica.health = Health.failing
            replica.changed = now

    def succeeded(self, replica: RoutedReplica) -> None:
        replica.failures = 0

    def checked(self, replica: RoutedReplica, status: int | None, now: float) -> None:
        """Result of a health check: an HTTP status, or None when the connection failed."""
        if status == 200:
            new = Health.ready
            replica.failures = 0
        elif replica.health in (Health.ready, Health.failing):
            new = Health.failing
        else:
            new = Health.loading
        if new is not replica.health:
            replica.health = new
            replica.changed = now
            replica.adapters.clear()


def loaded_first(
    ready: list[RoutedReplica], adapter: str, thresholds: Thresholds, now: float, stale_after: float
) -> list[RoutedReplica]:
    """The ready replicas that have ``adapter`` loaded, when one of them is not overloaded
    (its engine's signals past the thresholds, or more requests in flight than the
    bounded-load limit over all ready replicas); else all of them."""
    loaded = [r for r in ready if adapter in r.adapters]
    if not loaded or len(loaded) == len(ready):
        return ready
    bound = (1 + thresholds.epsilon) * sum(r.outstanding for r in ready) / len(ready) + 1
    for r in loaded:
        candidate = Candidate(r.address, r.outstanding, r.fresh_signals(now, stale_after))
        if not affinity.overloaded(candidate, thresholds, bound):
            return loaded
    return ready


def endpoints(
    spec: ClusterSpec, running: list[tuple[str, int, tuple[str, ...], bool]]
) -> dict[str, list[str]]:
    """Serving addresses by model from running replicas given as (model, port, members,
    active): rank 0 (the first member) serves the API. Inactive ones and ones on nodes
    or of models the spec no longer has are left out."""
    nodes = {n.name: n for n in spec.nodes}
    catalog = {m.name for m in spec.models}
    found: dict[str, list[str]] = {}
    for model, port, members, active in running:
        if not active or not port or not members or members[0] not in nodes or model not in catalog:
            continue
        found.setdefault(model, []).append(serving_address(nodes[members[0]].engine_host, port))
    return found


def serving_address(host: str, port: int) -> str:
    """``host:port`` of a replica's API (its rank-0 node), IPv6 in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"

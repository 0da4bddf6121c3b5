"""The ``Store`` protocol: what the gateway processes of one cluster share, whichever store
keeps it (``sqlite.py``, ``postgres.py``), and its ``Leadership``. Callers import these names
from ``sqlite.py``, which also opens the configured store."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.core.serving.limits import Limits
from llmgw_cli.gateway.store.values import Publication, Published, Usage


class Leadership(Protocol):
    """Who runs the model controllers: exactly one member of the cluster at a time.

    PostgreSQL: a session advisory lock held on a connection of its own; SQLite: ``flock``
    on ``<state_dir>/leader.lock``. Taking it increments the store's leader epoch, which is
    the fencing number: every action of a leader is preceded by ``still_leader``, and every
    publication is written only while the stored epoch is still this leader's."""

    fence: int | None  # this member's epoch while it leads, else None

    async def try_acquire(self) -> int | None:
        """Take the lead if nobody holds it: the new fencing number, or None."""
        ...

    async def still_leader(self) -> bool:
        """The fence check: the lock is still held (its connection alive) and the stored
        epoch is still ours. False also when the store cannot be reached."""
        ...

    async def release(self) -> None: ...


class Store(Protocol):
    """Everything the gateway processes of one cluster share. Every method is a coroutine;
    none runs on a request's path except through the background jobs that cache it."""

    # --- API keys
    async def add_key(self, key: ApiKey) -> None: ...
    async def api_keys(self) -> list[ApiKey]: ...
    async def revoke(self, name: str) -> bool: ...
    async def set_limits(self, name: str, limits: Limits) -> bool:
        """Replace the key's limits; False: no such key."""
        ...

    async def set_access(self, name: str, models: tuple[str, ...], expires: datetime | None) -> bool:
        """Replace the key's models (empty: all) and expiry (None: never); False: no such key."""
        ...

    async def keys_version(self) -> int:
        """Grows with every key added, revoked or changed: a cheap look before reading them all."""
        ...

    # --- counters of the key limits, shared by every gateway process. ``counter`` is one
    # of ``COUNTERS`` (requests, tokens, budget), ``window`` an id of ``core/serving/limits.py``
    # (``m:MINUTE``, ``d:YYYY-MM-DD``, ``M:YYYY-MM``): anything else is a ValueError. A window
    # is pruned ``COUNTERS_KEPT`` after it ended.
    async def lease(self, key: str, counter: str, window: str, want: int, cap: int) -> int:
        """Atomically grant ``g = max(0, min(want, cap - used))`` and add it to ``used``: the
        leases of all processes together never grant more than ``cap``; ``g``."""
        ...

    async def add_used(self, key: str, counter: str, window: str, n: int) -> None:
        """Add ``n`` whatever the cap (negative: an allowance given back; ``used`` stays >= 0)."""
        ...

    async def used(self, key: str, counter: str, windows: list[str]) -> dict[str, int]:
        """``used`` of each window asked for (0 where nothing was counted)."""
        ...

    async def prune_counters(self, before: float) -> None:
        """Forget the windows that ended before ``before`` (``add_usage`` prunes too)."""
        ...

    # --- usage: a batch is applied once, whatever the retries (``batch`` is its unique id)
    async def add_usage(self, batch: str, rows: list[Usage]) -> None:
        """Also forgets the batch ids older than ``BATCHES_KEPT`` and the counter windows
        that ended ``COUNTERS_KEPT`` ago: every gateway process writes usage every few
        seconds, so nothing old piles up."""
        ...

    async def usage(self, since: str | None = None) -> list[Usage]:
        """Totals per (day, key, model), from day ``since`` (YYYY-MM-DD) on when given."""
        ...

    # --- when each replica (``model@host:port``) last served a request (Unix time)
    async def save_last_use(self, rows: dict[str, float]) -> None: ...
    async def last_use(self) -> dict[str, float]: ...
    async def forget_last_use(self, replicas: list[str]) -> None: ...

    # --- the replica set: the leader writes, everyone reads
    async def publish(self, fence: int, publication: Publication, leader: str) -> bool:
        """Write a new publication; False (nothing written) when ``fence`` is not the
        stored leader epoch any more."""
        ...

    async def published(self) -> Published | None: ...
    async def published_version(self) -> int:
        """The version of the latest publication (0: none yet); a cheap look."""
        ...

    # --- on-demand starts asked for by followers, carried out by the leader
    async def request_start(self, model: str, member: str) -> None: ...
    async def take_start_requests(self, fence: int) -> list[str]:
        """The models asked for since the last take (removed from the store); none when
        ``fence`` is stale."""
        ...

    # --- the live gateway processes (each takes its share of a replica's concurrency)
    async def heartbeat(self, member: str, host: str, pid: int, now: float) -> int:
        """Record ``member`` alive at ``now``, forget members silent for ``MEMBER_TTL``;
        how many members are alive, this one included."""
        ...

    async def leave(self, member: str) -> None: ...

    # --- cordoned nodes (``core/planning/cordon.py``): `llmgw cordon` and `drain` write,
    # `apply` and the leader's controller read before they place
    async def cordon(self, cordon: Cordon) -> None:
        """Cordon ``cordon.node``, or replace the cordon it has (reason, who, since, draining)."""
        ...

    async def uncordon(self, node: str) -> bool:
        """Lift the node's cordon; False: it had none."""
        ...

    async def cordons(self) -> list[Cordon]:
        """Every cordon, by node name (a row that does not parse is left out)."""
        ...

    # --- leadership, changes, schema, lifetime
    def leadership(self, member: str) -> Leadership: ...
    async def wait_change(self, timeout: float) -> None:
        """Return when keys or the replica set may have changed (LISTEN/NOTIFY with
        PostgreSQL, a poll of the change counters with SQLite), or after ``timeout``."""
        ...

    async def migrate(self) -> int:
        """Create or upgrade the schema; the schema version now."""
        ...

    async def close(self) -> None:
        """Release what the object holds: its leaderships (a lead held goes to the next
        member) and its connections."""
        ...

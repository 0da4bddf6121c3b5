"""The gateway's own data: API keys and usage totals, in SQLite in ``gateway.state_dir``.

Callers use the ``Store`` protocol only, so no SQLite-specific SQL leaves this module: the
next step (several gateways sharing PostgreSQL) swaps the implementation, not the callers.

Contract: every method blocks (disk I/O). The gateway calls them from a worker thread
(``asyncio.to_thread``), never on the request path; one connection per call keeps the
object safe to use from any thread.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol

from llmgw_cli.core.keys import ApiKey
from llmgw_cli.errors import InputError


@dataclass(frozen=True)
class Usage:
    """Totals for one (day, key, model)."""

    day: str
    key: str
    model: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: int = 0
    latency_ms: float = 0.0  # sum; divide by requests for the mean

    def as_dict(self) -> dict[str, object]:
        return {
            "day": self.day,
            "key": self.key,
            "model": self.model,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "errors": self.errors,
            "mean_latency_ms": round(self.latency_ms / self.requests, 3) if self.requests else 0.0,
        }


@dataclass(frozen=True)
class ModelState:
    """One model as the leader's controller sees it, published for the followers: what
    ``/v1/models`` and a 503 answer say about a model no follower controls itself."""

    phase: str  # core.controller.Phase's value
    progress: str = ""  # what a start does now ("fetching weights on node03", ...)
    failures: int = 0  # starts failed in a row
    last_failure: str = ""  # why the last start failed
    retry_at: float | None = None  # Unix time the back-off ends; None: no back-off runs


@dataclass(frozen=True)
class Published:
    """The replica set the leader publishes after every look at the fleet: the serving
    addresses by model (what discovery found: followers health-check them themselves), the
    addresses being drained, and each model's state. ``version`` grows with every
    publication; ``fence`` is the leader's fencing number when it wrote it."""

    version: int
    fence: int
    leader: str  # the member that wrote it
    at: float  # Unix time it was written
    replicas: dict[str, list[str]]
    draining: list[str]
    models: dict[str, ModelState]


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
    async def keys_version(self) -> int:
        """Grows with every key added or revoked: a cheap look before reading them all."""
        ...

    # --- usage: a batch is applied once, whatever the retries (``batch`` is its unique id)
    async def add_usage(self, batch: str, rows: list[Usage]) -> None: ...
    async def usage(self, since: str | None = None) -> list[Usage]:
        """Totals per (day, key, model), from day ``since`` (YYYY-MM-DD) on when given."""
        ...

    # --- when each replica (``model@host:port``) last served a request (Unix time)
    async def save_last_use(self, rows: dict[str, float]) -> None: ...
    async def last_use(self) -> dict[str, float]: ...
    async def forget_last_use(self, replicas: list[str]) -> None: ...

    # --- the replica set: the leader writes, everyone reads
    async def publish(
        self,
        fence: int,
        replicas: dict[str, list[str]],
        draining: list[str],
        models: dict[str, ModelState],
        leader: str,
    ) -> bool:
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

    # --- leadership, changes, schema, lifetime
    def leadership(self, member: str) -> Leadership: ...
    async def wait_change(self, timeout: float) -> None:
        """Return when keys or the replica set may have changed (LISTEN/NOTIFY with
        PostgreSQL, a poll of the change counters with SQLite), or after ``timeout``."""
        ...

    async def migrate(self) -> int:
        """Create or upgrade the schema; the schema version now."""
        ...

    async def close(self) -> None: ...


MEMBER_TTL = 10.0  # seconds without a heartbeat after which a gateway process counts as gone


_SCHEMA = """
CREATE TABLE IF NOT EXISTS api_keys (
  name TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, models TEXT NOT NULL,
  expires TEXT, created TEXT NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,
  admin INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS usage (
  day TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,
  requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,
  errors INTEGER NOT NULL, latency_ms REAL NOT NULL, PRIMARY KEY (day, key, model));
CREATE TABLE IF NOT EXISTS last_use (replica TEXT PRIMARY KEY, at REAL NOT NULL);
"""


def _time(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


class SqliteStore:
    """``Store`` in ``<state_dir>/gateway.sqlite3`` (created 0700/0600: it holds key digests)."""

    def __init__(self, state_dir: str | Path) -> None:
        directory = Path(state_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise InputError(f"gateway state_dir {directory}: {exc.strerror}") from None
        self.path = directory / "gateway.sqlite3"
        with self._db() as db:
            db.executescript(_SCHEMA)
        self.path.chmod(0o600)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=10)
        try:
            with db:  # one transaction: commit, or roll back on error
                yield db
        finally:
            db.close()

    def add_key(self, key: ApiKey) -> None:
        created = (key.created or datetime.now(UTC)).isoformat()
        expires = key.expires.isoformat() if key.expires else None
        try:
            with self._db() as db:
                db.execute(
                    "INSERT INTO api_keys (name, digest, models, expires, created, revoked, admin)"
                    " VALUES (?, ?, ?, ?, ?, 0, ?)",
                    (key.name, key.digest, json.dumps(list(key.models)), expires, created, int(key.admin)),
                )
        except sqlite3.IntegrityError:
            raise InputError(f"a key named {key.name!r} exists already") from None

    def api_keys(self) -> list[ApiKey]:
        with self._db() as db:
            rows = db.execute(
                "SELECT name, digest, models, expires, created, revoked, admin FROM api_keys ORDER BY name"
            ).fetchall()
        return [
            ApiKey(
                name=r[0],
                digest=r[1],
                models=tuple(json.loads(r[2])),
                expires=_time(r[3]),
                created=_time(r[4]),
                revoked=bool(r[5]),
                admin=bool(r[6]),
            )
            for r in rows
        ]

    def revoke(self, name: str) -> bool:
        with self._db() as db:
            return db.execute("UPDATE api_keys SET revoked = 1 WHERE name = ?", (name,)).rowcount > 0

    def add_usage(self, rows: list[Usage]) -> None:
        with self._db() as db:
            db.executemany(
                "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (day, key, model) DO UPDATE SET"
                " requests = requests + excluded.requests,"
                " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
                " completion_tokens = completion_tokens + excluded.completion_tokens,"
                " errors = errors + excluded.errors, latency_ms = latency_ms + excluded.latency_ms",
                [
                    (
                        u.day,
                        u.key,
                        u.model,
                        u.requests,
                        u.prompt_tokens,
                        u.completion_tokens,
                        u.errors,
                        u.latency_ms,
                    )
                    for u in rows
                ],
            )

    def usage(self) -> list[Usage]:
        with self._db() as db:
            rows = db.execute("SELECT * FROM usage ORDER BY day, key, model").fetchall()
        return [Usage(*r) for r in rows]

    def save_last_use(self, rows: dict[str, float]) -> None:
        """When each replica (``model@host:port``) last served a request (Unix time); the
        newer time wins, so a slow writer never moves a replica's use back."""
        with self._db() as db:
            db.executemany(
                "INSERT INTO last_use VALUES (?, ?) ON CONFLICT (replica) DO UPDATE SET"
                " at = max(at, excluded.at)",
                sorted(rows.items()),
            )

    def last_use(self) -> dict[str, float]:
        with self._db() as db:
            return {r[0]: float(r[1]) for r in db.execute("SELECT replica, at FROM last_use")}

    def forget_last_use(self, replicas: list[str]) -> None:
        """A stopped replica's time must not pass to the next one at its address."""
        with self._db() as db:
            db.executemany("DELETE FROM last_use WHERE replica = ?", [(r,) for r in replicas])

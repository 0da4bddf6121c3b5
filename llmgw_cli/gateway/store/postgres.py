"""``Store`` in PostgreSQL (``gateway.store``): the gateways of several hosts, and the
workers of each, share one database.

Driver: asyncpg (bench/store.py, bench/RESULTS.md "Store": about 3x psycopg 3's rate on
the key-version look every process makes every second, 2x on a usage batch). Connections:
a small pool per process (``POOL_SIZE``) for the store's statements, plus two of its own,
opened when first needed: the lock connection of a process that may lead (the leader holds
the session advisory lock on it, which lives exactly as long as the session: a leader
whose connection or process dies loses the lock at once; the others keep theirs open to
try again) and the LISTEN connection ``wait_change`` waits on.

Fencing: taking the lock bumps ``leader.epoch`` (the fencing number); ``still_leader`` reads
the epoch ON THE LOCK CONNECTION, so a dead connection answers False. ``publish`` and
``take_start_requests`` lock the leader row (``FOR SHARE``) and act only while the stored
epoch is the caller's: a takeover waits for them, and they never act after it.

Schema (the scripts: ``postgres_schema.py``): ``migrate`` creates or upgrades it under a
transaction-scoped advisory lock (one migration at a time, whoever runs it). The first use of a store checks the stored
version: an empty database is migrated there and then (nothing can be lost); an older
schema is refused ("run llmgw store migrate"), and so is a newer one ("upgrade llmgw").

Password: ``gateway.store_password_file``, else ``$LLMGW_STORE_PASSWORD``, else none (peer
or certificate authentication); never in the URL, never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import asyncpg

from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.core.serving.limits import Limits
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.store import values as codec  # the encodings both stores share
from llmgw_cli.gateway.store.postgres_schema import SCHEMA
from llmgw_cli.gateway.store.values import (
    BATCHES_KEPT,
    CORDON_COLUMNS,
    COUNTERS_KEPT,
    KEY_COLUMNS,
    MEMBER_TTL,
    SCHEMA_VERSION,
    Publication,
    Published,
    Usage,
)
from llmgw_cli.polling import wait_event

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    from llmgw_cli.core.clusterfile.spec import ClusterSpec

    Db = asyncpg.Connection | PoolConnectionProxy  # a connection of its own, or the pool's

log = logging.getLogger(__name__)

PASSWORD_VAR = "LLMGW_STORE_PASSWORD"
POOL_SIZE = 4  # connections per process besides the lock and LISTEN ones
CHANNEL = "llmgw_changes"  # NOTIFY'd on every key change and publication
LEADER_LOCK = 0x6C6C6D6777  # the advisory lock key of the leadership ("llmgw")
MIGRATE_LOCK = 0x6C6C6D6778  # and of a migration
TIMEOUT = 10.0  # seconds for a connection or a statement


_USAGE_UPSERT = (
    "INSERT INTO usage VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (day, key, model) DO UPDATE SET"
    " requests = usage.requests + excluded.requests,"
    " prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
    " completion_tokens = usage.completion_tokens + excluded.completion_tokens,"
    " errors = usage.errors + excluded.errors, latency_ms = usage.latency_ms + excluded.latency_ms"
)


def read_password(file: str | None) -> str | None:
    """The store password: the file's first line, else ``$LLMGW_STORE_PASSWORD``, else None."""
    if file:
        try:
            text = Path(file).read_text()
        except OSError as exc:
            raise InputError(f"gateway.store_password_file {file}: {exc.strerror}") from None
        return text.splitlines()[0] if text.strip() else ""
    return os.environ.get(PASSWORD_VAR) or None


def _where(url: str) -> str:
    """``host:port/database`` of a URL, for messages (never a password: it has none)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 5432}{parts.path}"


class PostgresStore:
    def __init__(self, url: str, password: str | None = None, *, pool_size: int = POOL_SIZE) -> None:
        self.url = url
        self.password = password
        self.where = _where(url)
        self.pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()
        self._listener: asyncpg.Connection | None = None
        self._changed = asyncio.Event()
        self._leaderships: list[PostgresLeadership] = []  # closed with the store

    @classmethod
    def from_spec(cls, spec: ClusterSpec) -> PostgresStore:
        assert spec.gateway.store is not None
        return cls(spec.gateway.store, read_password(spec.gateway.store_password_file))

    # --- connections

    async def connect(self) -> asyncpg.Connection:
        """A connection of its own (the lock's, LISTEN's), once the schema was checked;
        errors say what to check."""
        await self._ready()
        try:
            return await asyncpg.connect(self.url, password=self.password, timeout=TIMEOUT)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            raise self._unreachable(exc) from None

    def _unreachable(self, exc: BaseException) -> InputError:
        hint = "is the server up and reachable from here?"
        if isinstance(exc, asyncpg.InvalidPasswordError | asyncpg.InvalidAuthorizationSpecificationError):
            hint = f"check the user and the password (gateway.store_password_file or ${PASSWORD_VAR})"
        elif isinstance(exc, asyncpg.InvalidCatalogNameError):
            hint = "create the database first (docs/operations.md), then run llmgw store migrate"
        return InputError(f"PostgreSQL store {self.where}: {type(exc).__name__}: {exc}; {hint}")

    async def _ready(self, check: bool = True) -> asyncpg.Pool:
        if self._pool is not None:
            return self._pool
        async with self._opening:
            if self._pool is None:
                try:
                    pool = await asyncpg.create_pool(
                        self.url,
                        password=self.password,
                        min_size=1,
                        max_size=self.pool_size,
                        timeout=TIMEOUT,
                        command_timeout=TIMEOUT,
                    )
                except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                    raise self._unreachable(exc) from None
                try:
                    if check:
                        await self._check_schema(pool)
                except BaseException:
                    await pool.close()
                    raise
                self._pool = pool
        return self._pool

    async def _check_schema(self, pool: asyncpg.Pool) -> None:
        async with pool.acquire() as db:
            version = await _version(db)
            if version == 0:  # an empty database: nothing to lose, make the schema now
                log.info("PostgreSQL store %s: empty, creating the schema", self.where)
                version = await _migrate(db)
        if version < SCHEMA_VERSION:
            raise InputError(
                f"PostgreSQL store {self.where}: schema version {version}, this llmgw needs"
                f" {SCHEMA_VERSION}: run llmgw store migrate"
            )
        if version > SCHEMA_VERSION:
            raise InputError(
                f"PostgreSQL store {self.where}: schema version {version} is newer than this llmgw"
                f" knows ({SCHEMA_VERSION}): upgrade llmgw"
            )

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[Db]:
        pool = await self._ready()
        async with pool.acquire(timeout=TIMEOUT) as db, db.transaction():
            yield db

    async def migrate(self) -> int:
        pool = await self._ready(check=False)
        async with pool.acquire() as db:
            return await _migrate(db)

    # --- API keys

    async def add_key(self, key: ApiKey) -> None:
        created = (key.created or datetime.now(UTC)).isoformat()
        expires = key.expires.isoformat() if key.expires else None
        try:
            async with self._tx() as db:
                await db.execute(
                    "INSERT INTO api_keys (name, digest, models, expires, created, revoked, admin, limits)"
                    " VALUES ($1, $2, $3, $4, $5, false, $6, $7)",
                    key.name,
                    key.digest,
                    json.dumps(list(key.models)),
                    expires,
                    created,
                    key.admin,
                    codec.encode_limits(key.limits),
                )
                await _bump(db, "keys_version")
        except asyncpg.UniqueViolationError:
            raise InputError(f"a key named {key.name!r} exists already") from None

    async def api_keys(self) -> list[ApiKey]:
        pool = await self._ready()
        rows = await pool.fetch(f"SELECT {KEY_COLUMNS} FROM api_keys ORDER BY name")
        return [codec.parse_key(tuple(r)) for r in rows]

    async def _change_key(self, name: str, assignments: str, *values: object) -> bool:
        """``UPDATE api_keys SET <assignments>`` ($2 on) of the key ``name`` and bump the
        keys' version; False when there is no such key."""
        async with self._tx() as db:
            done = await db.fetchval(
                f"UPDATE api_keys SET {assignments} WHERE name = $1 RETURNING name", name, *values
            )
            if done is None:
                return False
            await _bump(db, "keys_version")
            return True

    async def revoke(self, name: str) -> bool:
        return await self._change_key(name, "revoked = true")

    async def set_limits(self, name: str, limits: Limits) -> bool:
        return await self._change_key(name, "limits = $2", codec.encode_limits(limits))

    async def set_access(self, name: str, models: tuple[str, ...], expires: datetime | None) -> bool:
        return await self._change_key(
            name,
            "models = $2, expires = $3",
            json.dumps(list(models)),
            expires.isoformat() if expires else None,
        )

    async def keys_version(self) -> int:
        return await self._counter("keys_version")

    async def _counter(self, name: str) -> int:
        pool = await self._ready()
        value = await pool.fetchval("SELECT value FROM meta WHERE name = $1", name)
        return int(value) if value is not None else 0

    # --- usage

    async def add_usage(self, batch: str, rows: list[Usage]) -> None:
        now = time.time()
        async with self._tx() as db:
            new = await db.fetchval(
                "INSERT INTO usage_batches VALUES ($1, $2) ON CONFLICT DO NOTHING RETURNING id", batch, now
            )
            if new is None:
                return  # applied already: its answer was lost, not its write
            await db.executemany(
                _USAGE_UPSERT,
                [u.row() for u in rows],
            )
            await db.execute("DELETE FROM usage_batches WHERE at < $1", now - BATCHES_KEPT)
            await db.execute("DELETE FROM key_counters WHERE ends < $1", now - COUNTERS_KEPT)

    async def usage(self, since: str | None = None) -> list[Usage]:
        pool = await self._ready()
        rows = await pool.fetch(
            "SELECT day, key, model, requests, prompt_tokens, completion_tokens, errors, latency_ms"
            " FROM usage WHERE day >= $1 ORDER BY day, key, model",
            since or "",
        )
        return [Usage(*r) for r in rows]

    # --- counters of the key limits

    async def lease(self, key: str, counter: str, window: str, want: int, cap: int) -> int:
        """One statement: ON CONFLICT DO UPDATE locks the row and computes the grant from its
        latest ``used``, kept in ``granted`` to be read back."""
        ends = codec.counter_end(counter, window)
        pool = await self._ready()
        granted = await pool.fetchval(
            "INSERT INTO key_counters AS c VALUES ($1, $2, $3, GREATEST(0, LEAST($4::bigint, $5::bigint)),"
            " GREATEST(0, LEAST($4::bigint, $5::bigint)), $6) ON CONFLICT (key, counter, win) DO UPDATE SET"
            " granted = GREATEST(0, LEAST($4::bigint, $5::bigint - c.used)),"
            " used = c.used + GREATEST(0, LEAST($4::bigint, $5::bigint - c.used)) RETURNING granted",
            key,
            counter,
            window,
            want,
            cap,
            ends,
        )
        return int(granted)

    async def add_used(self, key: str, counter: str, window: str, n: int) -> None:
        ends = codec.counter_end(counter, window)
        pool = await self._ready()
        await pool.execute(
            "INSERT INTO key_counters AS c VALUES ($1, $2, $3, GREATEST(0, $4::bigint), 0, $5)"
            " ON CONFLICT (key, counter, win) DO UPDATE SET used = GREATEST(0, c.used + $4::bigint)",
            key,
            counter,
            window,
            n,
            ends,
        )

    async def used(self, key: str, counter: str, windows: list[str]) -> dict[str, int]:
        pool = await self._ready()
        rows = await pool.fetch(
            "SELECT win, used FROM key_counters WHERE key = $1 AND counter = $2 AND win = ANY($3::text[])",
            key,
            counter,
            windows,
        )
        return {**dict.fromkeys(windows, 0), **{str(r[0]): int(r[1]) for r in rows}}

    async def prune_counters(self, before: float) -> None:
        pool = await self._ready()
        await pool.execute("DELETE FROM key_counters WHERE ends < $1", before)

    # --- last use

    async def save_last_use(self, rows: dict[str, float]) -> None:
        async with self._tx() as db:
            await db.executemany(
                "INSERT INTO last_use VALUES ($1, $2) ON CONFLICT (replica) DO UPDATE SET"
                " at = GREATEST(last_use.at, excluded.at)",
                sorted(rows.items()),
            )

    async def last_use(self) -> dict[str, float]:
        pool = await self._ready()
        return {str(r[0]): float(r[1]) for r in await pool.fetch("SELECT replica, at FROM last_use")}

    async def forget_last_use(self, replicas: list[str]) -> None:
        pool = await self._ready()
        await pool.execute("DELETE FROM last_use WHERE replica = ANY($1::text[])", replicas)

    # --- the replica set

    async def publish(self, fence: int, publication: Publication, leader: str) -> bool:
        if fence < 1:  # epoch 0: nobody has led yet
            return False
        body = codec.encode_published(publication)
        async with self._tx() as db:
            if not await _fenced(db, fence):
                return False
            version = await _bump(db, "published_version")
            await db.execute(
                "INSERT INTO published VALUES (1, $1, $2, $3, $4, $5) ON CONFLICT (id) DO UPDATE SET"
                " version = excluded.version, fence = excluded.fence, leader = excluded.leader,"
                " at = excluded.at, body = excluded.body",
                version,
                fence,
                leader,
                time.time(),
                body,
            )
            await db.execute("SELECT pg_notify($1, 'published')", CHANNEL)
            return True

    async def published(self) -> Published | None:
        pool = await self._ready()
        row = await pool.fetchrow("SELECT version, fence, leader, at, body FROM published WHERE id = 1")
        if row is None:
            return None
        return codec.decode_published(str(row[4]), int(row[0]), int(row[1]), str(row[2]), float(row[3]))

    async def published_version(self) -> int:
        return await self._counter("published_version")

    # --- start requests

    async def request_start(self, model: str, member: str) -> None:
        async with self._tx() as db:
            await db.execute(
                "INSERT INTO start_requests VALUES ($1, $2, $3) ON CONFLICT (model) DO UPDATE SET"
                " member = excluded.member, at = excluded.at",
                model,
                member,
                time.time(),
            )
            await db.execute("SELECT pg_notify($1, 'start')", CHANNEL)  # sent at the commit

    async def take_start_requests(self, fence: int) -> list[str]:
        if fence < 1:
            return []
        async with self._tx() as db:
            if not await _fenced(db, fence):
                return []
            rows = await db.fetch("DELETE FROM start_requests RETURNING model, at")
        return [str(r[0]) for r in sorted(rows, key=lambda r: (r[1], r[0]))]

    # --- members

    async def heartbeat(self, member: str, host: str, pid: int, now: float) -> int:
        async with self._tx() as db:
            await db.execute(
                "INSERT INTO members VALUES ($1, $2, $3, $4) ON CONFLICT (member) DO UPDATE SET"
                " host = excluded.host, pid = excluded.pid, seen = excluded.seen",
                member,
                host,
                pid,
                now,
            )
            await db.execute("DELETE FROM members WHERE seen < $1", now - MEMBER_TTL)
            return int(await db.fetchval("SELECT count(*) FROM members"))

    async def leave(self, member: str) -> None:
        pool = await self._ready()
        await pool.execute("DELETE FROM members WHERE member = $1", member)

    # --- cordons

    async def cordon(self, cordon: Cordon) -> None:
        pool = await self._ready()
        await pool.execute(
            f"INSERT INTO cordons ({CORDON_COLUMNS}) VALUES ($1, $2, $3, $4, $5) ON CONFLICT (node)"
            " DO UPDATE SET reason = excluded.reason, who = excluded.who, since = excluded.since,"
            " draining = excluded.draining",
            *codec.cordon_row(cordon),
        )

    async def uncordon(self, node: str) -> bool:
        pool = await self._ready()
        return await pool.fetchval("DELETE FROM cordons WHERE node = $1 RETURNING node", node) is not None

    async def cordons(self) -> list[Cordon]:
        pool = await self._ready()
        rows = await pool.fetch(f"SELECT {CORDON_COLUMNS} FROM cordons ORDER BY node")
        return [c for c in (codec.parse_cordon(tuple(r)) for r in rows) if c is not None]

    # --- leadership, changes, lifetime

    def leadership(self, member: str) -> PostgresLeadership:
        made = PostgresLeadership(self, member)
        self._leaderships.append(made)
        return made

    def _on_notify(self, *_: object) -> None:
        self._changed.set()

    def _on_lost(self, connection: object) -> None:
        if connection is self._listener:
            self._listener = None
        self._changed.set()  # what was missed meanwhile: let the caller look again

    async def _listen(self) -> None:
        if self._listener is not None and not self._listener.is_closed():
            return
        listener = await self.connect()
        try:
            await listener.add_listener(CHANNEL, self._on_notify)
        except BaseException:
            await listener.close()
            raise
        listener.add_termination_listener(self._on_lost)
        self._listener = listener

    async def wait_change(self, timeout: float) -> None:
        """A NOTIFY since the last return (kept while nobody waits) returns at once; a
        lost LISTEN connection counts as a change (it is opened again on the next call)."""
        deadline = time.monotonic() + timeout
        try:
            await self._listen()
        except InputError as exc:
            log.warning("store change notifications unavailable, looking again in 1 s: %s", exc)
            await asyncio.sleep(min(timeout, 1.0))
            return
        await wait_event(self._changed, max(0.0, deadline - time.monotonic()))
        self._changed.clear()

    async def close(self) -> None:
        """Everything this object opened: the leaderships' connections (a lead held goes),
        the LISTEN connection, the pool."""
        leaderships, self._leaderships = self._leaderships, []
        for leadership in leaderships:
            await leadership.release()
        listener, self._listener = self._listener, None
        if listener is not None:
            await _close(listener)
        pool, self._pool = self._pool, None
        if pool is not None:
            try:
                async with asyncio.timeout(TIMEOUT):
                    await pool.close()
            except (TimeoutError, OSError, asyncpg.InterfaceError):
                pool.terminate()


class PostgresLeadership:
    """The session advisory lock ``LEADER_LOCK`` on a connection of its own."""

    def __init__(self, store: PostgresStore, member: str) -> None:
        self.store = store
        self.member = member
        self.fence: int | None = None
        self._db: asyncpg.Connection | None = None
        self._using = asyncio.Lock()  # one statement at a time on the lock connection

    async def try_acquire(self) -> int | None:
        """A member that does not get the lock keeps its connection for the next try:
        the followers of a cluster ask every second, and a new session each time would
        cost the server an authentication per follower per second."""
        async with self._using:
            if self._db is not None and self._db.is_closed():
                await self._drop()
            if self.fence is not None and self._db is not None:
                return self.fence
            if self._db is None:
                self._db = await self.store.connect()
            db = self._db
            try:
                if not await db.fetchval("SELECT pg_try_advisory_lock($1)", LEADER_LOCK, timeout=TIMEOUT):
                    return None
                epoch = await db.fetchval(
                    "UPDATE leader SET epoch = epoch + 1, member = $1, since = $2 WHERE id = 1 RETURNING epoch",
                    self.member,
                    time.time(),
                    timeout=TIMEOUT,
                )
            except BaseException:
                await self._drop()  # the lock, if it was taken, goes with the session
                raise
            self.fence = int(epoch)
            return self.fence

    async def still_leader(self) -> bool:
        async with self._using:
            db, fence = self._db, self.fence
            if fence is None:
                return False
            if db is None or db.is_closed():
                await self._drop()
                return False
            try:
                epoch = await db.fetchval("SELECT epoch FROM leader WHERE id = 1", timeout=TIMEOUT)
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                log.warning("leader lock connection lost: %s", exc)
                epoch = None
            if epoch != fence:
                await self._drop()  # whatever happened, this member leads no more
                return False
            return True

    async def _drop(self) -> None:
        db, self._db, self.fence = self._db, None, None
        if db is not None:
            await _close(db)

    async def release(self) -> None:
        async with self._using:
            await self._drop()


async def _close(db: asyncpg.Connection) -> None:
    try:
        async with asyncio.timeout(TIMEOUT):
            await db.close()
    except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
        db.terminate()


async def _bump(db: Db, counter: str) -> int:
    value = await db.fetchval("UPDATE meta SET value = value + 1 WHERE name = $1 RETURNING value", counter)
    if counter == "keys_version":
        await db.execute("SELECT pg_notify($1, 'keys')", CHANNEL)
    return int(value)


async def _fenced(db: Db, fence: int) -> bool:
    """Within a transaction: the stored epoch is ``fence``, and stays it until the end
    (the row is locked: a takeover waits for this transaction)."""
    epoch = await db.fetchval("SELECT epoch FROM leader WHERE id = 1 FOR SHARE")
    return bool(epoch == fence)


async def _version(db: Db) -> int:
    if await db.fetchval("SELECT to_regclass('meta')") is None:
        return 0
    value = await db.fetchval("SELECT value FROM meta WHERE name = 'schema_version'")
    return int(value) if value is not None else 0


async def _migrate(db: Db) -> int:
    async with db.transaction():
        await db.execute("SELECT pg_advisory_xact_lock($1)", MIGRATE_LOCK)
        version = await _version(db)
        for step in range(version + 1, SCHEMA_VERSION + 1):
            if step in SCHEMA:
                await db.execute(SCHEMA[step])
        await db.execute(
            "INSERT INTO meta VALUES ('schema_version', $1) ON CONFLICT (name) DO UPDATE SET"
            " value = GREATEST(meta.value, excluded.value)",
            SCHEMA_VERSION,
        )
        return await _version(db)

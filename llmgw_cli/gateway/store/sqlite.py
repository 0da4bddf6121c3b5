"""What the gateway processes of one cluster share: API keys, usage totals, when each
replica last served, the replica set the leader publishes, on-demand start requests, the
live members and who leads, and the counters of the key limits.

Two implementations of the ``Store`` protocol (declared in ``protocol.py``, imported from
here): ``SqliteStore`` (``<state_dir>/gateway.sqlite3``, the default: the worker processes
of one host) and ``PostgresStore`` (``gateway.store``: the gateways of several hosts, in
``postgres.py``, imported only when configured). Callers use the protocol only;
``open_store`` picks the implementation from the cluster file.

Contract: every method is a coroutine, never called on a request's path (background jobs
cache what requests need). SQLite's blocking calls run in a worker thread, one connection
per call, so the object is safe to share. Writes that read first take the write lock at
once (``BEGIN IMMEDIATE``) so two processes never deadlock upgrading a read lock. Every
value read back is treated as written by someone else: a publication that does not parse
is read as an empty one, not an error.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sqlite3
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.core.serving.limits import Limits
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.store.protocol import Leadership, Store
from llmgw_cli.gateway.store.sqlite_schema import MIGRATIONS
from llmgw_cli.gateway.store.values import (
    BATCHES_KEPT,
    CORDON_COLUMNS,
    COUNTERS,
    COUNTERS_KEPT,
    KEY_COLUMNS,
    MEMBER_TTL,
    SCHEMA_VERSION,
    ModelState,
    Publication,
    Published,
    Usage,
    cordon_row,
    counter_end,
    decode_published,
    encode_limits,
    encode_published,
    parse_cordon,
    parse_key,
)

if TYPE_CHECKING:
    from llmgw_cli.core.clusterfile.spec import ClusterSpec

__all__ = [  # what callers import from here, the values included
    "COUNTERS",
    "COUNTERS_KEPT",
    "MEMBER_TTL",
    "SCHEMA_VERSION",
    "Leadership",
    "ModelState",
    "Publication",
    "Published",
    "SqliteLeadership",
    "SqliteStore",
    "Store",
    "Usage",
    "open_store",
]


POLL_EVERY = 0.25  # seconds between two looks at SQLite's change counters in wait_change

T = TypeVar("T")


def open_store(spec: ClusterSpec) -> Store:
    """The store the cluster file names: PostgreSQL when ``gateway.store`` is set, else
    SQLite in ``gateway.state_dir``."""
    if spec.gateway.store is None:
        return SqliteStore(spec.gateway.state_dir)
    from llmgw_cli.gateway.store.postgres import PostgresStore  # noqa: PLC0415 (its driver only when used)

    return PostgresStore.from_spec(spec)


# --- SQLite (its schema: ``sqlite_schema.py``) ----------------------------------------------


@contextmanager
def _transaction(db: sqlite3.Connection, begin: str) -> Iterator[None]:
    """``begin`` … COMMIT, rolled back on any error (the connection is in autocommit mode,
    so sqlite3 itself never opens or ends a transaction)."""
    db.execute(begin)
    try:
        yield
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _regular_file(path: Path) -> int:
    """An open descriptor on ``path``, created 0600; never through a link, never anything
    but a regular file (the state folder is the gateway's, but nothing is taken on trust)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InputError(f"{path}: not a regular file")
    return fd


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """``flock`` on ``path``, waited for, held for the block; released with the descriptor
    even if the process dies."""
    fd = _regular_file(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class SqliteStore:
    """``Store`` in ``<state_dir>/gateway.sqlite3`` (created 0700/0600: it holds key digests),
    in WAL mode so readers never wait for the writer. The schema is created or upgraded when
    the object is made: the file belongs to the gateway host, nobody else migrates it."""

    def __init__(self, state_dir: str | Path) -> None:
        directory = Path(state_dir)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            raise InputError(f"gateway state_dir {directory}: {exc.strerror}") from None
        self.directory = directory
        self.path = directory / "gateway.sqlite3"
        self._seen: tuple[int, int] | None = None  # the change counters wait_change last saw
        self._leaderships: list[SqliteLeadership] = []  # released with the store
        try:
            # Made 0600 before SQLite opens it: its -wal and -shm files take the database
            # file's mode, and they hold key digests too.
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
            self.path.chmod(0o600)
            self._migrate()
        except OSError as exc:
            raise InputError(f"gateway store {self.path}: {exc.strerror}") from None
        except sqlite3.Error as exc:
            raise InputError(f"gateway store {self.path}: {exc}") from None

    @contextmanager
    def _db(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        """One connection, one transaction: committed, or rolled back on an error. ``write``
        takes the write lock at the start (a read-then-write never fails half way)."""
        db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout = 10000")
            with _transaction(db, "BEGIN IMMEDIATE" if write else "BEGIN"):
                yield db
        finally:
            db.close()

    async def _run(self, call: Callable[[], T]) -> T:
        return await asyncio.to_thread(call)

    # --- schema

    def _migrate(self) -> int:
        """Switch the file to WAL and bring its schema up to date, one process at a time.

        The gateway's workers open the store at the same moment. Switching a new file to
        WAL is the one step SQLite may refuse at once with "database is locked" (its busy
        timeout does not cover it) when another connection is switching or writing, so
        every opening holds ``<state_dir>/store.lock`` while it switches and migrates; the
        switch is made only while the file is not in WAL yet (asking for WAL again on a WAL
        file is harmless, but it is skipped anyway)."""
        with _file_lock(self.directory / "store.lock"):
            return self._migrate_locked()

    def _migrate_locked(self) -> int:
        db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        try:
            db.execute("PRAGMA busy_timeout = 10000")
            if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                db.execute("PRAGMA journal_mode = WAL")  # kept in the file: once is enough
            with _transaction(db, "BEGIN IMMEDIATE"):
                version = self._version(db)
                for step in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in MIGRATIONS[step].split(";"):
                        if statement.strip():
                            db.execute(statement)
                db.execute(
                    "INSERT INTO meta VALUES ('schema_version', ?) ON CONFLICT (name) DO UPDATE SET"
                    " value = max(value, excluded.value)",
                    (SCHEMA_VERSION,),
                )
                now = self._version(db)
        finally:
            db.close()
        if now > SCHEMA_VERSION:
            raise InputError(
                f"gateway store {self.path}: schema version {now} is newer than this llmgw knows"
                f" ({SCHEMA_VERSION}): upgrade llmgw"
            )
        return now

    @staticmethod
    def _version(db: sqlite3.Connection) -> int:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "meta" in tables:
            row = db.execute("SELECT value FROM meta WHERE name = 'schema_version'").fetchone()
            if row is not None:
                return int(row[0])
        return 1 if "api_keys" in tables else 0  # before the meta table: the first schema

    async def migrate(self) -> int:
        return await self._run(self._migrate)

    # --- API keys

    async def add_key(self, key: ApiKey) -> None:
        created = (key.created or datetime.now(UTC)).isoformat()
        expires = key.expires.isoformat() if key.expires else None

        def add() -> None:
            with self._db(write=True) as db:
                db.execute(
                    "INSERT INTO api_keys (name, digest, models, expires, created, revoked, admin, limits)"
                    " VALUES (?, ?, ?, ?, ?, 0, ?, ?)",
                    (
                        key.name,
                        key.digest,
                        json.dumps(list(key.models)),
                        expires,
                        created,
                        int(key.admin),
                        encode_limits(key.limits),
                    ),
                )
                db.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")

        try:
            await self._run(add)
        except sqlite3.IntegrityError:
            raise InputError(f"a key named {key.name!r} exists already") from None

    async def api_keys(self) -> list[ApiKey]:
        def read() -> list[ApiKey]:
            with self._db() as db:
                rows = db.execute(f"SELECT {KEY_COLUMNS} FROM api_keys ORDER BY name").fetchall()
            return [parse_key(r) for r in rows]

        return await self._run(read)

    async def _change_key(self, name: str, assignments: str, values: tuple[object, ...]) -> bool:
        """``UPDATE api_keys SET <assignments>`` of the key ``name`` and bump the keys'
        version; False when there is no such key."""

        def change() -> bool:
            with self._db(write=True) as db:
                if (
                    db.execute(f"UPDATE api_keys SET {assignments} WHERE name = ?", (*values, name)).rowcount
                    == 0
                ):
                    return False
                db.execute("UPDATE meta SET value = value + 1 WHERE name = 'keys_version'")
                return True

        return await self._run(change)

    async def revoke(self, name: str) -> bool:
        return await self._change_key(name, "revoked = 1", ())

    async def set_limits(self, name: str, limits: Limits) -> bool:
        return await self._change_key(name, "limits = ?", (encode_limits(limits),))

    async def set_access(self, name: str, models: tuple[str, ...], expires: datetime | None) -> bool:
        return await self._change_key(
            name,
            "models = ?, expires = ?",
            (json.dumps(list(models)), expires.isoformat() if expires else None),
        )

    def _counter(self, name: str) -> int:
        with self._db() as db:
            row = db.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return int(row[0]) if row is not None else 0

    async def keys_version(self) -> int:
        return await self._run(lambda: self._counter("keys_version"))

    # --- usage

    async def add_usage(self, batch: str, rows: list[Usage]) -> None:
        now = time.time()

        def add() -> None:
            with self._db(write=True) as db:
                try:
                    db.execute("INSERT INTO usage_batches VALUES (?, ?)", (batch, now))
                except sqlite3.IntegrityError:
                    return  # applied already: its answer was lost, not its write
                db.executemany(
                    "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (day, key, model) DO UPDATE SET"
                    " requests = requests + excluded.requests,"
                    " prompt_tokens = prompt_tokens + excluded.prompt_tokens,"
                    " completion_tokens = completion_tokens + excluded.completion_tokens,"
                    " errors = errors + excluded.errors, latency_ms = latency_ms + excluded.latency_ms",
                    [u.row() for u in rows],
                )
                db.execute("DELETE FROM usage_batches WHERE at < ?", (now - BATCHES_KEPT,))
                db.execute("DELETE FROM key_counters WHERE ends < ?", (now - COUNTERS_KEPT,))

        await self._run(add)

    async def usage(self, since: str | None = None) -> list[Usage]:
        def read() -> list[Usage]:
            with self._db() as db:
                rows = db.execute(
                    "SELECT day, key, model, requests, prompt_tokens, completion_tokens, errors, latency_ms"
                    " FROM usage WHERE day >= ? ORDER BY day, key, model",
                    (since or "",),
                ).fetchall()
            return [Usage(*r) for r in rows]

        return await self._run(read)

    # --- counters of the key limits

    async def lease(self, key: str, counter: str, window: str, want: int, cap: int) -> int:
        """One statement under the write lock: the grant is computed from the ``used`` the
        row has when it is written, and kept in ``granted`` to be read back."""
        ends = counter_end(counter, window)

        def lease() -> int:
            with self._db(write=True) as db:
                (granted,) = db.execute(
                    "INSERT INTO key_counters VALUES (:key, :counter, :win, max(0, min(:want, :cap)),"
                    " max(0, min(:want, :cap)), :ends) ON CONFLICT (key, counter, win) DO UPDATE SET"
                    " granted = max(0, min(:want, :cap - used)), used = used + max(0, min(:want, :cap - used))"
                    " RETURNING granted",
                    {"key": key, "counter": counter, "win": window, "want": want, "cap": cap, "ends": ends},
                ).fetchone()
            return int(granted)

        return await self._run(lease)

    async def add_used(self, key: str, counter: str, window: str, n: int) -> None:
        ends = counter_end(counter, window)

        def add() -> None:
            with self._db(write=True) as db:
                db.execute(
                    "INSERT INTO key_counters VALUES (:key, :counter, :win, max(0, :n), 0, :ends)"
                    " ON CONFLICT (key, counter, win) DO UPDATE SET used = max(0, used + :n)",
                    {"key": key, "counter": counter, "win": window, "n": n, "ends": ends},
                )

        await self._run(add)

    async def used(self, key: str, counter: str, windows: list[str]) -> dict[str, int]:
        def read() -> dict[str, int]:
            found = dict.fromkeys(windows, 0)
            with self._db() as db:
                for window in windows:
                    row = db.execute(
                        "SELECT used FROM key_counters WHERE key = ? AND counter = ? AND win = ?",
                        (key, counter, window),
                    ).fetchone()
                    if row is not None:
                        found[window] = int(row[0])
            return found

        return await self._run(read)

    async def prune_counters(self, before: float) -> None:
        def prune() -> None:
            with self._db(write=True) as db:
                db.execute("DELETE FROM key_counters WHERE ends < ?", (before,))

        await self._run(prune)

    # --- last use

    async def save_last_use(self, rows: dict[str, float]) -> None:
        """The newer time wins, so a slow writer never moves a replica's use back."""

        def save() -> None:
            with self._db(write=True) as db:
                db.executemany(
                    "INSERT INTO last_use VALUES (?, ?) ON CONFLICT (replica) DO UPDATE SET"
                    " at = max(at, excluded.at)",
                    sorted(rows.items()),
                )

        await self._run(save)

    async def last_use(self) -> dict[str, float]:
        def read() -> dict[str, float]:
            with self._db() as db:
                return {str(r[0]): float(r[1]) for r in db.execute("SELECT replica, at FROM last_use")}

        return await self._run(read)

    async def forget_last_use(self, replicas: list[str]) -> None:
        """A stopped replica's time must not pass to the next one at its address."""

        def forget() -> None:
            with self._db(write=True) as db:
                db.executemany("DELETE FROM last_use WHERE replica = ?", [(r,) for r in replicas])

        await self._run(forget)

    # --- the replica set

    async def publish(self, fence: int, publication: Publication, leader: str) -> bool:
        body = encode_published(publication)
        now = time.time()

        def publish() -> bool:
            with self._db(write=True) as db:
                (epoch,) = db.execute("SELECT epoch FROM leader WHERE id = 1").fetchone()
                if fence < 1 or epoch != fence:  # epoch 0: nobody has led yet
                    return False
                db.execute("UPDATE meta SET value = value + 1 WHERE name = 'published_version'")
                (version,) = db.execute("SELECT value FROM meta WHERE name = 'published_version'").fetchone()
                db.execute(
                    "INSERT INTO published VALUES (1, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET"
                    " version = excluded.version, fence = excluded.fence, leader = excluded.leader,"
                    " at = excluded.at, body = excluded.body",
                    (version, fence, leader, now, body),
                )
                return True

        return await self._run(publish)

    async def published(self) -> Published | None:
        def read() -> Published | None:
            with self._db() as db:
                row = db.execute(
                    "SELECT version, fence, leader, at, body FROM published WHERE id = 1"
                ).fetchone()
            if row is None:
                return None
            return decode_published(str(row[4]), int(row[0]), int(row[1]), str(row[2]), float(row[3]))

        return await self._run(read)

    async def published_version(self) -> int:
        return await self._run(lambda: self._counter("published_version"))

    # --- start requests

    async def request_start(self, model: str, member: str) -> None:
        now = time.time()

        def request() -> None:
            with self._db(write=True) as db:
                db.execute(
                    "INSERT INTO start_requests VALUES (?, ?, ?) ON CONFLICT (model) DO UPDATE SET"
                    " member = excluded.member, at = excluded.at",
                    (model, member, now),
                )

        await self._run(request)

    async def take_start_requests(self, fence: int) -> list[str]:
        def take() -> list[str]:
            with self._db(write=True) as db:
                (epoch,) = db.execute("SELECT epoch FROM leader WHERE id = 1").fetchone()
                if fence < 1 or epoch != fence:  # epoch 0: nobody has led yet
                    return []
                models = [
                    str(r[0]) for r in db.execute("SELECT model FROM start_requests ORDER BY at, model")
                ]
                db.execute("DELETE FROM start_requests")
                return models

        return await self._run(take)

    # --- members

    async def heartbeat(self, member: str, host: str, pid: int, now: float) -> int:
        def beat() -> int:
            with self._db(write=True) as db:
                db.execute(
                    "INSERT INTO members VALUES (?, ?, ?, ?) ON CONFLICT (member) DO UPDATE SET"
                    " host = excluded.host, pid = excluded.pid, seen = excluded.seen",
                    (member, host, pid, now),
                )
                db.execute("DELETE FROM members WHERE seen < ?", (now - MEMBER_TTL,))
                (count,) = db.execute("SELECT count(*) FROM members").fetchone()
                return int(count)

        return await self._run(beat)

    async def leave(self, member: str) -> None:
        def leave() -> None:
            with self._db(write=True) as db:
                db.execute("DELETE FROM members WHERE member = ?", (member,))

        await self._run(leave)

    # --- cordons

    async def cordon(self, cordon: Cordon) -> None:
        def write() -> None:
            with self._db(write=True) as db:
                db.execute(
                    f"INSERT INTO cordons ({CORDON_COLUMNS}) VALUES (?, ?, ?, ?, ?) ON CONFLICT (node)"
                    " DO UPDATE SET reason = excluded.reason, who = excluded.who, since = excluded.since,"
                    " draining = excluded.draining",
                    cordon_row(cordon),
                )

        await self._run(write)

    async def uncordon(self, node: str) -> bool:
        def lift() -> bool:
            with self._db(write=True) as db:
                return db.execute("DELETE FROM cordons WHERE node = ?", (node,)).rowcount > 0

        return await self._run(lift)

    async def cordons(self) -> list[Cordon]:
        def read() -> list[Cordon]:
            with self._db() as db:
                rows = db.execute(f"SELECT {CORDON_COLUMNS} FROM cordons ORDER BY node").fetchall()
            return [c for c in (parse_cordon(tuple(r)) for r in rows) if c is not None]

        return await self._run(read)

    # --- leadership, changes, lifetime

    def leadership(self, member: str) -> Leadership:
        made = SqliteLeadership(self, member)
        self._leaderships.append(made)
        return made

    def _counters(self) -> tuple[int, int]:
        with self._db() as db:
            values = dict(db.execute("SELECT name, value FROM meta"))
        return int(values.get("keys_version", 0)), int(values.get("published_version", 0))

    async def wait_change(self, timeout: float) -> None:
        """Polls the change counters; a change made since the last return counts too."""
        deadline = time.monotonic() + timeout
        seen = self._seen if self._seen is not None else await self._run(self._counters)
        while True:
            now = await self._run(self._counters)
            if now != seen or time.monotonic() >= deadline:
                self._seen = now
                return
            await asyncio.sleep(min(POLL_EVERY, max(0.0, deadline - time.monotonic())))

    async def close(self) -> None:
        """Lets go of the leader lock if one of its leaderships holds it."""
        leaderships, self._leaderships = self._leaderships, []
        for leadership in leaderships:
            await leadership.release()


class SqliteLeadership:
    """Leadership of one host: ``flock`` on ``<state_dir>/leader.lock``, held by an open
    file for as long as this member leads (the kernel lets it go when the process dies).
    Taking it bumps the stored epoch, the fencing number."""

    def __init__(self, store: SqliteStore, member: str) -> None:
        self.store = store
        self.member = member
        self.path = store.directory / "leader.lock"
        self.fence: int | None = None
        self._fd: int | None = None

    def _open(self) -> int:
        return _regular_file(self.path)

    def _acquire(self) -> int | None:
        if self._fd is not None and self.fence is not None:
            return self.fence
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            with self.store._db(write=True) as db:
                (epoch,) = db.execute(
                    "UPDATE leader SET epoch = epoch + 1, member = ?, since = ? WHERE id = 1 RETURNING epoch",
                    (self.member, time.time()),
                ).fetchone()
        except BaseException:
            os.close(fd)  # the lock goes with it
            raise
        self._fd, self.fence = fd, int(epoch)
        return self.fence

    async def try_acquire(self) -> int | None:
        return await asyncio.to_thread(self._acquire)

    def _still(self) -> bool:
        if self._fd is None or self.fence is None:
            return False
        try:
            with self.store._db() as db:
                row = db.execute("SELECT epoch FROM leader WHERE id = 1").fetchone()
        except sqlite3.Error:
            return False
        return row is not None and row[0] == self.fence

    async def still_leader(self) -> bool:
        return await asyncio.to_thread(self._still)

    async def release(self) -> None:
        fd, self._fd, self.fence = self._fd, None, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file lets the lock go

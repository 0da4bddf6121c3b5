"""Keys and usage in SQLite, the per-model admission queue, and asking a stream for its usage."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.core.serving.keys import ApiKey, bearer, hash_token, parse_expiry
from llmgw_cli.core.serving.limits import NO_LIMITS, Limits
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.control.state import Admission, read_engine_key
from llmgw_cli.gateway.serving.request_body import with_include_usage
from llmgw_cli.gateway.store.sqlite import SCHEMA_VERSION, SqliteStore, Usage
from llmgw_cli.gateway.store.sqlite_schema import MIGRATIONS
from llmgw_cli.gateway.store.usage import Meter, merged


def test_keys_round_trip_and_revoke(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SqliteStore(tmp_path / "state")
        expires = datetime(2030, 1, 1, tzinfo=UTC)
        await store.add_key(ApiKey("a", hash_token("tok-a"), ("m1", "m2"), expires, admin=True))
        await store.add_key(ApiKey("b", hash_token("tok-b")))
        with pytest.raises(InputError, match="exists already"):
            await store.add_key(ApiKey("a", hash_token("other")))
        a, _ = await store.api_keys()
        assert (a.name, a.models, a.expires, a.admin, a.revoked) == ("a", ("m1", "m2"), expires, True, False)
        assert await store.revoke("b") and not await store.revoke("nobody")
        assert (await store.api_keys())[1].revoked

    asyncio.run(scenario())
    stored = b"".join(p.read_bytes() for p in (tmp_path / "state").glob("gateway.sqlite3*"))
    assert b"tok-a" not in stored
    for path in (tmp_path / "state").glob("gateway.sqlite3*"):  # the WAL files hold digests too
        assert oct(path.stat().st_mode & 0o777) == "0o600", path


def test_key_checks() -> None:
    now = datetime(2026, 6, 1, tzinfo=UTC)
    key = ApiKey("a", "d", ("m1",), now + timedelta(days=1))
    assert key.allows("m1") and not key.allows("m2")
    assert key.valid(now) and not key.valid(now + timedelta(days=2))
    assert ApiKey("b", "d").allows("anything")
    assert not ApiKey("c", "d", revoked=True).valid(now)
    assert parse_expiry("2027-01-31") == datetime(2027, 1, 31, tzinfo=UTC)
    assert bearer("Bearer abc") == "abc" and bearer("Basic abc") is None and bearer(None) is None


def test_usage_adds_up_across_batches(tmp_path: Path) -> None:
    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        meter = Meter()
        now = datetime(2026, 6, 1, 12, tzinfo=UTC).timestamp()
        meter.record("a", "m", prompt=3, completion=5, error=False, latency_ms=10.0, now=now)
        meter.record("a", "m", prompt=1, completion=0, error=True, latency_ms=2.0, now=now)
        await store.add_usage("batch-1", meter.take())
        meter.record("a", "m", prompt=2, completion=2, error=False, latency_ms=3.0, now=now)
        assert meter.take() and not meter.take()
        meter.record("a", "m", prompt=2, completion=2, error=False, latency_ms=3.0, now=now)
        await store.add_usage("batch-2", meter.take())
        (row,) = await store.usage()
        assert row == Usage("2026-06-01", "a", "m", 3, 6, 7, 1, 15.0)
        meter.record("a", "m", prompt=1, completion=1, error=False, latency_ms=1.0, now=now)
        (total,) = merged(await store.usage(), meter.pending())
        assert (total.requests, total.prompt_tokens) == (4, 7)

    asyncio.run(scenario())


def test_a_failed_batch_is_handed_out_again_unchanged() -> None:
    """The flusher retries the SAME batch (id and rows) before taking the next, and the
    admin view counts it while it is unwritten."""
    meter = Meter()
    meter.record("a", "m", prompt=1, completion=1, error=False, latency_ms=1.0, now=0.0)
    first = meter.batch()
    assert first is not None
    meter.record("a", "m", prompt=5, completion=5, error=False, latency_ms=1.0, now=0.0)
    assert meter.batch() == first  # the write failed: again, not merged with the new count
    assert sum(u.requests for u in meter.pending()) == 2
    meter.sent(first[0])
    second = meter.batch()
    assert second is not None and second[0] != first[0]
    assert [u.prompt_tokens for u in second[1]] == [5]
    meter.sent(second[0])
    assert meter.batch() is None and meter.pending() == []


def test_engine_key_file(tmp_path: Path) -> None:
    path = tmp_path / "engine.env"
    path.write_text("# llmgw\nLLMGW_ENGINE_KEY='s3cret'\n")
    assert read_engine_key(path) == "s3cret"
    path.write_text("OTHER=1\n")
    with pytest.raises(InputError, match="no LLMGW_ENGINE_KEY"):
        read_engine_key(path)
    with pytest.raises(InputError, match="engine-key-file"):
        read_engine_key(tmp_path / "missing")


def test_admission_limits_and_queues_in_order() -> None:
    async def scenario() -> list[str]:
        gate = Admission()
        order: list[str] = []
        assert await gate.enter("m", queue=2)

        async def waiter(name: str) -> None:
            assert await gate.enter("m", queue=2)
            order.append(name)
            gate.leave("m")

        first = asyncio.create_task(waiter("first"))
        await asyncio.sleep(0)
        second = asyncio.create_task(waiter("second"))
        await asyncio.sleep(0)
        assert not await gate.enter("m", queue=2)  # queue full: refused at once
        assert gate.queued() == {"m": 2}
        gate.leave("m")
        await asyncio.gather(first, second)
        assert gate.active["m"] == 0
        return order

    assert asyncio.run(scenario()) == ["first", "second"]


def test_admission_cancelled_waiter_gives_up_its_place() -> None:
    async def scenario() -> int:
        gate = Admission()
        assert await gate.enter("m", queue=5)
        waiting = asyncio.create_task(gate.enter("m", queue=5))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        gate.leave("m")
        assert await gate.enter("m", queue=5)  # the slot is free again
        return gate.active["m"]

    assert asyncio.run(scenario()) == 1


def test_admission_grows_at_once_when_the_limit_is_raised() -> None:
    """A replica turned ready: waiters up to the new limit get their slot without waiting
    for anyone to leave; a lower limit hands no freed slot on until under it again."""

    async def scenario() -> None:
        gate = Admission()
        assert gate.limit("m") == 1
        assert await gate.enter("m", queue=10)
        waiting = [asyncio.create_task(gate.enter("m", queue=10)) for _ in range(3)]
        await asyncio.sleep(0)
        assert gate.queued() == {"m": 3}
        gate.resize("m", 3)  # two more slots: two waiters in, nobody left
        await asyncio.sleep(0)
        assert [t.done() for t in waiting] == [True, True, False]
        assert gate.active["m"] == 3 and gate.queued() == {"m": 1}
        gate.resize("m", 1)  # capacity gone: freed slots are not handed on while over it
        gate.leave("m")
        gate.leave("m")
        await asyncio.sleep(0)
        assert not waiting[2].done() and gate.active["m"] == 1
        gate.leave("m")  # now under the limit: the slot goes to the last waiter
        await asyncio.sleep(0)
        assert waiting[2].done() and gate.active["m"] == 1
        gate.leave("m")
        assert gate.active["m"] == 0

    asyncio.run(scenario())


def test_include_usage_is_asked_for_without_losing_stream_options() -> None:
    for body in (
        b'{"model":"m","stream":true}',
        b' {"model": "m"}\n',
        b'{"model":"m","stream_options":{"x":1}}',
    ):
        payload = json.loads(body)
        asked = json.loads(with_include_usage(body, dict(payload)))
        assert asked == {
            **payload,
            "stream_options": {**payload.get("stream_options", {}), "include_usage": True},
        }


def test_admission_waiting_keys_take_turns() -> None:
    async def scenario() -> list[str]:
        gate = Admission()
        order: list[str] = []
        assert await gate.enter("m", 10, "flood")

        async def waiter(key: str, name: str) -> None:
            assert await gate.enter("m", 10, key)
            order.append(name)
            gate.leave("m")

        tasks = []
        for key, name in [
            ("flood", "flood-1"),
            ("flood", "flood-2"),
            ("flood", "flood-3"),
            ("other", "other-1"),
        ]:
            tasks.append(asyncio.create_task(waiter(key, name)))
            await asyncio.sleep(0)
        assert gate.queued() == {"m": 4} and gate.key_waiting("m", "flood") == 3
        assert gate.oldest_wait("m", time.monotonic() + 1) >= 1
        gate.leave("m")
        await asyncio.gather(*tasks)
        assert gate.active["m"] == 0 and gate.queued() == {"m": 0}
        return order

    # FIFO would serve all three of the flooder's first.
    assert asyncio.run(scenario()) == ["flood-1", "other-1", "flood-2", "flood-3"]


def test_admission_refuses_a_key_beyond_its_share_of_the_queue() -> None:
    async def scenario() -> None:
        gate = Admission()
        assert await gate.enter("m", 4, "flood", key_queue=2)
        waiting = [asyncio.create_task(gate.enter("m", 4, "flood", key_queue=2)) for _ in range(2)]
        await asyncio.sleep(0)
        assert not await gate.enter("m", 4, "flood", key_queue=2)  # its share is full
        other = asyncio.create_task(gate.enter("m", 4, "other", key_queue=2))
        await asyncio.sleep(0)
        assert gate.queued() == {"m": 3}
        for _ in range(4):
            gate.leave("m")
            await asyncio.sleep(0)
        assert all(t.result() for t in [*waiting, other])
        assert gate.active["m"] == 0

    asyncio.run(scenario())


def test_bearer_is_none_for_tokens_no_key_can_be() -> None:
    assert bearer("Bearer llmgw-abc_DEF-123") == "llmgw-abc_DEF-123"
    # "\udcff" is how the HTTP parser keeps a byte 0xff it cannot decode.
    for header in [
        "Bearer \udcff",
        "Bearer caf\u00e9",
        "Bearer a\x01b",
        "Bearer ",
        "Basic abc",
        "Bearer a b",
    ]:
        assert bearer(header) is None, header


def test_sqlite_upgrades_a_first_schema_file_in_place(tmp_path: Path) -> None:
    """A state directory from before the shared store (keys, usage, last use only) keeps
    its keys and totals and gains the rest when a gateway opens it."""
    old = sqlite3.connect(tmp_path / "gateway.sqlite3")
    old.executescript(
        "CREATE TABLE api_keys (name TEXT PRIMARY KEY, digest TEXT NOT NULL UNIQUE, models TEXT NOT NULL,"
        " expires TEXT, created TEXT NOT NULL, revoked INTEGER NOT NULL DEFAULT 0,"
        " admin INTEGER NOT NULL DEFAULT 0);"
        "CREATE TABLE usage (day TEXT NOT NULL, key TEXT NOT NULL, model TEXT NOT NULL,"
        " requests INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, completion_tokens INTEGER NOT NULL,"
        " errors INTEGER NOT NULL, latency_ms REAL NOT NULL, PRIMARY KEY (day, key, model));"
        "CREATE TABLE last_use (replica TEXT PRIMARY KEY, at REAL NOT NULL);"
        "INSERT INTO api_keys VALUES ('old', 'd1', '[]', NULL, '2026-01-01T00:00:00+00:00', 0, 1);"
        "INSERT INTO usage VALUES ('2026-01-01', 'old', 'm', 3, 1, 2, 0, 9.0);"
    )
    old.close()

    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        assert [(k.name, k.admin) for k in await store.api_keys()] == [("old", True)]
        assert [u.requests for u in await store.usage()] == [3]
        assert await store.keys_version() == 0 and await store.migrate() == SCHEMA_VERSION
        await store.add_key(ApiKey("new", hash_token("t")))
        assert await store.keys_version() == 1

    asyncio.run(scenario())


def test_sqlite_leader_lock_is_never_a_link(tmp_path: Path) -> None:
    """Whoever can write the state directory must not point the lock at another file."""
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "leader.lock").symlink_to(tmp_path / "elsewhere")

    async def scenario() -> None:
        with pytest.raises(OSError):
            await SqliteStore(tmp_path).leadership("a").try_acquire()

    asyncio.run(scenario())


def test_sqlite_store_is_opened_one_process_at_a_time(tmp_path: Path) -> None:
    """The gateway's workers open the store at the same moment, and switching a new file
    to WAL is refused at once ("database is locked") if another opening is under way: an
    opening waits for ``store.lock``, held by another, before it touches the file."""
    import fcntl  # noqa: PLC0415
    import os  # noqa: PLC0415
    import threading  # noqa: PLC0415

    fd = os.open(tmp_path / "store.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another opening under way (flock: per open file)
    opened: list[SqliteStore] = []
    opening = threading.Thread(target=lambda: opened.append(SqliteStore(tmp_path)), daemon=True)
    opening.start()
    opening.join(0.5)
    assert opening.is_alive() and not opened
    assert not (tmp_path / "gateway.sqlite3-wal").exists()  # not switched to WAL behind the lock
    os.close(fd)
    opening.join(10)
    assert opened and not opening.is_alive()
    db = sqlite3.connect(tmp_path / "gateway.sqlite3")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_sqlite_store_lock_is_never_a_link(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "store.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(InputError):
        SqliteStore(tmp_path)


def test_sqlite_upgrades_a_second_schema_file_in_place(tmp_path: Path) -> None:
    """A store from before the key limits gains them when a gateway opens it: its keys keep
    working, without limits, and the counters are there."""
    old = sqlite3.connect(tmp_path / "gateway.sqlite3")
    old.executescript(
        MIGRATIONS[1]
        + MIGRATIONS[2]
        + "INSERT INTO meta VALUES ('schema_version', 2);"
        + "INSERT INTO api_keys VALUES ('old', 'd1', '[\"m\"]', NULL, '2026-01-01T00:00:00+00:00', 0, 1);"
    )
    old.close()

    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        (key,) = await store.api_keys()
        assert (key.name, key.models, key.admin, key.revoked, key.limits) == (
            "old",
            ("m",),
            True,
            False,
            NO_LIMITS,
        )
        assert await store.migrate() == SCHEMA_VERSION == 4
        assert await store.set_limits("old", Limits(rpm=5))
        assert [k.limits for k in await store.api_keys()] == [Limits(rpm=5)]
        assert await store.lease("old", "requests", "m:1", 9, 5) == 5

    asyncio.run(scenario())


def test_a_key_whose_stored_limits_do_not_parse_comes_back_revoked(tmp_path: Path) -> None:
    """Fails closed: never a key without limits because its limits were garbled."""

    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        await store.add_key(ApiKey("k", hash_token("t"), limits=Limits(rpm=5)))
        await store.add_key(ApiKey("fine", hash_token("u"), limits=Limits(tpm=5)))
        for bad in ('{"rpm": -1}', '{"rpm": "5"}', '{"budget": "10/week"}', '{"priority": "top"}', "[]", "x"):
            with sqlite3.connect(tmp_path / "gateway.sqlite3") as db:
                db.execute("UPDATE api_keys SET limits = ? WHERE name = 'k'", (bad,))
            keys = {k.name: k for k in await store.api_keys()}
            assert keys["k"].revoked and not keys["fine"].revoked, bad
            assert keys["fine"].limits == Limits(tpm=5)

    asyncio.run(scenario())


def test_sqlite_upgrades_a_third_schema_file_in_place(tmp_path: Path) -> None:
    """A store from before the cordons gains their table when a gateway opens it; its keys
    are kept."""
    old = sqlite3.connect(tmp_path / "gateway.sqlite3")
    old.executescript(
        MIGRATIONS[1]
        + MIGRATIONS[2]
        + MIGRATIONS[3]
        + "INSERT INTO meta VALUES ('schema_version', 3);"
        + "INSERT INTO api_keys VALUES ('old', 'd1', '[]', NULL, '2026-01-01T00:00:00+00:00', 0, 0, '{}');"
    )
    old.close()

    async def scenario() -> None:
        store = SqliteStore(tmp_path)
        assert [k.name for k in await store.api_keys()] == ["old"]
        assert await store.cordons() == []
        await store.cordon(Cordon("node01", "fans", "ops@desk", 5.0))
        assert await store.cordons() == [Cordon("node01", "fans", "ops@desk", 5.0)]
        assert await store.migrate() == SCHEMA_VERSION == 4

    asyncio.run(scenario())


def test_a_cordon_row_that_does_not_parse_is_left_out_or_masked(tmp_path: Path) -> None:
    """Rows are read as someone else's writing: a control character is never shown, a row
    of the wrong types is left out."""
    store = SqliteStore(tmp_path)
    db = sqlite3.connect(tmp_path / "gateway.sqlite3")
    db.executescript(
        "INSERT INTO cordons VALUES ('node01', 'a' || char(27) || '[2J', 'x', 1.0, 0);"
        "INSERT INTO cordons VALUES ('node02', 'ok', 'y', 'yesterday', 0);"
    )
    db.commit()
    db.close()
    (found,) = asyncio.run(store.cordons())
    assert (found.node, found.reason, found.by) == ("node01", "?", "?")

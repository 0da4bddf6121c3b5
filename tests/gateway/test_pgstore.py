"""What only the PostgreSQL store does, against a real server (the ``postgres`` fixture):
a leader whose lock connection dies is no leader any more, the schema checks at first use,
what a wrong password or a missing database says, LISTEN coming back after its
connection was cut, and a database of an older schema upgraded in place. The rest of the contract is in test_store_conformance.py."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.core.serving.keys import ApiKey, hash_token
from llmgw_cli.core.serving.limits import NO_LIMITS, Limits
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.store.postgres import PostgresStore
from llmgw_cli.gateway.store.postgres_schema import SCHEMA
from llmgw_cli.gateway.store.sqlite import SCHEMA_VERSION, Publication
from tests.pg import Postgres


def test_a_leader_whose_lock_connection_dies_leads_no_more(postgres: Postgres) -> None:
    url = postgres.new_database()

    async def scenario() -> None:
        a, b = PostgresStore(url, postgres.password), PostgresStore(url, postgres.password)
        first, second = a.leadership("a"), b.leadership("b")
        fence = await first.try_acquire()
        assert fence is not None and await first.still_leader()
        assert await second.try_acquire() is None
        # the server ends the lock's session (a network cut, a restart, an operator)
        postgres.sql(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted",
            database=url.rsplit("/", 1)[1],
        )
        assert not await first.still_leader()
        assert first.fence is None
        newer = await second.try_acquire()
        assert newer is not None and newer > fence
        assert not await a.publish(fence, Publication({}, [], {}), "a")  # fenced off
        assert await b.publish(newer, Publication({}, [], {}), "b")
        await second.release()
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_schema_checks_at_first_use(postgres: Postgres) -> None:
    url = postgres.new_database()
    name = url.rsplit("/", 1)[1]

    async def scenario() -> None:
        store = PostgresStore(url, postgres.password)
        await store.add_key(ApiKey("k", hash_token("t")))  # an empty database: made at first use
        await store.close()
        postgres.sql("UPDATE meta SET value = 1 WHERE name = 'schema_version'", database=name)
        older = PostgresStore(url, postgres.password)
        with pytest.raises(InputError, match="run llmgw store migrate"):
            await older.api_keys()
        assert await older.migrate() == SCHEMA_VERSION  # what `llmgw store migrate` does
        assert [k.name for k in await older.api_keys()] == ["k"]
        await older.close()
        postgres.sql(
            f"UPDATE meta SET value = {SCHEMA_VERSION + 1} WHERE name = 'schema_version'", database=name
        )
        newer = PostgresStore(url, postgres.password)
        with pytest.raises(InputError, match="upgrade llmgw"):
            await newer.keys_version()
        await newer.close()

    asyncio.run(scenario())


def test_connection_errors_say_what_to_check(postgres: Postgres) -> None:
    async def scenario() -> None:
        with pytest.raises(InputError, match="check the user and the password") as wrong:
            await PostgresStore(postgres.url, "not-the-password").api_keys()
        assert "not-the-password" not in str(wrong.value)
        missing = postgres.url.rsplit("/", 1)[0] + "/nosuchdb"
        with pytest.raises(InputError, match="create the database first"):
            await PostgresStore(missing, postgres.password).api_keys()

    asyncio.run(scenario())


def test_wait_change_listens_again_after_its_connection_is_cut(postgres: Postgres) -> None:
    url = postgres.new_database()

    async def scenario() -> None:
        a, b = PostgresStore(url, postgres.password), PostgresStore(url, postgres.password)
        await a.wait_change(0)  # listening from now on
        admin = await asyncpg.connect(postgres.dsn.rsplit("/", 1)[0] + "/" + url.rsplit("/", 1)[1])
        try:
            # what a dropped connection looks like: its backend ends
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE 'LISTEN%'"
                " AND pid <> pg_backend_pid()"
            )
        finally:
            await admin.close()
        await asyncio.wait_for(a.wait_change(120), 60)  # the loss counts as a change
        waiting = asyncio.create_task(a.wait_change(120))
        await asyncio.sleep(0.3)
        await b.add_key(ApiKey("k", hash_token("t")))
        await asyncio.wait_for(waiting, 60)  # woken through the new connection
        await a.close()
        await b.close()

    asyncio.run(scenario())


def test_a_database_of_the_second_schema_gains_the_key_limits(postgres: Postgres) -> None:
    """A store the gateways used before the key limits: refused until `llmgw store migrate`,
    which adds them in place; its keys keep working, without limits."""
    url = postgres.new_database()

    async def scenario() -> None:
        old = await asyncpg.connect(url, password=postgres.password)
        await old.execute(SCHEMA[2])
        await old.execute(
            "INSERT INTO meta VALUES ('schema_version', 2);"
            "INSERT INTO api_keys VALUES ('old', 'd1', '[\"m\"]', NULL, '2026-01-01T00:00:00+00:00', false, true)"
        )
        await old.close()
        store = PostgresStore(url, postgres.password)
        with pytest.raises(InputError, match="schema version 2, this llmgw needs 4: run llmgw store migrate"):
            await store.api_keys()
        assert await store.migrate() == SCHEMA_VERSION == 4
        (key,) = await store.api_keys()
        assert (key.name, key.models, key.admin, key.revoked, key.limits) == (
            "old",
            ("m",),
            True,
            False,
            NO_LIMITS,
        )
        assert await store.set_limits("old", Limits(rpm=5))
        assert [k.limits for k in await store.api_keys()] == [Limits(rpm=5)]
        assert await store.lease("old", "requests", "m:1", 9, 5) == 5
        await store.close()

    asyncio.run(scenario())


def test_a_database_of_the_third_schema_gains_the_cordons(postgres: Postgres) -> None:
    """A store from before the cordons: refused until `llmgw store migrate`, which adds
    their table; its keys are kept."""
    url = postgres.new_database()

    async def scenario() -> None:
        old = await asyncpg.connect(url, password=postgres.password)
        await old.execute(SCHEMA[2])
        await old.execute(SCHEMA[3])
        await old.execute(
            "INSERT INTO meta VALUES ('schema_version', 3);"
            "INSERT INTO api_keys VALUES ('old', 'd1', '[]', NULL, '2026-01-01T00:00:00+00:00', false, false, '{}')"
        )
        await old.close()
        store = PostgresStore(url, postgres.password)
        with pytest.raises(InputError, match="schema version 3, this llmgw needs 4: run llmgw store migrate"):
            await store.cordons()
        assert await store.migrate() == SCHEMA_VERSION == 4
        assert [k.name for k in await store.api_keys()] == ["old"]
        await store.cordon(Cordon("node01", "fans", "ops@desk", 5.0, draining=True))
        assert await store.cordons() == [Cordon("node01", "fans", "ops@desk", 5.0, draining=True)]
        await store.close()

    asyncio.run(scenario())

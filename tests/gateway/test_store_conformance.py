"""The ``Store`` contract, run against every implementation: the same test, the same
expectations, whether the gateways share SQLite on one host or PostgreSQL.

Each test opens two ``Store`` objects on one backend, as two gateway processes would, and
checks what one writes through what the other reads."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw_cli.core.planning.cordon import Cordon
from llmgw_cli.core.serving.keys import ApiKey, hash_token, parse_expiry
from llmgw_cli.core.serving.limits import NO_LIMITS, Budget, Limits, Priority
from llmgw_cli.core.serving.ratelimit import slot_window
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.store.postgres import PostgresStore
from llmgw_cli.gateway.store.sqlite import (
    COUNTERS_KEPT,
    MEMBER_TTL,
    SCHEMA_VERSION,
    ModelState,
    Publication,
    SqliteStore,
    Store,
    Usage,
)
from tests.pg import Postgres

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Backend:
    kind: str
    where: str  # the state directory, or the database URL
    open: Callable[[], Store]
    env: dict[str, str]  # what a process of its own needs to open it


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """SQLite in a fresh state directory, or a fresh database on the session's server."""
    if request.param == "sqlite":
        where = str(tmp_path / "state")
        yield Backend("sqlite", where, lambda: SqliteStore(where), {})
        return
    server: Postgres = request.getfixturevalue("postgres")
    url = server.new_database()
    yield Backend(
        "postgres",
        url,
        lambda: PostgresStore(url, server.password),
        {"LLMGW_STORE_PASSWORD": server.password},
    )


def run(scenario: Callable[[], object]) -> None:
    async def main() -> None:
        result = scenario()
        assert asyncio.iscoroutine(result)
        await result

    asyncio.run(main())


def test_keys_and_their_version(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        start = await b.keys_version()
        await a.add_key(ApiKey("k1", hash_token("t1"), ("m",)))
        assert await b.keys_version() == start + 1
        with pytest.raises(InputError, match="exists already"):
            await a.add_key(ApiKey("k1", hash_token("t2")))
        assert await b.keys_version() == start + 1
        assert [(k.name, k.models, k.revoked) for k in await b.api_keys()] == [("k1", ("m",), False)]
        assert await b.revoke("k1")
        assert not await b.revoke("nobody")
        assert await a.keys_version() == start + 2
        assert [k.revoked for k in await a.api_keys()] == [True]
        await a.close()
        await b.close()

    run(scenario)


def test_a_usage_batch_counts_once_however_often_it_is_sent(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        rows = [
            Usage("2026-06-01", "k", "m", 2, 10, 20, 1, 7.5),
            Usage("2026-06-02", "k", "m", 1, 1, 1, 0, 1.0),
        ]
        await a.add_usage("batch-1", rows)
        await b.add_usage("batch-1", rows)  # its first answer was lost: sent again
        await b.add_usage("batch-2", rows[:1])
        assert await a.usage() == [Usage("2026-06-01", "k", "m", 4, 20, 40, 2, 15.0), rows[1]]
        assert await a.usage(since="2026-06-02") == [rows[1]]
        await a.close()
        await b.close()

    run(scenario)


def test_last_use_keeps_the_newest_time(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        await a.save_last_use({"m@h:1": 100.0, "m@h:2": 50.0})
        await b.save_last_use({"m@h:1": 90.0})  # a slower writer never moves it back
        assert await b.last_use() == {"m@h:1": 100.0, "m@h:2": 50.0}
        await b.forget_last_use(["m@h:2", "m@h:9"])
        assert await a.last_use() == {"m@h:1": 100.0}
        await a.close()
        await b.close()

    run(scenario)


def test_publish_needs_the_current_fence(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        assert await b.published() is None and await b.published_version() == 0
        assert not await a.publish(0, Publication({"m": ["h:1"]}, [], {}), "nobody")  # nobody ever led
        first = a.leadership("a")
        fence = await first.try_acquire()
        assert fence is not None
        models = {"m": ModelState("starting", "fetching weights", 2, "boom", 1234.5)}
        assert await a.publish(fence, Publication({"m": ["h:2", "h:1"]}, ["h:3"], models), "a")
        seen = await b.published()
        assert seen is not None
        assert (seen.version, seen.fence, seen.leader) == (1, fence, "a")
        assert (seen.replicas, seen.draining, seen.models) == ({"m": ["h:1", "h:2"]}, ["h:3"], models)
        await first.release()
        second = b.leadership("b")
        newer = await second.try_acquire()
        assert newer is not None and newer > fence
        assert not await a.publish(fence, Publication({}, [], {}), "a")  # the old leader is fenced off
        assert await b.published_version() == 1
        assert await b.publish(newer, Publication({}, [], {}), "b")
        assert await a.published_version() == 2
        await second.release()
        await a.close()
        await b.close()

    run(scenario)


def test_start_requests_are_taken_once_and_only_by_the_leader(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        lead = a.leadership("a")
        fence = await lead.try_acquire()
        assert fence is not None
        await b.request_start("m1", "b")
        await b.request_start("m1", "c")  # asked twice: started once
        await b.request_start("m2", "b")
        assert await a.take_start_requests(fence - 1) == []  # a stale leader takes nothing
        assert sorted(await a.take_start_requests(fence)) == ["m1", "m2"]
        assert await a.take_start_requests(fence) == []
        await lead.release()
        await a.close()
        await b.close()

    run(scenario)


def test_members_are_counted_until_they_fall_silent(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        now = 1_000_000.0
        assert await a.heartbeat("a", "h1", 1, now) == 1
        assert await b.heartbeat("b", "h2", 2, now + 1) == 2
        assert await a.heartbeat("a", "h1", 1, now + 2) == 2
        assert await b.heartbeat("b", "h2", 2, now + 2 + MEMBER_TTL + 1) == 1  # a fell silent
        await b.leave("b")
        assert await a.heartbeat("a", "h1", 1, now + 2 + MEMBER_TTL + 2) == 1
        await a.close()
        await b.close()

    run(scenario)


def test_one_leader_at_a_time_and_the_next_one_fences_the_last(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        first, second = a.leadership("a"), b.leadership("b")
        fence = await first.try_acquire()
        assert fence is not None and first.fence == fence
        assert await first.try_acquire() == fence  # asked again: still ours, same fence
        assert await second.try_acquire() is None and second.fence is None
        assert await first.still_leader() and not await second.still_leader()
        await first.release()
        assert not await first.still_leader()
        newer = await second.try_acquire()
        assert newer is not None and newer > fence
        assert await second.still_leader()
        assert await first.try_acquire() is None
        await second.release()
        await a.close()
        await b.close()

    run(scenario)


def test_a_dead_leaders_lead_passes_on(backend: Backend) -> None:
    """The leader's process dies (SIGKILL: no release): its lock goes with it, and the
    next member leads with a bigger fencing number."""
    with subprocess.Popen(
        [sys.executable, "-m", "tests.gateway.store_member", backend.kind, backend.where],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **backend.env},
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdout is not None
        fence = int(child.stdout.readline())

        async def scenario() -> None:
            store = backend.open()
            lead = store.leadership("b")
            assert await lead.try_acquire() is None
            child.kill()
            child.wait()
            for _ in range(200):  # PostgreSQL sees the connection close a moment later
                newer = await lead.try_acquire()
                if newer is not None:
                    break
                await asyncio.sleep(0.05)
            assert newer is not None and newer > fence
            await lead.release()
            await store.close()

        try:
            run(scenario)
        finally:
            child.kill()


def test_wait_change_wakes_on_another_stores_writes(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        lead = b.leadership("b")
        fence = await lead.try_acquire()
        assert fence is not None
        await a.wait_change(0)  # what it has seen so far
        for change in (
            lambda: b.publish(fence, Publication({"m": ["h:1"]}, [], {}), "b"),
            lambda: b.add_key(ApiKey("k", hash_token("t"))),
            lambda: b.revoke("k"),
        ):
            waiting = asyncio.create_task(a.wait_change(120))
            await asyncio.sleep(0.3)
            assert not waiting.done()  # nothing changed yet
            await change()
            await asyncio.wait_for(waiting, 60)  # woken, long before its timeout
        await a.wait_change(0.01)  # and nothing more: it returns at its timeout
        await lead.release()
        await a.close()
        await b.close()

    run(scenario)


def test_migrate_is_idempotent(backend: Backend) -> None:
    async def scenario() -> None:
        store = backend.open()
        await store.add_key(ApiKey("k", hash_token("t")))
        assert await store.migrate() == SCHEMA_VERSION
        assert await store.migrate() == SCHEMA_VERSION
        assert [k.name for k in await store.api_keys()] == ["k"]
        await store.close()

    run(scenario)


LIMITS = Limits(
    rpm=60, tpm=100_000, max_parallel=4, budget=Budget(5_000_000, "month"), priority=Priority.high
)


def test_a_keys_limits_are_stored_and_changed_with_the_keys_version(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        await a.add_key(ApiKey("limited", hash_token("t1"), limits=LIMITS))
        await a.add_key(ApiKey("free", hash_token("t2")))
        assert {k.name: k.limits for k in await b.api_keys()} == {"limited": LIMITS, "free": NO_LIMITS}
        start = await b.keys_version()
        fewer = Limits(rpm=10, budget=Budget(1000, "day"))
        assert await b.set_limits("limited", fewer)
        assert await a.keys_version() == start + 1  # every gateway process reloads the keys
        assert not await b.set_limits("nobody", fewer)
        assert await a.keys_version() == start + 1
        assert await b.set_access("free", ("m1", "m2"), parse_expiry("2030-01-31"))
        assert await a.keys_version() == start + 2
        assert not await b.set_access("nobody", (), None)
        keys = {k.name: k for k in await a.api_keys()}
        assert keys["limited"].limits == fewer and keys["limited"].models == ()
        assert keys["free"].models == ("m1", "m2") and keys["free"].expires == parse_expiry("2030-01-31")
        assert keys["free"].limits == NO_LIMITS
        assert await a.set_limits("limited", NO_LIMITS) and await a.set_access("free", (), None)
        keys = {k.name: k for k in await b.api_keys()}
        assert keys["limited"].limits == NO_LIMITS and (keys["free"].models, keys["free"].expires) == (
            (),
            None,
        )
        await a.close()
        await b.close()

    run(scenario)


def test_a_lease_grants_up_to_the_cap_and_add_used_counts_past_it(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        minute = "m:29441760"
        assert await a.lease("k", "requests", minute, 3, 10) == 3
        assert await b.lease("k", "requests", minute, 5, 10) == 5
        assert await a.lease("k", "requests", minute, 5, 10) == 2  # what is left of the cap
        assert await b.lease("k", "requests", minute, 1, 10) == 0
        assert await b.lease("k", "requests", minute, 1, 12) == 1  # a raised cap: room again
        assert await a.lease("k", "requests", minute, 0, 100) == 0
        assert await a.lease("k", "tokens", minute, 7, 5) == 5  # a first lease is capped too
        assert await a.lease("other", "requests", minute, 4, 10) == 4  # counters are per key
        assert await b.used("k", "requests", [minute, "m:29441761"]) == {minute: 11, "m:29441761": 0}
        await b.add_used("k", "requests", minute, 4)  # beyond the cap: counted all the same
        assert await a.used("k", "requests", [minute]) == {minute: 15}
        assert await a.lease("k", "requests", minute, 1, 12) == 0
        await a.add_used("k", "requests", minute, -6)  # an allowance given back
        assert await b.lease("k", "requests", minute, 5, 12) == 3
        await a.add_used("k", "requests", minute, -100)  # never below 0
        assert await b.used("k", "requests", [minute]) == {minute: 0}
        await b.add_used("k", "budget", "d:2026-12-05", 700)
        await b.add_used("k", "budget", "M:2026-12", -5)  # a first give-back counts 0
        assert await a.used("k", "budget", ["d:2026-12-05", "M:2026-12"]) == {
            "d:2026-12-05": 700,
            "M:2026-12": 0,
        }
        assert await a.used("k", "tokens", [minute]) == {minute: 5}
        with pytest.raises(ValueError, match="counter"):
            await a.lease("k", "dollars", minute, 1, 1)
        with pytest.raises(ValueError, match="window"):
            await a.add_used("k", "tokens", "week:49", 1)
        await a.close()
        await b.close()

    run(scenario)


def test_concurrent_leases_never_grant_more_than_the_cap(backend: Backend) -> None:
    """Many callers on stores of their own (as gateway processes are), leasing at once:
    together they get exactly the cap, never more."""

    async def scenario() -> None:
        stores = [backend.open() for _ in range(4)]
        window, cap = "m:29441760", 150

        async def caller(store: Store) -> list[int]:
            return [await store.lease("k", "tokens", window, 7, cap) for _ in range(15)]

        grants = [
            g for got in await asyncio.gather(*(caller(s) for s in stores for _ in range(2))) for g in got
        ]
        assert sum(grants) == cap  # 8 callers x 15 leases x 7 = 840 asked for
        assert await stores[0].used("k", "tokens", [window]) == {window: cap}
        for store in stores:
            await store.close()

    run(scenario)


def test_counters_of_ended_windows_are_pruned(backend: Backend) -> None:
    async def scenario() -> None:
        a = backend.open()
        now = 1_796_515_200.0 + 3600  # 2026-12-06 01:00 UTC
        old_minute, this_minute = slot_window(now - 10 * 60).id, slot_window(now).id
        for window in (old_minute, this_minute, "d:2026-12-05", "d:2026-12-06", "M:2026-11", "M:2026-12"):
            await a.add_used("k", "budget" if window[0] in "dM" else "requests", window, 5)
        await a.prune_counters(now - COUNTERS_KEPT)
        assert await a.used("k", "requests", [old_minute, this_minute]) == {old_minute: 0, this_minute: 5}
        days = ["d:2026-12-05", "d:2026-12-06", "M:2026-11", "M:2026-12"]
        assert await a.used("k", "budget", days) == {  # the day that ended an hour ago is gone
            "d:2026-12-05": 0,
            "d:2026-12-06": 5,
            "M:2026-11": 0,
            "M:2026-12": 5,
        }
        # a usage write prunes too: windows that ended before now (minus COUNTERS_KEPT) go
        current = slot_window(time.time()).id
        await a.add_used("k", "requests", "m:1", 5)  # 1970
        await a.add_used("k", "requests", current, 5)
        await a.add_usage("batch", [Usage("2026-12-06", "k", "m", 1, 1, 1, 0, 1.0)])
        assert await a.used("k", "requests", ["m:1", current]) == {"m:1": 0, current: 5}
        await a.close()

    run(scenario)


def test_cordons_are_shared_replaced_and_lifted(backend: Backend) -> None:
    async def scenario() -> None:
        a, b = backend.open(), backend.open()
        assert await b.cordons() == []
        first = Cordon("node02", "disk swap", "ops@desk", 1_796_515_200.5)
        await a.cordon(first)
        await a.cordon(Cordon("node01", "", "root@lab", 1_796_515_300.0, draining=True))
        assert await b.cordons() == [
            Cordon("node01", "", "root@lab", 1_796_515_300.0, draining=True),
            first,
        ]
        # a second cordon of a node replaces the first (a drain marks it draining, then not)
        await b.cordon(Cordon("node02", "disk swap", "ops@desk", 1_796_515_200.5, draining=True))
        assert [c.draining for c in await a.cordons()] == [True, True]
        assert await a.uncordon("node01") and not await a.uncordon("node01")
        assert await b.cordons() == [
            Cordon("node02", "disk swap", "ops@desk", 1_796_515_200.5, draining=True)
        ]
        for store in (a, b):
            await store.close()

    run(scenario)

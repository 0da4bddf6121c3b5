#!/usr/bin/env python3
"""PostgreSQL drivers for the gateway's store: asyncpg against psycopg 3 (async), on the
three statements the gateway processes run most, against a real local server (tests/pg.py).

    .venv/bin/python bench/store.py              # defaults below
    .venv/bin/python bench/store.py --n 3000 --rounds 5

Per driver, on one connection, one statement in flight at a time (as a gateway process
issues them), median of ``--rounds`` runs of ``--n`` operations each, the drivers taking
turns ``--passes`` times (the best pass counts: on a shared machine, the others' load only
ever slows a pass down):
- key lookup: ``SELECT value FROM meta WHERE name = 'keys_version'`` (what every process
  asks every second) -- a cheap read, so the round trip and the driver's own cost;
- usage batch: one transaction inserting the batch id and upserting 10 usage rows
  (what a flush writes every 5 s per process);
- publish + read: a fenced UPDATE of the publication with ~2 kB of JSON, then reading it
  back (what the leader and each follower do when the replica set changes).
Prepared statements: asyncpg prepares and caches each statement by itself; psycopg 3 is
given ``prepare=True`` so both skip re-parsing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import pg  # noqa: E402 (after the path)

SCHEMA = """
CREATE TABLE meta (name TEXT PRIMARY KEY, value BIGINT NOT NULL);
INSERT INTO meta VALUES ('keys_version', 1), ('published_version', 0);
CREATE TABLE usage_batches (id TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL);
CREATE TABLE usage (day TEXT, key TEXT, model TEXT, requests BIGINT, prompt_tokens BIGINT,
  completion_tokens BIGINT, errors BIGINT, latency_ms DOUBLE PRECISION, PRIMARY KEY (day, key, model));
CREATE TABLE leader (id INT PRIMARY KEY, epoch BIGINT NOT NULL);
INSERT INTO leader VALUES (1, 7);
CREATE TABLE published (id INT PRIMARY KEY, version BIGINT, fence BIGINT, body TEXT);
INSERT INTO published VALUES (1, 0, 7, '{}');
"""
KEYS = "SELECT value FROM meta WHERE name = 'keys_version'"
BATCH = "INSERT INTO usage_batches VALUES ($1, $2) ON CONFLICT DO NOTHING"
UPSERT = (
    "INSERT INTO usage VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (day, key, model) DO UPDATE SET"
    " requests = usage.requests + excluded.requests, prompt_tokens = usage.prompt_tokens + excluded.prompt_tokens,"
    " completion_tokens = usage.completion_tokens + excluded.completion_tokens,"
    " errors = usage.errors + excluded.errors, latency_ms = usage.latency_ms + excluded.latency_ms"
)
PUBLISH = (
    "UPDATE published SET version = version + 1, fence = $1, body = $2"
    " WHERE id = 1 AND (SELECT epoch FROM leader WHERE id = 1) = $1"
)
READ = "SELECT version, fence, body FROM published WHERE id = 1"
ROWS = [("2026-12-01", f"key{i}", "model", 3, 100, 200, 0, 12.5) for i in range(10)]
BODY = json.dumps({"replicas": {f"model{i}": [f"10.0.0.{j}:8000" for j in range(4)] for i in range(30)}})


def psycopg_sql(sql: str) -> str:
    """asyncpg's $1 placeholders as psycopg's %s."""
    for n in range(8, 0, -1):
        sql = sql.replace(f"${n}", "%s")
    return sql


async def asyncpg_ops(
    dsn: str,
) -> tuple[dict[str, Callable[[], Awaitable[None]]], Callable[[], Awaitable[None]]]:
    import asyncpg  # noqa: PLC0415

    conn = await asyncpg.connect(dsn)

    async def keys() -> None:
        await conn.fetchval(KEYS)

    async def batch() -> None:
        async with conn.transaction():
            await conn.execute(BATCH, uuid.uuid4().hex, time.time())
            await conn.executemany(UPSERT, ROWS)

    async def publish() -> None:
        await conn.execute(PUBLISH, 7, BODY)
        await conn.fetchrow(READ)

    return {"key lookup": keys, "usage batch": batch, "publish + read": publish}, conn.close


async def psycopg_ops(
    dsn: str,
) -> tuple[dict[str, Callable[[], Awaitable[None]]], Callable[[], Awaitable[None]]]:
    import psycopg  # noqa: PLC0415

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    keys_sql, batch_sql, upsert_sql = psycopg_sql(KEYS), psycopg_sql(BATCH), psycopg_sql(UPSERT)
    publish_sql, read_sql = psycopg_sql(PUBLISH), psycopg_sql(READ)

    async def keys() -> None:
        cur = await conn.execute(keys_sql, prepare=True)
        await cur.fetchone()

    async def batch() -> None:
        async with conn.transaction(), conn.cursor() as cur:
            await cur.execute(batch_sql, (uuid.uuid4().hex, time.time()), prepare=True)
            await cur.executemany(upsert_sql, ROWS)

    async def publish() -> None:
        await conn.execute(publish_sql, (7, BODY, 7), prepare=True)  # $1 twice
        cur = await conn.execute(read_sql, prepare=True)
        await cur.fetchone()

    return {"key lookup": keys, "usage batch": batch, "publish + read": publish}, conn.close


async def measure(name: str, dsn: str, n: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Per operation: (wall, this process's CPU) microseconds, medians of ``rounds``."""
    make = asyncpg_ops if name == "asyncpg" else psycopg_ops
    ops, close = await make(dsn)
    result: dict[str, tuple[float, float]] = {}
    try:
        for label, op in ops.items():
            for _ in range(min(200, n)):  # warm up: connection caches, prepared statements
                await op()
            walls, cpus = [], []
            for _ in range(rounds):
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(n):
                    await op()
                walls.append((time.perf_counter() - start) / n * 1e6)
                cpus.append((time.process_time() - cpu) / n * 1e6)
            result[label] = (statistics.median(walls), statistics.median(cpus))
    finally:
        await close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="operations per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--passes", type=int, default=3, help="alternating passes per driver (best)")
    args = parser.parse_args()
    reason = pg.unavailable()
    if reason:
        sys.exit(reason)
    server = pg.start()
    try:
        dsn = server.dsn
        server.sql(SCHEMA, database=pg.DATABASE)
        server.sql(f"ALTER TABLE meta OWNER TO {pg.ROLE}", database=pg.DATABASE)
        for table in ("usage_batches", "usage", "leader", "published"):
            server.sql(f"ALTER TABLE {table} OWNER TO {pg.ROLE}", database=pg.DATABASE)
        figures: dict[str, list[dict[str, tuple[float, float]]]] = {}
        # alternate the drivers so neither gets a warmer machine: A B A B ... per figure
        for name in ("asyncpg", "psycopg") * args.passes:
            got = asyncio.run(measure(name, dsn, args.n, args.rounds))
            figures.setdefault(name, []).append(got)
        print(
            f"median of {args.rounds} runs x {args.n} ops, best of {args.passes} passes,"
            " microseconds per operation: wall (round trip) and client CPU (the driver's own cost)"
        )
        print(f"{'operation':<16} {'asyncpg':>15} {'psycopg 3':>15} {'psycopg/asyncpg':>18}")
        for label in figures["asyncpg"][0]:
            a = [min(f[label][i] for f in figures["asyncpg"]) for i in (0, 1)]
            p = [min(f[label][i] for f in figures["psycopg"]) for i in (0, 1)]
            print(
                f"{label:<16} {a[0]:>7.1f} {a[1]:>7.1f} {p[0]:>7.1f} {p[1]:>7.1f}"
                f" {p[0] / a[0]:>8.2f}x {p[1] / a[1]:>8.2f}x"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()

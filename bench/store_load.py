#!/usr/bin/env python3
"""The store's write load: what gateway processes write to PostgreSQL, idle and serving.

    .venv/bin/python bench/store_load.py                   # 2 workers, 15 s windows
    .venv/bin/python bench/store_load.py --workers 4 --seconds 30

A real local PostgreSQL (tests/pg.py: Debian's server, fsync off as in the tests), one
`llmgw gateway run --workers N` on it (``gateway.store``, the password from
``$LLMGW_STORE_PASSWORD``) in front of the fake upstream of bench/gateway.py, loaded by
its raw keep-alive client. Per window of ``--seconds``: idle (the processes only
heartbeat and look for changes), then plain chat completions at concurrency 4 and 64.

For each window the server's own counters of the gateway's database
(``pg_stat_database``: transactions committed, rows inserted, updated and deleted) and
the WAL it wrote (``pg_current_wal_lsn``), per second; then what serving adds over idle,
per 1,000 requests/s. Every metered request is counted in a process's memory and written
as one batch per process every flush interval (5 s, ``--flush-every``): the write load
follows the number of processes, keys and models, not the request rate.

The counters are read 2 s after a window (PostgreSQL's backends report their statistics
when idle, at most once a second), so each window's figures include 2 s of the next
one's quiet: idle-like, and the same for every window.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import gateway as one  # noqa: E402 (bench/gateway.py: upstream, client)

from tests import pg  # noqa: E402

COUNTERS = (
    "SELECT xact_commit, tup_inserted, tup_updated, tup_deleted, "
    "pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint FROM pg_stat_database WHERE datname = '{db}'"
)
NAMES = ("commits", "inserted", "updated", "deleted", "wal_bytes")


def counters(server: pg.Postgres) -> dict[str, float]:
    values = server.sql(COUNTERS.format(db=pg.DATABASE)).strip().split("|")
    return dict(zip(NAMES, (float(v) for v in values), strict=True))


def per_second(before: dict[str, float], after: dict[str, float], seconds: float) -> dict[str, float]:
    return {k: (after[k] - before[k]) / seconds for k in NAMES}


def measure(
    server: pg.Postgres, port: int, key: str, concurrency: int, seconds: float
) -> tuple[float, dict[str, float]]:
    """(requests/s, store writes per second) over ``seconds`` of load at ``concurrency``
    (0: idle), the counters read 2 s after the window's end."""
    time.sleep(2)
    before, started = counters(server), time.monotonic()
    rate = 0.0
    if concurrency:
        rate, _ = asyncio.run(one.throughput(port, False, key, concurrency, seconds))
    else:
        time.sleep(seconds + 1)  # throughput's warm-up second, to match
    time.sleep(2)
    return rate, per_second(before, counters(server), time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--flush-every", type=float, default=5.0)
    args = parser.parse_args()
    reason = pg.unavailable()
    if reason:
        raise SystemExit(f"cannot run: {reason}")
    server = pg.start()
    work = Path(tempfile.mkdtemp(prefix="llmgw-bench-store-"))
    up_port = one.free_port()
    procs = [subprocess.Popen([sys.executable, one.__file__, "--upstream", str(up_port)])]
    env = {**os.environ, "LLMGW_STORE_PASSWORD": server.password}
    try:
        one.wait_port(up_port)
        g = one.Gateway(work, "store", "auto", up_port, store=server.url, env=env)
        procs.append(
            subprocess.Popen(
                [*g.command(), "--workers", str(args.workers), "--flush-every", str(args.flush_every)],
                stdout=g.log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        )
        want = "event loop:" if args.workers == 1 else f"all {args.workers} workers ready"
        deadline = time.monotonic() + 120
        while want not in (g.dir / "gateway.log").read_text(errors="replace"):
            if time.monotonic() > deadline or procs[-1].poll() is not None:
                raise SystemExit((g.dir / "gateway.log").read_text()[-3000:])
            time.sleep(0.1)
        time.sleep(3)  # the first heartbeats and health checks
        rows = []
        for concurrency in (0, 4, 64):
            rate, writes = measure(server, g.port, g.key, concurrency, args.seconds)
            rows.append((concurrency, rate, writes))
            print(
                f"concurrency {concurrency}: {rate:,.0f} req/s; "
                + ", ".join(f"{k} {v:,.1f}/s" for k, v in writes.items()),
                flush=True,
            )
    finally:
        for p in reversed(procs):
            p.terminate()
            p.wait(60)
        server.stop()

    idle = rows[0][2]
    print(
        f"\n{args.workers} gateway workers, flush every {args.flush_every:g} s, windows of {args.seconds:g} s"
    )
    print(
        "| load | req/s | commits/s | rows written/s | WAL kB/s | added per 1,000 req/s: commits, rows, WAL kB |"
    )
    print("|---|---|---|---|---|---|")
    for concurrency, rate, w in rows:
        rows_written = w["inserted"] + w["updated"] + w["deleted"]
        added = "-"
        if rate:
            k = 1000 / rate
            added = (
                f"{(w['commits'] - idle['commits']) * k:+.2f}, "
                f"{(rows_written - idle['inserted'] - idle['updated'] - idle['deleted']) * k:+.2f}, "
                f"{(w['wal_bytes'] - idle['wal_bytes']) / 1024 * k:+.2f}"
            )
        label = "idle" if not concurrency else f"c={concurrency}"
        print(
            f"| {label} | {rate:,.0f} | {w['commits']:.1f} | {rows_written:.1f} | "
            f"{w['wal_bytes'] / 1024:.1f} | {added} |"
        )
    print(json.dumps([{"concurrency": c, "rps": r, **w} for c, r, w in rows]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Leader failover: three gateway hosts on one PostgreSQL, the leading one killed outright.

    sudo .venv/bin/python bench/failover.py               # 5 kills, 2 workers per host
    sudo .venv/bin/python bench/failover.py --kills 9 --workers 1

Boots the 4-node lab (`llmgw lab up`, root) and takes it down at the end: nothing else
may use the lab meanwhile. A real PostgreSQL (tests/pg.py) listens on the lab's bridge;
`apply` installs the gateway (``--workers`` per host) on node02, node03 and node04 with
``gateway.store`` on it, and starts the lab's always-on replicas.

Each kill: the official ``openai`` client sends requests to the two hosts that do not
lead, four at a time, each on a new connection; then every process of the leading
host's gateway gets SIGKILL (``systemctl kill --signal=SIGKILL``, the time taken on the
node's clock, which is this machine's: the lab's nodes share its kernel). Measured:

- lead: from the kill until the store records another leader (its advisory lock taken
  and the fencing epoch bumped), read every 20 ms;
- manages: from the kill until the new leader has probed the nodes and manages the
  replicas (its journal's "took over" line, on the same clock);
- requests to the surviving hosts during the 8 s after the kill: answered and failed
  (the target is none failed: a surviving host never depended on the dead one).

The killed gateway is started again by systemd (``Restart=on-failure``) and follows;
the next kill waits until every host answers. Medians over the kills.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import asyncpg
import openai

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from soak import boot  # noqa: E402 (bench/soak.py: the lab, booted afresh)

from tests import pg  # noqa: E402
from tests.integration.conftest import STATE, Lab, llmgw  # noqa: E402
from tests.integration.gateway_hosts import BRIDGE, LAB_NETWORK, cluster_file, store_url  # noqa: E402

HOSTS = {"node02": "10.213.0.12", "node03": "10.213.0.13", "node04": "10.213.0.14"}
PASSWORD_DIR = Path("/run/llmgw-bench-failover")  # the nodes' /run is their own
MODEL = "llama-3.1-8b-instruct"  # the lab's always-on simulated vLLM
AFTER = 8.0  # seconds of requests to the survivors after each kill


def ask(address: str, key: str) -> bool:
    try:
        with openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0, timeout=30) as c:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    except openai.OpenAIError:
        return False
    return True


class Load:
    """Requests to ``addresses`` in turn, ``concurrency`` threads, until stopped."""

    def __init__(self, addresses: list[str], key: str, concurrency: int = 4) -> None:
        self.ok = self.failed = 0
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._run, args=(addresses, key, i), daemon=True)
            for i in range(concurrency)
        ]
        for t in self.threads:
            t.start()

    def _run(self, addresses: list[str], key: str, i: int) -> None:
        n = i
        while not self.stopping.is_set():
            answered = ask(addresses[n % len(addresses)], key)
            n += 1
            with self.lock:
                if answered:
                    self.ok += 1
                else:
                    self.failed += 1

    def stop(self) -> tuple[int, int]:
        self.stopping.set()
        for t in self.threads:
            t.join(60)
        return self.ok, self.failed


async def leader(db: asyncpg.Connection) -> tuple[int, str]:
    row = await db.fetchrow("SELECT epoch, member FROM leader WHERE id = 1")
    assert row is not None
    return int(row["epoch"]), str(row["member"])


async def one_kill(lab: Lab, db: asyncpg.Connection, key: str) -> dict[str, float]:
    epoch, member = await leader(db)
    dead = member.split(":")[0]
    survivors = [f"{ip}:8080" for host, ip in HOSTS.items() if host != dead]
    load = Load(survivors, key)
    await asyncio.sleep(1.0)
    done = lab.ssh(dead, "date +%s.%N; systemctl kill --signal=SIGKILL llmgw-gateway.service")
    assert done.returncode == 0, done.stderr
    killed = float(done.stdout.split()[0])
    while True:
        new_epoch, new_member = await leader(db)
        if new_epoch > epoch:
            lead = time.time() - killed
            break
        assert time.time() - killed < 60, "no new leader within 60 s"
        await asyncio.sleep(0.02)
    await asyncio.sleep(max(0.0, killed + AFTER - time.time()))
    ok, failed = load.stop()
    host = new_member.split(":")[0]
    line = ""
    for _ in range(100):
        journal = lab.ssh(
            host,
            f"journalctl -u llmgw-gateway --since @{killed:.3f} -o short-unix --no-pager | grep 'took over'",
        ).stdout
        line = journal.strip().splitlines()[0] if journal.strip() else ""
        if line:
            break
        await asyncio.sleep(0.2)
    manages = float(line.split()[0]) - killed if line else float("nan")
    print(
        f"killed {member}; {new_member} leads after {lead:.2f} s, manages after {manages:.2f} s; "
        f"survivors answered {ok}, failed {failed}",
        flush=True,
    )
    # the killed host's gateway is back (systemd) before the next kill
    address = f"{HOSTS[dead]}:8080"
    deadline = time.monotonic() + 90
    while not ask(address, key):
        assert time.monotonic() < deadline, f"the gateway on {dead} never served again"
        await asyncio.sleep(0.5)
    return {"lead": lead, "manages": manages, "ok": ok, "failed": failed}


async def kills(lab: Lab, server: pg.Postgres, key: str, count: int) -> list[dict[str, float]]:
    db = await asyncpg.connect(server.dsn)
    try:
        return [await one_kill(lab, db, key) for _ in range(count)]
    finally:
        await db.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    lab = boot()
    server = pg.start(listen=[BRIDGE], allow=[LAB_NETWORK])
    try:
        with tempfile.TemporaryDirectory(prefix="llmgw-failover-") as folder:
            PASSWORD_DIR.mkdir(mode=0o700, exist_ok=True)
            (PASSWORD_DIR / "store-password").write_text(server.password + "\n")
            cluster = cluster_file(
                lab,
                Path(folder),
                hosts=list(HOSTS),
                workers=args.workers,
                load_wait="30s",
                store=store_url(server),
                store_password_file=str(PASSWORD_DIR / "store-password"),
            )
            llmgw("apply", "-f", str(cluster), "--yes", timeout=600)
            key = llmgw("keys", "create", "--name", "bench", "-f", str(cluster)).stdout.strip()
            for ip in HOSTS.values():
                deadline = time.monotonic() + 60
                while not ask(f"{ip}:8080", key):
                    assert time.monotonic() < deadline, f"no answer from {ip}"
                    time.sleep(0.5)
            results = asyncio.run(kills(lab, server, key, args.kills))
    finally:
        server.stop()
        llmgw("lab", "down", "--state", str(STATE), check=False)
        for p in PASSWORD_DIR.glob("*"):
            p.unlink()

    lead = [r["lead"] for r in results]
    manages = [r["manages"] for r in results]
    ok = sum(int(r["ok"]) for r in results)
    failed = sum(int(r["failed"]) for r in results)
    print(f"\n{args.kills} kills, {args.workers} workers per host")
    print("| kill | new leader after | manages after | survivors' requests answered / failed |")
    print("|---|---|---|---|")
    for i, r in enumerate(results, 1):
        print(f"| {i} | {r['lead']:.2f} s | {r['manages']:.2f} s | {int(r['ok'])} / {int(r['failed'])} |")
    print(
        f"| median | {statistics.median(lead):.2f} s | {statistics.median(manages):.2f} s | "
        f"total {ok} / {failed} |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

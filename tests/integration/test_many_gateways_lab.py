"""Many gateway processes, one cluster, on the lab (real sshd, systemd and PostgreSQL).

PostgreSQL: `apply` installs the gateway on three lab nodes, two workers each (six
processes, one leader). The official `openai` client spreads requests over the three
hosts; the leading host's gateway is killed outright (SIGKILL to every process of its
unit) and another process leads within ``FAILOVER_BOUND``; no replica is started again or
twice (the units on the nodes and their engines' pids are counted before and after); an
on-demand model asked for through followers is started once, by the leader, and served;
the usage in the store equals the requests the test counted; a key revoked on one gateway
host is refused by every host within ``REVOKE_BOUND``.

SQLite: one host, four workers of one `llmgw gateway run` on this machine: the same
assertions where they apply (the leading worker killed, the others take over; on-demand
through followers; exact usage; a revoked key refused by every worker).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from llmgw_cli.core.engine.engines import unit_name
from tests import pg
from tests.waiting import wait_until

from .conftest import Lab
from .gateway_hosts import GATEWAY_FILES, LLMGW, clean_hosts, cluster_file, store_on_the_bridge, store_url
from .lab_helpers import applied_with_gateway, run

pytestmark = pytest.mark.integration

HOSTS = {"node02": "10.213.0.12", "node03": "10.213.0.13", "node04": "10.213.0.14"}
PASSWORD_DIR = Path("/run/llmgw-many-test")  # the nodes' /run is their own
PASSWORD_FILE = PASSWORD_DIR / "store-password"
ALWAYS = "llama-3.1-8b-instruct"  # always on (min 1), a simulated vLLM: fast answers
ON_DEMAND = "qwen2.5-7b-instruct"  # min 0: started at its first request
FAILOVER_BOUND = 5.0  # seconds from the kill to a new leader (the documented bound)
REVOKE_BOUND = 5.0  # seconds from a revoke to its refusal by every process


@pytest.fixture(scope="module")
def store(lab: Lab) -> Iterator[pg.Postgres]:
    with store_on_the_bridge() as server:
        yield server


@pytest.fixture
def clean(lab: Lab) -> Iterator[None]:
    with clean_hosts(lab, list(HOSTS), PASSWORD_DIR):
        yield


# --- what the nodes run -------------------------------------------------------------------


def replicas(lab: Lab) -> dict[str, dict[str, str]]:
    """Every replica unit that runs, per node: unit name -> its engine's MainPID."""
    script = (
        "for u in $(systemctl list-units 'llmgw-*-[0-9]*.service' --state=active --plain --no-legend"
        " | awk '{print $1}'); do echo \"$u $(systemctl show -p MainPID --value $u)\"; done"
    )
    found = {}
    with ThreadPoolExecutor(len(lab.nodes)) as pool:
        for node, done in zip(lab.nodes, pool.map(lambda n: lab.ssh(n.name, script), lab.nodes), strict=True):
            found[node.name] = dict(line.split() for line in done.stdout.splitlines() if line.strip())
    return found


def units_of(found: dict[str, dict[str, str]], model: str) -> set[str]:
    """The replica units of ``model`` (a multi-node replica's unit counts once)."""
    prefix = unit_name(model, 0).removesuffix("0.service")
    return {u for units in found.values() for u in units if u.startswith(prefix)}


# --- clients ------------------------------------------------------------------------------


def client(address: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0, timeout=60)


def ask(address: str, key: str, model: str = ALWAYS) -> str:
    with client(address, key) as c:
        reply = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=4
        )
    return reply.choices[0].message.content or ""


def spread(addresses: list[str], key: str, count: int) -> int:
    """``count`` requests over ``addresses`` in turn, four at a time, each on a client of
    its own (a new connection: the workers of a host share its listener). Every one must
    be answered; returns how many were."""

    def one(i: int) -> bool:
        return bool(ask(addresses[i % len(addresses)], key))

    with ThreadPoolExecutor(4) as pool:
        answered = list(pool.map(one, range(count)))
    assert all(answered)
    return len(answered)


def refused(address: str, key: str) -> bool:
    try:
        ask(address, key)
    except openai.AuthenticationError:
        return True
    return False


IN_A_ROW = 10  # refusals in a row on new connections that count as every worker's


def revoked_everywhere(addresses: list[str], key: str, started: float) -> float:
    """Seconds from ``started`` until every address refuses ``key`` ``IN_A_ROW`` times in
    a row on new connections: every worker of a host shares its listener, and each looks
    at the store on its own schedule, so one refusal says only that one worker has the
    revocation (the promise is every process within the bound). Then each is asked ten
    times more, and every answer must be a refusal."""
    waiting = set(addresses)
    while waiting:
        assert time.monotonic() - started < 30, f"still accepted after 30 s by {sorted(waiting)}"
        waiting = {a for a in waiting if not all(refused(a, key) for _ in range(IN_A_ROW))}
        if waiting:
            time.sleep(0.1)
    took = time.monotonic() - started
    for address in addresses:
        assert all(refused(address, key) for _ in range(10)), f"{address} accepted a revoked key again"
    return took


def usage_of(cluster: Path, name: str) -> int:
    done = run("usage", "--json", "-f", str(cluster))
    assert done.returncode == 0, done.stderr
    return sum(int(r["requests"]) for r in json.loads(done.stdout) if r["key"] == name)


def usage_settles_at(cluster: Path, name: str, expected: int) -> None:
    """The store's usage of key ``name`` reaches ``expected`` and stays there for one more
    flush interval (5 s): nothing lost, nothing counted twice."""
    wait_until(
        lambda: usage_of(cluster, name),
        until=lambda total: total >= expected,
        timeout=40,
        interval=1,
        what=f"{expected} requests of {name} in the store",
    )
    time.sleep(6)
    assert usage_of(cluster, name) == expected


def take_over(
    lead: Callable[[], tuple[int, str]], kill: Callable[[str], None], *, same: Callable[[str, str], bool]
) -> tuple[int, str]:
    """Kill the leading member (``kill(member)``) and wait for another to lead (a higher
    epoch, a member that is not ``same`` as the dead one); within ``FAILOVER_BOUND``."""
    epoch, member = lead()
    killed = time.monotonic()
    kill(member)
    new = wait_until(
        lead,
        until=lambda now: now[0] > epoch and not same(now[1], member),
        timeout=30,
        interval=0.1,
        what="another gateway process leading",
    )
    took = time.monotonic() - killed
    print(f"\nleader {member} killed; {new[1]} leads after {took:.2f} s")
    assert took < FAILOVER_BOUND
    return new


def started_once(lab: Lab, before: dict[str, dict[str, str]], through: list[str], key: str) -> int:
    """Ask for the on-demand model through every address of ``through`` at once: all are
    answered, one replica runs, and no replica that ran ``before`` was started again.
    Returns the requests made."""
    with ThreadPoolExecutor(len(through)) as pool:
        answers = list(pool.map(lambda a: ask(a, key, ON_DEMAND), through))
    assert all(answers)
    after = replicas(lab)
    assert len(units_of(after, ON_DEMAND)) == 1, after
    for node, units in before.items():
        for unit, pid in units.items():
            assert after[node].get(unit) == pid, f"{unit} on {node} was started again: {before} -> {after}"
    return len(answers)


# --- PostgreSQL: three hosts of two workers -------------------------------------------------


def leader(store: pg.Postgres) -> tuple[int, str]:
    """(epoch, member) of the cluster's lead as the store records it; a member is
    ``host:pid:random``."""
    epoch, member = store.sql("SELECT epoch, member FROM leader", database=pg.DATABASE).strip().split("|")
    return int(epoch), member


def test_three_hosts_of_two_workers_ride_out_a_killed_leader(
    lab: Lab, store: pg.Postgres, clean: None, tmp_path: Path
) -> None:
    PASSWORD_DIR.mkdir(mode=0o700, exist_ok=True)
    PASSWORD_FILE.write_text(store.password + "\n")
    PASSWORD_FILE.chmod(0o600)
    cluster = cluster_file(
        lab,
        tmp_path,
        hosts=list(HOSTS),
        workers=2,
        load_wait="30s",
        store=store_url(store),
        store_password_file=str(PASSWORD_FILE),
    )
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    addresses = {host: f"{ip}:8080" for host, ip in HOSTS.items()}
    for host in HOSTS:
        workers = lab.ssh(host, "pgrep -u llmgw-gateway -f -- '--worker [0-9]' | wc -l").stdout.strip()
        assert workers == "2", f"{host} runs {workers} workers"
    made = run("keys", "create", "--name", "many", "-f", str(cluster))
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    wait_until(
        lambda: all(ask(a, key) for a in addresses.values()),
        timeout=30,
        interval=0.5,
        retry_on=(openai.AuthenticationError, openai.InternalServerError, openai.APIConnectionError),
        what="an answer from every gateway host",
    )
    counted = len(addresses)

    # every metered request counted once, over six processes on three hosts
    counted += spread(list(addresses.values()), key, 60)
    usage_settles_at(cluster, "many", counted)

    before = replicas(lab)
    assert len(units_of(before, ALWAYS)) == 1 and not units_of(before, ON_DEMAND), before
    dead = leader(store)[1].split(":")[0]
    assert dead in HOSTS, dead

    def kill(member: str) -> None:
        done = lab.ssh(dead, "systemctl kill --signal=SIGKILL llmgw-gateway.service")
        assert done.returncode == 0, done.stderr

    lead = take_over(lambda: leader(store), kill, same=lambda a, b: a.split(":")[0] == b.split(":")[0])
    followers = [h for h in HOSTS if h not in (dead, lead[1].split(":")[0])]
    assert followers  # the third host follows

    # the survivors serve on; the killed host's gateway comes back (systemd) and follows
    counted += spread([addresses[h] for h in HOSTS if h != dead], key, 20)
    wait_until(
        lambda: ask(addresses[dead], key),
        timeout=60,
        interval=0.5,
        retry_on=(openai.APIConnectionError, openai.InternalServerError),
        what=f"the gateway on {dead} serving again",
    )
    counted += 1
    assert leader(store) == lead

    # an on-demand model asked for through both followers at once: one start, by the leader
    counted += started_once(lab, before, [addresses[h] for h in (*followers, dead)], key)
    counted += spread(list(addresses.values()), key, 30)
    usage_settles_at(cluster, "many", counted)

    # a key revoked on one gateway host: refused by every host (and worker)
    revoker = followers[0]
    revoking = time.monotonic()
    gone = lab.ssh(revoker, f"{LLMGW} keys revoke many -f {GATEWAY_FILES}/cluster.yaml")
    assert gone.returncode == 0, gone.stdout + gone.stderr
    took = revoked_everywhere(list(addresses.values()), key, revoking)
    print(f"revoked on {revoker}: refused by every host {took:.2f} s after the revoke began")
    assert took < REVOKE_BOUND
    assert usage_of(cluster, "many") == counted  # a refused request is not metered


# --- SQLite: four workers on one host -------------------------------------------------------


def sqlite_leader(state: Path) -> tuple[int, str]:
    with sqlite3.connect(f"file:{state / 'gateway.sqlite3'}?mode=ro", uri=True, timeout=5) as db:
        epoch, member = db.execute("SELECT epoch, member FROM leader").fetchone()
    return int(epoch), str(member)


def test_four_workers_on_one_host_share_sqlite(lab: Lab, tmp_path: Path) -> None:
    with applied_with_gateway(lab, tmp_path, "--workers", "4") as gw:
        state = tmp_path / "state"
        address = f"127.0.0.1:{gw.port}"
        counted = spread([address], gw.key, 40)
        usage_settles_at(gw.cluster, "lab-user", counted)

        before = replicas(lab)
        lead = take_over(
            lambda: sqlite_leader(state),
            lambda member: os.kill(int(member.split(":")[1]), signal.SIGKILL),
            same=lambda a, b: a.split(":")[1] == b.split(":")[1],
        )
        # eight requests at once on new connections: most land on followers
        counted += started_once(lab, before, [address] * 8, gw.key)
        log = (tmp_path / "gateway.log").read_text()
        assert "a start asked for by another gateway process" in log
        assert sqlite_leader(state) == lead
        counted += spread([address], gw.key, 20)
        usage_settles_at(gw.cluster, "lab-user", counted)

        revoking = time.monotonic()
        gone = run("keys", "revoke", "lab-user", "-f", str(gw.cluster))
        assert gone.returncode == 0, gone.stderr
        took = revoked_everywhere([address], gw.key, revoking)
        print(f"revoked: refused by every worker {took:.2f} s after the revoke began")
        assert took < REVOKE_BOUND

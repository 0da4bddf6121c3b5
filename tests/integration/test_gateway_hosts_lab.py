"""Several gateway hosts (real systemd on lab nodes, a real PostgreSQL on this machine):
`apply` installs the gateway on both nodes of `gateway.hosts`, each with its own SSH key
that every node lets in, copies the store's password file to each (the gateway's group
alone reads it, it is never printed); `llmgw keys` and `llmgw usage` from this machine go
to the database; a client served by either host uses the same key, and the usage of both
lands in the one store. Then SQLite on one gateway host that is not this machine:
`llmgw keys` runs there over SSH."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests import pg
from tests.waiting import wait_until

from .conftest import Lab
from .gateway_hosts import GATEWAY_FILES, clean_hosts, cluster_file, store_on_the_bridge, store_url
from .lab_helpers import run, unit_props

pytestmark = pytest.mark.integration

HOSTS = {"node02": "10.213.0.12", "node03": "10.213.0.13"}
# The nodes' /run is their own: the file apply copies is not the one this machine holds.
PASSWORD_DIR = Path("/run/llmgw-hosts-test")
PASSWORD_FILE = PASSWORD_DIR / "store-password"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def store(lab: Lab) -> Iterator[pg.Postgres]:
    with store_on_the_bridge() as server:
        yield server


@pytest.fixture
def clean(lab: Lab) -> Iterator[None]:
    with clean_hosts(lab, list(HOSTS), PASSWORD_DIR):
        yield


def _answer(address: str, key: str, lab: Lab, host: str) -> str:
    client = openai.OpenAI(base_url=f"http://{address}:8080/v1", api_key=key, max_retries=0, timeout=60)
    try:
        reply = wait_until(
            lambda: client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6
            ),
            timeout=60,
            interval=1,
            retry_on=(openai.AuthenticationError, openai.InternalServerError, openai.APIConnectionError),
            what=lambda: (
                f"an answer through the gateway on {host}; its journal:\n"
                + lab.ssh(
                    host, "journalctl -u llmgw-gateway --no-pager -o cat | grep -v '^{' | tail -30"
                ).stdout
            ),
        )
    finally:
        client.close()
    return reply.choices[0].message.content or ""


def test_two_gateway_hosts_share_one_postgresql_store(
    lab: Lab, store: pg.Postgres, clean: None, tmp_path: Path
) -> None:
    PASSWORD_DIR.mkdir(mode=0o700, exist_ok=True)
    PASSWORD_FILE.write_text(store.password + "\n")
    PASSWORD_FILE.chmod(0o600)
    cluster = cluster_file(
        lab,
        tmp_path,
        hosts=list(HOSTS),
        store=store_url(store),
        store_password_file=str(PASSWORD_FILE),
    )
    first = run("apply", "-f", str(cluster), "--yes")
    assert first.returncode == 0, first.stdout + first.stderr
    for host, address in HOSTS.items():
        assert f"gateway on {host}: start or restart" in first.stdout
        assert f"Gateway {host}: ready at http://{address}:8080" in first.stdout
    assert store.password not in first.stdout + first.stderr

    public = {}
    for host in HOSTS:
        props = unit_props(lab, host, "llmgw-gateway.service")
        assert props["ActiveState"] == "active"
        assert lab.ssh(host, f"ps -o user= -p {props['MainPID']}").stdout.strip() == "llmgw-gateway"
        mode = lab.ssh(host, f"stat -c '%a %U %G' {PASSWORD_FILE}").stdout.split()
        assert mode == ["640", "root", "llmgw-gateway"]
        public[host] = lab.ssh(host, f"cat {GATEWAY_FILES}/id_ed25519.pub").stdout.split()[1]
    assert public["node02"] != public["node03"]  # each host its own key
    allowed = lab.ssh("node04", "cat /var/lib/llmgw-gateway/.ssh/authorized_keys").stdout.splitlines()
    assert sorted(line.split()[-1] for line in allowed) == sorted(public.values())
    assert all(
        line.startswith('restrict,command="/usr/local/libexec/llmgw/node-helper" ') for line in allowed
    )

    # keys from this machine, straight into the database both gateways read
    made = run("keys", "create", "--name", "hosts-user", "-f", str(cluster))
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    for host, address in HOSTS.items():
        assert _answer(address, key, lab, host)
    listed = run("keys", "list", "--json", "-f", str(cluster))
    assert listed.returncode == 0, listed.stderr
    assert [k["name"] for k in json.loads(listed.stdout)] == ["hosts-user"]

    def served() -> int | None:
        done = run("usage", "--json", "-f", str(cluster))
        assert done.returncode == 0, done.stderr
        total = sum(r["requests"] for r in json.loads(done.stdout) if r["key"] == "hosts-user")
        return total if total >= 2 else None

    assert wait_until(served, timeout=30, interval=1, what="both gateways' usage in the store") >= 2

    second = run("apply", "-f", str(cluster), "--yes")
    assert second.returncode == 0, second.stdout + second.stderr
    for host in HOSTS:
        assert f"gateway on {host}: unchanged" in second.stdout


def test_keys_reach_a_sqlite_store_on_another_host_over_ssh(lab: Lab, clean: None, tmp_path: Path) -> None:
    cluster = cluster_file(lab, tmp_path, host="node02")
    first = run("apply", "-f", str(cluster), "--yes")
    assert first.returncode == 0, first.stdout + first.stderr

    made = run("keys", "create", "--name", "far-user", "--models", MODEL, "-f", str(cluster))
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    owner = lab.ssh("node02", "stat -c %U /var/lib/llmgw-gw/gateway.sqlite3").stdout.strip()
    assert owner == "llmgw-gateway"  # written there as the gateway's account
    assert not Path("/var/lib/llmgw-gw").exists()  # nothing on this machine
    assert _answer(HOSTS["node02"], key, lab, "node02")

    listed = run("keys", "list", "-f", str(cluster))
    assert listed.returncode == 0 and "far-user" in listed.stdout, listed.stderr
    gone = run("keys", "revoke", "far-user", "-f", str(cluster))
    assert gone.returncode == 0, gone.stderr
    missing = run("keys", "revoke", "nobody", "-f", str(cluster))
    assert missing.returncode == 2 and "on the gateway host node02: no key named 'nobody'" in missing.stderr
    usage = run("usage", "--json", "-f", str(cluster))
    assert usage.returncode == 0, usage.stderr
    assert all(r["key"] == "far-user" for r in json.loads(usage.stdout))

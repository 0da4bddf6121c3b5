"""The gateway holds no key that is root on a node: after `apply` installs it on a lab node
(real sshd, real systemd, real sudo), its own key logs in to the nodes only as
``llmgw-gateway`` and only reaches the node helper, which refuses anything outside its
verbs; neither the gateway's account nor the engines' account can read a key that logs in
as root; and the gateway still starts an on-demand model with that key alone."""

from __future__ import annotations

import asyncio
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import yaml

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.hosts.node_access import HELPER_CONFIG, helper_config
from llmgw_cli.core.observe.parse.probe import parse_probe
from llmgw_cli.core.planning.drain import marker_path, marker_text
from llmgw_cli.core.weights.fetch import Peers, plan_fetch
from llmgw_cli.remote import connect, fetch
from llmgw_cli.remote.transport import write_command
from tests.integration.conftest import Lab
from tests.integration.lab_helpers import origin_on_the_bridge, reset, run
from tests.integration.visible_llmgw import LLMGW
from tests.integration.weights_origin import Origin
from tests.waiting import wait_until

pytestmark = pytest.mark.integration

GATEWAY_FILES = "/etc/llmgw/gateway"
GATEWAY_KEY = f"{GATEWAY_FILES}/id_ed25519"
STATE = "/var/lib/llmgw-gw"
HOST = "node02"  # the gateway host, itself a node
CLEAN = (
    "for u in llmgw-gateway.socket llmgw-gateway-handover llmgw-gateway; do systemctl disable --now $u; done "
    "2>/dev/null; "
    "rm -rf /etc/systemd/system/llmgw-gateway.service /etc/systemd/system/llmgw-gateway.socket "
    "/etc/systemd/system/llmgw-gateway-handover.service "
    f"{GATEWAY_FILES} {STATE}; systemctl daemon-reload; true"
)
HOSTILE_UNIT = """[Unit]
Description=not a replica
[Service]
Type=exec
User={user}
{extra}ExecStart={program} serve
[Install]
WantedBy=multi-user.target
"""


@dataclass
class Installed:
    cluster: Path
    key: Path  # a copy of the gateway's private key, taken off the gateway host by the test
    known_hosts: Path
    address: dict[str, str]

    def as_key(self, user: str, node: str, command: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
        """``ssh -i <the gateway's key> user@node command``: that key and no other."""
        return subprocess.run(
            ["ssh", "-F", "/dev/null", "-i", str(self.key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
             "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
             "-o", "ConnectTimeout=10", f"{user}@{self.address[node]}", command],
            input=stdin, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip


def _cluster(lab: Lab, folder: Path) -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    for model in data["models"]:  # nothing for apply to start: the gateway starts what is asked
        model["scaling"] = {**model.get("scaling", {}), "min": 0}
    data["gateway"] = {
        "host": HOST,
        "listen": "0.0.0.0:8080",
        "admin_listen": "127.0.0.1:9090",
        "state_dir": STATE,
        "llmgw_bin": LLMGW,
        "load_wait": "20s",
    }
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def installed(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    folder = tmp_path_factory.mktemp("least-privilege")
    reset(lab)
    lab.ssh(HOST, CLEAN)
    cluster = _cluster(lab, folder)
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    key = folder / "gateway-key"
    key.write_text(lab.ssh(HOST, f"cat {GATEWAY_KEY}").stdout)
    key.chmod(0o600)
    try:
        yield Installed(cluster, key, lab.known_hosts, {n.name: n.ip for n in lab.nodes})
    finally:
        lab.ssh(HOST, CLEAN)
        reset(lab)


def test_gateway_key_reaches_only_the_helper_as_llmgw_gateway(installed: Installed) -> None:
    # The key works: the helper answers its own verbs...
    date = installed.as_key("llmgw-gateway", "node01", "date")
    assert date.returncode == 0 and date.stdout.strip().isdigit(), date.stderr
    # ...and nothing else: no shell, no other command, whatever the command line says.
    for command in ("id", "sh -c id", "cat /etc/shadow", "date; id", "/bin/bash -i"):
        done = installed.as_key("llmgw-gateway", "node01", command)
        assert done.returncode != 0, (command, done.stdout)
        assert "node-helper: refused" in done.stderr, (command, done.stderr)
        assert "uid=" not in done.stdout
    # sshd itself turns the key away for root (and any account but llmgw-gateway).
    for user in ("root", "llmgw"):
        denied = installed.as_key(user, "node01", "true")
        assert denied.returncode == 255 and "Permission denied" in denied.stderr, (user, denied.stderr)


def test_the_gateways_probe_sees_a_drain_marker_as_apply_writes_it(lab: Lab, installed: Installed) -> None:
    # apply writes a marker as root (mode 0644, its root-only folder made 0755); the
    # gateway's probe runs unprivileged through the helper and must still read it, or it
    # would route a replica being retired
    unit = "llmgw-smollm2-135m-7.service"
    path = marker_path(unit)
    write = write_command(path, 0o644)
    try:
        wrote = lab.ssh(
            "node01", f"printf %s {shlex.quote(marker_text(1700000000.5))} | sh -c {shlex.quote(write)}"
        )
        assert wrote.returncode == 0, wrote.stderr
        probed = installed.as_key("llmgw-gateway", "node01", "probe")
        assert probed.returncode == 0, probed.stderr
        spec = parse_cluster(installed.cluster.read_text())
        facts = parse_probe(spec.node("node01"), probed.stdout)
        assert facts.error is None and facts.draining == {unit: 1700000000.5}
    finally:
        lab.ssh("node01", f"rm -f {shlex.quote(path)}")


def test_helper_refuses_units_that_would_run_something_else(lab: Lab, installed: Installed) -> None:
    attacks = {
        "root-prefix": HOSTILE_UNIT.format(
            user="llmgw", extra="ExecStartPre=+/bin/sh -c 'touch /owned'\n", program="/opt/vllm/bin/vllm"
        ),
        "as-root": HOSTILE_UNIT.format(user="root", extra="", program="/opt/vllm/bin/vllm"),
        "other-program": HOSTILE_UNIT.format(user="llmgw", extra="", program="/bin/sh"),
    }
    for name, text in attacks.items():
        unit = f"llmgw-{name}-0.service"
        done = installed.as_key("llmgw-gateway", "node01", f"write-unit {unit}", stdin=text)
        assert done.returncode != 0 and "node-helper: refused" in done.stderr, (name, done.stderr)
        assert lab.ssh("node01", f"test -e /etc/systemd/system/{unit}").returncode == 1, name
    assert lab.ssh("node01", "test -e /owned").returncode == 1
    stop = installed.as_key("llmgw-gateway", "node01", "stop ssh.service")
    assert stop.returncode != 0 and "node-helper: refused" in stop.stderr
    assert lab.ssh("node01", "systemctl is-active ssh sshd | grep -c '^active'").stdout.strip() == "1"


def test_no_account_on_the_gateway_host_reads_a_root_key(lab: Lab, installed: Installed) -> None:
    # The operator's key was never copied: no file on the gateway host holds it.
    # (the first lines of every ed25519 key file are alike: take one deep in the secret part)
    operator_key = lab.key.read_text().strip().splitlines()[3]
    found = lab.ssh(HOST, f"grep -rlF -e '{operator_key}' /etc /var/lib /root /home 2>/dev/null; true")
    assert found.stdout.strip() == "", found.stdout
    listing = lab.ssh(HOST, f"find {GATEWAY_FILES} {STATE} -type f").stdout.split()
    assert GATEWAY_KEY in listing and f"{GATEWAY_FILES}/ssh-key" not in listing
    # Every private key the gateway's account can read is its own, which root refuses.
    readable = lab.ssh(
        HOST,
        f"runuser -u llmgw-gateway -- grep -lr 'PRIVATE KEY' /etc {STATE} /var/lib/llmgw-gateway "
        f"{lab.key.parent} /root /home 2>/dev/null; true",
    )
    assert readable.stdout.split() == [GATEWAY_KEY], readable.stdout
    # The engines' account (models' code runs as it) cannot read the gateway's key.
    engines = lab.ssh(HOST, f"runuser -u llmgw -- cat {GATEWAY_KEY}")
    assert engines.returncode != 0 and "PRIVATE KEY" not in engines.stdout
    modes = lab.ssh(HOST, f"stat -c '%a %U' {GATEWAY_KEY}").stdout.split()
    assert modes == ["600", "llmgw-gateway"]
    pid = lab.ssh(HOST, "systemctl show -p MainPID --value llmgw-gateway").stdout.strip()
    assert lab.ssh(HOST, f"ps -o user= -p {pid}").stdout.strip() == "llmgw-gateway"


def test_on_demand_start_through_the_restricted_key(lab: Lab, installed: Installed) -> None:
    model = "qwen2.5-7b-instruct"  # min 0 in the lab's cluster file: started at its first request
    assert lab.ssh("node01", "ls /etc/systemd/system | grep -c qwen; true").stdout.strip() in ("", "0")
    key = lab.ssh(
        HOST,
        f"runuser -u llmgw-gateway -- {LLMGW} keys create --name lab-user -f {GATEWAY_FILES}/cluster.yaml",
    )
    assert key.returncode == 0, key.stderr
    client = openai.OpenAI(
        base_url=f"http://{installed.address[HOST]}:8080/v1",
        api_key=key.stdout.strip(),
        max_retries=0,
        timeout=60,
    )
    try:
        reply = wait_until(
            lambda: client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6
            ),
            timeout=150,
            interval=2,
            retry_on=(openai.AuthenticationError, openai.APIStatusError, openai.APIConnectionError),
            what=lambda: (
                "an answer through the gateway; its journal:\n"
                + lab.ssh(
                    HOST, "journalctl -u llmgw-gateway --no-pager -o cat | grep -v '^{' | tail -30"
                ).stdout
            ),
        )
        assert reply.choices[0].message.content
    finally:
        client.close()
    # The gateway wrote the unit through the helper: as the engines' account, nothing refused.
    users = [
        lab.ssh(n.name, "grep -h '^User=' /etc/systemd/system/llmgw-qwen2.5-7b-instruct-*.service").stdout
        for n in lab.nodes
    ]
    assert "".join(users).split() == ["User=llmgw"], users
    journal = lab.ssh(HOST, "journalctl -u llmgw-gateway --no-pager -o cat").stdout
    assert "refused" not in journal, journal[-2000:]


@pytest.fixture
def origin(lab: Lab, installed: Installed, tmp_path: Path) -> Iterator[Origin]:
    """An HTTPS origin on the lab bridge whose certificate the nodes trust."""
    with origin_on_the_bridge(lab, tmp_path / "origin") as o:
        yield o


def test_gateway_fetches_weights_only_into_the_weights_folders(
    lab: Lab, installed: Installed, origin: Origin
) -> None:
    name = "gw-fetch.bin"
    sha = origin.add(name, 2 << 20, seed=7)
    data = yaml.safe_load(installed.cluster.read_text())
    data["models"] = [
        {
            "name": "gw",
            "source": origin.url(name),
            "sha256": sha,
            "profile": "llama-cpp",
            "scaling": {"min": 0, "max": 1},
        }
    ]
    spec = parse_cluster(yaml.safe_dump(data))
    base = installed.cluster.parent
    access = connect.GatewayAccess(installed.key, installed.known_hosts)
    nodes = ["node01", "node02"]  # one from the origin, the other from its peer

    async def gateway_fetch() -> list[fetch.FetchResult]:
        async with connect.Connections(spec, base, access) as conns:
            fetcher = fetch.Fetcher(spec, base, lambda _event: None, conns=conns)
            return await fetcher.run(plan_fetch(spec, {"gw": nodes}, set(), set(), Peers.fabric))

    configs = {n: lab.ssh(n, f"cat {HELPER_CONFIG}").stdout for n in nodes}
    try:
        for node in nodes:  # what apply writes for this cluster file: the origin is one of its
            config = shlex.quote(helper_config(spec, spec.node(node)))
            assert lab.ssh(node, f"printf %s {config} > {HELPER_CONFIG}").returncode == 0
        results = asyncio.run(gateway_fetch())
        assert all(r.ok for r in results) and len(results) == 2, results
        for node in nodes:
            assert lab.ssh(node, f"sha256sum /data/models/{name}").stdout.split()[0] == sha
        # A job aimed anywhere else is refused before anything runs as root.
        job = f'{{"mode": "fetch", "url": "{origin.url(name)}", "target": "/etc/cron.d/llmgw-owned"}}'
        done = installed.as_key("llmgw-gateway", "node01", "fetch", stdin=job)
        assert done.returncode != 0 and "node-helper: refused" in done.stderr, done.stderr
        assert lab.ssh("node01", "ls /etc/cron.d/ | grep -c llmgw; true").stdout.strip() == "0"
    finally:
        for node in nodes:
            lab.ssh(node, f"rm -f /data/models/{name} /data/models/{name}.part /data/models/.{name}.*")
            lab.ssh(node, f"printf %s {shlex.quote(configs[node])} > {HELPER_CONFIG}")

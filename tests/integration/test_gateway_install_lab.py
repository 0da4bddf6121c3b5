"""`apply` installs the gateway on the gateway host as llmgw-gateway.service (real systemd
on a lab node): it runs as its own account, llmgw-gateway, reaches the nodes with its own
SSH key (made on that host; the nodes let it run their helper only), and serves the
replicas apply started. A second apply changes
nothing; a changed cluster file is a reload, not a restart."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import reset, run, unit_props

pytestmark = pytest.mark.integration

LLMGW = f"{sys.prefix}/bin/llmgw"
GATEWAY_FILES = "/etc/llmgw/gateway"
CLEAN = (
    "systemctl disable --now llmgw-gateway 2>/dev/null; rm -rf /etc/systemd/system/llmgw-gateway.service "
    f"{GATEWAY_FILES} /var/lib/llmgw-gw; systemctl daemon-reload; true"
)


def _cluster(lab: Lab, folder: Path, load_wait: str = "20s") -> Path:
    data = yaml.safe_load(lab.cluster_file.read_text())
    data["gateway"] = {
        "host": "node02",
        "listen": "0.0.0.0:8080",
        "admin_listen": "127.0.0.1:9090",
        "state_dir": "/var/lib/llmgw-gw",
        "llmgw_bin": LLMGW,
        "load_wait": load_wait,
    }
    path = folder / "cluster.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def clean(lab: Lab) -> Iterator[None]:
    reset(lab)
    lab.ssh("node02", CLEAN)
    yield
    lab.ssh("node02", CLEAN)
    reset(lab)


def test_apply_installs_and_updates_the_gateway(lab: Lab, clean: None, tmp_path: Path) -> None:
    cluster = _cluster(lab, tmp_path)
    # As an older llmgw left it: /etc/llmgw private to root. The gateway's account must
    # still read its files.
    lab.ssh("node02", "mkdir -p /etc/llmgw && chmod 700 /etc/llmgw")
    first = run("apply", "-f", str(cluster), "--yes")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "gateway on node02: start or restart" in first.stdout
    assert "Gateway: ready at http://10.213.0.12:8080" in first.stdout

    props = unit_props(lab, "node02", "llmgw-gateway.service")
    assert props["ActiveState"] == "active"
    user = lab.ssh("node02", f"ps -o user= -p {props['MainPID']}").stdout.strip()
    assert user == "llmgw-gateway"
    modes = lab.ssh("node02", f"stat -c '%n %a %U' {GATEWAY_FILES}/id_ed25519").stdout
    assert modes.split() == [f"{GATEWAY_FILES}/id_ed25519", "600", "llmgw-gateway"]

    key = lab.ssh(
        "node02",
        f"runuser -u llmgw-gateway -- {LLMGW} keys create --name lab-user -f {GATEWAY_FILES}/cluster.yaml",
    )
    assert key.returncode == 0, key.stderr
    client = openai.OpenAI(
        base_url="http://10.213.0.12:8080/v1", api_key=key.stdout.strip(), max_retries=0, timeout=60
    )
    try:
        # The gateway found the replicas by probing the nodes over SSH, with its credential.
        # Keys are read again every few seconds, replicas found at the first probe.
        reply = wait_until(
            lambda: client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6
            ),
            timeout=30,
            interval=1,
            retry_on=(openai.AuthenticationError, openai.InternalServerError),
            what=lambda: (
                "an answer through the gateway; its journal:\n"
                + lab.ssh(
                    "node02", "journalctl -u llmgw-gateway --no-pager -o cat | grep -v '^{' | tail -30"
                ).stdout
            ),
        )
        assert reply.choices[0].message.content
    finally:
        client.close()

    second = run("apply", "-f", str(cluster), "--yes")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "gateway on node02: unchanged" in second.stdout
    assert unit_props(lab, "node02", "llmgw-gateway.service")["MainPID"] == props["MainPID"]

    changed = _cluster(lab, tmp_path, load_wait="30s")
    third = run("apply", "-f", str(changed), "--yes")
    assert third.returncode == 0, third.stdout + third.stderr
    assert "gateway on node02: reload (cluster.yaml)" in third.stdout
    after = unit_props(lab, "node02", "llmgw-gateway.service")
    assert after["MainPID"] == props["MainPID"] and after["ActiveState"] == "active"
    assert "load_wait: 30s" in lab.ssh("node02", f"cat {GATEWAY_FILES}/cluster.yaml").stdout
    journal = lab.ssh("node02", "journalctl -u llmgw-gateway --no-pager -o cat").stdout
    assert "reloaded the cluster file" in journal

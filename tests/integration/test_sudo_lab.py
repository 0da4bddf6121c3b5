"""`become: sudo` on a lab node: an operator who does not log in as root gets root actions
through `sudo -n`, and a missing sudo right is reported as such, for that node."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from llmgw_cli.core.clusterfile.spec import SshSettings
from llmgw_cli.errors import NodeError
from llmgw_cli.remote.ssh import SshTarget, SshTransport

from .conftest import Lab

pytestmark = pytest.mark.integration
NODE = "node02"
ADD_USER = (
    "id ops >/dev/null 2>&1 || useradd --create-home --shell /bin/sh ops; usermod -p '*' ops; "
    "echo 'ops ALL=(root) NOPASSWD: ALL' > /etc/sudoers.d/llmgw-test; chmod 440 /etc/sudoers.d/llmgw-test"
)


@pytest.fixture
def operator(lab: Lab) -> Iterator[Lab]:
    done = lab.ssh(NODE, ADD_USER)
    assert done.returncode == 0, done.stderr
    yield lab
    lab.ssh(NODE, "rm -f /etc/sudoers.d/llmgw-test; userdel -r ops 2>/dev/null; true")


def transport(lab: Lab) -> SshTransport:
    address = next(n.ip for n in lab.nodes if n.name == NODE)
    settings = SshSettings(user="ops", become="sudo", connect_timeout="10s")
    return SshTransport(SshTarget(NODE, address, settings, lab.known_hosts, lab.key))


async def ids(t: SshTransport) -> tuple[str, str]:
    try:
        plain = await t.run("id -un")
        root = await t.run("id -un", root=True)
        return plain.stdout.strip(), root.stdout.strip()
    finally:
        await t.close()


def test_root_actions_go_through_sudo(operator: Lab) -> None:
    assert asyncio.run(ids(transport(operator))) == ("ops", "root")


def test_missing_sudo_right_is_reported_for_the_node(operator: Lab) -> None:
    operator.ssh(NODE, "rm -f /etc/sudoers.d/llmgw-test")
    with pytest.raises(NodeError) as info:
        asyncio.run(ids(transport(operator)))
    assert info.value.node == NODE
    assert info.value.kind == "sudo"
    assert "sudo -n refused for ops" in info.value.reason

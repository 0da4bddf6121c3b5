"""The gateway's key writes a replica unit that asks systemd, which reads these files as
root before it drops to the engine account, for secrets that are not this replica's: the
node's engine key under a glob, every model's secret environment, the whole of
``/etc/llmgw`` as credentials, or a drop-in beside a replica unit. On a lab node (real
sshd, sudo and systemd) the node helper refuses each, and no unit file appears."""

from __future__ import annotations

import shlex

import pytest

from tests.integration.conftest import Lab
from tests.security.test_least_privilege import Installed, installed  # noqa: F401 (the fixture)

pytestmark = pytest.mark.integration

NODE = "node01"
UNIT_DIR = "/etc/systemd/system"
UNIT = """[Unit]
Description=llmgw vllm replica 9 of smollm2-135m (rank 0)
After=network-online.target
[Service]
Type=exec
User=llmgw
EnvironmentFile=/etc/llmgw/engine.env
{line}
ExecStart=/opt/vllm/bin/vllm serve /data/models/x --port 8199
[Install]
WantedBy=multi-user.target
"""
# unit name -> the line that reaches for someone else's secrets
ATTACKS = {
    "llmgw-attack-glob-9.service": "EnvironmentFile=/etc/llmgw/env/*.env",
    "llmgw-attack-engine-key-9.service": "EnvironmentFile=/etc/llmgw/engine.en?",
    "llmgw-attack-optional-9.service": "EnvironmentFile=-/etc/llmgw/env/qwen2.5-7b-instruct.env",
    "llmgw-smollm2-135m-9.service": "EnvironmentFile=/etc/llmgw/env/qwen2.5-7b-instruct.env",
    "llmgw-attack-env-folder-9.service": "LoadCredential=env:/etc/llmgw/env",
    "llmgw-attack-all-9.service": "LoadCredential=all:/etc/llmgw",
    "llmgw-attack-key-file-9.service": "LoadCredential=key:/etc/llmgw/engine.env",
}
DROP_INS = ("llmgw-smollm2-135m-0.service.d/override.conf", "llmgw-.service.d/override.conf")


def _written(lab: Lab, path: str) -> bool:
    return lab.ssh(NODE, f"test -e {shlex.quote(path)}").returncode == 0


def test_a_unit_reaching_for_other_services_secrets_is_refused(
    lab: Lab,
    installed: Installed,  # noqa: F811 (the fixture imported above)
) -> None:
    try:
        for unit, line in ATTACKS.items():
            done = installed.as_key("llmgw-gateway", NODE, f"write-unit {unit}", stdin=UNIT.format(line=line))
            directive = line.partition("=")[0]
            assert done.returncode == 2 and "node-helper: refused" in done.stderr, (line, done.stderr)
            assert f"{directive}=" in done.stderr, (line, done.stderr)
            assert not _written(lab, f"{UNIT_DIR}/{unit}"), line
        for drop_in in DROP_INS:
            text = "[Service]\nUser=root\n"
            done = installed.as_key("llmgw-gateway", NODE, f"write-unit {shlex.quote(drop_in)}", stdin=text)
            assert done.returncode == 2 and "node-helper: refused" in done.stderr, (drop_in, done.stderr)
            assert not _written(lab, f"{UNIT_DIR}/{drop_in.partition('/')[0]}"), drop_in
    finally:  # what a helper that let an attack through wrote: gone before the next test
        paths = " ".join(f"{UNIT_DIR}/{u}" for u in ATTACKS)
        lab.ssh(NODE, f"rm -f {paths}; systemctl daemon-reload")

"""`ssh.jump_host` on the lab: node01 is the jump host for the others. `apply` starts the
replicas and waits for their readiness from where the nodes can be reached (over the SSH
connection, on the replica's own node), and every login the nodes accepted came through
the jump host, not from this machine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from .conftest import Lab
from .lab_helpers import reset, run, sshd_marks

pytestmark = pytest.mark.integration

JUMP = "node01"


def test_apply_and_status_go_through_the_jump_host(lab: Lab, tmp_path: Path) -> None:
    reset(lab)
    data = yaml.safe_load(lab.cluster_file.read_text())
    jump = next(n for n in lab.nodes if n.name == JUMP)
    data["ssh"]["jump_host"] = f"root@{jump.ip}"
    data["nodes"] = [n for n in data["nodes"] if n["name"] != JUMP]
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump(data, sort_keys=False))
    behind = [n for n in lab.nodes if n.name != JUMP]
    marks = sshd_marks(lab)
    try:
        applied = run("apply", "-f", str(cluster), "--yes")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert "every started replica is ready" in applied.stdout, applied.stdout
        report = json.loads(run("status", "-f", str(cluster), "--json").stdout)
        assert {n["name"]: n["reachable"] for n in report["nodes"]} == {n.name: True for n in behind}, report[
            "nodes"
        ]
        for node in behind:
            # every login since the mark but this check's own (its client port is in $SSH_CLIENT)
            script = (
                f"set -- $SSH_CLIENT; journalctl --sync; journalctl -u ssh --after-cursor '{marks[node.name]}'"
                " --no-pager -o cat | grep 'Accepted publickey for root from ' | grep -v \" port $2 ssh2\"; true"
            )
            accepted = lab.ssh(node.name, script).stdout.splitlines()
            assert accepted, f"no login on {node.name}"
            sources = {line.split(" from ", 1)[1].split()[0] for line in accepted}
            assert sources == {jump.ip}, (node.name, accepted)
    finally:
        reset(lab)

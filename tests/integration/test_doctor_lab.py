"""`llmgw doctor` on the lab with faults injected: each shows up as its finding, with the
exit code that says whether serving would break. The local and loopback runs are in
test_doctor_local.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import Lab
from .lab_helpers import cluster_variant, reset, run

pytestmark = pytest.mark.integration

SQUAT = "systemd-run --unit=doctor-squat --collect -- python3 -m http.server 8150 --bind 0.0.0.0"
LOW_MEMLOCK_UNIT = """\
[Service]
ExecStart=/bin/sleep infinity
LimitMEMLOCK=64K
"""


@pytest.fixture
def clean(lab: Lab) -> Iterator[Lab]:
    reset(lab)
    yield lab
    for node in lab.nodes:
        lab.ssh(node.name, "systemctl stop doctor-squat 2>/dev/null; true")
    reset(lab)


def doctor(cluster: Path, *args: str) -> tuple[int, list[dict[str, Any]]]:
    done = run("doctor", "-f", str(cluster), "--json", *args)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, list(json.loads(done.stdout)["findings"])


def of(findings: list[dict[str, Any]], node: str | None, check: str) -> dict[str, Any]:
    matches = [f for f in findings if f["node"] == node and f["check"] == check]
    assert matches, f"no {check} on {node}: {findings}"
    return matches[0]


def test_healthy_lab_has_no_errors(clean: Lab) -> None:
    code, findings = doctor(clean.cluster_file)
    assert code == 0, findings
    assert [f for f in findings if f["severity"] == "error"] == []


def test_ib_port_init_is_an_error_pointing_at_the_subnet_manager(clean: Lab) -> None:
    clean.fault("node02", "ib-port", "mlx5_1", "init")
    code, findings = doctor(clean.cluster_file, "--nodes", "node02")
    assert code == 1
    finding = of(findings, "node02", "ib.port-not-active")
    assert "mlx5_1 port 1 is INIT" in finding["message"] and "opensm" in finding["fix"]


def test_declared_adapter_absent_and_weights_folder_missing(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(
            (
                "{name: node03, address: 10.213.0.13, fabric: lab-ib, hcas: [mlx5_0",
                "{name: node03, address: 10.213.0.13, fabric: lab-ib, hcas: [mlx5_7, mlx5_0",
            ),
            ("weights: [/data/models]", "weights: [/data/models, /data/missing]"),
        ),
    )
    code, findings = doctor(cluster, "--nodes", "node03")
    assert code == 1
    assert "mlx5_7" in of(findings, "node03", "ib.adapter-absent")["message"]
    assert "/data/missing" in of(findings, "node03", "weights.missing")["message"]


def test_port_of_a_profile_range_taken_by_another_program(clean: Lab) -> None:
    done = clean.ssh("node01", SQUAT)
    assert done.returncode == 0, done.stderr
    clean.ssh("node01", "for i in $(seq 50); do ss -Htln | grep -q ':8150 ' && break; sleep 0.1; done")
    code, findings = doctor(clean.cluster_file, "--nodes", "node01")
    assert code == 1
    assert (
        "port 8150 (profile vllm 8100-8199) is taken by python3"
        in of(findings, "node01", "ports.taken")["message"]
    )


def test_unit_with_a_low_memlock_limit(clean: Lab) -> None:
    done = clean.ssh(
        "node01",
        f"printf '{LOW_MEMLOCK_UNIT}' > /etc/systemd/system/llmgw-doctor-test.service && "
        "systemctl daemon-reload && systemctl start llmgw-doctor-test.service",
    )
    assert done.returncode == 0, done.stderr
    code, findings = doctor(clean.cluster_file, "--nodes", "node01")
    assert code == 1
    assert "LimitMEMLOCK=64 KiB" in of(findings, "node01", "memlock.unit")["message"]


def test_unreachable_node_and_lost_gpu(clean: Lab) -> None:
    clean.fault("node04", "gpu", "5", "lost")
    clean.fault("node03", "node", "unreachable")
    code, findings = doctor(clean.cluster_file, "--nodes", "node03,node04")
    assert code == 1
    assert of(findings, "node03", "node.unreachable")["severity"] == "error"
    assert of(findings, "node04", "gpu.count")["severity"] == "warning"


def test_the_60_second_trap(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(("  load_wait: 20s\n", "  load_wait: 20s\n  timeouts: {first_byte: 60s}\n"),),
    )
    code, findings = doctor(cluster, "--nodes", "node01")
    assert code == 1
    assert of(findings, None, "gateway.first-byte-timeout")["severity"] == "error"

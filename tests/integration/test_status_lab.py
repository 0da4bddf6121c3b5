"""`llmgw status` on the lab, with faults injected: each shows up with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from .conftest import Lab
from .lab_helpers import cluster_variant, node_row, run, status

pytestmark = pytest.mark.integration


def test_healthy_lab(clean: Lab) -> None:
    report = status(clean.cluster_file)
    assert [n["reachable"] for n in report["nodes"]] == [True] * len(clean.nodes)
    assert all(n["topology"] == "NVLink (7 peers)" for n in report["nodes"])
    (h100,) = report["classes"]
    assert (h100["gpu_class"], h100["total"], h100["free"], h100["faulty"]) == ("H100-80GB", 32, 32, 0)
    (fabric,) = report["fabrics"]
    assert (fabric["advertising"], fabric["free_nodes"], fabric["rate_gbps"]) == (4, 4, 400.0)
    assert report["probe_seconds"] < 10


def test_ib_port_init_means_no_subnet_manager(clean: Lab) -> None:
    clean.fault("node02", "ib-port", "mlx5_1", "init")
    row = node_row(status(clean.cluster_file), "node02")
    assert not row["fabric_ok"]
    assert row["fabric_reason"] == "mlx5_1 INIT: link up but no subnet manager has configured it"


def test_declared_adapter_missing(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(
            (
                "{name: node03, address: 10.213.0.13, fabric: lab-ib, hcas: [mlx5_0",
                "{name: node03, address: 10.213.0.13, fabric: lab-ib, hcas: [mlx5_7, mlx5_0",
            ),
        ),
    )
    row = node_row(status(cluster), "node03")
    assert not row["fabric_ok"]
    assert row["fabric_reason"] == "declared adapter mlx5_7 not found"


def test_reset_required_gpu_is_faulty_not_free(clean: Lab) -> None:
    clean.fault("node04", "gpu", "3", "reset-required")
    report = status(clean.cluster_file)
    row = node_row(report, "node04")
    assert row["faulty"] == 1
    assert row["faulty_reasons"][0].startswith("GPU 3: ")
    (h100,) = report["classes"]
    assert (h100["total"], h100["free"], h100["faulty"]) == (32, 31, 1)
    # a faulty card also keeps its node from counting as a free whole node
    assert report["fabrics"][0]["free_nodes"] == 3


def test_unreachable_node_is_shown_with_its_reason(clean: Lab) -> None:
    clean.fault("node03", "node", "unreachable")
    report = status(clean.cluster_file)
    row = node_row(report, "node03")
    assert not row["reachable"]
    assert "10.213.0.13" in row["error"]
    assert [n["name"] for n in report["nodes"]] == [n.name for n in clean.nodes]  # shown, never hidden


def test_rotated_host_key_is_refused_and_named(clean: Lab) -> None:
    clean.fault("node02", "hostkey", "rotate")
    row = node_row(status(clean.cluster_file), "node02")
    assert not row["reachable"]
    assert "host key of 10.213.0.12 does not match" in row["error"]
    table = run("status", "-f", str(clean.cluster_file))
    assert "node02" in table.stdout
    assert "does not match" in table.stdout

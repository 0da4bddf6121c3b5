"""Engine versions on the lab: the probe reads the simulated vLLM's version from its venv's
metadata, and `llmgw plan` refuses a profile flag that version does not accept, naming the
node, the version, the flag and where the cluster file gives it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import Lab
from .lab_helpers import cluster_variant, llmgw_units, run

pytestmark = pytest.mark.integration
VLLM = "/opt/vllm/bin/vllm"
COMMAND = f"    command: [{VLLM}, serve]\n"


def test_the_probe_reports_the_simulated_engines_versions(lab: Lab) -> None:
    done = run("status", "-f", str(lab.cluster_file), "--json")
    assert done.returncode in (0, 1), done.stderr
    nodes = json.loads(done.stdout)["nodes"]
    assert {n["name"]: n["engines"][VLLM] for n in nodes} == {n.name: "0.32.0" for n in lab.nodes}
    assert {n["engines"]["/opt/sglang/bin/python3"] for n in nodes} == {"0.5.23"}


def test_plan_refuses_a_flag_the_nodes_vllm_does_not_accept(lab: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(
        lab, tmp_path, replace=((COMMAND, COMMAND + '    args: [--swap-space, "4"]\n'),)
    )
    line = cluster.read_text().split("\n").index('    args: [--swap-space, "4"]') + 1
    before = llmgw_units(lab)
    done = run("plan", "-f", str(cluster))
    said = " ".join((done.stdout + done.stderr).split())  # rich wraps long lines
    assert done.returncode == 2, said
    assert f"{cluster}:{line}:12: profiles.vllm.args[0]: vllm 0.32.0 on " in said
    assert "does not accept --swap-space" in said
    assert any(f"vllm 0.32.0 on {n.name} does not accept --swap-space" in said for n in lab.nodes), said
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 2, applied.stdout + applied.stderr
    assert llmgw_units(lab) == before  # nothing was changed

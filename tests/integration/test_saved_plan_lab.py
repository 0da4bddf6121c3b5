"""A saved plan on the lab: `plan --out` saves the whole change (replicas and host steps),
`apply PLAN` refuses it once the cluster file changed, carries it out when nothing did,
and finds nothing to do when it is applied again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .conftest import Lab
from .lab_helpers import cluster_variant, llmgw_units, run, unit_props

pytestmark = pytest.mark.integration
SMOL = "llmgw-smollm2-135m-0.service"
LLAMA = "llmgw-llama-3.1-8b-instruct-0.service"
QWEN_SCALING = "scaling: {min: 0, max: 1, idle_timeout: 2m}"


def saved_plan(cluster: Path, folder: Path) -> Path:
    saved = folder / "plan.json"
    made = run("plan", "-f", str(cluster), "--out", str(saved))
    assert made.returncode == 0, made.stdout + made.stderr
    return saved


def test_a_saved_plan_is_refused_once_the_cluster_file_changed(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(clean, tmp_path)
    saved = saved_plan(cluster, tmp_path)
    # a comment changes nothing apply does: the plan still holds
    cluster.write_text(cluster.read_text() + "# reviewed\n")
    looked = run("apply", str(saved), "-f", str(cluster), "--dry-run")
    assert looked.returncode == 0, looked.stdout + looked.stderr
    cluster.write_text(cluster.read_text().replace(QWEN_SCALING, QWEN_SCALING.replace("2m", "3m")))
    refused = run("apply", str(saved), "-f", str(cluster), "--yes")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    said = " ".join(refused.stderr.split())
    assert "the cluster file changed since this plan was made (model qwen2.5-7b-instruct)" in said
    assert llmgw_units(clean) == {n.name: [] for n in clean.nodes}
    assert clean.ssh(clean.nodes[0].name, "test -e /etc/llmgw/engine.env; echo $?").stdout.strip() == "1"


def test_a_saved_plan_is_carried_out_and_applied_again_is_a_no_op(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(clean, tmp_path)
    saved = saved_plan(cluster, tmp_path)
    plan = json.loads(saved.read_text())
    assert plan["format"] == 2 and plan["cluster_digest"] and plan["host_digest"]
    kinds = {(s["kind"], s["target"]) for s in plan["steps"]}
    # the lab was reset: every node lacks its engine key, the started models' paths are checked
    assert {("engine_key", n.name) for n in clean.nodes} <= kinds
    assert {s["detail"][0] for s in plan["steps"] if s["kind"] == "weights"} == {
        "smollm2-135m",
        "llama-3.1-8b-instruct",
    }

    first = run("apply", str(saved), "-f", str(cluster), "--yes")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "engine key: write on" in first.stdout
    units = llmgw_units(clean)
    assert sorted(u for names in units.values() for u in names) == sorted([LLAMA, SMOL])
    for node in clean.nodes:
        assert clean.ssh(node.name, "test -s /etc/llmgw/engine.env; echo $?").stdout.strip() == "0"
    pids = {u: unit_props(clean, n, u)["MainPID"] for n, names in units.items() for u in names}

    again = run("apply", str(saved), "-f", str(cluster), "--yes")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "Nothing to do: every step of" in again.stdout
    after = llmgw_units(clean)
    assert after == units
    assert {u: unit_props(clean, n, u)["MainPID"] for n, names in after.items() for u in names} == pids

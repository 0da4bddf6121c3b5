"""`llmgw apply` on the lab: real sshd, real systemd, the simulated vLLM and the real
llama-server. Each test starts from a lab without llmgw units or faults."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import cluster_variant, llmgw_units, logins, run, sshd_marks, unit_props

pytestmark = pytest.mark.integration
SMOL = "llmgw-smollm2-135m-0.service"
LLAMA = "llmgw-llama-3.1-8b-instruct-0.service"


def apply(cluster: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run("apply", "-f", str(cluster), "--yes", *extra)


def engine_key(lab: Lab, node: str) -> str:
    return lab.ssh(node, "sed -n 's/^LLMGW_ENGINE_KEY=//p' /etc/llmgw/engine.env").stdout.strip()


def where(lab: Lab, unit: str) -> str:
    return next(node for node, units in llmgw_units(lab).items() if unit in units)


def test_apply_starts_min_replicas_and_a_second_apply_changes_nothing(clean: Lab) -> None:
    marks = sshd_marks(clean)
    first = apply(clean.cluster_file)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Plan: 2 to create" in first.stdout
    # probe, node helper, engine keys, units and readiness waits: one connection per node
    assert {n.name: logins(clean, n.name, "root", marks[n.name]) for n in clean.nodes} == {
        n.name: 1 for n in clean.nodes
    }
    node = where(clean, SMOL)
    # the real llama-server answers through its engine key, and only with it
    address = next(n.ip for n in clean.nodes if n.name == node)
    port = unit_props(clean, node, SMOL)
    assert port["ActiveState"] == "active"
    client = openai.OpenAI(base_url=f"http://{address}:8300/v1", api_key=engine_key(clean, node))
    reply = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://{address}:8300/v1", api_key="wrong").models.list()
    key_file = clean.ssh(node, "stat -c '%a %U' /etc/llmgw/engine.env").stdout.strip()
    assert key_file == "600 root"
    user = clean.ssh(node, f"ps -o user= -p {port['MainPID']}").stdout.strip()
    assert user == "llmgw"  # engines never run as root

    before = {u: unit_props(clean, where(clean, u), u) for u in (SMOL, LLAMA)}
    second = apply(clean.cluster_file)
    assert second.returncode == 0, second.stderr
    assert "No changes." in second.stdout
    after = {u: unit_props(clean, where(clean, u), u) for u in (SMOL, LLAMA)}
    for unit in (SMOL, LLAMA):
        assert (after[unit]["MainPID"], after[unit]["NRestarts"]) == (
            before[unit]["MainPID"],
            before[unit]["NRestarts"],
        )


def test_changing_one_model_replaces_only_its_replica(clean: Lab, tmp_path: Path) -> None:
    assert apply(clean.cluster_file).returncode == 0
    smol_before = unit_props(clean, where(clean, SMOL), SMOL)["MainPID"]
    assert unit_props(clean, where(clean, LLAMA), LLAMA)["ActiveState"] == "active"
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(
            (
                "    tensor_parallel: 2\n    scaling: {min: 1, max: 2",
                "    tensor_parallel: 2\n    args: [--max-model-len, '4096']\n    scaling: {min: 1, max: 2",
            ),
        ),
    )
    changed = apply(cluster)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    # the lab has free cards beside it: its successor, replica 1, starts first
    assert "~ llama-3.1-8b-instruct #0 -> #1 on " in changed.stdout
    assert "(spec changed; new replica first, then #0 drained and stopped)" in changed.stdout
    assert "Plan: 0 to create, 1 to replace" in changed.stdout
    assert unit_props(clean, where(clean, SMOL), SMOL)["MainPID"] == smol_before
    assert all(LLAMA not in units for units in llmgw_units(clean).values())
    successor = LLAMA.replace("-0.service", "-1.service")
    assert int(unit_props(clean, where(clean, successor), successor)["MainPID"]) > 0
    assert (
        "--max-model-len 4096"
        in clean.ssh(where(clean, successor), f"cat /etc/systemd/system/{successor}").stdout
    )
    assert "No changes" in apply(cluster).stdout  # it converged


def test_removing_a_model_stops_and_removes_its_units(clean: Lab, tmp_path: Path) -> None:
    assert apply(clean.cluster_file).returncode == 0
    node = where(clean, SMOL)
    text = clean.cluster_file.read_text()
    start = text.index("  - name: smollm2-135m")
    end = text.index("  - name: llama-3.1-8b-instruct")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(text[:start] + text[end:])
    removed = apply(cluster)
    assert removed.returncode == 0, removed.stderr
    assert "- smollm2-135m #0" in removed.stdout
    assert SMOL not in llmgw_units(clean)[node]
    assert clean.ssh(node, f"systemctl is-active {SMOL}").stdout.strip() in ("inactive", "unknown")


def test_multi_node_replica_avoids_a_node_whose_ib_port_is_init(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(
            # the lab's 405B folder is a half-finished download on purpose: serve complete weights
            ("source: /data/models/Llama-3.1-405B-Instruct", "source: /data/models/Llama-3.1-8B-Instruct"),
            (
                "    nodes: 2\n    scaling: {min: 0, max: 1, idle_timeout: 5m}",
                "    nodes: 2\n    scaling: {min: 1, max: 1, idle_timeout: 5m}",
            ),
            ("    scaling: {min: 1, max: 1}\n", "    scaling: {min: 0, max: 1}\n"),
            (
                "    scaling: {min: 1, max: 2, idle_timeout: 10m}",
                "    scaling: {min: 0, max: 2, idle_timeout: 10m}",
            ),
        ),
    )
    for node in ("node01", "node02", "node03"):
        clean.fault(node, "ib-port", "mlx5_2", "init")
    refused = apply(cluster)
    assert refused.returncode == 1
    assert (
        "llama-3.1-405b-instruct needs 2 whole nodes in one fabric; lab-ib has 1 free (node01: mlx5_2 INIT: link up but no subnet manager"
        in refused.stdout
    )
    clean.fault("node03", "ib-port", "mlx5_2", "active")
    placed = apply(cluster)
    assert placed.returncode == 0, placed.stdout + placed.stderr
    assert "+ llama-3.1-405b-instruct #0 on node03, node04" in placed.stdout
    unit = "llmgw-llama-3.1-405b-instruct-0.service"
    units = llmgw_units(clean)
    assert unit in units["node03"] and unit in units["node04"]
    worker = clean.ssh("node04", f"cat /etc/systemd/system/{unit}").stdout
    assert "--node-rank 1" in worker and "--headless" in worker and "--master-addr 10.213.0.13" in worker
    assert "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1" in worker


def test_reset_required_gpu_is_not_used(clean: Lab) -> None:
    for node in clean.nodes:
        clean.fault(node.name, "gpu", "0", "reset-required")
    done = apply(clean.cluster_file)
    assert done.returncode == 0, done.stdout + done.stderr
    for unit in (SMOL, LLAMA):
        env = unit_props(clean, where(clean, unit), unit)["Environment"]
        assert "-0," not in env and not env.rstrip().endswith("-0")  # GPU index 0's UUID ends in -0
        assert "CUDA_VISIBLE_DEVICES=GPU-" in env


def test_saved_plan_is_refused_when_the_nodes_changed(clean: Lab, tmp_path: Path) -> None:
    saved = tmp_path / "plan.json"
    made = run("plan", "-f", str(clean.cluster_file), "--out", str(saved))
    assert made.returncode == 0, made.stderr
    clean.fault("node01", "gpu", "5", "reset-required")
    refused = run("apply", str(saved), "-f", str(clean.cluster_file), "--yes")
    assert refused.returncode == 2
    assert "the nodes changed since this plan was made" in refused.stderr
    assert llmgw_units(clean) == {n.name: [] for n in clean.nodes}


def test_killed_apply_converges_on_the_next_run(clean: Lab) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_cli", "apply", "-f", str(clean.cluster_file), "--yes"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = proc.stderr
    assert stderr is not None
    # Kill it once the nodes are being worked on (or once it has ended on its own).
    wait_until(
        stderr.readline,
        until=lambda line: "units in place" in line or not line,
        timeout=60,
        interval=0,
        what="apply to put the units in place",
    )
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    again = apply(clean.cluster_file)
    assert again.returncode == 0, again.stdout + again.stderr
    third = apply(clean.cluster_file)
    assert "No changes." in third.stdout


def test_multi_node_replica_with_ray(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(
            (
                "profiles:\n",
                "profiles:\n  vllm-ray:\n    engine: vllm\n    command: [/opt/vllm/bin/vllm, serve]\n    multi_node: ray\n    ports: 8400-8499\n",
            ),
            (
                "source: /data/models/Llama-3.1-405B-Instruct\n    profile: vllm",
                "source: /data/models/Llama-3.1-8B-Instruct\n    profile: vllm-ray",
            ),
            (
                "    nodes: 2\n    scaling: {min: 0, max: 1, idle_timeout: 5m}",
                "    nodes: 2\n    scaling: {min: 1, max: 1, idle_timeout: 5m}",
            ),
        ),
    )
    done = apply(cluster)
    assert done.returncode == 0, done.stdout + done.stderr
    unit = "llmgw-llama-3.1-405b-instruct-0.service"
    members = [node for node, units in llmgw_units(clean).items() if unit in units]
    assert len(members) == 2
    head, worker = members
    head_unit = clean.ssh(head, f"cat /etc/systemd/system/{unit}").stdout
    if "ExecStartPre" not in head_unit:  # rank order follows placement, not names
        head, worker = worker, head
    assert unit_props(clean, worker, unit)["ActiveState"] == "active"
    journal = clean.ssh(worker, f"journalctl -u {unit} -o cat --no-pager").stdout
    assert "Ray runtime started (joined" in journal
    assert "No changes." in apply(cluster).stdout


BAD_ENGINE = "/usr/local/bin/llmgw-bad-interpreter"


def test_engine_that_cannot_start_is_reported_with_its_journal(clean: Lab, tmp_path: Path) -> None:
    """An engine whose program cannot be executed fails its start job (``Type=exec``) before
    the readiness wait begins; apply reports it as a replica that did not get ready, with
    the unit's journal, and stops it."""
    for node in clean.nodes:
        clean.ssh(node.name, f"printf '#!/nonexistent/interpreter\\n' > {BAD_ENGINE}; chmod 755 {BAD_ENGINE}")
    try:
        cluster = cluster_variant(
            clean, tmp_path, replace=(("command: [/usr/local/bin/llama-server]", f"command: [{BAD_ENGINE}]"),)
        )
        done = apply(cluster)
        output = done.stdout + done.stderr
        assert done.returncode == 1, output
        words = " ".join(output.split())  # rich wraps long lines at the terminal's width
        assert "1 replica not ready (smollm2-135m#0), stopped" in words, output
        assert f"{SMOL} " in words, output  # the unit's state leads its journal lines
        # systemd's own journal line for the failed exec, which only the journal holds
        assert "No such file or directory" in words, output
        states = [clean.ssh(n.name, f"systemctl is-active {SMOL}").stdout.strip() for n in clean.nodes]
        assert "activating" not in states and "active" not in states, states  # not left restarting
    finally:
        for node in clean.nodes:
            clean.ssh(node.name, f"rm -f {BAD_ENGINE}")


LOCKED_ENGINE = "/usr/local/bin/llmgw-locked-engine"


def test_engine_program_its_account_may_not_run_is_refused_before_the_start(
    clean: Lab, tmp_path: Path
) -> None:
    """A profile's program that only root may run (mode 0700) would fail every start with
    203/EXEC as the engine's account: apply refuses those nodes' starts before writing a
    unit, naming the program, the account and the mode."""
    ran = "/var/tmp/llmgw-locked-engine-ran"
    for node in clean.nodes:
        clean.ssh(
            node.name, f"printf '#!/bin/sh\\ntouch {ran}\\n' > {LOCKED_ENGINE}; chmod 700 {LOCKED_ENGINE}"
        )
    try:
        cluster = cluster_variant(
            clean,
            tmp_path,
            replace=(("command: [/usr/local/bin/llama-server]", f"command: [{LOCKED_ENGINE}]"),),
        )
        done = apply(cluster)
        output = done.stdout + done.stderr
        assert done.returncode == 1, output
        words = " ".join(output.split())  # rich wraps long lines at the terminal's width
        assert (
            f"the engine program {LOCKED_ENGINE} cannot be run by llmgw, the engine's account: "
            f"{LOCKED_ENGINE} (owner root, mode 0700)"
        ) in words, output
        assert all(SMOL not in units for units in llmgw_units(clean).values())  # never written
        for node in clean.nodes:
            assert clean.ssh(node.name, f"test -e {ran} && echo ran || echo never").stdout.strip() == "never"
    finally:
        for node in clean.nodes:
            clean.ssh(node.name, f"rm -f {LOCKED_ENGINE} {ran}")


def test_engine_that_exits_at_once_is_reported_before_systemd_restarts_it(clean: Lab, tmp_path: Path) -> None:
    """The engine starts (its start job succeeds) and exits at once on a flag value it
    refuses (a flag it does not know is refused by the plan already); systemd waits RestartSec before restarting it. apply reports it from that wait
    (no restart yet), with the engine's own journal line, not after start_timeout."""
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(
            (
                "    tensor_parallel: 2\n    scaling: {min: 1, max: 2, idle_timeout: 10m}",
                "    tensor_parallel: 2\n    args: [--distributed-executor-backend, nope]\n    scaling: {min: 1, max: 2, idle_timeout: 10m}",
            ),
        ),
    )
    began = time.monotonic()
    done = apply(cluster)
    took = time.monotonic() - began
    output = done.stdout + done.stderr
    print(f"apply reported the engine that exits at once after {took:.1f}s (start_timeout 120s)")
    assert done.returncode == 1, output
    words = " ".join(output.split())  # rich wraps long lines at the terminal's width
    assert "0 restart(s)" in words, output  # seen before systemd's first restart
    assert "error: argument --distributed-executor-backend: invalid choice: 'nope'" in words, output
    assert took < 60, output  # well under the profile's start_timeout (2m)

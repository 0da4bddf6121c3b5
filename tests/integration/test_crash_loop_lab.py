"""A replica whose engine exits at once, on the lab (real sshd and systemd, the simulated
vLLM given a flag value it refuses): apply, plan, status and doctor say it is not ready,
name it with its journal, and its cards are not counted as held (``core/observe/health.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import cluster_variant, llmgw_units, run, unit_props

pytestmark = pytest.mark.integration
BAD = "mistral-7b-instruct"
UNIT = f"llmgw-{BAD}-0.service"


def status(cluster: Path) -> tuple[int, dict[str, Any]]:
    done = run("status", "-f", str(cluster), "--json")
    return done.returncode, dict(json.loads(done.stdout))


def crash_finding(cluster: Path, node: str) -> dict[str, Any] | None:
    """doctor's ``replica.crash-looping`` finding on ``node``, if it has one (the engine is
    crash-looping except in the half second of each life it takes to exit)."""
    done = run("doctor", "-f", str(cluster), "--nodes", node, "--json")
    assert done.returncode in (0, 1), done.stderr
    found = [f for f in json.loads(done.stdout)["findings"] if f["check"] == "replica.crash-looping"]
    if found:
        assert done.returncode == 1
    return dict(found[0]) if found else None


def used_cards(report: dict[str, Any]) -> int:
    return sum(int(c["used"]) for c in report["classes"])


def test_a_crash_looping_replica_is_named_stopped_and_holds_no_cards(clean: Lab, tmp_path: Path) -> None:
    cluster = cluster_variant(
        clean,
        tmp_path,
        replace=(
            (
                "    scaling: {min: 0, max: 0}",
                "    args: [--distributed-executor-backend, nope]\n    scaling: {min: 1, max: 1}",
            ),
        ),
    )
    first = run("apply", "-f", str(cluster), "--yes")
    said = first.stdout + first.stderr
    assert first.returncode == 1, said
    assert f"1 replica not ready ({BAD}#0), stopped" in said
    assert "invalid choice: 'nope'" in said  # its journal
    node = next(n for n, units in llmgw_units(clean).items() if UNIT in units)
    # stopped: systemd no longer restarts it, its unit file stays for the next apply
    assert unit_props(clean, node, UNIT)["ActiveState"] in ("inactive", "failed")
    code, stopped = status(cluster)
    assert code == 1  # a model below its min
    (row,) = [r for r in stopped["health"] if r["model"] == BAD]
    assert row["state"] == "failed"
    cards_free = used_cards(stopped)

    # started again outside llmgw (or by systemd at boot): systemd restarts it over and over
    clean.ssh(node, f"systemctl start {UNIT}")
    wait_until(
        lambda: unit_props(clean, node, UNIT)["NRestarts"] not in ("", "0"),
        timeout=60,
        what="a restart",
        interval=1.0,
    )
    code, looping = status(cluster)
    assert code == 1
    (row,) = [r for r in looping["health"] if r["model"] == BAD]
    assert row["state"] == "crash-looping", row
    assert row["restarts"] >= 1 and row["exit_status"] == 2
    assert "invalid choice: 'nope'" in row["journal"]
    (model,) = [m for m in looping["models"] if m["name"] == BAD]
    assert (model["running"], model["not_ready"]) == (0, {"crash-looping": 1})
    assert used_cards(looping) == cards_free  # its cards are not held
    # doctor names it with the lines its engine wrote to the journal
    finding = wait_until(
        lambda: crash_finding(cluster, node), timeout=60, interval=2.0, what="doctor's crash-looping finding"
    )
    assert UNIT in finding["message"] and "its journal ends:" in finding["message"], finding
    assert "invalid choice: 'nope'" in finding["message"], finding
    assert "Scheduled restart job" not in finding["message"]  # systemd's lines left out
    wide = {**os.environ, "COLUMNS": "200"}  # one table row a line
    shown = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "status", "-f", str(cluster)],
        capture_output=True,
        text=True,
        env=wide,
    )
    assert "0 / 1 running, 1 crash-looping" in shown.stdout, shown.stdout

    dry = run("apply", "-f", str(cluster), "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"! {BAD}#0 crash-looping (" in dry.stdout, dry.stdout
    assert "invalid choice" in dry.stdout
    assert "No changes" not in dry.stdout

    second = run("apply", "-f", str(cluster), "--yes")
    said = second.stdout + second.stderr
    assert second.returncode == 1, said
    assert "No changes" not in said
    assert f"1 replica not ready ({BAD}#0), stopped" in said
    assert "invalid choice: 'nope'" in said
    assert unit_props(clean, node, UNIT)["ActiveState"] in ("inactive", "failed")
    # the other replicas are as they should be and ready
    code, after = status(cluster)
    states = {(r["model"], r["state"]) for r in after["health"]}
    assert (BAD, "failed") in states
    assert {s for m, s in states if m != BAD} == {"ready"}, after["health"]
    assert used_cards(after) == cards_free


# a path source in the nodes' own weights folder (the GGUF is a read-only bind mount)
CONFIG = "/data/models/Llama-3.1-8B-Instruct/config.json"


def test_weights_the_engine_account_cannot_read_are_refused_before_the_start(clean: Lab) -> None:
    """A file of a path source readable only by root: apply names it with its owner and
    mode and starts no unit of that model (the engine would die with PermissionError)."""
    was = {n.name: clean.ssh(n.name, f"stat -c '%u:%g %a' {CONFIG}").stdout.split() for n in clean.nodes}
    try:
        for n in clean.nodes:
            # the account apply makes (after this check, on a node that never had a replica)
            clean.ssh(
                n.name, "id -u llmgw || useradd --system --no-create-home --shell /usr/sbin/nologin llmgw"
            )
            done = clean.ssh(n.name, f"chown root {CONFIG} && chmod 600 {CONFIG}")
            assert done.returncode == 0, done.stderr
        applied = run("apply", "-f", str(clean.cluster_file), "--yes")
        said = applied.stdout + applied.stderr
        assert applied.returncode == 1, said
        assert f"is not readable by llmgw, the engine's account: {CONFIG} (owner root, mode 0600)" in said
        assert all(
            "llmgw-llama-3.1-8b-instruct-0.service" not in units for units in llmgw_units(clean).values()
        )
    finally:
        for name, (owner, mode) in was.items():
            clean.ssh(name, f"chown {owner} {CONFIG} && chmod {mode} {CONFIG}")

"""`llmgw logs` and `llmgw restart` on the lab: the replicas' journals through the
operator's SSH access, merged and labelled; a replica restarted in place and ready again."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.waiting import wait_until

from .conftest import Lab
from .lab_helpers import ESCAPE, reset, run, run_on_terminal, unit_props

pytestmark = pytest.mark.integration

SIM = "llama-3.1-8b-instruct"  # always on, a simulated vLLM on two cards of one node
REAL = "smollm2-135m"  # always on, the real llama-server


@pytest.fixture(scope="module")
def applied(lab: Lab) -> Iterator[Path]:
    reset(lab)
    done = run("apply", "-f", str(lab.cluster_file), "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    yield lab.cluster_file
    reset(lab)


def where(lab: Lab, model: str) -> tuple[str, str]:
    """(node, unit) of the model's replica 0."""
    unit = f"llmgw-{model}-0.service"
    for node in lab.nodes:
        if unit_props(lab, node.name, unit).get("ActiveState") == "active":
            return node.name, unit
    raise AssertionError(f"{unit} runs nowhere")


def say(lab: Lab, node: str, unit: str, text: str) -> None:
    """A line in the journal about ``unit`` (``UNIT=`` as systemd writes its own lines about
    a unit), as written on ``node``; printf reads ``text``'s escapes."""
    done = lab.ssh(node, f"printf 'MESSAGE={text}\\nUNIT={unit}\\n' | logger --journald")
    assert done.returncode == 0, done.stderr


def test_logs_show_the_replicas_journal_labelled_by_node(lab: Lab, applied: Path) -> None:
    node, unit = where(lab, REAL)
    marker = f"llmgw-logs-test-{time.time_ns()}"
    say(lab, node, unit, f"{marker} \\033[2J done")  # a line with an escape sequence in it
    shown = run("logs", REAL, "-f", str(applied), "--lines", "500")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines, shown.stderr
    assert all(re.match(rf"^\S+ {node} {REAL}#0 \| ", line) for line in lines), lines[:5]
    assert any("llama-server" in line for line in lines)  # the engine's own lines
    assert "\x1b" not in shown.stdout
    assert any(f"{marker} \\x1b[2J done" in line for line in lines), lines[-5:]
    stamps = [line.split()[0] for line in lines]
    assert stamps == sorted(stamps)

    recent = run("logs", f"{REAL}#0", "-f", str(applied), "--since", "1s")
    assert recent.returncode == 0, recent.stderr
    assert len(recent.stdout.splitlines()) < len(lines)

    typo = run("logs", "smolm2-135m", "-f", str(applied))
    assert typo.returncode == 2 and "did you mean smollm2-135m" in typo.stderr
    missing = run("logs", f"{REAL}#5", "-f", str(applied))
    assert missing.returncode == 2 and f"no replica {REAL}#5 runs; running: {REAL}#0" in missing.stderr


def test_logs_follow_prints_new_lines_until_interrupted(lab: Lab, applied: Path) -> None:
    node, unit = where(lab, SIM)
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw_cli", "logs", SIM, "-f", str(applied), "--follow", "--lines", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()
        assert f" {node} {SIM}#0 | " in first, first
        marker = f"followed-{time.time_ns()}"
        say(lab, node, unit, marker)
        seen = wait_until(
            proc.stdout.readline,
            until=lambda line: marker in line,
            timeout=30,
            what="the new line while following",
        )
        assert f" {node} {SIM}#0 | " in seen
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # not left running into the next tests
            proc.communicate()
            raise
    assert proc.returncode == 130, err
    assert "Traceback" not in err


def test_restart_restarts_one_replica_in_place_and_waits_until_it_is_ready(lab: Lab, applied: Path) -> None:
    node, unit = where(lab, SIM)
    other_node, other = where(lab, REAL)
    before = unit_props(lab, node, unit)["MainPID"]
    untouched = unit_props(lab, other_node, other)["MainPID"]
    dry = run("restart", f"{SIM}#0", "-f", str(applied), "--dry-run")
    assert dry.returncode == 0 and f"~ {SIM}#0: restart {unit} on {node}" in dry.stdout
    assert unit_props(lab, node, unit)["MainPID"] == before
    refused = subprocess.run(
        [sys.executable, "-m", "llmgw_cli", "restart", SIM, "-f", str(applied)],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2 and "pass --yes" in refused.stderr

    done = run("restart", f"{SIM}#0", "-f", str(applied), "--yes")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(rf"{SIM}#0: restarted, ready on {node}:\d+ after [\d.]+s", done.stdout), done.stdout
    assert unit_props(lab, node, unit)["MainPID"] != before
    assert unit_props(lab, node, unit)["ActiveState"] == "active"
    assert unit_props(lab, other_node, other)["MainPID"] == untouched  # only the one named


def test_on_a_terminal_doctor_shows_its_progress_and_apply_times_each_replica(
    lab: Lab, applied: Path, tmp_path: Path
) -> None:
    """What an operator at a terminal sees: doctor's bar counting the nodes checked, and
    apply's live table, each replica's state coloured by its phase (green once ready) and
    the time it took beside it. Last in this module: the replaced replica may get a new
    number."""
    code, _, seen = run_on_terminal("doctor", "-f", str(applied), tmp=tmp_path)
    text = ESCAPE.sub("", seen)
    assert code in (0, 1), text
    assert "checking" in text and f"{len(lab.nodes)}/{len(lab.nodes)}" in text, text

    code, _, seen = run_on_terminal(
        "apply", "-f", str(applied), "--yes", "--replace", f"{SIM}#0", tmp=tmp_path
    )
    text = ESCAPE.sub("", seen).replace("\r", "")
    assert code == 0, text
    assert "\x1b[32mready" in seen, text  # green: the phase the executor gave, done
    # Each redraw of the table: "MODEL#N  STATE  ELAPSED", the frames run together once the
    # cursor movements are stripped.
    rows = re.findall(rf"{re.escape(SIM)}#\d+ +(\S.*?) +((?:\d+h)?(?:\d+m)?\d+s)(?= |$)", text, re.M)
    assert rows, text
    assert any(state.startswith("ready") or "routed" in state for state, _ in rows), rows

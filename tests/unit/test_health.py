"""The one notion of a replica's health (core/observe/health.py), from `systemctl show` output as
systemd 252 prints it for the properties the probe asks (order not the asked one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.spec import Node
from llmgw_cli.core.observe.health import (
    ReplicaState,
    describe,
    journal_tail,
    telling_line,
    unit_health,
    worst,
)
from llmgw_cli.core.observe.parse.probe import _parse_units
from llmgw_cli.core.observe.parse.systemctl import parse_show, unit_state
from llmgw_cli.core.observe.unit_state import UnitState

# /proc/uptime of the node when these were read: 1000 s after boot
NOW = 1000.0

# an engine that exits at once, waiting for its 8th start (RestartSec=15)
CRASH_LOOPING = """\
Id=llmgw-smollm2-bad-0.service
NRestarts=7
ExecMainStartTimestampMonotonic=991000000
ExecMainExitTimestampMonotonic=991250000
ExecMainCode=1
ExecMainStatus=1
MainPID=0
LoadState=loaded
ActiveState=activating
SubState=auto-restart
Result=exit-code
"""

# the same engine a moment later: started again for the 8th time, not yet exited
RESTARTED = """\
Id=llmgw-smollm2-bad-0.service
NRestarts=8
ExecMainStartTimestampMonotonic=999900000
ExecMainExitTimestampMonotonic=991250000
ExecMainCode=0
ExecMainStatus=0
MainPID=4242
LoadState=loaded
ActiveState=active
SubState=running
Result=success
"""

# started 30 s ago, never restarted
LOADING = """\
Id=llmgw-qwen-0.service
NRestarts=0
ExecMainStartTimestampMonotonic=970000000
ExecMainExitTimestampMonotonic=0
ExecMainCode=0
ExecMainStatus=0
MainPID=77
LoadState=loaded
ActiveState=active
SubState=running
Result=success
"""

# running for 900 s
SERVING = LOADING.replace("=970000000", "=100000000")

# a long-lived engine (800 s) that crashed once: systemd brings it back
CRASHED_ONCE = """\
Id=llmgw-qwen-0.service
NRestarts=0
ExecMainStartTimestampMonotonic=190000000
ExecMainExitTimestampMonotonic=990000000
ExecMainCode=2
ExecMainStatus=9
MainPID=0
LoadState=loaded
ActiveState=activating
SubState=auto-restart
Result=signal
"""

# systemd gave up (StartLimitBurst)
GAVE_UP = """\
Id=llmgw-smollm2-bad-0.service
NRestarts=4
ExecMainStartTimestampMonotonic=991000000
ExecMainExitTimestampMonotonic=991250000
ExecMainCode=1
ExecMainStatus=1
MainPID=0
LoadState=loaded
ActiveState=failed
SubState=failed
Result=start-limit-hit
"""

# stopped by apply after its engine failed, and stopped on purpose
STOPPED_FAILED = (
    GAVE_UP.replace("ActiveState=failed", "ActiveState=inactive")
    .replace("SubState=failed", "SubState=dead")
    .replace("start-limit-hit", "exit-code")
)
STOPPED = STOPPED_FAILED.replace("Result=exit-code", "Result=success")
NOT_FOUND = (
    "Id=llmgw-gone-0.service\nLoadState=not-found\nActiveState=inactive\nSubState=dead\nResult=success\n"
)


def shown(text: str) -> UnitState:
    return unit_state(parse_show(text)[0], NOW)


@pytest.mark.parametrize(
    ("text", "healthy", "expected"),
    [
        (CRASH_LOOPING, None, ReplicaState.crash_looping),
        (RESTARTED, None, ReplicaState.crash_looping),  # restarted 8 times within its timeout
        (RESTARTED, True, ReplicaState.ready),  # ... but its health check says ready
        (LOADING, None, ReplicaState.starting),
        (LOADING, False, ReplicaState.starting),
        (LOADING, True, ReplicaState.ready),
        (SERVING, None, ReplicaState.ready),  # past its start timeout, nobody asked
        (SERVING, False, ReplicaState.crash_looping),  # past its start timeout, never ready
        (CRASHED_ONCE, None, ReplicaState.starting),
        (GAVE_UP, None, ReplicaState.failed),
        (STOPPED_FAILED, None, ReplicaState.failed),
        (STOPPED, None, ReplicaState.stopped),
        (NOT_FOUND, None, ReplicaState.stopped),
    ],
)
def test_a_units_state(text: str, healthy: bool | None, expected: ReplicaState) -> None:
    assert unit_health(shown(text), 600.0, healthy) is expected


def test_the_start_timeout_decides_whether_a_running_engine_is_still_starting() -> None:
    assert unit_health(shown(LOADING), 20.0) is ReplicaState.ready
    assert unit_health(shown(LOADING), 20.0, healthy=False) is ReplicaState.crash_looping
    # one that died after a life longer than its timeout is brought back by systemd
    assert unit_health(shown(CRASH_LOOPING), 0.1) is ReplicaState.starting


def test_without_timestamps_an_engine_waiting_for_its_restart_is_crash_looping() -> None:
    """A systemd that does not give the timestamps: the life's length is unknown."""
    block = {k: v for k, v in parse_show(CRASH_LOOPING)[0].items() if "Timestamp" not in k}
    state = unit_state(block, NOW)
    assert state.age is None and state.lived is None
    assert unit_health(state, 600.0) is ReplicaState.crash_looping


def test_ages_come_from_the_node_clock_the_probe_prints() -> None:
    facts = _parse_units("@uptime 1000.00\n" + CRASH_LOOPING, Node(name="n1", address="10.0.0.1"), {})
    (unit,) = facts["units"]
    assert unit.age == pytest.approx(9.0) and unit.lived == pytest.approx(0.25)
    assert unit.n_restarts == 7 and unit.exec_main_status == 1
    no_clock = _parse_units(CRASH_LOOPING, Node(name="n1", address="10.0.0.1"), {})
    assert no_clock["units"][0].age is None


def test_a_replica_is_as_bad_as_its_worst_unit() -> None:
    assert worst([ReplicaState.ready, ReplicaState.crash_looping]) is ReplicaState.crash_looping
    assert worst([ReplicaState.ready, ReplicaState.starting]) is ReplicaState.starting
    assert worst([]) is ReplicaState.stopped
    assert ReplicaState.starting.alive and not ReplicaState.crash_looping.alive


def test_describe_says_restarts_and_exit_status() -> None:
    assert (
        describe(ReplicaState.crash_looping, shown(CRASH_LOOPING))
        == "crash-looping (7 restarts, exit status 1)"
    )
    assert describe(ReplicaState.ready, shown(SERVING)) == "ready"
    assert describe(ReplicaState.stopped, None) == "stopped"


# --- captured on the lab ----------------------------------------------------------------

CAPTURED = Path(__file__).parents[1] / "fixtures" / "systemctl_show_crash_loop_lab.txt"


def captured() -> dict[str, str]:
    """Block name -> its text (comment lines dropped)."""
    text = "\n".join(ln for ln in CAPTURED.read_text().splitlines() if not ln.startswith("# "))
    return {b.partition("\n")[0]: b.partition("\n")[2] for b in text.split("## ") if b.strip()}


def lab_unit(name: str) -> UnitState:
    uptime, _, show = captured()[name].partition("\n")
    return unit_state(parse_show(show)[0], float(uptime.split()[0]))


@pytest.mark.parametrize(
    ("name", "expected", "restarts"),
    [
        ("running", ReplicaState.starting, 0),  # 4.6 s old: nobody asked its health check
        ("stopped-after-failing", ReplicaState.failed, 0),
        ("auto-restart-no-restart-yet", ReplicaState.crash_looping, 0),
        ("auto-restart-after-3-restarts", ReplicaState.crash_looping, 3),
    ],
)
def test_the_states_of_units_captured_on_the_lab(name: str, expected: ReplicaState, restarts: int) -> None:
    unit = lab_unit(name)
    assert unit_health(unit, 120.0) is expected
    assert unit.n_restarts == restarts


def test_a_captured_running_unit_is_ready_once_answered_or_past_its_start_timeout() -> None:
    unit = lab_unit("running")
    assert unit.age == pytest.approx(4.59, abs=0.01)
    assert unit_health(unit, 120.0, healthy=True) is ReplicaState.ready
    assert unit_health(unit, 2.0) is ReplicaState.ready


def test_a_captured_crash_looping_unit_lived_a_fraction_of_a_second() -> None:
    unit = lab_unit("auto-restart-after-3-restarts")
    assert unit.lived == pytest.approx(0.126, abs=0.001) and unit.exec_main_status == 2
    assert describe(ReplicaState.crash_looping, unit) == "crash-looping (3 restarts, exit status 2)"


def test_the_telling_line_of_a_journal_is_the_engines_not_systemds() -> None:
    tail = captured()["journal"]
    assert "Failed with result" in tail
    assert telling_line(tail) == "[model_tag]"  # the engine's last line; no error named in these 5
    said = "vllm serve: error: unrecognized arguments: --no-such-flag\n  [model_tag]\n" + tail
    assert telling_line(said) == "vllm serve: error: unrecognized arguments: --no-such-flag"
    assert telling_line("llmgw-a-0.service: Failed with result 'exit-code'.") == (
        "llmgw-a-0.service: Failed with result 'exit-code'."
    )  # nothing of the engine's: systemd's word is better than none
    assert telling_line("Error: \x1b[31mbad") == "Error: \\x1b[31mbad"
    assert telling_line("") == ""


def test_a_journal_tail_is_the_engines_last_lines_not_systemds() -> None:
    tail = (
        captured()["journal"]
        + "\nllmgw-mistral-7b-instruct-0.service: Scheduled restart job, restart counter is at 3."
    )
    assert journal_tail(tail, 2) == ("[--disable-log-stats] [--enable-chunked-prefill]", "[model_tag]")
    assert len(journal_tail(tail, 5)) == 3  # only the engine's three; systemd's left out
    # the error line came first (stderr), the usage after it (stdout, flushed at exit)
    late = "vllm serve: error: unrecognized arguments: --no-such-flag\nusage: vllm serve\n" + tail
    assert journal_tail(late, 3) == (
        "vllm serve: error: unrecognized arguments: --no-such-flag",
        "[--disable-log-stats] [--enable-chunked-prefill]",
        "[model_tag]",
    )
    assert journal_tail(late, 1) == ("vllm serve: error: unrecognized arguments: --no-such-flag",)
    systemd_only = "llmgw-a-0.service: Main process exited, code=exited, status=2/INVALIDARGUMENT\n" * 3
    assert journal_tail(systemd_only, 5) == (
        ("llmgw-a-0.service: Main process exited, code=exited, status=2/INVALIDARGUMENT",) * 3
    )  # nothing of the engine's: systemd's word is better than none
    assert journal_tail("Error: \x1b[31mbad\x07\n" + "x" * 900, 2) == ("Error: \\x1b[31mbad\\x07", "x" * 500)
    assert journal_tail("", 5) == () and journal_tail("a", 0) == ()

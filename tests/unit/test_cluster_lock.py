"""The cluster lock on a temporary file, with holders in other processes: the gateway's
in-process flock, apply's shell (through the local transport), and each against the other.
A second holder waits and names the first; a holder killed with SIGKILL frees it."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from llmgw_cli.core.planning.cluster_lock import (
    HOLDER_MAX,
    UNKNOWN_HOLDER,
    hold_script,
    holder_record,
    lock_path,
    shown_holder,
    waiting_message,
)
from llmgw_cli.errors import LlmgwError
from llmgw_cli.remote.cluster_lock import FileLock, LocalLock
from llmgw_cli.remote.local import LocalTransport

HANG = 60.0  # only a guard against a test that would hang: no assertion on time

# A gateway-side holder in its own process: takes the lock, says so, holds until killed.
GATEWAY_HOLDER = """
import asyncio, sys
from llmgw_cli.remote.cluster_lock import FileLock

async def main() -> None:
    async with FileLock(sys.argv[1], "the gateway (pid test)").hold("starting model gamma"):
        print("held", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""

# An apply-side holder in its own process: the shell apply runs, through the local transport.
APPLY_HOLDER = """
import asyncio, sys
from llmgw_cli.core.planning.cluster_lock import hold_script
from llmgw_cli.remote.local import LocalTransport

async def main() -> None:
    t = LocalTransport("gw", command_timeout=10)
    proc = await t.spawn(hold_script(sys.argv[1], 60, "apply by ops@box (pid test)", created_owner=None))
    print((await proc.readline()).strip(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _holder(program: str, argument: str) -> Iterator[subprocess.Popen[str]]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", program, argument],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.fixture
def state(tmp_path: Path) -> Path:
    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    return folder


@pytest.fixture
def gateway_holder(state: Path) -> Iterator[subprocess.Popen[str]]:
    yield from _holder(GATEWAY_HOLDER, lock_path(str(state)))


@pytest.fixture
def apply_holder(state: Path) -> Iterator[subprocess.Popen[str]]:
    yield from _holder(APPLY_HOLDER, str(state))


async def _wait_for_message(messages: list[str]) -> None:
    while not messages:
        await asyncio.sleep(0.01)


def test_a_second_gateway_holder_waits_names_the_first_and_gets_it_when_it_is_killed(
    state: Path, gateway_holder: subprocess.Popen[str]
) -> None:
    messages: list[str] = []
    lock = FileLock(lock_path(str(state)), "the other gateway", on_wait=messages.append, poll=0.01)
    entered = []

    async def second() -> None:
        async with lock.hold("starting model beta"):
            entered.append(True)
            assert "the other gateway" in Path(lock_path(str(state))).read_text()

    async def scenario() -> None:
        task = asyncio.create_task(second())
        await asyncio.wait_for(_wait_for_message(messages), HANG)
        assert not entered  # it waits while the first holds it
        gateway_holder.send_signal(signal.SIGKILL)
        await asyncio.wait_for(task, HANG)

    asyncio.run(scenario())
    assert len(messages) == 1
    assert messages[0].startswith("waiting for the cluster lock held by the gateway (pid test) since ")
    assert messages[0].endswith(": starting model gamma")
    assert entered == [True]
    assert Path(lock_path(str(state))).read_text() == ""  # released: no holder named any more


def test_apply_waits_for_the_gateway_and_names_it(state: Path, gateway_holder: subprocess.Popen[str]) -> None:
    async def scenario() -> list[str]:
        t = LocalTransport("gw", command_timeout=10)
        proc = await t.spawn(hold_script(str(state), 60, "apply by ops@box", created_owner=None))
        first = await asyncio.wait_for(proc.readline(), HANG)
        gateway_holder.send_signal(signal.SIGKILL)
        second = await asyncio.wait_for(proc.readline(), HANG)
        held_by = Path(lock_path(str(state))).read_text()
        await proc.close()
        return [first.strip(), second.strip(), held_by.strip()]

    first, second, held_by = asyncio.run(scenario())
    assert first.startswith("busy the gateway (pid test) since ") and first.endswith(": starting model gamma")
    assert second == "held"
    assert held_by == "apply by ops@box"
    assert Path(lock_path(str(state))).read_text() == ""  # closing stdin released it


def test_the_gateway_waits_for_apply_and_a_killed_apply_frees_it(
    state: Path, apply_holder: subprocess.Popen[str]
) -> None:
    messages: list[str] = []
    lock = FileLock(lock_path(str(state)), "the gateway", on_wait=messages.append, poll=0.01)

    async def take() -> None:
        async with lock.hold("starting model gamma"):
            pass

    async def scenario() -> None:
        task = asyncio.create_task(take())
        await asyncio.wait_for(_wait_for_message(messages), HANG)
        assert not task.done()
        # SIGKILL: apply cannot close anything itself; its pipe closes with it, and the
        # shell holding the lock sees the end of its stdin
        apply_holder.send_signal(signal.SIGKILL)
        await asyncio.wait_for(task, HANG)

    asyncio.run(scenario())
    assert messages == [waiting_message("apply by ops@box (pid test)")]


def test_apply_gives_up_after_its_wait(state: Path, gateway_holder: subprocess.Popen[str]) -> None:
    async def scenario() -> list[str]:
        t = LocalTransport("gw", command_timeout=10)
        proc = await t.spawn(hold_script(str(state), 0.2, "apply by ops@box", created_owner=None))
        lines = [await asyncio.wait_for(proc.readline(), HANG) for _ in range(3)]
        await proc.close()
        return [line.strip() for line in lines]

    busy, timeout, end = asyncio.run(scenario())
    assert busy.startswith("busy the gateway (pid test)")
    assert timeout == "timeout"
    assert end == ""  # the shell ended: it holds nothing
    assert gateway_holder.poll() is None


def test_apply_makes_a_missing_state_folder_private(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"

    async def scenario() -> str:
        t = LocalTransport("gw", command_timeout=10)
        proc = await t.spawn(hold_script(str(state), 5, "apply by ops@box", created_owner=None))
        line = await asyncio.wait_for(proc.readline(), HANG)
        await proc.close()
        return line.strip()

    assert asyncio.run(scenario()) == "held"
    assert state.is_dir() and (state.stat().st_mode & 0o777) == 0o700
    assert (Path(lock_path(str(state))).stat().st_mode & 0o777) == 0o600


def test_the_gateway_never_opens_the_lock_through_a_link(state: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    Path(lock_path(str(state))).symlink_to(target)

    async def take() -> None:
        async with FileLock(lock_path(str(state)), "gw").hold("x"):
            pass

    with pytest.raises(LlmgwError, match="cluster lock"):
        asyncio.run(take())
    assert target.read_text() == "precious\n"


def test_the_gateway_never_opens_a_fifo_as_its_lock(state: Path) -> None:
    os.mkfifo(lock_path(str(state)))

    async def take() -> None:
        async with FileLock(lock_path(str(state)), "gw").hold("x"):
            pass

    with pytest.raises(LlmgwError, match="not a regular file"):
        asyncio.run(take())


def test_holders_in_one_process_take_turns() -> None:
    order: list[str] = []

    async def one(lock: LocalLock, name: str) -> None:
        async with lock.hold(name):
            order.append(f"{name} in")
            await asyncio.sleep(0)
            order.append(f"{name} out")

    async def scenario() -> None:
        lock = LocalLock()
        await asyncio.gather(one(lock, "a"), one(lock, "b"))

    asyncio.run(scenario())
    assert order == ["a in", "a out", "b in", "b out"]


def test_a_holder_line_is_shown_as_plain_short_text() -> None:
    assert shown_holder("apply by x\x1b[31m red\nsecond line") == "apply by x[31m red"
    assert shown_holder("") == UNKNOWN_HOLDER
    assert shown_holder("\x00\x01") == UNKNOWN_HOLDER
    long = shown_holder("x" * 1000)
    assert len(long) == HOLDER_MAX and long.endswith("...")
    when = datetime(2026, 12, 1, 2, 50, tzinfo=UTC).timestamp()
    record = holder_record("apply by root@ops1 (pid 4242)", "applying cluster.yaml", when)
    assert record == "apply by root@ops1 (pid 4242) since 2026-12-01T02:50:00Z: applying cluster.yaml"
    assert lock_path("/var/lib/llmgw/") == "/var/lib/llmgw/cluster.lock"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: apply opens the lock as the folder's owner")
def test_apply_opens_the_lock_only_as_the_state_folders_owner(tmp_path: Path) -> None:
    """The state folder's account plants a link to a root file: apply (root) follows it
    only with that account's rights, so the file is neither opened nor written."""
    tmp_path.chmod(0o755)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    os.chown(state, 65534, 65534)  # nobody
    target = tmp_path / "root-only"
    target.write_text("precious\n")
    target.chmod(0o600)
    Path(lock_path(str(state))).symlink_to(target)

    async def scenario() -> list[str]:
        t = LocalTransport("gw", command_timeout=10)
        proc = await t.spawn(hold_script(str(state), 5, "apply by ops@box", created_owner=None))
        lines = [await asyncio.wait_for(proc.readline(), HANG)]
        while lines[-1]:
            lines.append(await asyncio.wait_for(proc.readline(), HANG))
        await proc.close()
        return [line.strip() for line in lines if line]

    said = asyncio.run(scenario())
    assert "Permission denied" in said[0], said  # the shell, as nobody
    assert said[-1] == f"error cannot open {lock_path(str(state))}", said
    assert target.read_text() == "precious\n"

"""Transports against real things: an OpenSSH server on loopback, and local subprocesses.
Every failure is attributed to its node with a kind and a reason a person can act on."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.spec import SshSettings
from llmgw_cli.core.planning.cluster_lock import hold_script, lock_path
from llmgw_cli.errors import NodeError
from llmgw_cli.remote.local import LocalTransport
from llmgw_cli.remote.ssh import SshTarget, SshTransport

from .sshd import Sshd, free_port, keygen, running_sshd

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("sshd") is None and not Path("/usr/sbin/sshd").exists(), reason="no sshd"
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="sshd for root logins needs root"),
]


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[Sshd]:
    with running_sshd(tmp_path / "sshd") as server:
        yield server


def transport(server: Sshd, **overrides: object) -> SshTransport:
    settings = SshSettings.model_validate({"port": server.port, "connect_timeout": "5s", **overrides})
    return SshTransport(SshTarget("n1", "127.0.0.1", settings, server.known_hosts, server.client_key))


async def use(t: SshTransport, command: str = "echo hi") -> str:
    try:
        return (await t.run(command)).stdout
    finally:
        await t.close()


def error_of(t: SshTransport, command: str = "echo hi") -> NodeError:
    with pytest.raises(NodeError) as info:
        asyncio.run(use(t, command))
    assert info.value.node == "n1"
    return info.value


def test_one_connection_runs_many_commands_and_writes_atomically(sshd: Sshd, tmp_path: Path) -> None:
    target = tmp_path / "out" / "unit.service"

    async def scenario() -> list[str]:
        t = transport(sshd)
        try:
            outputs = [(await t.run(f"echo {i}")).stdout.strip() for i in range(3)]
            await t.write_file(str(target), "[Unit]\n", mode=0o600)
            failed = await t.run("exit 3")
            outputs.append(str(failed.exit_status))
            return outputs
        finally:
            await t.close()

    assert asyncio.run(scenario()) == ["0", "1", "2", "3"]
    assert target.read_text() == "[Unit]\n"
    assert oct(target.stat().st_mode & 0o777) == "0o600"
    assert [p.name for p in target.parent.iterdir()] == ["unit.service"]  # no temporary file left


def test_an_empty_file_is_written_too(sshd: Sshd, tmp_path: Path) -> None:
    """Empty input ends at once (asyncssh sends no end of input for an empty one itself):
    an empty file, an authorized_keys with no key, is written, not waited on forever."""
    target = tmp_path / "empty"
    target.write_text("old\n")

    async def scenario() -> None:
        t = transport(sshd, command_timeout="10s")
        try:
            await t.write_file(str(target), "")
        finally:
            await t.close()

    asyncio.run(scenario())
    assert target.read_text() == ""


def test_changed_host_key_is_refused_and_explained(sshd: Sshd) -> None:
    sshd.rotate_host_key()
    err = error_of(transport(sshd, accept_unknown_hosts=True))  # never bypassed, even so
    assert err.kind == "hostkey-changed"
    assert "does not match" in err.reason
    assert "ssh-keygen -R" in err.reason


def test_unknown_host_refused_unless_accepted_then_recorded(sshd: Sshd) -> None:
    sshd.known_hosts.write_text("")
    assert error_of(transport(sshd)).kind == "hostkey-unknown"
    assert asyncio.run(use(transport(sshd, accept_unknown_hosts=True))) == "hi\n"
    assert f"[127.0.0.1]:{sshd.port} ssh-ed25519 " in sshd.known_hosts.read_text()
    assert asyncio.run(use(transport(sshd))) == "hi\n"  # now known: strict checking passes


def test_wrong_key_is_an_authentication_error(sshd: Sshd, tmp_path: Path) -> None:
    keygen(tmp_path / "other")
    t = SshTransport(
        SshTarget("n1", "127.0.0.1", SshSettings(port=sshd.port), sshd.known_hosts, tmp_path / "other")
    )
    err = error_of(t)
    assert err.kind == "auth"
    assert "authentication refused for root@127.0.0.1" in err.reason


def test_closed_port_is_unreachable(sshd: Sshd) -> None:
    settings = SshSettings(port=free_port())
    err = error_of(SshTransport(SshTarget("n1", "127.0.0.1", settings, sshd.known_hosts, sshd.client_key)))
    assert err.kind == "unreachable"


def test_command_timeout(sshd: Sshd) -> None:
    err = error_of(transport(sshd, command_timeout="500ms"), "sleep 5")
    assert err.kind == "timeout"
    assert "timed out after 0.5s" in err.reason


def test_jump_host(sshd: Sshd) -> None:
    # the node is reached through the jump host (here the same sshd, forwarding to itself)
    t = transport(sshd, jump_host=f"root@127.0.0.1:{sshd.port}")
    assert asyncio.run(use(t, "echo via-jump")) == "via-jump\n"


def test_local_transport(tmp_path: Path) -> None:
    async def scenario() -> tuple[str, int]:
        t = LocalTransport("ws", command_timeout=5)
        await t.write_file(str(tmp_path / "f"), "data")
        out = await t.run("cat " + str(tmp_path / "f"))
        code = (await t.run("exit 4")).exit_status
        return out.stdout, code

    assert asyncio.run(scenario()) == ("data", 4)
    with pytest.raises(NodeError) as info:
        asyncio.run(LocalTransport("ws", command_timeout=0.2).run("sleep 3"))
    assert info.value.kind == "timeout"


def session_pid(out: str) -> int:
    """The sshd process that serves the connection ($PPID of the command's shell)."""
    return int(out.strip())


def test_a_dropped_connection_is_opened_again(sshd: Sshd) -> None:
    """sshd's process for the connection is killed (a node rebooted, sshd restarted): the
    next command opens a new connection; the one that was running ends with status 255,
    as with OpenSSH's client."""

    async def scenario() -> tuple[str, int]:
        t = transport(sshd)
        try:
            pid = session_pid((await t.run("echo $PPID")).stdout)
            lost = await t.run(f"kill -9 {pid}; sleep 5; echo not reached")
            assert (lost.exit_status, lost.stdout) == (255, "")
            out = (await t.run("echo again")).stdout
            return out, t.connects
        finally:
            await t.close()

    assert asyncio.run(scenario()) == ("again\n", 2)


def test_a_connection_that_stopped_answering_is_replaced(sshd: Sshd) -> None:
    """The connection's sshd process is frozen (the link went dead, nothing tells the
    client): a command cannot open its session within connect_timeout, so it runs on a
    new connection instead of waiting for TCP to give up."""

    async def scenario() -> tuple[str, int]:
        t = transport(sshd, connect_timeout="1s")
        pid = session_pid((await t.run("echo $PPID")).stdout)
        os.kill(pid, signal.SIGSTOP)
        try:
            out = (await t.run("echo fresh")).stdout
            return out, t.connects
        finally:
            os.kill(pid, signal.SIGKILL)
            await t.close()

    assert asyncio.run(scenario()) == ("fresh\n", 2)


def test_commands_share_one_connection_until_closed(sshd: Sshd) -> None:
    async def scenario() -> tuple[set[int], int, int]:
        t = transport(sshd)
        pids = [session_pid((await t.run("echo $PPID")).stdout) for _ in range(3)]
        pids += [
            session_pid(r.stdout) for r in await asyncio.gather(*(t.run("echo $PPID") for _ in range(4)))
        ]
        await t.close()
        after = session_pid((await t.run("echo $PPID")).stdout)  # a closed transport opens again
        await t.close()
        return set(pids), after, t.connects

    pids, after, connects = asyncio.run(scenario())
    assert len(pids) == 1 and after not in pids
    assert connects == 2


# An apply holding the cluster lock over SSH in its own process, killed with SIGKILL later.
SSH_HOLDER = """
import asyncio, sys
from pathlib import Path
from llmgw_cli.core.planning.cluster_lock import hold_script
from llmgw_cli.core.clusterfile.spec import SshSettings
from llmgw_cli.remote.ssh import SshTarget, SshTransport

async def main() -> None:
    port, known, key, state = sys.argv[1:]
    settings = SshSettings.model_validate({"port": int(port), "connect_timeout": "5s"})
    t = SshTransport(SshTarget("gw", "127.0.0.1", settings, Path(known), Path(key)))
    proc = await t.spawn(hold_script(state, 60, "apply by ops@box (pid test)", created_owner=None))
    print((await proc.readline()).strip(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_the_cluster_lock_over_ssh_waits_names_its_holder_and_is_freed_by_a_killed_apply(
    sshd: Sshd, tmp_path: Path
) -> None:
    """apply's hold is a shell on the gateway host that lives as long as apply's channel:
    a second apply waits and names the first; SIGKILL of the first frees the lock (its
    connection closes, the shell sees the end of its stdin)."""
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    argv = [str(sshd.port), str(sshd.known_hosts), str(sshd.client_key), str(state)]
    first = subprocess.Popen(
        [sys.executable, "-c", SSH_HOLDER, *argv], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert first.stdout is not None
        assert first.stdout.readline().strip() == "held"

        async def second() -> list[str]:
            t = transport(sshd)
            try:
                proc = await t.spawn(hold_script(str(state), 60, "apply by second", created_owner=None))
                busy = await asyncio.wait_for(proc.readline(), 60)
                first.send_signal(signal.SIGKILL)
                held = await asyncio.wait_for(proc.readline(), 60)
                holder = lock_path(str(state))
                written = Path(holder).read_text()
                await proc.close()
                return [busy.strip(), held.strip(), written.strip(), Path(holder).read_text()]
            finally:
                await t.close()

        busy, held, written, after = asyncio.run(second())
    finally:
        if first.poll() is None:
            first.kill()
        first.wait()
        if first.stdout is not None:
            first.stdout.close()
    assert busy == "busy apply by ops@box (pid test)"
    assert held == "held"
    assert written == "apply by second"
    assert after == ""  # closed: released, and no holder named any more

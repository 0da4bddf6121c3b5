"""Attacks on root's writes and signals, made from a less trusted account on a lab node.

The engine account (``llmgw``, uid 4242, home ``/var/lib/llmgw``) plants links and pids in
the folders it owns, then ``apply``'s own code runs as root over SSH: it writes a drain
marker (as a rolling replacement does), the engine key map of a gateway it does not
install (into that gateway's state folder), and reads and signals the gateways' routes
files. Each attack must change nothing of root's: the victim files keep their bytes, mode
and owner, and the victim process lives.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import Iterator

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.planning.drain import DRAIN_DIR, Routes, marker_path, marker_text, routes_text
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import silent
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.gateway_install import sync_engine_keys
from llmgw_cli.remote.rollout import Gateways

from ..integration.conftest import Lab

pytestmark = pytest.mark.integration
NODE = "node02"
ENGINE = "llmgw"  # the lab's engine account: owns /var/lib/llmgw
VICTIM = "/root/llmgw-victim"
UNIT = "llmgw-smollm2-135m-9.service"


def sh(lab: Lab, command: str, *, user: str | None = None) -> str:
    if user:
        command = f"runuser -u {user} -- sh -c {shlex.quote(command)}"
    done = lab.ssh(NODE, command)
    assert done.returncode == 0, (command, done.stdout, done.stderr)
    return done.stdout


@pytest.fixture
def victim(lab: Lab) -> Iterator[str]:
    """A root file (0600) the attacker would like root to clobber, chmod or give away;
    yields its ``sha256 mode owner`` line, checked again by the test."""
    sh(lab, f"umask 077 && printf 'root:secret\\n' > {VICTIM} && chmod 600 {VICTIM}")
    state = f"sha256sum < {VICTIM} | cut -c1-64; stat -c '%a %U' {VICTIM}"
    before = sh(lab, state)
    yield state
    after = sh(lab, state)
    sh(
        lab,
        f"rm -f {VICTIM}; rm -rf /var/lib/llmgw/draining /var/lib/llmgw/gw-state; rm -f {DRAIN_DIR}/{UNIT}",
    )
    assert after == before, f"root's file changed: {before!r} -> {after!r}"


def test_a_drain_marker_never_lands_where_the_engine_account_planted_a_link(lab: Lab, victim: str) -> None:
    # The attacker owns /var/lib/llmgw: it makes the folder markers once lived in and puts a
    # link at every name root's old shell wrote through (the marker's temporary file, the
    # marker itself) pointing at a root file.
    old = "/var/lib/llmgw/draining"
    planted = " && ".join(f"ln -sfn {VICTIM} {old}/{UNIT}{suffix}" for suffix in ("", ".llmgw-tmp"))
    sh(lab, f"mkdir -p {old} && {planted}", user=ENGINE)
    spec = parse_cluster(lab.cluster_file.read_text())

    async def mark() -> None:
        # the write a rolling replacement makes on each node of the replica it retires
        async with Connections(spec, lab.state) as conns:
            await conns.to(NODE).write_file(marker_path(UNIT), marker_text(1700000000.0), root=True)

    asyncio.run(mark())
    # the marker is in root's own folder, which the engine account cannot write in
    assert marker_path(UNIT).startswith(DRAIN_DIR + "/")
    assert sh(lab, f"stat -c '%U %a' {DRAIN_DIR} {marker_path(UNIT)}").split() == [
        "root",
        "755",
        "root",
        "644",
    ]
    denied = lab.ssh(NODE, f"runuser -u {ENGINE} -- touch {DRAIN_DIR}/{UNIT}.x")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr


def test_root_refuses_to_write_below_a_folder_another_account_owns(lab: Lab, victim: str) -> None:
    sh(lab, "mkdir -p /var/lib/llmgw/gw-state", user=ENGINE)
    spec = parse_cluster(lab.cluster_file.read_text())

    async def write() -> None:
        async with Connections(spec, lab.state) as conns:
            await conns.to(NODE).write_file("/var/lib/llmgw/gw-state/x.json", "{}\n", root=True)

    with pytest.raises(NodeError) as refused:
        asyncio.run(write())
    assert "refused: /var/lib/llmgw is owned by uid 4242" in refused.value.reason
    assert sh(lab, "ls -A /var/lib/llmgw/gw-state") == ""


def test_the_engine_keys_of_a_gateway_apply_does_not_install_are_written_as_its_owner(
    lab: Lab, victim: str
) -> None:
    # a gateway run by hand as the engine account: its state folder is that account's, which
    # plants links at the key file and at the temporary name root's old shell wrote through
    state = "/var/lib/llmgw/gw-state"
    path = f"{state}/engine-keys.json"
    sh(lab, f"mkdir -p {state} && ln -sfn {VICTIM} {path}.llmgw-tmp && ln -sfn {VICTIM} {path}", user=ENGINE)
    spec = parse_cluster(lab.cluster_file.read_text())
    keys = {"node01": ("a" * 64,)}

    async def sync() -> bool:
        async with Connections(spec, lab.state) as conns:
            return await sync_engine_keys(conns.to(NODE), keys, path=path, group=None, owner=ENGINE)

    assert asyncio.run(sync()) is True
    assert sh(lab, f"stat -c '%U %a %F' {path}").split(maxsplit=2) == [ENGINE, "600", "regular file\n"]
    assert json.loads(sh(lab, f"cat {path}")) == {"node01": ["a" * 64]}


def test_a_pid_planted_in_the_routes_folder_is_not_signalled_as_root(lab: Lab, victim: str) -> None:
    # a root process whose command line says llmgw (as apply's own helpers do), and a
    # process of the routes folder's owner standing for its gateway: only the latter may
    # be told to probe now
    sh(lab, "systemd-run --unit=llmgw-victim-proc python3 -c 'import time; time.sleep(600)' llmgw")
    sh(
        lab,
        "systemd-run --unit=llmgw-owner-proc --uid=llmgw python3 -c "
        + shlex.quote(
            "import signal, time, pathlib\n"
            "signal.signal(signal.SIGUSR1, lambda *_: pathlib.Path('/var/lib/llmgw/gw-state/probed').touch())\n"
            "time.sleep(600)"
        )
        + " llmgw",
    )
    try:
        routes = "/var/lib/llmgw/gw-state/routes"
        sh(lab, f"mkdir -p {routes}", user=ENGINE)
        pids = {
            u: sh(lab, f"systemctl show -p MainPID --value {u}").strip()
            for u in ("llmgw-victim-proc", "llmgw-owner-proc")
        }
        for pid in pids.values():
            text = routes_text(Routes(pid=int(pid), written=0.0, ready={}))
            sh(lab, f"printf %s {shlex.quote(text)} > {routes}/{pid}.json", user=ENGINE)
        spec = parse_cluster(lab.cluster_file.read_text())

        async def signal() -> list[int]:
            async with Connections(spec, lab.state) as conns:
                gateways = Gateways([(NODE, conns.to(NODE))], [NODE], routes, silent)
                views = await gateways.views()
                await gateways.probe_now(views)
                return sorted(v.pid for v in views)

        # read as the folder's owner, a pid of root's is not even seen alive (kill -0: EPERM)
        assert asyncio.run(signal()) == [int(pids["llmgw-owner-proc"])]
        sh(lab, "for i in $(seq 50); do [ -e /var/lib/llmgw/gw-state/probed ] && break; sleep 0.1; done")
        assert sh(lab, "ls /var/lib/llmgw/gw-state").split() == ["probed", "routes"]  # the owner's got it
        alive = lab.ssh(NODE, "systemctl is-active llmgw-victim-proc")
        assert alive.stdout.strip() == "active", "root's process was signalled"
    finally:
        lab.ssh(
            NODE,
            "systemctl stop llmgw-victim-proc llmgw-owner-proc; systemctl reset-failed llmgw-victim-proc llmgw-owner-proc",
        )

"""The command `llmgw keys` and `llmgw usage` run on a gateway host whose SQLite store is not
on this machine, run for real on this machine (as root, the way it runs there over SSH):
it runs llmgw as the state folder's owner against that folder's store, and what it prints
is what the caller parses. No lab needed: this machine stands in for the gateway host."""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import llmgw_cli
from llmgw_cli.cli.store_access import parse_keys, parse_usage
from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.serving.limits import Budget, Limits
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.gateway_store import on_gateway_host
from llmgw_cli.remote.transport import CommandResult

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="runs llmgw as another account: needs root"),
]
SOURCE = Path(llmgw_cli.__file__).resolve().parent.parent


def run(state: Path, bin: Path, command: list[str], args: list[str]) -> CommandResult:
    spec = parse_cluster(
        f"cluster: {{name: t}}\ngateway: {{host: localhost, state_dir: {state}, llmgw_bin: {bin}}}\n"
    )

    async def go() -> CommandResult:
        async with Connections(spec, Path("/")) as conns:
            return await on_gateway_host(spec, conns, "localhost", command, args)

    return asyncio.run(go())


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder another account can reach (pytest's own is root's alone)."""
    made = Path(tempfile.mkdtemp(prefix="llmgw-keys-", dir="/var/tmp"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made, ignore_errors=True)


def _can_run_python(account: str) -> bool:
    done = subprocess.run(
        ["runuser", "-u", account, "--", sys.executable, "-c", "pass"], capture_output=True, check=False
    )
    return done.returncode == 0


def test_keys_and_usage_run_as_the_state_folders_owner(folder: Path) -> None:
    # Another account when it can run this interpreter (one under /root cannot): the
    # command must run as the folder's owner, whoever that is.
    owner = "nobody" if _can_run_python("nobody") else "root"
    uid = pwd.getpwnam(owner).pw_uid
    state = folder / "state"
    state.mkdir(mode=0o700)
    os.chown(state, uid, -1)
    # llmgw as this test runs it (this checkout), where the owner can run it
    bin = folder / "llmgw"
    bin.write_text(f'#!/bin/sh\nPYTHONPATH={SOURCE} exec {sys.executable} -m llmgw_cli "$@"\n')
    bin.chmod(0o755)

    made = run(state, bin, ["keys", "create"], ["--name=team a", "--admin"])
    assert made.ok, made.stderr
    assert made.stdout.startswith("llmgw-")
    store = state / "gateway.sqlite3"
    assert store.stat().st_uid == uid  # written as the folder's owner, never as root

    listed = run(state, bin, ["keys", "list"], ["--json"])
    assert listed.ok, listed.stderr
    (key,) = parse_keys(listed.stdout)
    assert (key.name, key.admin, key.revoked) == ("team a", True, False)

    assert parse_usage(run(state, bin, ["usage"], ["--json", "--since=2026-01-01"]).stdout) == []

    # limits, as `llmgw keys create|set` forward them
    limited = run(state, bin, ["keys", "create"], ["--name=limited", "--rpm=60", "--budget=100000/day"])
    assert limited.ok, limited.stderr
    changed = run(state, bin, ["keys", "set"], ["--tpm=5000", "--rpm=none", "--", "limited"])
    assert changed.ok and "tpm 5000, budget 100000/day" in changed.stdout, changed.stderr
    keys = {k.name: k for k in parse_keys(run(state, bin, ["keys", "list"], ["--json"]).stdout)}
    assert keys["limited"].limits == Limits(tpm=5000, budget=Budget(100_000, "day"))

    hostile = "-x; touch /tmp/llmgw-pwned"
    missing = run(state, bin, ["keys", "revoke"], ["--", hostile])
    assert missing.exit_status == 2 and "no key named" in missing.stderr
    assert not Path("/tmp/llmgw-pwned").exists()
    gone = run(state, bin, ["keys", "revoke"], ["--", "team a"])
    assert gone.ok, gone.stderr
    keys = {k.name: k for k in parse_keys(run(state, bin, ["keys", "list"], ["--json"]).stdout)}
    assert keys["team a"].revoked

    nowhere = run(folder / "missing", bin, ["keys", "list"], ["--json"])
    assert nowhere.exit_status == 3 and "no gateway state folder" in nowhere.stderr
    assert not (folder / "missing").exists()

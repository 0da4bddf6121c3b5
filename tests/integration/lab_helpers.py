"""Shared steps for tests that drive llmgw against the lab cluster."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shlex
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from llmgw_cli.lab import fault as lab_fault
from llmgw_cli.lab import host as lab_host
from tests.gateway.harness import free_port, start_gateway, stop
from tests.integration.weights_origin import Origin, start_origin

from .conftest import Lab

RESET_UNITS = (
    # sockets first: a socket left listening would start its service again
    "systemctl disable --now llmgw-gateway.socket 2>/dev/null; "
    "systemctl stop 'llmgw-*' 2>/dev/null; rm -f /etc/systemd/system/llmgw-*.service "
    "/etc/systemd/system/llmgw-*.socket; "
    "systemctl daemon-reload; systemctl reset-failed 2>/dev/null; "
    "rm -rf /etc/llmgw/engine.env /etc/llmgw/engine-sglang-*.yaml /etc/llmgw/env; true"
)


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_on_terminal(*args: str, tmp: Path, timeout: float = 300) -> tuple[int, str, str]:
    """The CLI with its stderr on a pseudo-terminal 200 columns wide, as an operator at a
    terminal runs it: (exit code, stdout, what the terminal received, escapes included).
    Strip the escapes with ``ESCAPE`` to read the text."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "200"}
    env.pop("NO_COLOR", None)
    stdout = tmp / f"terminal-{time.monotonic_ns()}.out"
    with stdout.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw_cli", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=slave,
            env=env,
        )
    os.close(slave)
    seen = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, stdout.read_text(), seen.decode(errors="replace")


def reset(lab: Lab) -> None:
    """Heal every fault and remove every llmgw unit, so each test starts from a clean lab.

    Faults are healed with the code `llmgw lab fault NODE clear` runs, called here: a CLI
    process per node cost seconds of interpreter start each, twice a test (the CLI's
    ``clear`` has its own test in test_lab.py). The nodes' units go in parallel."""
    record = lab_host.load_record(lab.state)
    assert record is not None, f"no lab is up in {lab.state}"
    heal = lab_fault.parse_fault("clear", [])
    for node in record.nodes:
        lab_fault.inject(record, node, heal)
    with ThreadPoolExecutor(len(lab.nodes)) as pool:
        list(pool.map(lambda node: lab.ssh(node.name, RESET_UNITS), lab.nodes))


def cluster_variant(
    lab: Lab, folder: Path, edit: str = "", replace: tuple[tuple[str, str], ...] = ()
) -> Path:
    """A copy of the lab's cluster file with text replaced (key paths are absolute)."""
    text = lab.cluster_file.read_text()
    for old, new in replace:
        assert old in text, old
        text = text.replace(old, new)
    path = folder / "cluster.yaml"
    path.write_text(text + edit)
    return path


def engine_keys_file(lab: Lab, path: Path) -> Path:
    """The gateway's map node -> engine key, read from every node's key file (what `apply`
    writes on an installed gateway's host; the lab's gateway runs on this machine)."""
    keys = {}
    for node in lab.nodes:
        text = lab.ssh(node.name, "sed -n 's/^LLMGW_ENGINE_KEY=//p' /etc/llmgw/engine.env 2>/dev/null").stdout
        if text.strip():
            keys[node.name] = [text.strip()]
    path.write_text(json.dumps(keys))
    path.chmod(0o600)
    return path


def status(cluster: Path) -> dict[str, Any]:
    done = run("status", "-f", str(cluster), "--json")
    # 1: a model has fewer ready replicas than its min (a lab without replicas); the
    # report is the same
    assert done.returncode in (0, 1), done.stderr
    return dict(json.loads(done.stdout))


def admin_replicas(admin_port: int, admin: str, model: str) -> list[dict[str, Any]]:
    """The replicas of ``model`` as the gateway's admin API lists them."""
    got = httpx.get(
        f"http://127.0.0.1:{admin_port}/admin/api/replicas",
        headers={"Authorization": f"Bearer {admin}"},
        timeout=10,
    )
    got.raise_for_status()
    return [r for r in got.json()["replicas"] if r["model"] == model]


def node_row(report: dict[str, Any], name: str) -> dict[str, Any]:
    return dict(next(n for n in report["nodes"] if n["name"] == name))


def unit_props(lab: Lab, node: str, unit: str) -> dict[str, str]:
    done = lab.ssh(node, f"systemctl show -p MainPID,NRestarts,ActiveState,Environment {unit}")
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def llmgw_units(lab: Lab) -> dict[str, list[str]]:
    out = {}
    for node in lab.nodes:
        done = lab.ssh(node.name, "ls /etc/systemd/system/ | grep '^llmgw-' || true")
        out[node.name] = sorted(done.stdout.split())
    return out


def sshd_marks(lab: Lab) -> dict[str, str]:
    """Where each node's sshd log stands now (a journal cursor), for ``logins``."""
    marks = {}
    for node in lab.nodes:
        # --sync: this very login's line is in the journal before the cursor is read
        done = lab.ssh(node.name, "journalctl --sync; journalctl -u ssh -n 1 --show-cursor --no-pager")
        marks[node.name] = done.stdout.rsplit("-- cursor: ", 1)[1].strip()
    return marks


def logins(lab: Lab, node: str, user: str, mark: str) -> int:
    """SSH logins of ``user`` that ``node``'s sshd accepted since ``mark`` (``sshd_marks``),
    this question's own login left out."""
    script = (
        f"set -- $SSH_CLIENT; journalctl --sync; journalctl -u ssh --after-cursor {shlex.quote(mark)} "
        f"--no-pager -o cat | grep 'Accepted publickey for {user} from ' | grep -vc \" port $2 ssh2\"; true"
    )
    done = lab.ssh(node, script)
    return int(done.stdout.strip())


@dataclass
class LabGateway:
    """`llmgw gateway run` on this machine for the lab's cluster, after `apply`."""

    cluster: Path
    port: int
    admin_port: int
    key: str  # an API key named lab-user
    admin: str  # an admin key named ops


@contextmanager
def applied_with_gateway(lab: Lab, tmp_path: Path, *gateway_args: str) -> Iterator[LabGateway]:
    """Apply the lab's cluster file (its always-on replicas), then run a gateway on free
    loopback ports that finds them by probing the nodes. Cleans the lab before and after."""
    reset(lab)
    port, admin_port = free_port(), free_port()
    cluster = cluster_variant(
        lab,
        tmp_path,
        replace=(
            ("listen: 127.0.0.1:8080", f"listen: 127.0.0.1:{port}"),
            ("admin_listen: 127.0.0.1:9090", f"admin_listen: 127.0.0.1:{admin_port}"),
            ("metrics_listen: 127.0.0.1:9100", f"metrics_listen: 127.0.0.1:{free_port()}"),
            ("state_dir: /var/lib/llmgw-lab/gateway", f"state_dir: {tmp_path / 'state'}"),
        ),
    )
    applied = run("apply", "-f", str(cluster), "--yes")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    keys_file = engine_keys_file(lab, tmp_path / "engine-keys.json")
    key = run("keys", "create", "--name", "lab-user", "-f", str(cluster)).stdout.strip()
    admin = run("keys", "create", "--name", "ops", "--admin", "-f", str(cluster)).stdout.strip()
    try:
        proc = start_gateway(
            cluster,
            tmp_path / "gateway.log",
            "--engine-keys-file",
            str(keys_file),
            # the gateway's own key, made by apply in its state folder (the lab's host runs
            # no systemd): it reaches the nodes' helper only, never a root shell
            *("--identity-file", str(tmp_path / "state/ssh-key")),
            *gateway_args,
            port=port,
        )
        try:
            yield LabGateway(cluster, port, admin_port, key, admin)
        finally:
            stop(proc)
    finally:
        reset(lab)


BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


@contextmanager
def origin_on_the_bridge(lab: Lab, folder: Path, hub_port: int | None = None) -> Iterator[Origin]:
    """An HTTPS weights origin on the lab's bridge whose certificate every node trusts: it
    is added to each node's own copy of the CA bundle (its overlay), restored after.
    ``hub_port``: it fronts a Hub stand-in too (``start_origin``)."""
    origin = start_origin(folder, host=f"{lab_host.SUBNET}.1", hub_port=hub_port)
    pem = shlex.quote(origin.cert.read_text())
    for node in lab.nodes:
        done = lab.ssh(node.name, f"cp {BUNDLE} {BUNDLE}.llmgw-test && printf '%s\\n' {pem} >> {BUNDLE}")
        assert done.returncode == 0, done.stderr
    try:
        yield origin
    finally:
        origin.stop()
        for node in lab.nodes:
            lab.ssh(node.name, f"mv -f {BUNDLE}.llmgw-test {BUNDLE}")

"""Install or update ``llmgw-gateway.service`` on the gateway host (``gateway.host``).

Two steps, so that `apply` can show the change before it asks: ``preview`` reads what is
on the host (file digests, whether the unit runs) and says what would change;
``install`` writes the changed files atomically, then reloads or restarts the gateway and
waits until it answers ``/health`` (or, when its listener cannot be reached from here,
until its unit has stayed up).

The host is a node of the cluster file, ``localhost`` (this machine), or an address
reached with the top-level ``ssh`` settings. A host without systemd as init (a container,
the lab's own host) gets nothing, with a note saying how to run the gateway by hand.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from llmgw_cli.core.gateway_install import (
    CLUSTER_FILE,
    GATEWAY_DIR,
    SSH_KEY,
    UNIT_FILE,
    GatewayChange,
    gateway_change,
    gateway_files,
)
from llmgw_cli.core.load import parse_cluster
from llmgw_cli.core.spec import Become, ClusterSpec, Node
from llmgw_cli.core.units import GATEWAY_UNIT
from llmgw_cli.errors import LlmgwError, NodeError
from llmgw_cli.remote.connect import resolve_path, transport_for
from llmgw_cli.remote.execute import Outcome, Report, UnitWatch, ensure_account, ensure_engine_key, must
from llmgw_cli.remote.local import LocalTransport
from llmgw_cli.remote.transport import Transport

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
SUBJECT = "gateway"


@dataclass(frozen=True)
class GatewayPreview:
    host: str
    change: GatewayChange | None  # None: nothing is installed (``skip`` says why)
    skip: str = ""
    llmgw_bin: str = ""

    @property
    def changes(self) -> bool:
        return self.change is not None and self.change.how != "none"

    def describe(self) -> str:
        if self.change is None:
            return f"gateway on {self.host}: not installed: {self.skip}"
        if self.change.how == "none":
            return f"gateway on {self.host}: unchanged"
        written = ", ".join(Path(f.path).name for f in self.change.write) or "no file changed"
        verb = {"reload": "reload", "restart": "start or restart"}[self.change.how]
        return f"gateway on {self.host}: {verb} ({written})"


def gateway_transport(spec: ClusterSpec, base: Path) -> Transport:
    host = spec.gateway.host
    for node in spec.nodes:
        if node.name == host:
            return transport_for(spec, node, base)
    if host in LOCAL_NAMES:
        return LocalTransport(
            SUBJECT, command_timeout=spec.ssh.command_timeout, sudo=spec.ssh.become is Become.sudo
        )
    return transport_for(spec, Node(name=SUBJECT, address=host), base)


def _read_local(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LlmgwError(f"{what} {path}: {exc.strerror}") from None


async def _host_state(t: Transport, paths: list[str]) -> tuple[dict[str, str], bool, str]:
    """Digests of ``paths`` on the host, whether the gateway unit is active, and the
    cluster file the gateway runs with now (empty when none)."""
    q = " ".join(shlex.quote(p) for p in paths)
    marker = "--llmgw-cluster--"
    result = await t.run(
        f"sha256sum {q} 2>/dev/null; echo {marker}; systemctl is-active {GATEWAY_UNIT} 2>/dev/null; "
        f"echo {marker}; cat {shlex.quote(CLUSTER_FILE)} 2>/dev/null; true",
        root=True,
    )
    digests_text, _, rest = result.stdout.partition(marker + "\n")
    active_text, _, cluster = rest.partition(marker + "\n")
    digests = {}
    for line in digests_text.splitlines():
        digest, _, path = line.partition("  ")
        digests[path.strip()] = digest
    return digests, active_text.strip() == "active", cluster


def _listeners(text: str) -> tuple[str, str, str | None] | None:
    try:
        g = parse_cluster(text).gateway
    except Exception:  # an old file that no longer parses: treat as changed
        return None
    return (g.listen, g.admin_listen, g.metrics_listen)


async def preview(spec: ClusterSpec, base: Path, cluster_text: str) -> GatewayPreview:
    """What installing the gateway would change; contacts the gateway host only."""
    host = spec.gateway.host
    if not spec.gateway.install:
        return GatewayPreview(host, None, "gateway.install is off")
    t = gateway_transport(spec, base)
    try:
        if not (await t.run("test -d /run/systemd/system")).ok:
            return GatewayPreview(
                host,
                None,
                f"{host} does not run systemd; start the gateway yourself: llmgw gateway run -f CLUSTER_FILE",
            )
        llmgw_bin = spec.gateway.llmgw_bin
        if llmgw_bin is None:
            found = await t.run("command -v llmgw")
            llmgw_bin = found.stdout.strip() if found.ok else ""
        if not llmgw_bin or not (await t.run(f"test -x {shlex.quote(llmgw_bin)}")).ok:
            where = llmgw_bin or "on PATH"
            raise NodeError(
                host,
                "failed",
                f"llmgw is not installed on the gateway host ({where}): install it there "
                "(pip install llmgw) or set gateway.llmgw_bin",
            )
        settings = spec.ssh
        if settings.identity_file is None:
            raise LlmgwError(
                "the gateway needs an SSH key to probe the nodes and start replicas: set ssh.identity_file"
            )
        files = gateway_files(
            spec,
            cluster_text=cluster_text,
            llmgw_bin=llmgw_bin,
            ssh_key=_read_local(resolve_path(settings.identity_file, base), "ssh.identity_file"),
            known_hosts=_read_local(resolve_path(settings.known_hosts, base), "ssh.known_hosts"),
        )
        digests, active, running_cluster = await _host_state(t, [f.path for f in files])
        wanted = (spec.gateway.listen, spec.gateway.admin_listen, spec.gateway.metrics_listen)
        change = gateway_change(
            files, digests, active=active, listeners_changed=_listeners(running_cluster) != wanted
        )
        return GatewayPreview(host, change, llmgw_bin=llmgw_bin)
    finally:
        await t.close()


async def install(
    spec: ClusterSpec, base: Path, planned: GatewayPreview, engine_key: str, report: Report
) -> Outcome:
    """Carry out ``planned`` (from ``preview``); never raises for a node failure."""
    change = planned.change
    if change is None or change.how == "none":
        return Outcome(SUBJECT, True, planned.describe())
    t = gateway_transport(spec, base)
    try:
        await _install(t, spec, change, engine_key, report)
        return await _wait(t, spec, planned.host, report)
    except NodeError as exc:
        report(SUBJECT, f"failed: {exc.reason}")
        return Outcome(SUBJECT, False, exc.reason)
    finally:
        await t.close()


async def _install(t: Transport, spec: ClusterSpec, change: GatewayChange, key: str, report: Report) -> None:
    await ensure_account(t, "llmgw")
    # /etc/llmgw may exist already as 0700 (written by an older llmgw): the account must
    # traverse it to read its files (engine.env in it stays 0600).
    await must(
        t,
        f"mkdir -p {GATEWAY_DIR} && chmod 755 {GATEWAY_DIR} {Path(GATEWAY_DIR).parent}",
        f"create {GATEWAY_DIR}",
    )
    await ensure_engine_key(
        t, key, "the gateway could not talk to the engines: copy the nodes' file to the gateway host"
    )
    for f in change.write:
        await t.write_file(f.path, f.text, mode=f.mode, root=True)
    await must(t, f"chgrp llmgw {SSH_KEY}", "give the llmgw group its key")
    report(SUBJECT, "files in place")
    if any(f.path == UNIT_FILE for f in change.write):
        await must(t, "systemctl daemon-reload", "systemctl daemon-reload")
    await must(t, f"systemctl enable {GATEWAY_UNIT} 2>&1", "enable the gateway")
    verb = "reload" if change.how == "reload" else "restart"
    await must(t, f"systemctl {verb} {GATEWAY_UNIT}", f"{verb} the gateway")
    report(SUBJECT, f"{verb}ed")


def _health_url(spec: ClusterSpec, host: str) -> str:
    listen_host, _, port = spec.gateway.listen.rpartition(":")
    listen_host = listen_host.strip("[]")
    if listen_host in ("0.0.0.0", "::", ""):
        node = next((n for n in spec.nodes if n.name == host), None)
        listen_host = "127.0.0.1" if host in LOCAL_NAMES else (node.address if node else host)
    if ":" in listen_host:
        listen_host = f"[{listen_host}]"
    return f"http://{listen_host}:{port}/health"


async def _wait(t: Transport, spec: ClusterSpec, host: str, report: Report, timeout: float = 30) -> Outcome:
    """Ready when ``/health`` answers 200; when it cannot be reached from here, when the
    unit has stayed active for a few seconds. A unit that fails is reported with its journal."""
    watch = await UnitWatch.start(t, GATEWAY_UNIT)
    url = _health_url(spec, host)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() - started < timeout:
            failed = await watch.failure(lines=40)  # a Python traceback is long
            if failed:
                return Outcome(SUBJECT, False, failed)
            try:
                if (await client.get(url)).status_code == 200:
                    report(SUBJECT, "ready")
                    return Outcome(SUBJECT, True, f"ready at {url.removesuffix('/health')}")
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
    active = await t.run(f"systemctl is-active {GATEWAY_UNIT}")
    if active.stdout.strip() == "active":
        return Outcome(SUBJECT, True, f"unit active; {url} did not answer from here")
    return Outcome(SUBJECT, False, f"{GATEWAY_UNIT} is {active.stdout.strip() or 'unknown'}")

"""Install or update ``llmgw-gateway.service`` on every gateway host (``gateway.all_hosts``).

Two steps, so that `apply` can show the change before it asks: ``preview`` reads what is
on the host (file digests, whether the units run) and says what would change;
``install`` writes the changed files atomically, then reloads, hands over or restarts the
gateway and waits until it answers ``/health`` (or, when its listener cannot be reached
from here, until its unit has stayed up).

A hand-over (the gateway runs and its files changed): ``llmgw-gateway-handover.service``
starts on the same listening sockets (``systemctl start`` returns once it is READY);
``llmgw-gateway.service`` restarts (the old process drains its requests while the
hand-over accepts the new ones; the new one is READY when ``restart`` returns); the
hand-over stops (it drains too). No connection is refused: the kernel queues them on the
sockets ``llmgw-gateway.socket`` holds. When those sockets change (new listener
addresses, or a host whose gateway bound its ports itself, before the socket unit), the
gateway stops, the socket unit (re)starts and the gateway starts: a brief interruption,
which the preview says.

Each host is a node of the cluster file, ``localhost`` (this machine), or an address
reached with the top-level ``ssh`` settings. A host without systemd as init (a container,
the lab's own host) gets nothing, with a note saying how to run the gateway by hand.

Several hosts (``gateway.hosts``): each is previewed on its own (one plan line each) and
installed one after the other, in the order of the cluster file, so that a change that
restarts a gateway (its listeners moved) never refuses connections on every host at once;
each host makes its own SSH key.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.clusterfile.spec import Become, ClusterSpec, Node
from llmgw_cli.core.hosts.gateway_install import (
    CLUSTER_FILE,
    ENGINE_KEYS_FILE,
    GATEWAY_ACCOUNT,
    GATEWAY_DIR,
    GATEWAY_KEY,
    OLD_OPERATOR_KEY,
    UNIT_FILE,
    UNIT_FILES,
    GatewayChange,
    GatewayFile,
    gateway_change,
    gateway_files,
    hub_env_text,
)
from llmgw_cli.core.hosts.node_access import valid_public_key
from llmgw_cli.core.hosts.units import GATEWAY_HANDOVER_UNIT, GATEWAY_SOCKET, GATEWAY_UNIT
from llmgw_cli.core.observe.unit_state import UnitState
from llmgw_cli.errors import LlmgwError, NodeError
from llmgw_cli.polling import attempts
from llmgw_cli.progress import Phase, Report
from llmgw_cli.remote.connect import Connections, resolve_path
from llmgw_cli.remote.execute import Outcome, UnitWatch, ensure_account, must
from llmgw_cli.remote.gateway_sight import check_sight
from llmgw_cli.remote.local import LocalTransport
from llmgw_cli.remote.node_access import ensure_gateway_account
from llmgw_cli.remote.nodeops import ShellOps
from llmgw_cli.remote.transport import Transport, write_command

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
        verb = {
            "reload": "reload",
            "handover": "hand over to a new gateway process, no request refused",
            "restart": "start or restart",
        }[self.change.how]
        if self.change.interrupts:
            verb = (
                f"restart: its listeners move to {GATEWAY_SOCKET}; connections are refused "
                "while it stops and starts (a few seconds, once)"
            )
        return f"gateway on {self.host}: {verb} ({written})"


def host_subject(spec: ClusterSpec, host: str) -> str:
    """What progress lines and outcomes call a gateway host: ``gateway`` when there is one,
    ``gateway HOST`` among several."""
    return SUBJECT if len(spec.gateway.all_hosts) == 1 else f"{SUBJECT} {host}"


def gateway_transport(conns: Connections, host: str | None = None) -> Transport:
    """A gateway host's transport (``host``; None: ``gateway.host``, the first): a node's
    own (the same connection), this machine's, or one to an address reached with the
    top-level ``ssh`` settings, held by ``conns``."""
    spec = conns.spec
    host = host or spec.gateway.host
    for node in spec.nodes:
        if node.name == host:
            return conns.to(node)
    if host in LOCAL_NAMES:
        return LocalTransport(
            host_subject(spec, host),
            command_timeout=spec.ssh.command_timeout,
            sudo=spec.ssh.become is Become.sudo,
        )
    if host == spec.gateway.all_hosts[0]:
        return conns.to(Node(name=SUBJECT, address=host))
    # Not a node: named for the connections' cache and for messages, never validated as a
    # node name (``host`` was validated as a host name or address).
    return conns.to(Node.model_construct(name=f"{SUBJECT} {host}", address=host))


def _read_local(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LlmgwError(f"{what} {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class HostState:
    digests: dict[str, str]  # path -> sha256 of the files found (``GatewayFile.state``)
    active: bool  # llmgw-gateway.service
    socket_active: bool  # llmgw-gateway.socket
    cluster: str  # the cluster file the gateway runs with now ("" when none)


async def _host_state(t: Transport, files: tuple[GatewayFile, ...]) -> HostState:
    q = " ".join(shlex.quote(f.path) for f in files)
    grouped = " ".join(shlex.quote(f.path) for f in files if f.group)
    owners = f"stat -c 'mode %a %G %n' {grouped} 2>/dev/null; " if grouped else ""
    marker = "--llmgw-cluster--"
    result = await t.run(
        f"sha256sum {q} 2>/dev/null; {owners}echo {marker}; systemctl is-active {GATEWAY_UNIT} "
        f"{GATEWAY_SOCKET} 2>/dev/null; echo {marker}; cat {shlex.quote(CLUSTER_FILE)} 2>/dev/null; true",
        root=True,
    )
    digests_text, _, rest = result.stdout.partition(marker + "\n")
    active_text, _, cluster = rest.partition(marker + "\n")
    digests: dict[str, str] = {}
    modes: dict[str, str] = {}
    for line in digests_text.splitlines():
        if line.startswith("mode "):
            _, mode, group, path = ([*line.split(" ", 3), "", "", ""])[:4]
            modes[path.strip()] = f"{mode} {group}"
            continue
        digest, _, path = line.partition("  ")
        digests[path.strip()] = digest
    for path, mode in modes.items():
        if path in digests:
            digests[path] += f" {mode}"
    states = [*active_text.split(), "", ""]
    return HostState(digests, states[0] == "active", states[1] == "active", cluster)


def _listeners(text: str) -> tuple[str, str, str | None] | None:
    try:
        g = parse_cluster(text).gateway
    except Exception:  # an old file that no longer parses: treat as changed
        return None
    return (g.listen, g.admin_listen, g.metrics_listen)


@dataclass(frozen=True)
class GatewayPreviews:
    """What installing the gateway would change on each gateway host, in the order of
    ``gateway.all_hosts``."""

    hosts: tuple[GatewayPreview, ...]

    @property
    def changes(self) -> bool:
        return any(p.changes for p in self.hosts)

    def describe(self) -> str:
        return "\n".join(p.describe() for p in self.hosts)

    def settled(self) -> GatewayPreviews:
        """The same hosts once installed: only their engine key maps may change."""
        return GatewayPreviews(
            tuple(
                p if p.change is None else GatewayPreview(p.host, GatewayChange((), "none"))
                for p in self.hosts
            )
        )


def store_password(spec: ClusterSpec) -> str | None:
    """The store's password file as this machine has it, for apply to copy to every gateway
    host (None: no such file here; the operator puts it on each host)."""
    path = spec.gateway.store_password_file
    if path is None or not Path(path).exists():
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise LlmgwError(
            f"gateway.store_password_file {path}: {why}; apply copies it to every gateway host "
            "from here: make it readable to the account that runs apply"
        ) from None


async def preview(
    spec: ClusterSpec, conns: Connections, cluster_text: str, pins_text: str
) -> GatewayPreviews:
    """What installing the gateway would change on every gateway host; contacts those hosts
    only. ``pins_text``: the pins file of the plan (``core/pins.pins_text``)."""
    password = store_password(spec) if spec.gateway.install else None
    found = await asyncio.gather(
        *(
            preview_host(spec, conns, cluster_text, host, password, pins_text=pins_text)
            for host in spec.gateway.all_hosts
        )
    )
    return GatewayPreviews(tuple(found))


async def preview_host(
    spec: ClusterSpec,
    conns: Connections,
    cluster_text: str,
    host: str,
    password: str | None = None,
    *,
    pins_text: str,
) -> GatewayPreview:
    """What installing the gateway would change on ``host``."""
    if not spec.gateway.install:
        return GatewayPreview(host, None, "gateway.install is off")
    t = gateway_transport(conns, host)
    if not (await t.run("test -d /run/systemd/system")).ok:
        return GatewayPreview(
            host,
            None,
            f"{host} does not run systemd; start the gateway yourself: llmgw gateway run -f CLUSTER_FILE "
            f"--identity-file {gateway_key_path(spec, systemd=False)}",
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
    files = gateway_files(
        spec,
        cluster_text=cluster_text,
        pins_text=pins_text,
        llmgw_bin=llmgw_bin,
        known_hosts=_read_local(resolve_path(spec.ssh.known_hosts, conns.base), "ssh.known_hosts"),
        store_password=password,
        hub_env=hub_env_text(os.environ),
    )
    # before anything is changed: a unit that could not run llmgw is never installed
    await check_sight(t, host, llmgw_bin, next(f.text for f in files if f.path == UNIT_FILE))
    on_host = await _host_state(t, files)
    wanted = (spec.gateway.listen, spec.gateway.admin_listen, spec.gateway.metrics_listen)
    change = gateway_change(
        files,
        on_host.digests,
        active=on_host.active,
        listeners_changed=_listeners(on_host.cluster) != wanted,
        socket_active=on_host.socket_active,
    )
    return GatewayPreview(host, change, llmgw_bin=llmgw_bin)


async def install(
    spec: ClusterSpec,
    conns: Connections,
    planned: GatewayPreviews,
    engine_keys: dict[str, tuple[str, ...]],
    report: Report,
) -> list[Outcome]:
    """Carry out ``planned`` (from ``preview``) on every gateway host, one host after the
    other, and bring each host's engine key map up to date; one Outcome per host, never
    raises for a host's failure."""
    return [await install_host(spec, conns, p, engine_keys, report) for p in planned.hosts]


async def install_host(
    spec: ClusterSpec,
    conns: Connections,
    planned: GatewayPreview,
    engine_keys: dict[str, tuple[str, ...]],
    report: Report,
) -> Outcome:
    """Carry out one host's ``planned`` change and bring its engine key map up to date."""
    change = planned.change
    who = host_subject(spec, planned.host)
    if change is None:
        return await _keys_for_own_gateway(spec, conns, planned, engine_keys)
    t = gateway_transport(conns, planned.host)
    try:
        keys_changed = await sync_engine_keys(t, engine_keys)
        if change.how == "none":
            if keys_changed and (await t.run(f"systemctl is-active {GATEWAY_UNIT}")).ok:
                await must(t, f"systemctl reload {GATEWAY_UNIT}", "reload the gateway (new engine keys)")
                report(who, "reloaded (engine keys)", Phase.done)
            return Outcome(who, True, planned.describe())
        await _install(t, spec, change, report, who)
        return await _wait(t, spec, planned.host, report, who)
    except NodeError as exc:
        report(who, f"failed: {exc.reason}", Phase.failed)
        return Outcome(who, False, exc.reason)


async def _keys_for_own_gateway(
    spec: ClusterSpec, conns: Connections, planned: GatewayPreview, engine_keys: dict[str, tuple[str, ...]]
) -> Outcome:
    """A gateway apply does not install (no systemd there) still needs the keys: the map
    goes to its state folder on its host (owned by that folder's owner, 0600), where
    `llmgw gateway run` finds it; the gateway re-reads it when it changes."""
    who = host_subject(spec, planned.host)
    if not spec.gateway.install:
        return Outcome(who, True, planned.describe())
    t = gateway_transport(conns, planned.host)
    try:
        path = engine_keys_path(spec, installed=False)
        owner = await t.run(f"stat -c %U {shlex.quote(spec.gateway.state_dir)} 2>/dev/null")
        await sync_engine_keys(t, engine_keys, path=path, group=None, owner=owner.stdout.strip() or "root")
        return Outcome(who, True, f"{planned.describe()}; engine keys in {path}")
    except NodeError as exc:
        return Outcome(who, False, f"engine keys for the gateway: {exc.reason}")


def engine_keys_path(spec: ClusterSpec, *, installed: bool) -> str:
    """Where the gateway's map node -> engine keys lives on its host."""
    return ENGINE_KEYS_FILE if installed else f"{spec.gateway.state_dir.rstrip('/')}/engine-keys.json"


async def sync_engine_keys(
    t: Transport,
    engine_keys: dict[str, tuple[str, ...]],
    *,
    path: str = ENGINE_KEYS_FILE,
    group: str | None = "",
    owner: str = "root",
) -> bool:
    """Write the map node -> engine keys for the gateway; True when it changed. Installed:
    root:<the gateway unit's account> 0640 (``group`` ""; no other account reads it);
    ``group`` None: ``owner``'s alone, 0600, written as ``owner`` (its own state folder). The gateway re-reads it when it changes (and
    on SIGHUP). The gateway host itself needs no engine key file."""
    text = json.dumps({node: list(keys) for node, keys in sorted(engine_keys.items())}, indent=1) + "\n"
    digest = hashlib.sha256(text.encode()).hexdigest()
    # A state folder of another account's: read and written as that account (runuser), so
    # a link or FIFO it planted there can only point root's hand at its own files.
    as_user = owner if group is None and owner != "root" else None
    read = f"sha256sum {shlex.quote(path)} 2>/dev/null"
    current = await t.run(
        shlex.join(["runuser", "-u", as_user, "--", "sh", "-c", read]) if as_user else read, root=True
    )
    if current.stdout.split(" ", 1)[0] == digest:
        return False
    if group == "":
        shown = await t.run(f"systemctl show -p User --value {GATEWAY_UNIT} 2>/dev/null")
        group = shown.stdout.strip() or GATEWAY_ACCOUNT
        await ensure_account(t, group)
    mode = 0o600 if group is None else 0o640
    result = await t.run(write_command(path, mode, group=group, as_user=as_user), root=True, stdin=text)
    if not result.ok:
        raise NodeError(t.node, "failed", f"give the gateway its engine keys: {result.stderr.strip()}")
    return True


async def _install(t: Transport, spec: ClusterSpec, change: GatewayChange, report: Report, who: str) -> None:
    await ensure_gateway_account(t)
    # /etc/llmgw may exist already as 0700 (written by an older llmgw): the account must
    # traverse it to read its files (engine.env in it stays 0600).
    await must(
        t,
        f"mkdir -p {GATEWAY_DIR} && chmod 755 {GATEWAY_DIR} {Path(GATEWAY_DIR).parent}",
        f"create {GATEWAY_DIR}",
    )
    for f in change.write:
        # a secret gets the gateway's group before it takes its name: never readable by more
        await t.write_file(f.path, f.text, mode=f.mode, root=True, group=f.group or None)
    report(who, "files in place")
    if any(f.path in UNIT_FILES for f in change.write):
        await must(t, "systemctl daemon-reload", "systemctl daemon-reload")
    await must(t, f"systemctl enable {GATEWAY_SOCKET} {GATEWAY_UNIT} 2>&1", "enable the gateway")
    if change.how == "reload":
        await must(t, f"systemctl reload {GATEWAY_UNIT}", "reload the gateway")
        report(who, "reloaded")
    elif change.how == "handover":
        await _hand_over(t, spec, report, who)
    elif change.rebind:
        # The sockets change (or the gateway bound its ports itself, before the socket
        # unit): nothing may hold them while the socket unit binds them again. The socket
        # goes first, or a connection in between would start the old gateway again.
        await must(
            t,
            f"systemctl stop {GATEWAY_SOCKET} {GATEWAY_HANDOVER_UNIT} {GATEWAY_UNIT}",
            "stop the gateway",
        )
        await _start(t, f"systemctl start {GATEWAY_SOCKET} {GATEWAY_UNIT}")
        report(who, "restarted" if change.active else "started")
    else:
        # down, under a socket unit that runs unchanged: its queued connections wait
        await _start(t, f"systemctl restart {GATEWAY_UNIT}")
        report(who, "started")


async def _start(t: Transport, command: str) -> None:
    """``command`` starts the gateway; if it fails, the error carries the gateway's own
    last words (its journal since the start), not only systemd's "see journalctl"."""
    ops = ShellOps(t)
    since = await ops.date()
    result = await t.run(command, root=True)
    if not result.ok:
        said = (await ops.journal(GATEWAY_UNIT, since, 12)).strip()
        why = (result.stderr or result.stdout).strip()
        raise NodeError(
            t.node, "failed", f"start the gateway: {why}" + (f"\nits journal:\n{said}" if said else "")
        )


async def _hand_over(t: Transport, spec: ClusterSpec, report: Report, who: str = SUBJECT) -> None:
    """The running gateway is replaced with no connection refused: a second process
    serves from the same sockets while the first restarts. A hand-over that does not
    start leaves the running gateway as it is. Each step is queued (``--no-block``) and
    watched, so that a drain longer than one remote command's time limit is waited for."""
    ops = ShellOps(t)
    # systemd's own bound on a stop (TimeoutStopSec: the drain, and time to write usage),
    # and on a start (a probe of every node, before READY)
    stopping = max(60.0, spec.gateway.drain_timeout + 30) + 10
    starting = 120.0
    before = await ops.show(GATEWAY_HANDOVER_UNIT)
    since = await ops.date()
    report(who, "starting the hand-over gateway")
    await must(t, f"systemctl start --no-block {GATEWAY_HANDOVER_UNIT}", "start the hand-over gateway")
    failed = await _until(
        ops,
        GATEWAY_HANDOVER_UNIT,
        since,
        lambda u: u.active_state == "active",
        timeout=starting,
        before=before,
    )
    if failed:
        await t.run(f"systemctl stop {GATEWAY_HANDOVER_UNIT}", root=True)
        raise NodeError(
            t.node,
            "failed",
            "the new gateway did not start; the running one keeps serving, with the new files "
            f"in place (its next restart takes them): {failed}",
        )
    primary = await ops.show(GATEWAY_UNIT)
    old_pid = primary.main_pid if primary else 0
    since = await ops.date()
    report(who, "hand-over serving; restarting the gateway (it drains)")
    await must(t, f"systemctl restart --no-block {GATEWAY_UNIT}", "restart the gateway")
    failed = await _until(
        ops,
        GATEWAY_UNIT,
        since,
        lambda u: u.active_state == "active" and u.main_pid not in (0, old_pid),
        timeout=stopping + starting,
        before=primary,
    )
    if failed:
        # The hand-over keeps serving: leave it running rather than refuse every request.
        raise NodeError(t.node, "failed", f"{failed}\n{GATEWAY_HANDOVER_UNIT} keeps serving meanwhile")
    report(who, "restarted; stopping the hand-over gateway (it drains)")
    await must(t, f"systemctl stop --no-block {GATEWAY_HANDOVER_UNIT}", "stop the hand-over gateway")
    stopped = None
    async for _ in attempts(stopping, 0.5):
        if (stopped := await _stopped(ops, GATEWAY_HANDOVER_UNIT)) is not None:
            break
    if stopped is None:
        raise NodeError(t.node, "failed", f"{GATEWAY_HANDOVER_UNIT} did not stop within {stopping:g}s")
    report(who, "handed over")


async def _stopped(ops: ShellOps, unit: str) -> bool | None:
    state = await ops.show(unit)
    return True if state is None or state.active_state in ("inactive", "failed") else None


async def _until(
    ops: ShellOps,
    unit: str,
    since: str,
    done: Callable[[UnitState], bool],
    *,
    timeout: float,
    before: UnitState | None,
) -> str:
    """Wait until ``unit`` is ``done``; "" then, else why not with its journal's tail (it
    failed, systemd restarts it after a failure, or the time ran out)."""
    restarts = before.n_restarts if before else 0

    async def step() -> str | None:
        state = await ops.show(unit)
        if state is None:
            return f"{unit}: systemd does not know it"
        if done(state):
            return ""
        if state.active_state == "failed" or state.sub_state == "auto-restart" or state.n_restarts > restarts:
            return f"{unit} {state.active_state}/{state.sub_state}"
        return None

    why = None
    async for _ in attempts(timeout, 0.5):
        if (why := await step()) is not None:
            break
    if why == "":
        return ""
    why = why or f"{unit} not ready within {timeout:g}s"
    tail = await ops.journal(unit, since, 30)
    return f"{why}\n{tail.strip()}"


def _health_url(spec: ClusterSpec, host: str) -> str:
    listen_host, _, port = spec.gateway.listen.rpartition(":")
    listen_host = listen_host.strip("[]")
    if listen_host in ("0.0.0.0", "::", ""):
        node = next((n for n in spec.nodes if n.name == host), None)
        listen_host = "127.0.0.1" if host in LOCAL_NAMES else (node.address if node else host)
    if ":" in listen_host:
        listen_host = f"[{listen_host}]"
    return f"http://{listen_host}:{port}/health"


async def _wait(
    t: Transport, spec: ClusterSpec, host: str, report: Report, who: str, *, timeout: float = 30
) -> Outcome:
    """Ready when ``/health`` answers 200; when it cannot be reached from here, when the
    unit has stayed active for a few seconds. A unit that fails is reported with its journal."""
    watch = await UnitWatch.start(ShellOps(t), GATEWAY_UNIT)
    url = _health_url(spec, host)
    # httpx (with click, rich and pygments it imports) only here: a gateway process that
    # imports this module for its cluster lock never installs a gateway
    import httpx  # noqa: PLC0415

    async with httpx.AsyncClient(timeout=2.0) as client:

        async def step() -> Outcome | None:
            failed = await watch.failure(lines=40)  # a Python traceback is long
            if failed:
                report(who, f"failed: {failed}", Phase.failed)
                return Outcome(who, False, failed)
            try:
                if (await client.get(url)).status_code == 200:
                    report(who, "ready", Phase.done)
                    return Outcome(who, True, f"ready at {url.removesuffix('/health')}")
            except httpx.TransportError:
                pass
            return None

        done = None
        async for _ in attempts(timeout, 0.5):
            if (done := await step()) is not None:
                break
    if done is not None:
        return done
    active = await t.run(f"systemctl is-active {GATEWAY_UNIT}")
    if active.stdout.strip() == "active":
        report(who, f"unit active; {url} did not answer from here", Phase.done)
        return Outcome(who, True, f"unit active; {url} did not answer from here")
    report(who, f"failed: {GATEWAY_UNIT} is {active.stdout.strip() or 'unknown'}", Phase.failed)
    return Outcome(who, False, f"{GATEWAY_UNIT} is {active.stdout.strip() or 'unknown'}")


def gateway_key_path(spec: ClusterSpec, *, systemd: bool) -> str:
    """Where the gateway's private key lives on the gateway host: beside its other files
    when apply installs it as a unit; in its state folder when it is run by hand."""
    return GATEWAY_KEY if systemd else f"{spec.gateway.state_dir.rstrip('/')}/ssh-key"


async def gateway_public_key(
    spec: ClusterSpec, conns: Connections, *, create: bool, host: str | None = None
) -> tuple[str | None, str]:
    """The public half of a gateway host's own key (``host``; None: ``gateway.host``) and
    the path of its private half there; with ``create``, the pair is made there first when
    missing (``ssh-keygen`` on that host: the private half never travels). ``(None, "")``
    with gateway.install off.

    An installed gateway's key belongs to ``llmgw-gateway`` (0600); a gateway run by hand
    (no systemd on its host) gets it in its state folder, owned by whoever runs apply
    there. A copy of the operator's key left by an older llmgw is deleted."""
    if not spec.gateway.install:
        return None, ""
    host = host or spec.gateway.host
    t = gateway_transport(conns, host)
    systemd = (await t.run("test -d /run/systemd/system")).ok
    path = gateway_key_path(spec, systemd=systemd)
    q, pub = shlex.quote(path), shlex.quote(path + ".pub")
    if create:
        if systemd:
            await ensure_gateway_account(t)
            folder = f"mkdir -p {GATEWAY_DIR} && chmod 755 {GATEWAY_DIR} {Path(GATEWAY_DIR).parent}"
            owner = f"chown {GATEWAY_ACCOUNT}: {q} {pub} && "
            old = f"rm -f {shlex.quote(OLD_OPERATOR_KEY)} && "
        else:
            folder, owner, old = f"mkdir -p {shlex.quote(str(Path(path).parent))}", "", ""
        await must_as(
            t,
            f"{folder} && {old}{{ [ -s {q} ] && [ -s {pub} ] || {{ rm -f {q} {pub} && "
            f"ssh-keygen -q -t ed25519 -N '' -C {GATEWAY_ACCOUNT}@{shlex.quote(host)} "
            f"-f {q} </dev/null >/dev/null; }}; }} && {owner}chmod 600 {q} && chmod 644 {pub}",
            "make the gateway's SSH key",
            root=systemd,
        )
    found = await t.run(f"cat {pub} 2>/dev/null", root=systemd)
    text = found.stdout.strip()
    if not text:
        return None, path
    if not valid_public_key(text):
        raise NodeError(host_subject(spec, host), "failed", f"{path}.pub on {host} is not an SSH public key")
    return text, path


async def gateway_public_keys(
    spec: ClusterSpec, conns: Connections, *, create: bool
) -> dict[str, tuple[str | None, str]]:
    """``gateway_public_key`` of every gateway host, by host (in ``gateway.all_hosts``'s order)."""
    hosts = spec.gateway.all_hosts
    found = await asyncio.gather(*(gateway_public_key(spec, conns, create=create, host=h) for h in hosts))
    return dict(zip(hosts, found, strict=True))


async def must_as(t: Transport, command: str, what: str, *, root: bool) -> None:
    result = await t.run(command, root=root)
    if not result.ok:
        raise NodeError(t.node, "failed", f"{what}: {(result.stderr or result.stdout).strip()}")

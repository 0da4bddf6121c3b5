"""Checks of one node: its facts (probe + doctor sections) and its part of the cluster file
in, findings out. Each check is a function of its own so that a test can feed it the bad
and the good case."""

from __future__ import annotations

from collections.abc import Callable

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node, ScalingMode
from llmgw_cli.core.doctor.facts import Collected, Finding, Limit, Severity
from llmgw_cli.core.hosts.root_folders import ROOT_FOLDERS, ancestors, fix, problem
from llmgw_cli.core.observe.facts import IbPort, PortState, ReplicaUnit
from llmgw_cli.core.observe.gpu_faults import faulty_cards, xid_notes
from llmgw_cli.core.observe.hardware import gpu_class, same_class
from llmgw_cli.core.observe.health import ReplicaState, describe
from llmgw_cli.core.observe.parse.probe import engine_binaries
from llmgw_cli.core.observe.parse.units import replica_units

Check = Callable[[ClusterSpec, Node, Collected], list[Finding]]

WEIGHTS_FREE_FRACTION = 0.05  # below 5 % free a weights folder is "nearly full"

# Debian/Ubuntu packages of the libraries engines most often miss.
LIBRARY_PACKAGES = {
    "libgomp.so.1": "libgomp1",
    "libstdc++.so.6": "libstdc++6",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4",
    "libssl.so.3": "libssl3",
    "libibverbs.so.1": "libibverbs1",
    "libcuda.so.1": "the NVIDIA driver's libnvidia-compute / libcuda1 package",
}

UNREACHABLE_FIX = {
    "unreachable": "check that the node is up, that `address` is right and that port 22 is open",
    "auth": "install the control host's public key in the login user's ~/.ssh/authorized_keys",
    "hostkey-unknown": "add the node to known_hosts (ssh-keyscan, checked out of band) "
    "or set ssh.accept_unknown_hosts: true once",
    "hostkey-changed": "find out why the host key changed; if the node was reinstalled, "
    "remove its old line from known_hosts",
    "timeout": "the node answers too slowly; check its load, or raise ssh.command_timeout",
    "sudo": "give the login user passwordless sudo (NOPASSWD) or log in as root",
    "bad-output": "the node's probe output was cut off or not in the probe's format: check that "
    "the node has GNU coreutils (base64, dd) and findutils (find -printf), and that nothing on "
    "the node kills the login shell early",
}


def _finding(node: Node, check: str, severity: Severity, message: str, fix: str) -> Finding:
    return Finding(node=node.name, check=check, severity=severity, message=message, fix=fix)


def check_engines(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """Every profile's program must be on the node and loadable: a binary whose library is
    "not found" registers, looks healthy and fails every replica (exit 127)."""
    found = {e.path: e for e in c.facts.engines}
    used = {m.profile for m in spec.models if m.mode is not ScalingMode.off}
    findings = []
    for binary in engine_binaries(spec):
        names = [n for n, p in spec.profiles.items() if p.argv0[0] == binary]
        profiles = ", ".join(names)
        # A profile no model uses (or only switched-off ones) breaks nothing yet.
        severity = Severity.error if used & set(names) else Severity.warning
        engine = found.get(binary)
        if engine is None:
            continue  # not probed (older script); nothing to say
        if not engine.found:
            findings.append(
                _finding(
                    node,
                    "engine.missing",
                    severity,
                    f"{binary} (profile {profiles}) is not installed or not on PATH",
                    f"install the engine on {node.name}, or give the profile's `command` its absolute path",
                )
            )
        elif engine.missing_libraries:
            libs = ", ".join(engine.missing_libraries)
            packages = sorted(
                {LIBRARY_PACKAGES[lib] for lib in engine.missing_libraries if lib in LIBRARY_PACKAGES}
            )
            how = (
                f"apt-get install {' '.join(packages)}"
                if packages
                else "install the package that provides it"
            )
            findings.append(
                _finding(
                    node,
                    "engine.libraries",
                    severity,
                    f"{binary} (profile {profiles}) cannot start: ldd finds no {libs}",
                    f"{how} (check with `ldd $(command -v {binary}) | grep 'not found'`)",
                )
            )
    return findings


def check_cpu(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """A CPU without AVX2/FMA (a VM on QEMU's kvm64 model) runs CPU inference several times
    slower, and engines built for AVX2 die with 'illegal instruction'. On a node without
    GPUs every replica runs on that CPU: an error; with GPUs, a warning."""
    cpu = c.facts.cpu
    if cpu is None or not cpu.flags_missing:
        return []
    vm = " (a virtual machine)" if cpu.virtual else ""
    return [
        _finding(
            node,
            "cpu.flags",
            Severity.warning if c.facts.gpus else Severity.error,
            f"CPU {cpu.model or '?'}{vm} lacks {', '.join(cpu.flags_missing)}",
            "set the VM's CPU type to `host` (or x86-64-v3 or newer) and restart it"
            if cpu.virtual or "KVM" in cpu.model
            else "this CPU is too old for CPU inference; serve GPU models only on this node",
        )
    ]


def _limit_text(limit: Limit | None) -> str:
    if limit is None:
        return "unknown"
    return limit if isinstance(limit, str) else f"{limit // 1024} KiB"


def check_memlock(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """RDMA pins memory: a locked-memory limit below unlimited makes NCCL's ibv_reg_mr fail
    (ENOMEM). llmgw's units set LimitMEMLOCK=infinity; a unit that has less (an old unit, a
    drop-in) breaks its replica. limits.conf does not apply to services, only to logins."""
    if node.fabric is None:
        return []
    findings = [
        _finding(
            node,
            "memlock.unit",
            Severity.error,
            f"{unit} runs with LimitMEMLOCK={_limit_text(limit)}: RDMA (NCCL over InfiniBand) fails",
            f"remove the drop-in that lowers it (`systemctl cat {unit}`), then `llmgw apply`",
        )
        for unit, limit in sorted(c.doctor.unit_memlock.items())
        if limit != "unlimited"
    ]
    if c.doctor.memlock_soft is not None and c.doctor.memlock_soft != "unlimited":
        findings.append(
            _finding(
                node,
                "memlock.login",
                Severity.warning,
                f"locked-memory limit of logins is {_limit_text(c.doctor.memlock_soft)} "
                f"(hard {_limit_text(c.doctor.memlock_hard)}): NCCL tests or engines started by hand "
                "over SSH fail to register RDMA memory (llmgw's units are not affected)",
                "add `* - memlock unlimited` to /etc/security/limits.d/rdma.conf and log in again",
            )
        )
    return findings


def _port_fix(port: IbPort) -> str:
    if port.state is PortState.init:
        if port.link_layer.lower() == "ethernet":
            return "RoCE port stuck in INIT: check the Ethernet link and the adapter's firmware"
        return "start a subnet manager: `opensm` on one host of the fabric, or enable the switch's SM"
    if port.state is PortState.down:
        return "no physical link: check the cable, the switch port, and `ibstat` on the node"
    if port.state is PortState.armed:
        return "the subnet manager configured the port but did not activate it; check the SM's log"
    return "check the port with `ibstat`"


def check_fabric(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """A node on a fabric: every declared adapter present with an ACTIVE port (or, with no
    adapter declared, at least one ACTIVE port). Otherwise multi-node replicas skip it."""
    if node.fabric is None:
        return []
    ports = list(c.facts.ib_ports)
    findings = []
    for hca in node.hcas:
        label = f"{hca.name}:{hca.port}" if hca.port else hca.name
        mine = [p for p in ports if p.hca == hca.name and (hca.port is None or p.port == hca.port)]
        if not mine:
            present = ", ".join(sorted({p.hca for p in ports})) or "none"
            findings.append(
                _finding(
                    node,
                    "ib.adapter-absent",
                    Severity.error,
                    f"declared adapter {label} is not on the node (adapters found: {present})",
                    "correct `hcas` in the cluster file, or load the adapter's driver (mlx5_core, "
                    "`ibstat` lists what the kernel sees)",
                )
            )
            continue
        findings += [
            _finding(
                node,
                "ib.port-not-active",
                Severity.error,
                f"{p.hca} port {p.port} is {p.reason}",
                _port_fix(p),
            )
            for p in mine
            if p.state is not PortState.active
        ]
    if not node.hcas and not any(p.state is PortState.active for p in ports):
        findings.append(
            _finding(
                node,
                "ib.no-active-port",
                Severity.error,
                f"node is on fabric {node.fabric} but has no ACTIVE InfiniBand/RoCE port"
                + (f" ({'; '.join(f'{p.hca}:{p.port} {p.reason}' for p in ports)})" if ports else ""),
                _port_fix(ports[0])
                if ports
                else "install the adapter's driver, or remove `fabric` from the node",
            )
        )
    return findings


FABRIC_DONE = {"completed", "n/a", "not supported", ""}
FABRIC_OK_STATUS = {"success", "n/a", "not supported", ""}


def check_fabric_manager(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """On NVSwitch systems CUDA refuses to start ('system not yet initialized') until the
    fabric manager has trained the NVSwitch fabric: nvidia-smi's Fabric State is then
    'Completed', Status 'Success'."""
    pending = [
        f
        for f in c.doctor.fabric
        if f.state.lower() not in FABRIC_DONE or f.status.lower() not in FABRIC_OK_STATUS
    ]
    manager = c.doctor.fabric_manager
    if pending:
        states = sorted({f"{f.state}/{f.status}" for f in pending})
        running = "not installed" if manager is None else manager
        return [
            _finding(
                node,
                "gpu.fabric-manager",
                Severity.error,
                f"NVSwitch fabric not ready on {len(pending)} GPU(s) (State/Status {', '.join(states)}; "
                f"nvidia-fabricmanager {running}): CUDA will not start",
                "`systemctl enable --now nvidia-fabricmanager` (its version must match the driver's "
                "exactly; see `journalctl -u nvidia-fabricmanager`)",
            )
        ]
    if manager == "failed":
        return [
            _finding(
                node,
                "gpu.fabric-manager",
                Severity.error,
                "nvidia-fabricmanager has failed",
                "`journalctl -u nvidia-fabricmanager` (a version that differs from the driver's "
                "is the usual cause), then `systemctl restart nvidia-fabricmanager`",
            )
        ]
    return []


def check_weights(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """Declared weights folders must exist; one with less than 5 % free is nearly full."""
    findings = [
        _finding(
            node,
            "weights.missing",
            Severity.error,
            f"weights folder {w.path} does not exist: models expected there cannot start",
            f"mount the shared storage on {node.name}"
            if w.shared
            else f"`mkdir -p {w.path}` and put the weights there",
        )
        for w in c.facts.weights
        if not w.present
    ]
    for disk in c.doctor.disks:
        if disk.total_bytes and disk.free_bytes < disk.total_bytes * WEIGHTS_FREE_FRACTION:
            percent = 100 * disk.free_bytes / disk.total_bytes
            findings.append(
                _finding(
                    node,
                    "weights.nearly-full",
                    Severity.warning,
                    f"weights folder {disk.path} is nearly full: {disk.free_bytes / 2**30:.1f} GiB free "
                    f"({percent:.1f} %)",
                    "remove weights no model uses, or grow the file system, before fetching more",
                )
            )
    return findings


def _our_ports(c: Collected) -> set[int]:
    """Ports llmgw's own running replicas hold on this node (port and port + 1)."""
    return {p for u in replica_units(c.facts) if u.up and u.port for p in (u.port, u.port + 1)}


def check_ports(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """A port of a profile's range held by something that is not an llmgw replica: the
    replica given that port exits at once with 'address already in use'."""
    if not c.doctor.listeners_known:
        return [
            _finding(
                node,
                "ports.unknown",
                Severity.info,
                "listening ports could not be read (no `ss`, no /proc/net/tcp)",
                "install iproute2",
            )
        ]
    ours = _our_ports(c)
    findings = []
    seen: set[int] = set()
    for listener in sorted(c.doctor.listeners, key=lambda x: x.port):
        if listener.port in seen:
            continue
        profiles = [n for n, p in spec.profiles.items() if p.ports.first <= listener.port <= p.ports.last]
        if not profiles:
            continue
        # ss names the process's unit when it may; else a running replica's label says it.
        mine = listener.unit.startswith("llmgw-") if listener.unit is not None else listener.port in ours
        if mine:
            continue
        seen.add(listener.port)
        who = f"{listener.process} (pid {listener.pid})" if listener.pid else "another program"
        ranges = ", ".join(
            f"{n} {spec.profiles[n].ports.first}-{spec.profiles[n].ports.last}" for n in profiles
        )
        findings.append(
            _finding(
                node,
                "ports.taken",
                Severity.error,
                f"port {listener.port} (profile {ranges}) is taken by {who}: a replica given it "
                "fails with 'address already in use'",
                "stop that program, or move the profile's `ports` range away from it",
            )
        )
    return findings


def check_gpus(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """The driver must answer, and declared GPUs be there; faulty cards are left out by
    placement (and the gateway replaces the replicas on them), so each is a warning that
    says why and what to do (``core/observe/gpu_faults.py``, NVIDIA's XID catalog in
    ``core/observe/xid.py``). XID reports that take no card out are info."""
    facts = c.facts
    findings = []
    if facts.gpu_tool != "ok" and node.gpus is not None:
        findings.append(
            _finding(
                node,
                "gpu.driver",
                Severity.error,
                f"nvidia-smi {facts.gpu_tool}: the GPUs cannot be seen",
                "install the NVIDIA driver (nvidia-smi must list the GPUs), or reboot after an upgrade",
            )
        )
    elif node.gpus is not None:
        matching = [g for g in facts.gpus if same_class(gpu_class(g.name), node.gpus.gpu_class)]
        if len(matching) < node.gpus.count:
            findings.append(
                _finding(
                    node,
                    "gpu.count",
                    Severity.warning,
                    f"declared {node.gpus.count} x {node.gpus.gpu_class}, found {len(matching)}"
                    + (f" (lost: {', '.join(facts.lost_gpus)})" if facts.lost_gpus else "")
                    + ": a card nvidia-smi does not list has fallen off the bus (XID 79) or is disabled",
                    "drain the node and reboot it; reseat or replace (RMA) a card that falls off again "
                    "(`lspci | grep -i nvidia` shows what the bus holds); or correct `gpus`",
                )
            )
    findings += [
        _finding(
            node,
            "gpu.faulty",
            Severity.warning,
            f"GPU {card.gpu} is faulty ({'; '.join(card.reasons)}): placement leaves it out and "
            "the gateway replaces the replicas on it",
            card.action,
        )
        for card in faulty_cards(facts)
    ]
    findings += [_finding(node, "gpu.xid", Severity.info, note, "") for note in xid_notes(facts)]
    if facts.kernel_log == "unreadable" and node.gpus is not None:
        findings.append(
            _finding(
                node,
                "gpu.kernel-log",
                Severity.warning,
                "the probe cannot read the kernel log (neither `journalctl -k` nor `dmesg`): NVIDIA's "
                "XID reports of a failing card are not seen",
                "run `llmgw apply` (it installs the node helper that reads it as root), or let the "
                "probe's account read the journal (group systemd-journal)",
            )
        )
    return findings


def _holds(path: str) -> str:
    """Which folders root writes in ``path`` is, or holds."""
    if path in ROOT_FOLDERS:
        return "root writes in it"
    held = [f for f in ROOT_FOLDERS if path in ancestors(f)]
    if held:
        return f"it holds {', '.join(held)}, where root writes"
    return "a link on the way to a folder root writes in leads through it"


def check_root_folders(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """Root writes units, the helper, secrets and drain markers in folders that only root
    may change. A folder (or one above it) that another account owns or may write lets
    that account swap the folder or its files, or plant a link root then writes through:
    root's next `llmgw apply` writes where that account chose. Folders not there are fine."""
    findings = []
    for entry in c.doctor.root_folders:
        wrong = problem(entry)
        if wrong is None:
            continue
        findings.append(
            _finding(
                node,
                "node.root-folder",
                Severity.error,
                f"{entry.path} is {wrong}; {_holds(entry.path)}: another account could swap the "
                "files root writes there (or plant a link root writes through) and so act as root",
                f"`{fix(entry)}` on {node.name}",
            )
        )
    return findings


JOURNAL_LINES = 5  # of a failing replica's journal, in its finding


def failing_units(c: Collected) -> list[ReplicaUnit]:
    """The node's replica units whose engine crash-loops or failed (``core/observe/health.py``):
    the ones whose journal the doctor reads (``Collected.journals``)."""
    return [
        u for u in replica_units(c.facts) if u.health() in (ReplicaState.crash_looping, ReplicaState.failed)
    ]


def check_replicas(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """A replica unit whose engine crash-loops or failed: it serves nothing, and the last
    lines of its journal say why."""
    findings = []
    for u in failing_units(c):
        state = u.health()
        message = f"{u.name} ({u.model}#{u.replica}) is {describe(state, u.state)}"
        lines = c.journals.get(u.name, ())
        if lines:
            message += "; its journal ends:\n" + "\n".join(f"  {line}" for line in lines)
        findings.append(
            _finding(
                node,
                f"replica.{state.value}",
                Severity.error,
                message,
                f"read the rest of its journal (`llmgw logs {u.model}#{u.replica}`, or `journalctl -u "
                f"{u.name} -n 50` on {node.name}), fix the cause, then `llmgw apply` starts it again",
            )
        )
    return findings


NODE_CHECKS: tuple[Check, ...] = (
    check_engines,
    check_cpu,
    check_gpus,
    check_fabric_manager,
    check_memlock,
    check_fabric,
    check_weights,
    check_ports,
    check_root_folders,
    check_replicas,
)


def check_node(spec: ClusterSpec, node: Node, c: Collected) -> list[Finding]:
    """Every check of one node; an unreachable node gets one finding saying why."""
    if not c.facts.reachable:
        kind = c.facts.error_kind or "unreachable"
        return [
            _finding(
                node,
                "node.unreachable",
                Severity.error,
                f"not checked: {c.facts.error}",
                UNREACHABLE_FIX.get(kind, "check the node's SSH settings in the cluster file"),
            )
        ]
    return [f for check in NODE_CHECKS for f in check(spec, node, c)]

"""Faults injected into a running lab node, and what a node reports about itself.

``parse_fault`` is pure (arguments in, a Fault value out). ``inject`` changes the node
from outside: files through ``/proc/<pid1>/root`` (the node's own mount namespace, so
the host's files are never touched), services through ``nsenter`` into the node, the
link on the host side of the node's veth (the node cannot bring it back itself).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

from llmgw_cli.errors import LabError, UsageError
from llmgw_cli.lab import kmsg, nodefs
from llmgw_cli.lab.host import LabRecord, NodeRecord, sh
from llmgw_cli.lab.shapes import (
    PortState,
    ShapeKind,
    gpu_state,
    gpu_state_json,
    node_shape,
    port_files,
    port_lid,
)

USAGE = (
    "faults: ib-port HCA[:PORT] init|down|active, "
    "gpu N reset-required|lost|ecc|remap-pending|remap-failed|healthy, "
    "gpu N xid CODE (an XID report in the node's kernel log), "
    "node unreachable|reachable, ssh stop|start, hostkey rotate|restore, clear (all of them healed)"
)
GPU_STATES = ("reset-required", "lost", "ecc", "remap-pending", "remap-failed", "healthy")
_CHOICES = {
    "ib-port": ("init", "down", "active"),
    "gpu": (*GPU_STATES, "xid"),
    "node": ("unreachable", "reachable"),
    "ssh": ("stop", "start"),
    "hostkey": ("rotate", "restore"),
    "clear": (),
}


MAX_XID = 9999


@dataclass(frozen=True)
class Fault:
    kind: str  # a key of _CHOICES
    action: str
    target: str = ""  # the HCA (with ":port") or the GPU index
    port: int = 1
    code: int = 0  # gpu ... xid CODE


def parse_fault(kind: str, args: list[str]) -> Fault:
    """``llmgw lab fault NODE <kind> <args...>`` as a value; a wrong form is a UsageError."""
    if kind not in _CHOICES:
        raise UsageError(f"unknown fault {kind!r}; {USAGE}")
    if kind == "clear":
        if args:
            raise UsageError(f"clear takes no arguments; {USAGE}")
        return Fault(kind, kind)
    takes_target = kind in ("ib-port", "gpu")
    if kind == "gpu" and args[1:2] == ["xid"]:
        if len(args) != 3 or not args[0].isdigit() or not args[2].isdigit() or int(args[2]) > MAX_XID:
            raise UsageError(f"gpu: the form is `gpu N xid CODE` (CODE a number up to {MAX_XID}); {USAGE}")
        return Fault(kind, "xid", args[0], code=int(args[2]))
    if len(args) != (2 if takes_target else 1):
        raise UsageError(f"wrong arguments for {kind!r}; {USAGE}")
    action = args[-1]
    if action not in _CHOICES[kind]:
        raise UsageError(f"{kind}: {action!r} is not one of {', '.join(_CHOICES[kind])}")
    if kind == "gpu":
        if not args[0].isdigit():
            raise UsageError(f"gpu: {args[0]!r} is not a GPU index")
        return Fault(kind, action, args[0])
    if kind == "ib-port":
        name, _, port = args[0].partition(":")
        if port and not port.isdigit():
            raise UsageError(f"ib-port: {args[0]!r} is not HCA or HCA:PORT")
        return Fault(kind, action, name, int(port or 1))
    return Fault(kind, action)


def find_node(record: LabRecord, name: str) -> NodeRecord:
    for node in record.nodes:
        if node.name == name:
            return node
    raise UsageError(f"no node {name!r} in the lab ({', '.join(n.name for n in record.nodes)})")


def node_root(node: NodeRecord) -> Path:
    """The node's / as seen from the host (through its PID 1)."""
    root = Path(f"/proc/{node.pid1}/root")
    if not (root / "etc/lab").is_dir():
        raise LabError(f"{node.name} is not running (PID 1 {node.pid1} is gone)")
    return root


def in_node(node: NodeRecord, *cmd: str, check: bool = True) -> str:
    return sh("nsenter", "-t", str(node.pid1), "-a", *cmd, check=check).stdout


def _atomic_write(path: Path, text: str, mode: int = 0o644) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, prefix=".lab-") as f:
        f.write(text)
    tmp = Path(f.name)
    tmp.chmod(mode)
    tmp.replace(path)


def inject(record: LabRecord, node: NodeRecord, fault: Fault) -> str:
    """Apply ``fault`` to ``node``; returns a one-line description of what changed."""
    root = node_root(node)
    if fault.kind == "ib-port":
        shape = node_shape(ShapeKind(record.shape), node.index)
        hca = next((h for h in shape.hcas if h.name == fault.target), None)
        port_dir = root / "sys/class/infiniband" / fault.target / "ports" / str(fault.port)
        if hca is None or not port_dir.is_dir():
            raise UsageError(f"{node.name} has no InfiniBand port {fault.target}:{fault.port}")
        files = port_files(hca, PortState(fault.action), port_lid(node.index, hca))
        for name, text in files.items():
            _atomic_write(port_dir / name, text)
        return f"{node.name}: {fault.target} port {fault.port} is {files['state'].strip().split(': ')[-1]}"
    if fault.kind == "gpu":
        return _gpu(root, node, int(fault.target), fault.action, fault.code)
    if fault.kind == "node":
        link = "down" if fault.action == "unreachable" else "up"
        sh("ip", "link", "set", f"lgwv{node.index}", link)
        return f"{node.name}: link {link}"
    if fault.kind == "clear":
        return _clear(record, root, node)
    if fault.kind == "ssh":
        in_node(node, "systemctl", fault.action, "ssh.service")
        return f"{node.name}: sshd {'stopped' if fault.action == 'stop' else 'started'}"
    return _hostkey(root, node, fault.action)


def _gpu(root: Path, node: NodeRecord, index: int, action: str, code: int = 0) -> str:
    path = root / "etc/lab/gpus.json"
    doc = json.loads(path.read_text())
    gpus = [g for g in doc["gpus"] if g["index"] == index]
    if not gpus:
        raise UsageError(f"{node.name} has no GPU {index} (it has {len(doc['gpus'])})")
    if action == "xid":
        line = kmsg.xid_line(gpus[0]["bus_id"], code, kmsg.uptime())
        kmsg.append(root, line)
        return f"{node.name}: GPU {index}: {line}"
    gpus[0]["state"] = action
    if action == "healthy":  # as after a reset: its XID reports are gone from the log
        kmsg.forget(root, gpus[0]["bus_id"])
    _atomic_write(path, json.dumps(doc, indent=1) + "\n")
    _atomic_write(root / "etc/lab/gpus.csv", nodefs.gpus_csv(doc))
    nodefs.write_smi_replay(root)
    return f"{node.name}: GPU {index} is {action}"


def _hostkey(root: Path, node: NodeRecord, action: str) -> str:
    """``rotate``: a new host key the clients' known_hosts does not have; ``restore``: the
    original one back. Either way sshd is restarted to serve it."""
    key = root / "etc/ssh/lab/ssh_host_ed25519_key"
    pub = key.with_name(key.name + ".pub")
    saved, saved_pub = key.with_name(key.name + ".orig"), pub.with_name(pub.name + ".orig")
    if action == "rotate":
        if not saved.exists():
            _atomic_write(saved, key.read_text(), 0o600)
            _atomic_write(saved_pub, pub.read_text())
        with tempfile.TemporaryDirectory() as tmp:
            nodefs.host_key(Path(tmp) / "k", node.name)
            _atomic_write(key, (Path(tmp) / "k").read_text(), 0o600)
            _atomic_write(pub, (Path(tmp) / "k.pub").read_text())
    else:
        if not saved.exists():
            return f"{node.name}: host key was never rotated"
        _atomic_write(key, saved.read_text(), 0o600)
        _atomic_write(pub, saved_pub.read_text())
        saved.unlink()
        saved_pub.unlink()
    in_node(node, "systemctl", "restart", "ssh.service")
    return f"{node.name}: host key {'rotated' if action == 'rotate' else 'restored'}"


def _clear(record: LabRecord, root: Path, node: NodeRecord) -> str:
    """Every fault healed: hardware as booted, link up, original host key, sshd running."""
    shape = node_shape(ShapeKind(record.shape), node.index)
    _atomic_write(root / "etc/lab/gpus.json", gpu_state_json(shape, node.name))
    _atomic_write(root / "etc/lab/gpus.csv", nodefs.gpus_csv(gpu_state(shape, node.name)))
    nodefs.write_smi_replay(root)
    kmsg.clear(root)
    for hca in shape.hcas:
        port_dir = root / "sys/class/infiniband" / hca.name / "ports/1"
        for name, text in port_files(hca, PortState.active, port_lid(node.index, hca)).items():
            _atomic_write(port_dir / name, text)
    sh("ip", "link", "set", f"lgwv{node.index}", "up")
    if (root / "etc/ssh/lab/ssh_host_ed25519_key.orig").exists():
        return _hostkey(root, node, "restore").replace("host key restored", "cleared")
    in_node(node, "systemctl", "start", "ssh.service")
    return f"{node.name}: cleared"

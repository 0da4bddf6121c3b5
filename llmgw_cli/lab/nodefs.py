"""One node's files before it boots: the overlay upper layer, the fake sysfs, CPU and memory.

Layout of ``<state>/nodes/<name>/``: ``upper/`` and ``work/`` (the root overlay),
``root/`` (its mount point), ``sysclass/{u,w}`` (overlay on ``/sys/class``), ``cpuinfo``
and ``meminfo`` (bind-mounted over ``/proc``), ``binds`` (read-only bind mounts),
``console.log``. Everything is on the lab tmpfs, never on the host's root filesystem.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llmgw_cli.core.observe.parse.nvidia_smi import HEALTH_FIELDS, QUERY_FIELDS
from llmgw_cli.lab import kmsg, shapes, smi, weights
from llmgw_cli.lab.engine_args import SGLANG_VERSION, VLLM_VERSION
from llmgw_cli.lab.host import NodeRecord

LAB_UID = 4242  # the `llmgw` account engines run as (profiles default to `user: llmgw`)
# Units that would act on the host through shared kernel state (modules, binfmt, the
# sysctls are read-only anyway) or that a node does not need (consoles, clocks, utmp).
MASKED = (
    "systemd-modules-load.service",
    "systemd-sysctl.service",
    "systemd-binfmt.service",
    "proc-sys-fs-binfmt_misc.automount",
    "systemd-remount-fs.service",
    "systemd-update-utmp.service",
    "systemd-journal-flush.service",
    "e2scrub_reap.service",
    "systemd-timesyncd.service",
    "systemd-pstore.service",
    "getty.target",
    "console-getty.service",
)
LAB_TARGET = """[Unit]
Description=llmgw lab node
Wants=systemd-journald.service ssh.service dbus.socket systemd-user-sessions.service
AllowIsolate=yes
"""


@dataclass(frozen=True)
class NodeInputs:
    """What every node gets from the host."""

    client_pubkey: str
    python: str
    llama_server: Path | None
    gguf: Path | None
    vllm_cpu: Path | None = None
    root_dirs: tuple[Path, ...] = ()  # host dirs under /root (Python, venv) bound into nodes


SMI_PROGRAM = "/usr/lib/lab/nvidia-smi.py"
SMI_REPLAY = "etc/lab/smi-replay"


def _replayed() -> list[list[str]]:
    """The nvidia-smi calls llmgw's probe makes: answered from files, not by starting Python."""
    fmt = "--format=csv,noheader,nounits"
    return [
        [f"--query-gpu={','.join(QUERY_FIELDS)}", fmt],
        [f"--query-gpu={','.join(HEALTH_FIELDS)}", fmt],
        ["topo", "-m"],
    ]


def smi_front() -> str:
    """/usr/bin/nvidia-smi: replays the probe's calls, hands anything else to the Python fake.

    Every node shares the host's 2 cores; a Python start-up per call made the simulation,
    not llmgw, the largest cost of probing 32 nodes. Real nodes run nvidia-smi on their own.
    """
    cases = "".join(f'  "{" ".join(argv)}") n={i};;\n' for i, argv in enumerate(_replayed()))
    return (
        "#!/bin/sh\n"
        "# Answers to llmgw's probe calls are rendered whenever the GPU state changes (lab up, lab fault).\n"
        f'r=/{SMI_REPLAY}\ncase "$*" in\n{cases}  *) exec {SMI_PROGRAM} "$@";;\nesac\n'
        'read -r rc < "$r/$n.rc"\ncat "$r/$n.out"\n[ -s "$r/$n.err" ] && cat "$r/$n.err" >&2\nexit "$rc"\n'
    )


def write_smi_replay(root: Path) -> None:
    """Render the replayed answers from the node's current /etc/lab state (``root`` is its /)."""
    folder = root / SMI_REPLAY
    folder.mkdir(parents=True, exist_ok=True)
    for i, argv in enumerate(_replayed()):
        out, err, code = smi.run(argv, str(root / "etc/lab/gpus.json"), str(root / "etc/lab/topo.txt"))
        for suffix, text in ((".out", out), (".err", err), (".rc", f"{code}\n")):
            tmp = folder / f".{i}{suffix}.tmp"
            tmp.write_text(text)
            tmp.replace(folder / f"{i}{suffix}")


def node_dir(state_dir: Path, name: str) -> Path:
    return state_dir / "nodes" / name


def _write(path: Path, text: str | bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, str):
        path.write_text(text, encoding="utf-8")
    else:
        path.write_bytes(text)
    path.chmod(mode)


def sshd_config(ip: str) -> str:
    return (
        "HostKey /etc/ssh/lab/ssh_host_ed25519_key\n"
        # the lab's key for every account, plus each account's own file, as on a stock
        # sshd: the gateway's key reaches llmgw-gateway through its home's authorized_keys
        "AuthorizedKeysFile /etc/ssh/lab/authorized_keys .ssh/authorized_keys\n"
        f"ListenAddress {ip}:22\n"
        "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "UsePAM no\nX11Forwarding no\nMaxStartups 200:30:400\nMaxSessions 100\n"
    )


def host_key(path: Path, comment: str) -> str:
    """Generate an ed25519 host key at ``path``; returns the public key line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, path.with_suffix(".pub")):
        p.unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )
    return path.with_suffix(".pub").read_text().strip()


def gpus_csv(doc: dict[str, object]) -> str:
    """The reference format (``index,name,memory,uuid,driver,health``) the engine simulator reads."""
    gpus = doc["gpus"]
    assert isinstance(gpus, list)
    return "".join(
        f"{g['index']},{g['name']},{g['memory_total_mib']},{g['uuid']},{doc['driver_version']},{g['state']}\n"
        for g in gpus
    )


def _accounts(upper: Path) -> None:
    """Host account files plus the `llmgw` user, as the node's own copies."""
    extra = {
        "passwd": f"llmgw:x:{LAB_UID}:{LAB_UID}:llmgw engines:/var/lib/llmgw:/usr/sbin/nologin\n",
        "group": f"llmgw:x:{LAB_UID}:\n",
        "shadow": "llmgw:!:19000::::::\n",
    }
    for name, line in extra.items():
        host = Path("/etc") / name
        text = host.read_text(encoding="utf-8") if host.exists() else ""
        if not any(row.startswith("llmgw:") for row in text.splitlines()):
            text += line
        _write(upper / "etc" / name, text, 0o640 if name == "shadow" else 0o644)
    home = upper / "var/lib/llmgw"
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, LAB_UID, LAB_UID)


def _engines(upper: Path, inputs: NodeInputs) -> None:
    for path, kind in (("opt/vllm/bin/vllm", "vllm"), ("opt/sglang/bin/python3", "sglang")):
        script = f'#!/bin/sh\nexec {inputs.python} -m llmgw_cli.lab.engine_sim {kind} "$@"\n'
        _write(upper / path, script, 0o755)
    # each venv's distribution metadata, where the probe reads an engine's version
    for prefix, name, version in (
        ("opt/vllm", "vllm", VLLM_VERSION),
        ("opt/sglang", "sglang", SGLANG_VERSION),
    ):
        info = upper / prefix / f"lib/python3.11/site-packages/{name}-{version}.dist-info/METADATA"
        _write(info, f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    # Ray's CLI beside vLLM, as a vLLM venv has it (for `multi_node: ray` profiles)
    _write(
        upper / "opt/vllm/bin/ray", f'#!/bin/sh\nexec {inputs.python} -m llmgw_cli.lab.ray_sim "$@"\n', 0o755
    )
    if inputs.llama_server is not None:
        link = upper / "usr/local/bin/llama-server"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(inputs.llama_server)
    if inputs.vllm_cpu is not None:
        # the cached venv itself, read-only to the engine account: /opt/vllm-cpu/bin/vllm
        link = upper / "opt/vllm-cpu"
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(inputs.vllm_cpu)


def _models(upper: Path, index: int) -> None:
    by_dir = {m.directory: m for m in weights.MODELS}
    for directory, state in weights.node_weights(index).items():
        for rel, data in weights.model_files(by_dir[directory], state).items():
            _write(upper / "data/models" / directory / rel, data)


def _sysclass(d: Path, shape: shapes.Shape, index: int) -> None:
    for hca in shape.hcas:
        for rel, text in shapes.hca_files(hca, index).items():
            _write(d / "sysclass/u/infiniband" / hca.name / rel, text)


def prepare(state_dir: Path, node: NodeRecord, inputs: NodeInputs) -> tuple[str, list[Path]]:
    """Write node ``node``'s files. Returns its host-key line for known_hosts and the
    upper dirs that must hide the host's copy (made opaque by the caller)."""
    d = node_dir(state_dir, node.name)
    upper = d / "upper"
    shape = shapes.node_shape(shapes.ShapeKind(node.shape), node.index)
    for sub in ("upper", "work", "root", "sysclass/u", "sysclass/w"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    _write(upper / "etc/hostname", node.name + "\n")
    _write(upper / "etc/machine-id", os.urandom(16).hex() + "\n", 0o444)
    # clean /root: the host's shell init would slow down every ssh command
    _write(upper / "root/.bashrc", 'PS1="\\h# "\n')
    _write(upper / "root/.profile", 'PS1="\\h# "\n')
    key = host_key(upper / "etc/ssh/lab/ssh_host_ed25519_key", node.name)
    # readable by every account: the lab key also logs in operators made for `become: sudo` tests
    _write(upper / "etc/ssh/lab/authorized_keys", inputs.client_pubkey + "\n", 0o644)
    _write(upper / "etc/ssh/sshd_config.d/00-lab.conf", sshd_config(node.ip))
    _write(upper / "etc/systemd/system/lab.target", LAB_TARGET)
    for unit in MASKED:
        (upper / "etc/systemd/system" / unit).symlink_to("/dev/null")
    _write(
        upper / "etc/systemd/journald.conf.d/lab.conf",
        "[Journal]\nStorage=volatile\nRuntimeMaxUse=16M\nRuntimeMaxFileSize=1M\n",
    )
    _accounts(upper)
    # simulated hardware
    doc = shapes.gpu_state(shape, node.name)
    _write(upper / "etc/lab/gpus.json", shapes.gpu_state_json(shape, node.name))
    _write(upper / "etc/lab/gpus.csv", gpus_csv(doc))
    _write(upper / "etc/lab/topo.txt", shapes.topo_matrix(shape))
    _write(upper / "etc/lab/shape", shape.kind + "\n")
    smi_source = Path(smi.__file__).read_text(encoding="utf-8")
    _write(upper / SMI_PROGRAM.lstrip("/"), f"#!{inputs.python} -IS\n" + smi_source, 0o755)
    _write(upper / "usr/bin/nvidia-smi", smi_front(), 0o755)
    write_smi_replay(upper)
    # the node's own kernel log (``lab/kmsg.py``): dmesg must never show the host's
    _write(upper / kmsg.KMSG, "")
    _write(upper / "usr/bin/dmesg", kmsg.DMESG, 0o755)
    _sysclass(d, shape, node.index)
    _write(d / "cpuinfo", shapes.cpuinfo(shape))
    _write(d / "meminfo", shapes.meminfo(shape))
    _models(upper, node.index)
    _engines(upper, inputs)
    binds = ""
    for src in inputs.root_dirs:  # hidden in nodes (clean /root, fresh /tmp): show these again
        if src.is_relative_to("/root"):
            (upper / src.relative_to("/")).mkdir(parents=True, exist_ok=True)
        binds += f"{src}\t{src}\n"
    (upper / "root").chmod(0o711)  # let the `llmgw` account reach them
    if inputs.gguf is not None:
        target = f"/data/models/{weights.GGUF_NAME}"
        _write(upper / target.lstrip("/"), b"")  # the bind mount's target
        binds += f"{inputs.gguf}\t{target}\n"
    _write(d / "binds", binds)
    return f"{node.ip} {' '.join(key.split()[:2])}", [upper / "root", upper / "etc/systemd/system"]


def ssh_config_block(name: str, ip: str, key: Path, known_hosts: Path) -> str:
    return (
        f"Host {name} {ip}\n  HostName {ip}\n  User root\n  IdentityFile {key}\n"
        f"  UserKnownHostsFile {known_hosts}\n  GlobalKnownHostsFile /dev/null\n"
        "  StrictHostKeyChecking yes\n  BatchMode yes\n  ConnectTimeout 5\n\n"
    )

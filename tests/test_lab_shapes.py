"""The lab's simulated hardware, checked against real captures (tests/fixtures/lab/)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from llmgw_cli.core.clusterfile.load import parse_cluster
from llmgw_cli.core.observe.parse.kernel_log import parse_xids
from llmgw_cli.core.observe.parse.nvidia_smi import HEALTH_FIELDS, parse_health
from llmgw_cli.errors import LabUnavailable, UsageError
from llmgw_cli.lab import cluster, fault, host, kmsg, shapes, smi, weights
from llmgw_cli.lab.host import LabRecord, NodeRecord

FIXTURES = Path(__file__).parent / "fixtures" / "lab"
REPO = Path(__file__).parent.parent


def _fixture(name: str) -> str:
    return "".join(
        line for line in (FIXTURES / name).read_text().splitlines(True) if not line.startswith("#")
    )


def test_hgx_topo_has_the_real_raw_layout() -> None:
    ours, real = shapes.topo_matrix(shapes.HGX), _fixture("topo_hgx-h100_8gpu_nv18_1nic_TABS.txt")
    o_lines, r_lines = ours.splitlines(), real.splitlines()
    # header starts with a TAB, ends with the same three affinity columns
    assert o_lines[0].startswith("\tGPU0\t") and r_lines[0].startswith("\tGPU0\t")
    assert o_lines[0].split("\t")[-3:] == r_lines[0].split("\t")[-3:]
    # a GPU row: self cell ' X ', NV18 elsewhere, empty field before GPU NUMA ID
    row = o_lines[1].split("\t")
    assert row[:9] == ["GPU0", " X "] + ["NV18"] * 7
    assert row[-2:] == ["", "N/A"]
    assert row[-4:-2] == ["0-47,96-143", "0"]
    # NIC rows end with four empty fields, as captured
    nic_row = next(line for line in o_lines if line.startswith("NIC0\t"))
    assert nic_row.endswith(" X \tNODE\tSYS\tSYS\t\t\t\t")
    assert next(line for line in r_lines if line.startswith("NIC0\t")).endswith(" X \t\t\t\t")
    # legend identical to the real one; NIC legend names the adapters
    assert (
        real[real.index("Legend:") : real.index("NIC Legend:")]
        == ours[ours.index("Legend:") : ours.index("NIC Legend:")]
    )
    assert ours.endswith("NIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n  NIC2: mlx5_2\n  NIC3: mlx5_3\n")


def test_topo_rows_are_one_field_wider_than_the_header() -> None:
    # as captured: the empty field before GPU NUMA ID has no header cell
    real = _fixture("topo_hgx-h100_8gpu_nv18_1nic_TABS.txt").split("\n\n")[0].splitlines()
    assert {len(line.split("\t")) for line in real[1:]} == {len(real[0].split("\t")) + 1}
    for shape in (shapes.HGX, shapes.PCIE):
        lines = shapes.topo_matrix(shape).split("\n\n")[0].splitlines()
        assert {len(line.split("\t")) for line in lines[1:]} == {len(lines[0].split("\t")) + 1}


def test_pcie_topo_bridges_pairs_only() -> None:
    rows = {
        line.split("\t")[0]: line.split("\t")[1:]
        for line in shapes.topo_matrix(shapes.PCIE).splitlines()[1:6]
    }
    assert rows["GPU0"][:4] == [" X ", "NV12", "SYS", "SYS"]
    assert rows["GPU2"][:4] == ["SYS", "SYS", " X ", "NV12"]
    assert rows["GPU0"][4] == "PHB" and rows["GPU3"][4] == "SYS"
    assert rows["NIC0"][:5] == ["PHB", "PHB", "SYS", "SYS", " X "]


def _doc(tmp_path: Path, shape: shapes.Shape = shapes.HGX) -> Path:
    path = tmp_path / "gpus.json"
    path.write_text(shapes.gpu_state_json(shape, "node01"))
    return path


def test_query_matches_the_real_csv_shape(tmp_path: Path) -> None:
    query = "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,pci.bus_id"
    out, errors, code = smi.run([query, "--format=csv,noheader,nounits"], str(_doc(tmp_path)))
    assert code == 0 and errors == ""
    ours = [line.split(", ") for line in out.splitlines()]
    real = [line.split(", ") for line in _fixture("nvidia-smi_query-gpu_h100-sxm-x8.csv").splitlines()]
    assert len(ours) == len(real) == 8
    for o, r in zip(ours, real, strict=True):
        assert (o[0], o[2], o[3], o[6]) == (r[0], r[2], r[3], r[6])
        assert o[1].startswith("GPU-") and len(o[1]) == len(r[1])


def test_units_and_header(tmp_path: Path) -> None:
    out, _, code = smi.run(
        ["--query-gpu", "index,memory.total,power.draw", "--format", "csv"], str(_doc(tmp_path))
    )
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "index, memory.total [MiB], power.draw [W]"
    assert lines[1] == "0, 81559 MiB, 68.50 W"
    out, _, _ = smi.run(["--query-gpu=memory.total", "--format=csv,nounits"], str(_doc(tmp_path)))
    assert out.splitlines()[:2] == ["memory.total [MiB]", "81559"]


def test_unknown_field_rejects_the_whole_query(tmp_path: Path) -> None:
    out, errors, code = smi.run(
        ["--query-gpu=index,retired_pages.bogus", "--format=csv"], str(_doc(tmp_path))
    )
    assert code != 0 and out == ""
    assert 'Field "retired_pages.bogus" is not a valid field to query.' in errors


def test_reset_required_gpu_shows_the_real_signals(tmp_path: Path) -> None:
    path = _doc(tmp_path)
    doc = json.loads(path.read_text())
    doc["gpus"][2]["state"] = "reset-required"
    path.write_text(json.dumps(doc))
    fields = "--query-gpu=index,temperature.gpu,utilization.gpu,memory.used,reset_status.reset_required"
    out, _, code = smi.run([fields, "--format=csv"], str(path))
    lines = out.splitlines()
    assert code == 0
    assert lines[3] == "2, [GPU requires reset], [GPU requires reset], 0 MiB, Yes"  # fixture [D]
    assert lines[1] == "0, 30, 0 %, 0 MiB, No"
    detail, _, _ = smi.run(["-q", "-i", "2"], str(path))
    assert "Reset Required                    : Yes" in detail
    assert "System is not in ready state" in detail and "Unknown Error" in detail
    healthy, _, _ = smi.run(["-q", "-i", "1"], str(path))
    assert "Reset Required                    : No" in healthy and "not in ready state" not in healthy
    assert "GPU 00000000:64:00.0" in healthy and "GPU 00000000:53:00.0" not in healthy


def test_listing_topo_and_missing_driver(tmp_path: Path) -> None:
    topo = tmp_path / "topo.txt"
    topo.write_text(shapes.topo_matrix(shapes.PCIE))
    path = _doc(tmp_path, shapes.PCIE)
    out, _, _ = smi.run(["-L"], str(path))
    assert out.splitlines()[0].startswith("GPU 0: NVIDIA A100 80GB PCIe (UUID: GPU-")
    assert smi.run(["topo", "-m"], str(path), str(topo))[0] == topo.read_text()
    out, _, code = smi.run(["-L"], str(tmp_path / "absent.json"))
    assert code == 9 and "couldn't communicate with the NVIDIA driver" in out


def test_uuids_differ_between_nodes_and_are_stable() -> None:
    a, b = shapes.gpu_state(shapes.HGX, "node01"), shapes.gpu_state(shapes.HGX, "node02")
    ua = [g["uuid"] for g in json.loads(json.dumps(a))["gpus"]]
    ub = [g["uuid"] for g in json.loads(json.dumps(b))["gpus"]]
    assert len(set(ua) | set(ub)) == 16
    assert shapes.gpu_state(shapes.HGX, "node01") == a


def test_port_states_use_kernel_formats() -> None:
    hca = shapes.HGX.hcas[1]
    assert shapes.port_files(hca, shapes.PortState.init, 5)["state"] == "2: INIT\n"
    down = shapes.port_files(hca, shapes.PortState.down, 5)
    assert (down["state"], down["phys_state"]) == ("1: DOWN\n", "2: Polling\n")
    active = shapes.port_files(hca, shapes.PortState.active, 26)
    assert active["lid"] == "0x1a\n" and active["rate"] == "400 Gb/sec (4X NDR)\n"


def test_cpuinfo_has_avx512_and_the_thread_count() -> None:
    text = shapes.cpuinfo(shapes.HGX)
    assert text.count("processor\t:") == 192
    flags = next(line for line in text.splitlines() if line.startswith("flags")).split()
    assert {"avx2", "fma", "avx512f"} <= set(flags)
    assert shapes.meminfo(shapes.HGX).startswith("MemTotal:       2147483648 kB\n")


def test_weights_complete_and_partial() -> None:
    model = weights.MODELS[0]
    done = weights.model_files(model, weights.Download.complete)
    index = json.loads(done["model.safetensors.index.json"])
    assert set(index["weight_map"].values()) <= set(done)
    shard = done["model-00001-of-00004.safetensors"]
    (size,) = struct.unpack("<Q", shard[:8])
    assert json.loads(shard[8 : 8 + size]) == {"__metadata__": {"format": "pt"}}
    part = weights.model_files(model, weights.Download.part)
    assert "model-00004-of-00004.safetensors.part" in part
    assert "model-00004-of-00004.safetensors" not in part
    assert weights.node_weights(2)["Qwen2.5-7B-Instruct"] is weights.Download.part
    assert weights.node_weights(3)["Llama-3.1-405B-Instruct"] is weights.Download.incomplete
    assert "Llama-3.1-405B-Instruct" not in weights.node_weights(4)


@pytest.mark.parametrize(
    ("kind", "args", "expected"),
    [
        ("ib-port", ["mlx5_1", "init"], fault.Fault("ib-port", "init", "mlx5_1", 1)),
        ("ib-port", ["mlx5_0:2", "down"], fault.Fault("ib-port", "down", "mlx5_0", 2)),
        ("gpu", ["3", "reset-required"], fault.Fault("gpu", "reset-required", "3")),
        ("gpu", ["0", "lost"], fault.Fault("gpu", "lost", "0")),
        ("gpu", ["2", "ecc"], fault.Fault("gpu", "ecc", "2")),
        ("gpu", ["2", "remap-pending"], fault.Fault("gpu", "remap-pending", "2")),
        ("gpu", ["1", "xid", "79"], fault.Fault("gpu", "xid", "1", code=79)),
        ("node", ["unreachable"], fault.Fault("node", "unreachable")),
        ("ssh", ["stop"], fault.Fault("ssh", "stop")),
        ("hostkey", ["rotate"], fault.Fault("hostkey", "rotate")),
        ("clear", [], fault.Fault("clear", "clear")),
    ],
)
def test_parse_fault(kind: str, args: list[str], expected: fault.Fault) -> None:
    assert fault.parse_fault(kind, args) == expected


@pytest.mark.parametrize(
    ("kind", "args"),
    [
        ("gpu", ["x", "healthy"]),
        ("gpu", ["1", "broken"]),
        ("gpu", ["1", "xid"]),
        ("gpu", ["1", "xid", "seventy-nine"]),
        ("gpu", ["1", "xid", "100000"]),
        ("gpu", ["x", "xid", "79"]),
        ("gpu", ["1", "xid", "79", "again"]),
        ("disk", ["full"]),
        ("ssh", ["1", "stop"]),
        ("clear", ["now"]),
    ],
)
def test_parse_fault_refuses(kind: str, args: list[str]) -> None:
    with pytest.raises(UsageError):
        fault.parse_fault(kind, args)


def lab_record(n: int, shape: str, state: str = "/var/lib/llmgw-lab") -> LabRecord:
    nodes = [
        NodeRecord(name=shapes.node_name(i), index=i, ip=shapes.node_ip("10.213.0", i), shape=shape)
        for i in range(1, n + 1)
    ]
    return LabRecord(state_dir=state, shape=shape, cgroup="/sys/fs/cgroup/lgw", nodes=nodes)


def test_committed_lab_inventory_is_what_lab_up_writes() -> None:
    assert cluster.inventory(lab_record(4, "hgx")) == (REPO / "inventories/lab.yaml").read_text()


@pytest.mark.parametrize(("n", "shape"), [(4, "hgx"), (3, "pcie"), (5, "mixed"), (32, "hgx")])
def test_every_lab_inventory_validates(n: int, shape: str) -> None:
    spec = parse_cluster(cluster.inventory(lab_record(n, shape, "/srv/lab")), "cluster.yaml")
    assert [node.address for node in spec.nodes] == [f"10.213.0.{10 + i}" for i in range(1, n + 1)]
    assert spec.ssh.identity_file == "/srv/lab/id_ed25519"
    assert spec.ssh.known_hosts == "/srv/lab/known_hosts"
    counts = {node.gpus.count for node in spec.nodes if node.gpus}
    assert counts == {"hgx": {8}, "pcie": {4}, "mixed": {8, 4}}[shape]


def test_lab_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host.sys, "platform", "linux")
    monkeypatch.setattr(host.os, "geteuid", lambda: 1000)
    with pytest.raises(LabUnavailable, match="needs root"):
        host.require_host()
    monkeypatch.setattr(host.sys, "platform", "darwin")
    with pytest.raises(LabUnavailable, match="needs Linux"):
        host.require_host()
    assert LabUnavailable.exit_code == 2


def test_lost_gpu_has_no_row_and_fails_the_command(tmp_path: Path) -> None:
    path = _doc(tmp_path)
    doc = json.loads(path.read_text())
    doc["gpus"][1]["state"] = "lost"
    path.write_text(json.dumps(doc))
    out, _, code = smi.run(["--query-gpu=index,name", "--format=csv,noheader"], str(path))
    lines = out.splitlines()
    assert code == 15 and len(lines) == 8  # seven rows plus the message, in GPU order
    assert lines[1] == "Unable to determine the device handle for GPU 0000:64:00.0: Unknown Error"
    assert lines[0] == "0, NVIDIA H100 80GB HBM3" and lines[2].startswith("2, ")
    listing, _, code = smi.run(["-L"], str(path))
    assert code == 15 and "GPU 1:" not in listing and "GPU 2: NVIDIA" in listing
    assert smi.run(["-q", "-i", "0"], str(path))[2] == 0  # asking only for a healthy GPU succeeds


def test_memory_faults_show_in_the_fields_the_probe_asks(tmp_path: Path) -> None:
    path = _doc(tmp_path)
    doc = json.loads(path.read_text())
    for index, state in ((1, "ecc"), (2, "remap-pending"), (3, "remap-failed")):
        doc["gpus"][index]["state"] = state
    path.write_text(json.dumps(doc))
    fields = "--query-gpu=" + ",".join(HEALTH_FIELDS)
    out, _, code = smi.run([fields, "--format=csv,noheader,nounits"], str(path))
    assert code == 0
    assert parse_health(out) == {
        1: ["2 uncorrected ECC errors since boot"],
        2: ["row remapping pending (reset needed)"],
        3: ["row remapping failed (memory repair exhausted)"],
    }
    detail, _, _ = smi.run(["-q", "-i", "2"], str(path))
    assert "        Pending                           : Yes" in detail  # Remapped Rows


def test_an_injected_xid_line_reads_as_the_driver_writes_it() -> None:
    line = kmsg.xid_line("00000000:CA:00.0", 79, 1234.5)
    assert line == (
        "[ 1234.500000] NVRM: Xid (PCI:0000:ca:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    )
    (report,) = parse_xids(f"@xid {line}")
    assert (report.bus, report.code, report.seconds) == ("0000:ca:00", 79, 1234.5)
    assert parse_xids(f"@xid {kmsg.xid_line('00000000:CA:00.0', 48, 5.0)}")[0].detail.endswith(
        "ROBUST_CHANNEL_GPU_ECC_DBE"
    )


def test_reset_status_block_is_laid_out_like_the_capture(tmp_path: Path) -> None:
    path = _doc(tmp_path)
    doc = json.loads(path.read_text())
    doc["gpus"][2]["state"] = "reset-required"
    path.write_text(json.dumps(doc))
    real = _fixture("nvidia-smi_faulty_gpu_excerpts.txt")
    block = real[real.index("GPU Reset Status") :].splitlines()[:3]
    ours = smi.run(["-q", "-i", "2"], str(path))[0].splitlines()
    start = ours.index("    GPU Reset Status")
    assert [line[4:] for line in ours[start : start + 3]] == block  # same columns, one level deeper

"""Parsers against recorded real outputs (tests/fixtures, copied from the shared reference)."""

from collections.abc import Callable
from pathlib import Path

import pytest

from llmgw_cli.core.observe.facts import GpuHealth, PortState
from llmgw_cli.core.observe.parse.cpuinfo import parse_cpuinfo
from llmgw_cli.core.observe.parse.infiniband import nccl_ib_hca, parse_ib_ports
from llmgw_cli.core.observe.parse.nvidia_smi import parse_query_gpu
from llmgw_cli.core.observe.parse.systemctl import parse_show, unit_state
from llmgw_cli.core.observe.parse.topo import parse_topology

from .conftest import FIXTURES

Read = Callable[[str], str]
FIXTURE_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "utilization.gpu", "pci.bus_id")


def test_query_gpu_h100(fixture_text: Read) -> None:
    gpus, lost = parse_query_gpu(fixture_text("nvidia-smi_query-gpu_h100-sxm-x8.csv"), FIXTURE_FIELDS)
    assert lost == []
    assert [g.index for g in gpus] == list(range(8))
    assert {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert gpus[2].memory_used == 9221
    assert gpus[0].memory_total == 81559
    assert gpus[5].pci_bus_id == "00000000:A8:00.0"
    assert all(g.health is GpuHealth.healthy for g in gpus)


def test_query_gpu_reset_required_and_lost_gpu() -> None:
    text = (
        "0, GPU-a, NVIDIA H100 80GB HBM3, 81559, 0, 00000000:53:00.0\n"
        "Unable to determine the device handle for GPU 0000:64:00.0: Unknown Error\n"
        "2, GPU-c, NVIDIA H100 80GB HBM3, [GPU requires reset], [GPU requires reset], 00000000:75:00.0\n"
        "3, GPU-d, Odd, Name, 81559, 5, [N/A]\n"
    )
    gpus, lost = parse_query_gpu(text)
    assert lost == ["0000:64:00.0"]
    assert [(g.index, g.health) for g in gpus] == [(0, "healthy"), (2, "faulty"), (3, "healthy")]
    assert gpus[1].reasons == ("nvidia-smi reports [GPU requires reset]",)
    assert gpus[1].memory_total is None
    assert gpus[2].name == "Odd, Name"
    assert gpus[2].pci_bus_id is None


@pytest.mark.parametrize(
    ("name", "gpus", "peers", "sample"),
    [
        ("topo_hgx-h100_8gpu_nv18_1nic_TABS.txt", 8, 7, {(0, 7): "NV18"}),
        ("topo_hgx-h20_8gpu_nv18_8nic.txt", 8, 7, {(3, 4): "NV18"}),
        ("topo_hgx-h100_4gpu_nv6_4nic_truncated-legend.txt", 4, 3, {(1, 2): "NV6"}),
        ("topo_pcie-a30x4_nv4-pairs_1nic.txt", 4, 1, {(0, 1): "NV4", (1, 2): "SYS"}),
        ("topo_pcie-a100x4_nv12-pairs_no-legend.txt", 4, 1, {(2, 3): "NV12", (0, 3): "SYS"}),
        ("topo_pcie-rtx5090x2_phb_TABS.txt", 2, 0, {(0, 1): "PHB"}),
    ],
)
def test_topology(
    fixture_text: Read, name: str, gpus: int, peers: int, sample: dict[tuple[int, int], str]
) -> None:
    topo = parse_topology(fixture_text(name))
    assert topo is not None
    assert topo.gpus == tuple(range(gpus))
    assert [topo.nvlink_peers(g) for g in topo.gpus] == [peers] * gpus
    for (a, b), kind in sample.items():
        assert topo.link(a, b) == kind
        assert topo.link(b, a) == kind


def test_topology_nic_legend_names_adapters(fixture_text: Read) -> None:
    h20 = parse_topology(fixture_text("topo_hgx-h20_8gpu_nv18_8nic.txt"))
    assert h20 is not None
    # NICk is not mlx5_k: the legend decides
    assert h20.nics["NIC0"] == "mlx5_1"
    assert h20.gpu_nic["0-mlx5_1"] == "PIX"
    a30 = parse_topology(fixture_text("topo_pcie-a30x4_nv4-pairs_1nic.txt"))
    assert a30 is not None
    assert a30.gpu_nic == {"0-mlx5_0": "SYS", "1-mlx5_0": "SYS", "2-mlx5_0": "PXB", "3-mlx5_0": "PIX"}


def test_topology_legacy_mlx5_columns(fixture_text: Read) -> None:
    text = fixture_text("topo_legacy-format_dgx2-16gpu_mlx5-columns_excerpt.txt")
    # only rows GPU0-3 of 16 survive in the source: an incomplete matrix is unknown, not partial
    assert parse_topology(text) is None
    # the same layout cut to a complete 4-GPU matrix with one mlx5 column
    header, *rows = [line for line in text.splitlines() if line.strip()][:5]
    trimmed = "\t" + "\t".join([*header.split()[:4], "mlx5_0", "CPU Affinity"]) + "\n"
    for row in rows:
        cells = row.split()
        trimmed += "\t".join([*cells[:5], cells[17], cells[-1]]) + "\n"
    topo = parse_topology(trimmed)
    assert topo is not None
    assert topo.nics == {"mlx5_0": "mlx5_0"}
    assert topo.gpu_nic["2-mlx5_0"] == "PXB"
    assert topo.nvlink_peers(0) == 3


@pytest.mark.parametrize(
    "text", ["", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."]
)
def test_topology_unknown_is_none_not_zero_links(text: str) -> None:
    assert parse_topology(text) is None


def sysfs_lines(tree: Path) -> str:
    """What `grep -H . /sys/class/infiniband/*/ports/*/{state,phys_state,rate,link_layer}` prints."""
    out = []
    for path in sorted(tree.glob("*/ports/*/*")):
        if path.name in ("state", "phys_state", "rate", "link_layer"):
            rel = path.relative_to(tree)
            out.append(f"/sys/class/infiniband/{rel}:{path.read_text().strip()}")
    return "\n".join(out)


def test_infiniband_states_synthetic() -> None:
    ports = parse_ib_ports(sysfs_lines(FIXTURES / "sysfs_class_infiniband_SYNTHETIC_states"))
    by_hca = {p.hca: p for p in ports}
    assert by_hca["mlx5_0"].state is PortState.init
    assert "no subnet manager" in by_hca["mlx5_0"].reason
    assert by_hca["mlx5_1"].state is PortState.down
    assert by_hca["mlx5_1"].reason == "DOWN (Polling): no link"
    assert by_hca["mlx5_2"].state is PortState.active
    assert by_hca["mlx5_3"].link_layer == "Ethernet"
    assert nccl_ib_hca(ports) == "=mlx5_2:1,mlx5_3:1"


def test_infiniband_real_h100_ndr() -> None:
    ports = parse_ib_ports(sysfs_lines(FIXTURES / "sysfs_class_infiniband_h100_ndr_real"))
    ib = [p for p in ports if p.link_layer == "InfiniBand"]
    assert [p.hca for p in ib] == [
        "mlx5_0",
        "mlx5_1",
        "mlx5_4",
        "mlx5_5",
        "mlx5_6",
        "mlx5_7",
        "mlx5_8",
        "mlx5_9",
    ]
    assert {p.rate_gbps for p in ib} == {400.0}
    assert all(p.state is PortState.active for p in ib)


def test_systemctl_show_blocks_by_key_not_position(fixture_text: Read) -> None:
    text = fixture_text("systemd_outputs.txt")
    start = text.index("LoadState=loaded")
    blocks = parse_show(text[start:].replace("--\n", "\n"))
    first = unit_state(blocks[0])
    assert (first.active_state, first.main_pid, first.n_restarts) == ("active", 42, 1)
    failed = unit_state(blocks[2])
    assert (failed.active_state, failed.result, failed.exec_main_status) == ("failed", "exit-code", 203)


def test_cpuinfo_kvm64_lacks_avx2_fma(fixture_text: Read) -> None:
    for name in ("proc_cpuinfo_kvm64_guest_amd-host.txt", "proc_cpuinfo_kvm64_guest_intel-host_flags.txt"):
        cpu = parse_cpuinfo(fixture_text(name))
        assert cpu is not None
        assert cpu.missing == ["avx2", "fma"]
        assert "Common KVM processor" in cpu.model


def test_cpuinfo_bare_metal_has_them(fixture_text: Read) -> None:
    text = fixture_text("lscpu_flags_baremetal_xeon-gold-6342.txt").replace("Flags:", "flags\t:", 1)
    text = text.replace("Model name:", "model name\t:", 1)
    cpu = parse_cpuinfo(text)
    assert cpu is not None
    assert cpu.missing == []
    assert not cpu.virtual

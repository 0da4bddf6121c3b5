"""Declarative hardware of simulated lab nodes, and the files that describe it.

Pure: values in, text out. ``cluster.py`` writes what these functions return into each
node's root; the fake ``nvidia-smi`` (``smi.py``) inside the node reads the GPU JSON and
the pre-rendered topology matrix. Formats follow real captures (see
``tests/fixtures/lab/``): TAB-separated ``topo -m`` with NIC columns and a NIC legend,
sysfs ``"<n>: <NAME>"`` port states.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum


class ShapeKind(StrEnum):
    hgx = "hgx"
    pcie = "pcie"
    mixed = "mixed"


@dataclass(frozen=True)
class Hca:
    """An RDMA adapter: its NUMA node and the GPUs behind the same PCIe switch (PIX)."""

    name: str
    numa: int
    pix_gpus: tuple[int, ...]
    rate: str = "400 Gb/sec (4X NDR)"
    link_layer: str = "InfiniBand"


@dataclass(frozen=True)
class Shape:
    """One kind of server: GPUs, their links, adapters, CPU and memory."""

    kind: str
    gpu_name: str
    gpu_class: str
    architecture: str
    memory_mib: int
    power_limit_w: int
    bus_ids: tuple[str, ...]
    gpu_numa: tuple[int, ...]
    numa_cpus: tuple[str, ...]
    nvlink: str
    bridged_pairs: tuple[tuple[int, int], ...]
    hcas: tuple[Hca, ...]
    cpu_model: str
    cpu_threads: int
    mem_kib: int
    fabric_manager: bool
    driver: str = "535.183.01"
    cuda: str = "12.2"

    @property
    def gpu_count(self) -> int:
        return len(self.bus_ids)

    def link(self, a: int, b: int) -> str:
        """The ``topo -m`` cell between GPU ``a`` and GPU ``b``."""
        if a == b:
            return " X "
        if not self.bridged_pairs or (min(a, b), max(a, b)) in self.bridged_pairs:
            return self.nvlink
        return "PHB" if self.gpu_numa[a] == self.gpu_numa[b] else "SYS"

    def gpu_nic(self, gpu: int, hca: Hca) -> str:
        """The cell between a GPU and an adapter."""
        if gpu in hca.pix_gpus:
            return "PIX"
        if self.gpu_numa[gpu] != hca.numa:
            return "SYS"
        return "PHB" if self.bridged_pairs else "NODE"


# Sapphire Rapids flags as on bare metal (AVX-512, AMX): what a CPU-inference probe wants.
_SPR_FLAGS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush dts acpi mmx "
    "fxsr sse sse2 ss ht tm pbe syscall nx pdpe1gb rdtscp lm constant_tsc arch_perfmon pebs bts "
    "rep_good nopl xtopology nonstop_tsc cpuid aperfmperf pni pclmulqdq dtes64 monitor ds_cpl vmx "
    "smx est tm2 ssse3 sdbg fma cx16 xtpr pdcm pcid dca sse4_1 sse4_2 x2apic movbe popcnt "
    "tsc_deadline_timer aes xsave avx f16c rdrand lahf_lm abm 3dnowprefetch cpuid_fault epb cat_l3 "
    "cat_l2 cdp_l3 invpcid_single intel_ppin cdp_l2 ssbd mba ibrs ibpb stibp ibrs_enhanced "
    "tpr_shadow flexpriority ept vpid ept_ad fsgsbase tsc_adjust bmi1 hle avx2 smep bmi2 erms "
    "invpcid rtm cqm rdt_a avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb intel_pt "
    "avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves cqm_llc cqm_occup_llc "
    "cqm_mbm_total cqm_mbm_local split_lock_detect avx_vnni avx512_bf16 wbnoinvd dtherm ida arat "
    "pln pts hwp hwp_act_window hwp_epp hwp_pkg_req avx512vbmi umip pku ospke waitpkg avx512_vbmi2 "
    "gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq la57 rdpid bus_lock_detect "
    "cldemote movdiri movdir64b enqcmd fsrm md_clear serialize tsxldtrk pconfig arch_lbr ibt "
    "amx_bf16 avx512_fp16 amx_tile amx_int8 flush_l1d arch_capabilities"
)

HGX = Shape(
    kind="hgx",
    gpu_name="NVIDIA H100 80GB HBM3",
    gpu_class="H100-80GB",
    architecture="Hopper",
    memory_mib=81559,
    power_limit_w=700,
    bus_ids=tuple(f"00000000:{b}:00.0" for b in ("53", "64", "75", "86", "97", "A8", "B9", "CA")),
    gpu_numa=(0, 0, 0, 0, 1, 1, 1, 1),
    numa_cpus=("0-47,96-143", "48-95,144-191"),
    nvlink="NV18",
    bridged_pairs=(),
    hcas=tuple(Hca(f"mlx5_{k}", numa=k // 2, pix_gpus=(2 * k, 2 * k + 1)) for k in range(4)),
    cpu_model="Intel(R) Xeon(R) Platinum 8468",
    cpu_threads=192,
    mem_kib=2 * 1024**3,
    fabric_manager=True,
)

PCIE = Shape(
    kind="pcie",
    gpu_name="NVIDIA A100 80GB PCIe",
    gpu_class="A100-80GB",
    architecture="Ampere",
    memory_mib=81920,
    power_limit_w=300,
    bus_ids=("00000000:17:00.0", "00000000:31:00.0", "00000000:B1:00.0", "00000000:CA:00.0"),
    gpu_numa=(0, 0, 1, 1),
    numa_cpus=("0-23,48-71", "24-47,72-95"),
    nvlink="NV12",
    bridged_pairs=((0, 1), (2, 3)),
    hcas=(Hca("mlx5_0", numa=0, pix_gpus=(), rate="200 Gb/sec (4X HDR)"),),
    cpu_model="Intel(R) Xeon(R) Gold 6342 CPU @ 2.80GHz",
    cpu_threads=96,
    mem_kib=512 * 1024**2,
    fabric_manager=False,
)


def node_shape(kind: ShapeKind, index: int) -> Shape:
    """The shape of node ``index`` (1-based): ``mixed`` alternates hgx (odd) and pcie (even)."""
    if kind is ShapeKind.hgx:
        return HGX
    if kind is ShapeKind.pcie:
        return PCIE
    return HGX if index % 2 else PCIE


def node_name(index: int) -> str:
    return f"node{index:02d}"


def node_ip(subnet: str, index: int) -> str:
    """``node01`` is ``<subnet>.11``: room below for the bridge and helpers."""
    return f"{subnet}.{10 + index}"


def _uuid(node: str, gpu: int) -> str:
    h = hashlib.sha256(f"{node}/{gpu}".encode()).hexdigest()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def gpu_state(shape: Shape, node: str) -> dict[str, object]:
    """The JSON document the fake nvidia-smi reads (``/etc/lab/gpus.json``); every GPU healthy."""
    return {
        "driver_version": shape.driver,
        "cuda_version": shape.cuda,
        "architecture": shape.architecture,
        "fabric_manager": shape.fabric_manager,
        "gpus": [
            {
                "index": i,
                "name": shape.gpu_name,
                "uuid": _uuid(node, i),
                "serial": str(1650000000000 + int(hashlib.sha256(node.encode()).hexdigest()[:6], 16) * 8 + i),
                "bus_id": bus,
                "module_id": shape.gpu_count - i if shape.fabric_manager else 1,
                "memory_total_mib": shape.memory_mib,
                "memory_reserved_mib": 551 if shape.fabric_manager else 457,
                "power_limit_w": shape.power_limit_w,
                "state": "healthy",
            }
            for i, bus in enumerate(shape.bus_ids)
        ],
    }


def gpu_state_json(shape: Shape, node: str) -> str:
    return json.dumps(gpu_state(shape, node), indent=1) + "\n"


LEGEND = """Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""


def topo_matrix(shape: Shape) -> str:
    """``nvidia-smi topo -m`` exactly as a current driver prints it: TAB-separated, NIC
    columns and rows, the legend and a NIC legend (NICk named by the adapter it is)."""
    gpus, nics = range(shape.gpu_count), range(len(shape.hcas))
    header = ["", *(f"GPU{g}" for g in gpus), *(f"NIC{n}" for n in nics)]
    lines = ["\t".join([*header, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for g in gpus:
        cells = [shape.link(g, o) for o in gpus] + [shape.gpu_nic(g, h) for h in shape.hcas]
        numa = shape.gpu_numa[g]
        lines.append("\t".join([f"GPU{g}", *cells, shape.numa_cpus[numa], str(numa), "", "N/A"]))
    for n, hca in enumerate(shape.hcas):
        cells = [shape.gpu_nic(g, hca) for g in gpus]
        for m, other in enumerate(shape.hcas):
            cells.append(" X " if m == n else ("NODE" if other.numa == hca.numa else "SYS"))
        lines.append("\t".join([f"NIC{n}", *cells, "", "", "", ""]))
    nic_legend = "".join(f"  NIC{n}: {h.name}\n" for n, h in enumerate(shape.hcas))
    return "\n".join(lines) + "\n\n" + LEGEND + ("\nNIC Legend:\n\n" + nic_legend if nic_legend else "")


class PortState(StrEnum):
    active = "active"
    init = "init"
    down = "down"


# (state, phys_state, lid, sm_lid): INIT = link up but no subnet manager, so no LID.
_PORT_FILES: dict[PortState, tuple[str, str, str, str]] = {
    PortState.active: ("4: ACTIVE", "5: LinkUp", "0x{lid:x}", "0x1"),
    PortState.init: ("2: INIT", "5: LinkUp", "0xffff", "0x0"),
    PortState.down: ("1: DOWN", "2: Polling", "0xffff", "0x0"),
}


def port_lid(node_index: int, hca: Hca) -> int:
    """The LID a subnet manager would give port 1 of ``hca`` on node ``node_index``."""
    return node_index * 16 + int(hca.name.rsplit("_", 1)[-1]) + 1


def port_files(hca: Hca, state: PortState, lid: int) -> dict[str, str]:
    """The sysfs files of one adapter port, by name, in the kernel's formats."""
    st, phys, lid_text, sm_lid = _PORT_FILES[state]
    return {
        "state": st + "\n",
        "phys_state": phys + "\n",
        "rate": (hca.rate if state is not PortState.down else "10 Gb/sec (4X SDR)") + "\n",
        "link_layer": hca.link_layer + "\n",
        "lid": lid_text.format(lid=lid) + "\n",
        "sm_lid": sm_lid + "\n",
    }


def hca_files(hca: Hca, node_index: int) -> dict[str, str]:
    """Adapter-level sysfs files, paths relative to ``/sys/class/infiniband/<hca>/``."""
    guid = f"{0xB83F:04x}:d203:00{node_index:02x}:{int(hca.name.rsplit('_', 1)[-1]):04x}"
    files = {
        "node_type": "1: CA\n",
        "node_guid": guid + "\n",
        "sys_image_guid": guid + "\n",
        "hca_type": "MT4129\n",
        "fw_ver": "28.41.1000\n",
    }
    active = port_files(hca, PortState.active, port_lid(node_index, hca))
    files.update({f"ports/1/{k}": v for k, v in active.items()})
    return files


def cpuinfo(shape: Shape) -> str:
    """A ``/proc/cpuinfo`` for the shape (bind-mounted over the node's)."""
    cores = shape.cpu_threads // 2
    blocks = []
    for cpu in range(shape.cpu_threads):
        blocks.append(
            f"processor\t: {cpu}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            f"model name\t: {shape.cpu_model}\nstepping\t: 8\ncpu MHz\t\t: 2100.000\n"
            f"cache size\t: 107520 KB\nphysical id\t: {(cpu % cores) * 2 // cores}\n"
            f"siblings\t: {shape.cpu_threads // 2}\ncore id\t\t: {cpu % (cores // 2)}\n"
            f"cpu cores\t: {cores // 2}\nfpu\t\t: yes\nflags\t\t: {_SPR_FLAGS}\n"
            "bogomips\t: 4200.00\naddress sizes\t: 46 bits physical, 57 bits virtual\n"
        )
    return "\n".join(blocks) + "\n"


def meminfo(shape: Shape) -> str:
    """A ``/proc/meminfo`` with the shape's memory (the node's processes use the host's)."""
    total = shape.mem_kib
    rows = [
        ("MemTotal", total),
        ("MemFree", total * 9 // 10),
        ("MemAvailable", total * 19 // 20),
        ("Buffers", 0),
        ("Cached", total // 40),
        ("SwapTotal", 0),
        ("SwapFree", 0),
        ("Shmem", 0),
    ]
    return "".join(f"{k + ':':<16}{v:>10} kB\n" for k, v in rows)

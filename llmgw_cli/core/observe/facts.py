"""Facts about nodes, as probed. Frozen values: gather first, then decide."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from llmgw_cli.core.observe.health import DEFAULT_START_TIMEOUT, ReplicaState, unit_health
from llmgw_cli.core.observe.unit_state import UnitState


class Fact(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GpuHealth(StrEnum):
    healthy = "healthy"
    faulty = "faulty"


class Gpu(Fact):
    """One card as nvidia-smi reports it. ``memory_*`` in MiB; None when not readable."""

    index: int
    uuid: str
    name: str
    memory_total: int | None
    memory_used: int | None
    pci_bus_id: str | None
    health: GpuHealth
    reasons: tuple[str, ...] = ()
    # why it is faulty, in words of a fixed set (``nvidia-smi``, ``reset-required``,
    # ``remap-pending``, ``ecc``, ``xid-79``...): what a metric's label carries
    causes: tuple[str, ...] = ()


class XidReport(Fact):
    """NVIDIA's XID reports of one code for one card in this boot's kernel log
    (``core/observe/parse/kernel_log.py``; what the code means: ``core/observe/xid.py``)."""

    bus: str  # PCI bus id, normalized: "0000:4e:00"
    code: int
    count: int
    detail: str  # the last report's text after the code, printable and cut short
    seconds: float | None  # when the last one came, seconds since boot; None: not read
    gpu: int | None = None  # the card's index when nvidia-smi lists a card at ``bus``


class Topology(Fact):
    """``nvidia-smi topo -m``: link kind between GPU pairs (``NV18``, ``PIX``, ``SYS``...)
    and from each GPU to each NIC (by adapter name when the legend gives it)."""

    gpus: tuple[int, ...]
    links: dict[str, str]  # "i-j" -> kind, for i < j
    nics: dict[str, str]  # column label (NIC0 / mlx5_0) -> adapter name
    gpu_nic: dict[str, str]  # "i-<adapter>" -> kind

    def link(self, a: int, b: int) -> str:
        return self.links[f"{min(a, b)}-{max(a, b)}"]

    def nvlink_peers(self, gpu: int) -> int:
        """How many other GPUs this one reaches over NVLink."""
        return sum(1 for other in self.gpus if other != gpu and self.link(gpu, other).startswith("NV"))


class PortState(StrEnum):
    active = "ACTIVE"
    init = "INIT"
    down = "DOWN"
    armed = "ARMED"
    unknown = "UNKNOWN"


class IbPort(Fact):
    """One port of an InfiniBand/RoCE adapter, from sysfs."""

    hca: str
    port: int
    state: PortState
    phys_state: str
    rate_gbps: float | None
    link_layer: str

    @property
    def reason(self) -> str:
        """Why a port that is not ACTIVE does not carry traffic, in operator terms."""
        if self.state is PortState.active:
            return "active"
        if self.state is PortState.init:
            return "INIT: link up but no subnet manager has configured it"
        if self.state is PortState.down:
            return f"DOWN ({self.phys_state or 'unknown physical state'}): no link"
        return f"{self.state.value} ({self.phys_state})"


class ReplicaUnit(Fact):
    """One unit of an llmgw replica on one node: the labels llmgw wrote into it
    (``X-Llmgw-*``), read once (``core/observe/parse/units.py``), and its systemd state."""

    node: str
    name: str
    model: str
    replica: int
    rank: int | None
    members: tuple[str, ...]  # node names, rank order
    gpus: tuple[str, ...]  # GPU UUIDs
    port: int  # 0: no port label
    spec_hash: str
    state: UnitState | None  # None: systemd does not know the unit (not loaded)
    # its profile's start timeout when it was written (label ``X-Llmgw-Start-Timeout``)
    start_timeout: float = DEFAULT_START_TIMEOUT

    @property
    def active_state(self) -> str:
        return self.state.active_state if self.state else "not-loaded"

    def health(self, healthy: bool | None = None) -> ReplicaState:
        """Its state by the one rule (``core/observe/health.py``); ``healthy``: the last answer of
        its replica's health check, None when not known."""
        return unit_health(self.state, self.start_timeout, healthy)

    @property
    def up(self) -> bool:
        """Ready or starting (not crash-looping, failed or stopped): it holds its cards."""
        return self.health().alive


class ModelFiles(Fact):
    """One entry of a weights directory: a model folder or a single file (GGUF)."""

    directory: str
    name: str
    shared: bool
    size: int
    complete: bool
    reason: str  # why it is not complete; "" when it is


class WeightsDir(Fact):
    path: str
    shared: bool
    present: bool
    free_bytes: int | None
    models: tuple[ModelFiles, ...]


class Engine(Fact):
    path: str
    found: bool
    missing_libraries: tuple[str, ...] = ()
    # as the node reports it (a version-shaped word), "unknown" when it could not be read
    version: str = "unknown"

    @property
    def usable(self) -> bool:
        return self.found and not self.missing_libraries


class Cpu(Fact):
    model: str
    flags_missing: tuple[str, ...]
    virtual: bool


class NodeAccess(Fact):
    """What ``apply`` keeps on a node for the gateway's helper (``core/hosts/node_access.py``),
    as the probe read it: the SHA-256 of each of those files that exists, and the accounts
    that are missing."""

    digests: dict[str, str]  # path -> SHA-256, hex
    missing_accounts: tuple[str, ...]


class NodeFacts(Fact):
    """Everything one probe of one node found. ``error`` set means the node could not be
    probed; the other fields are then empty, and the node is shown, never hidden."""

    node: str
    error: str | None = None
    error_kind: str | None = None
    gpus: tuple[Gpu, ...] = ()
    lost_gpus: tuple[str, ...] = ()
    # NVIDIA's XID reports in this boot's kernel log, and where they were read:
    # "journal", "dmesg", "unreadable" (neither could be read), "" (not probed)
    xids: tuple[XidReport, ...] = ()
    kernel_log: str = ""
    gpu_tool: str = "missing"  # "ok" | "missing" | "failed: <reason>"
    topology: Topology | None = None
    ib_ports: tuple[IbPort, ...] = ()
    cpu: Cpu | None = None
    memory_total_kib: int | None = None
    memory_available_kib: int | None = None
    weights: tuple[WeightsDir, ...] = ()
    units: tuple[UnitState, ...] = ()
    unit_labels: dict[str, dict[str, str]] = {}
    engines: tuple[Engine, ...] = ()
    # Replica units being retired: unit name -> deadline (node clock), from the drain
    # markers (``core/planning/drain.py``).
    draining: dict[str, float] = {}
    # Read only by a probe that runs as root (the operator's, logged in as root); None
    # otherwise. The engine key itself never leaves the node: only whether there is one.
    node_access: NodeAccess | None = None
    engine_key_present: bool | None = None
    clock: float | None = None
    probe_seconds: float | None = None

    @property
    def reachable(self) -> bool:
        return self.error is None

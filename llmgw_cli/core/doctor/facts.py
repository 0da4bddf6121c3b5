"""What the doctor reads on a node beyond the probe, and the findings it returns."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from pydantic import Field

from llmgw_cli.core.hosts.root_folders import Owned
from llmgw_cli.core.observe.facts import Fact, NodeFacts

Limit = int | Literal["unlimited"]
"""A resource limit in bytes, or ``unlimited``."""


class Severity(StrEnum):
    error = "error"  # serving breaks (a replica fails, or never starts): exit code 1
    warning = "warning"  # serving works but worse, or breaks later (a disk filling up)
    info = "info"


SEVERITY_ORDER = {Severity.error: 0, Severity.warning: 1, Severity.info: 2}


class Finding(Fact):
    """One problem on one node (``node`` None: the cluster file itself, e.g. the gateway)."""

    node: str | None
    check: str  # stable id for scripts: "engine.libraries", "ib.port-not-active", ...
    severity: Severity
    message: str
    fix: str


class GpuFabric(Fact):
    """The ``Fabric`` block of ``nvidia-smi -q`` for one GPU (NVSwitch systems)."""

    gpu: str  # PCI bus id as nvidia-smi prints it
    state: str  # "Completed", "In Progress", "Not Started", "N/A"...
    status: str  # "Success", "N/A", or an error


class Listener(Fact):
    """A listening TCP socket; ``unit`` is the systemd unit of its process when known."""

    address: str
    port: int
    process: str = ""
    pid: int | None = None
    unit: str | None = None


class Disk(Fact):
    path: str
    total_bytes: int
    free_bytes: int


class DoctorFacts(Fact):
    """The doctor's own sections of the node script, parsed."""

    node: str
    memlock_soft: Limit | None = None  # the login shell's `ulimit -l` (None: unreadable)
    memlock_hard: Limit | None = None
    unit_memlock: dict[str, Limit] = Field(default_factory=dict)  # llmgw-* unit -> LimitMEMLOCK
    fabric: tuple[GpuFabric, ...] = ()
    fabric_manager: str | None = None  # ActiveState of nvidia-fabricmanager; None: not installed
    listeners: tuple[Listener, ...] = ()
    listeners_known: bool = False  # False: neither ss nor /proc/net/tcp could be read
    disks: tuple[Disk, ...] = ()
    root_folders: tuple[Owned, ...] = ()  # the folders root writes in, and those above them
    clock_end: float | None = None  # the node's clock at the end of the script


@dataclass(frozen=True)
class Collected:
    """One node as the doctor saw it: the probe's facts, the doctor's, and when (by this
    host's clock) the script was sent and its answer received, to bound the clock skew;
    ``journals``: the last lines of each failing replica unit's journal (``failing_units``),
    engine keys replaced, control characters escaped; a unit whose journal could not be
    read is left out."""

    facts: NodeFacts
    doctor: DoctorFacts
    sent_at: float
    received_at: float
    journals: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

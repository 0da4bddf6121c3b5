"""Synthetic NodeFacts for tests of the pure core (placement, summary)."""

from __future__ import annotations

import itertools

from llmgw_cli.core.observe.facts import (
    Gpu,
    GpuHealth,
    IbPort,
    ModelFiles,
    NodeFacts,
    PortState,
    Topology,
    WeightsDir,
)
from llmgw_cli.core.observe.unit_state import UnitState


def topology(n: int, link: str = "NV18", pairs: bool = False) -> Topology:
    """NVSwitch-like (every pair ``link``) or bridged pairs (0-1, 2-3 ``link``, others SYS)."""
    links = {}
    for a, b in itertools.combinations(range(n), 2):
        links[f"{a}-{b}"] = link if not pairs or (a // 2 == b // 2) else "SYS"
    return Topology(gpus=tuple(range(n)), links=links, nics={}, gpu_nic={})


def node_facts(
    name: str,
    *,
    gpus: int = 8,
    gpu_name: str = "NVIDIA H100 80GB HBM3",
    memory: int = 81559,
    faulty: tuple[int, ...] = (),
    topo: Topology | str | None = "nvswitch",
    ib: dict[str, str] | None = None,
    models: tuple[str, ...] = (),
) -> NodeFacts:
    cards = tuple(
        Gpu(
            index=i,
            uuid=f"GPU-{name}-{i}",
            name=gpu_name,
            memory_total=memory,
            memory_used=0,
            pci_bus_id=None,
            health=GpuHealth.faulty if i in faulty else GpuHealth.healthy,
            reasons=("reset required",) if i in faulty else (),
            causes=("reset-required",) if i in faulty else (),
        )
        for i in range(gpus)
    )
    if topo == "nvswitch":
        topo = topology(gpus)
    elif topo == "pairs":
        topo = topology(gpus, "NV4", pairs=True)
    assert not isinstance(topo, str)
    ports = tuple(
        IbPort(
            hca=hca,
            port=1,
            state=PortState(state),
            phys_state="LinkUp",
            rate_gbps=400.0,
            link_layer="InfiniBand",
        )
        for hca, state in (ib or {"mlx5_0": "ACTIVE"}).items()
    )
    weights = (
        WeightsDir(
            path="/data/models",
            shared=False,
            present=True,
            free_bytes=None,
            models=tuple(
                ModelFiles(directory="/data/models", name=m, shared=False, size=1, complete=True, reason="")
                for m in models
            ),
        ),
    )
    return NodeFacts(node=name, gpus=cards, gpu_tool="ok", topology=topo, ib_ports=ports, weights=weights)


def unit_state(name: str, state: str = "active") -> UnitState:
    """What `systemctl show` reports for a unit in ``state``."""
    return UnitState(
        name=name,
        load_state="loaded",
        active_state=state,
        sub_state="running",
        result="success",
        main_pid=100,
        n_restarts=0,
        exec_main_code=None,
        exec_main_status=None,
    )


def with_units(
    facts: dict[str, NodeFacts],
    units: list[tuple[str, str, str]],
    state: str = "active",
    shown: UnitState | None = None,
) -> dict[str, NodeFacts]:
    """``facts`` as the nodes would report them once ``units`` (node, name, text) run;
    ``shown``: what `systemctl show` says of each of them (its name aside), else a unit in
    ``state``."""
    out = dict(facts)
    for node, name, text in units:
        labels = {
            line.split("=", 1)[0].removeprefix("X-Llmgw-"): line.split("=", 1)[1]
            for line in text.splitlines()
            if line.startswith("X-Llmgw-")
        }
        f = out[node]
        unit = shown.model_copy(update={"name": name}) if shown else unit_state(name, state)
        out[node] = f.model_copy(
            update={
                "units": (*[u for u in f.units if u.name != name], unit),
                "unit_labels": {**f.unit_labels, name: labels},
            }
        )
    return out

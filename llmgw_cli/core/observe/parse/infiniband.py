"""InfiniBand/RoCE ports from sysfs, as printed by
``grep -H . /sys/class/infiniband/*/ports/*/{state,phys_state,rate,link_layer}``
(``PATH:VALUE`` lines; formats from the kernel's drivers/infiniband/core/sysfs.c)."""

from __future__ import annotations

import re
from collections import defaultdict

from llmgw_cli.core.observe.facts import IbPort, PortState

_LINE = re.compile(r"/sys/class/infiniband/([^/]+)/ports/(\d+)/(state|phys_state|rate|link_layer):(.*)$")
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


def _state(value: str) -> PortState:
    name = value.split(":", 1)[-1].strip().upper()
    try:
        return PortState(name)
    except ValueError:
        return PortState.unknown


def parse_ib_ports(text: str) -> list[IbPort]:
    """Every port found, sorted by adapter and port."""
    fields: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
    for line in text.splitlines():
        match = _LINE.search(line.strip())
        if match:
            hca, port, key, value = match.groups()
            fields[(hca, int(port))][key] = value.strip()
    ports = []
    for (hca, port), values in sorted(fields.items()):
        rate = _RATE.match(values.get("rate", ""))
        phys = values.get("phys_state", "")
        ports.append(
            IbPort(
                hca=hca,
                port=port,
                state=_state(values.get("state", "")),
                phys_state=phys.split(":", 1)[-1].strip(),
                rate_gbps=float(rate.group(1)) if rate else None,
                link_layer=values.get("link_layer", "InfiniBand"),
            )
        )
    return ports


def nccl_ib_hca(ports: list[IbPort]) -> str:
    """``NCCL_IB_HCA`` for the active ports, with ``=`` so names match exactly, not as prefixes
    (``mlx5_1`` would otherwise also select ``mlx5_10``)."""
    active = [f"{p.hca}:{p.port}" for p in ports if p.state is PortState.active]
    return "=" + ",".join(active) if active else ""

"""Rules that turn raw facts into what placement and the views need: a GPU's class, and
whether a node advertises its fabric."""

from __future__ import annotations

import re
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import Node
from llmgw_cli.core.observe.facts import IbPort, NodeFacts, PortState


def gpu_class(name: str) -> str:
    """A short class name from nvidia-smi's product name, matching what cluster files use:
    ``NVIDIA H100 80GB HBM3`` -> ``H100-80GB``, ``NVIDIA A100 80GB PCIe`` -> ``A100-80GB-PCIE``,
    ``NVIDIA GeForce RTX 4090`` -> ``RTX4090``, ``NVIDIA H200`` -> ``H200``."""
    text = re.sub(r"^(NVIDIA\s+)?(GeForce\s+|Tesla\s+|Quadro\s+)?", "", name.strip())
    memory = re.search(r"(\d+)\s*GB", text)
    pcie = "PCIE" in text.upper()
    product = re.split(r"[\s-]", text, maxsplit=1)[0]
    if product.upper() in ("RTX", "GTX") and len(text.split()) > 1:
        product += text.split()[1]
    parts = [product.upper()]
    if memory:
        parts.append(f"{memory.group(1)}GB")
    if pcie:
        parts.append("PCIE")
    return "-".join(parts)


def same_class(a: str, b: str) -> bool:
    return a.upper() == b.upper()


@dataclass(frozen=True)
class FabricStatus:
    """Whether a node can take part in multi-node replicas on its fabric, and why not."""

    fabric: str | None
    advertises: bool
    reason: str
    rate_gbps: float | None
    ports: tuple[IbPort, ...]  # the verified active ports (for NCCL_IB_HCA)


def fabric_status(node: Node, facts: NodeFacts) -> FabricStatus:
    """Declared adapters checked against the discovered ones: a declared adapter that is
    absent or has no ACTIVE port means the node does not advertise its fabric."""
    if node.fabric is None:
        return FabricStatus(None, False, "no fabric declared", None, ())
    if not facts.reachable:
        return FabricStatus(node.fabric, False, f"not probed: {facts.error}", None, ())
    found = list(facts.ib_ports)
    if node.hcas:
        chosen: list[IbPort] = []
        for hca in node.hcas:
            ports = [p for p in found if p.hca == hca.name and (hca.port is None or p.port == hca.port)]
            label = f"{hca.name}:{hca.port}" if hca.port else hca.name
            if not ports:
                return FabricStatus(node.fabric, False, f"declared adapter {label} not found", None, ())
            active = [p for p in ports if p.state is PortState.active]
            if not active:
                return FabricStatus(node.fabric, False, f"{label} {ports[0].reason}", None, ())
            chosen += active
    else:
        chosen = [p for p in found if p.state is PortState.active]
        if not chosen:
            return FabricStatus(node.fabric, False, "no active InfiniBand/RoCE port found", None, ())
    rates = [p.rate_gbps for p in chosen if p.rate_gbps is not None]
    return FabricStatus(node.fabric, True, "active", min(rates) if rates else None, tuple(chosen))

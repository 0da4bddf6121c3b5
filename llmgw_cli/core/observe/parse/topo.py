"""``nvidia-smi topo -m``, in both the raw TAB-separated form and space-expanded pastes,
with NIC columns (newer drivers, plus their ``NIC Legend``) or ``mlx5_N`` columns (older)."""

from __future__ import annotations

import re

from llmgw_cli.core.observe.facts import Topology

_TRAILING = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_DEVICE = re.compile(r"^(GPU\d+|NIC\d+|mlx\d+_\d+)$")
_LEGEND = re.compile(r"^\s*(NIC\d+):\s*(\S+)\s*$")


def _cells(line: str) -> list[str]:
    if "\t" in line:
        return [c.strip() for c in line.split("\t")]
    return re.split(r"\s{2,}", line.strip())


def parse_topology(text: str) -> Topology | None:
    """The GPU/NIC matrix, or None when the output holds no matrix (unknown, not "no links")."""
    lines = [line for line in text.splitlines() if line.strip()]
    header_at = next((i for i, line in enumerate(lines) if re.search(r"\bGPU0\b", line)), None)
    if header_at is None:
        return None
    header = [c for c in _cells(lines[header_at]) if c]
    labels = [c for c in header if c not in _TRAILING]
    if not labels or not all(_DEVICE.match(label) for label in labels):
        return None
    rows: dict[str, list[str]] = {}
    for line in lines[header_at + 1 :]:
        first = line.split(None, 1)[0]
        if not _DEVICE.match(first):
            if line.strip().startswith("Legend"):
                break
            continue
        cells = line.split("\t") if "\t" in line else line.split()
        rows[first] = [c.strip() for c in cells[1 : 1 + len(labels)]]
    gpus = [label for label in labels if label.startswith("GPU")]
    if any(len(rows.get(g, [])) < len(labels) for g in gpus):
        return None
    legend = {m.group(1): m.group(2) for line in lines if (m := _LEGEND.match(line))}
    nics = {label: legend.get(label, label) for label in labels if not label.startswith("GPU")}
    links: dict[str, str] = {}
    gpu_nic: dict[str, str] = {}
    for g in gpus:
        i = int(g[3:])
        for label, kind in zip(labels, rows[g], strict=True):
            if label.startswith("GPU"):
                j = int(label[3:])
                if i < j:
                    links[f"{i}-{j}"] = kind
            else:
                gpu_nic[f"{i}-{nics[label]}"] = kind
    return Topology(gpus=tuple(int(g[3:]) for g in gpus), links=links, nics=nics, gpu_nic=gpu_nic)

"""The node probe: the script sent to each node and the parse of what it prints.

One script per node, one round trip: the sections below each feed a parser of their own.
"""

from __future__ import annotations

from collections import defaultdict

from llmgw_cli.core.facts import Cpu, Engine, GpuHealth, NodeFacts, WeightsDir
from llmgw_cli.core.parse.cpuinfo import parse_cpuinfo
from llmgw_cli.core.parse.infiniband import parse_ib_ports
from llmgw_cli.core.parse.nvidia_smi import HEALTH_FIELDS, QUERY_FIELDS, parse_health, parse_query_gpu
from llmgw_cli.core.parse.systemctl import parse_show, unit_state
from llmgw_cli.core.parse.topo import parse_topology
from llmgw_cli.core.parse.weights import judge
from llmgw_cli.core.render import render
from llmgw_cli.core.spec import ClusterSpec, Node


def engine_binaries(spec: ClusterSpec) -> list[str]:
    """The program of each profile (``vllm``, ``/opt/sglang/bin/python``...), once each."""
    return list(dict.fromkeys(p.argv0[0] for p in spec.profiles.values()))


def probe_script(spec: ClusterSpec, node: Node) -> str:
    """The shell script that gathers one node's facts."""
    return render(
        "probe.sh.j2",
        gpu_fields=",".join(QUERY_FIELDS),
        health_fields=",".join(HEALTH_FIELDS),
        weight_dirs=[w.path for w in node.weights],
        engine_binaries=engine_binaries(spec),
    )


def split_sections(text: str) -> dict[str, str]:
    sections: dict[str, list[str]] = defaultdict(list)
    current = ""
    for line in text.splitlines():
        if line.startswith("@@ "):
            current = line[3:].strip()
            sections.setdefault(current, [])  # an empty section still exists
        elif current:
            sections[current].append(line)
    return {name: "\n".join(lines) for name, lines in sections.items()}


def _host(text: str) -> tuple[float | None, int | None, int | None]:
    clock = total = available = None
    for line in text.splitlines():
        parts = line.split()
        if parts[:1] == ["clock"] and len(parts) > 1:
            try:
                clock = float(parts[1])
            except ValueError:
                clock = None
        elif parts[:1] == ["MemTotal:"] and len(parts) > 1:
            total = int(parts[1])
        elif parts[:1] == ["MemAvailable:"] and len(parts) > 1:
            available = int(parts[1])
    return clock, total, available


def _weights(text: str, node: Node) -> tuple[WeightsDir, ...]:
    shared = {w.path: w.shared for w in node.weights}
    dirs: list[WeightsDir] = []
    current: str | None = None
    entries: list[tuple[str, int, str]] = []
    shards: dict[str, set[str]] = defaultdict(set)
    free: int | None = None
    present = True

    def flush() -> None:
        if current is not None:
            models = judge(current, shared.get(current, False), entries, shards) if present else []
            dirs.append(
                WeightsDir(
                    path=current,
                    shared=shared.get(current, False),
                    present=present,
                    free_bytes=free,
                    models=tuple(models),
                )
            )

    for line in text.splitlines():
        if line.startswith("@dir "):
            flush()
            current, entries, shards, free, present = line[5:], [], defaultdict(set), None, True
        elif line == "@absent":
            present = False
        elif line.startswith("@free_kib "):
            value = line[10:].strip()
            free = int(value) * 1024 if value.isdigit() else None
        elif line.startswith("@shard\t"):
            _, model, shard = line.split("\t", 2)
            shards[model].add(shard)
        elif line.count("\t") >= 2:
            kind, size, rel = line.split("\t", 2)
            entries.append((kind, int(size) if size.isdigit() else 0, rel))
    flush()
    return tuple(dirs)


def _engines(text: str) -> tuple[Engine, ...]:
    engines: list[Engine] = []
    for line in text.splitlines():
        if line.startswith("@engine "):
            path, _, state = line[8:].rpartition(" ")
            engines.append(Engine(path=path, found=state == "found"))
        elif line.startswith("@lib ") and engines:
            last = engines[-1]
            engines[-1] = last.model_copy(update={"missing_libraries": (*last.missing_libraries, line[5:])})
    return tuple(engines)


def _labels(text: str) -> dict[str, dict[str, str]]:
    labels: dict[str, dict[str, str]] = defaultdict(dict)
    for line in text.splitlines():
        path, sep, rest = line.partition(":")
        key, eq, value = rest.partition("=")
        if sep and eq:
            labels[path.rsplit("/", 1)[-1]][key.removeprefix("X-Llmgw-")] = value
    return dict(labels)


def parse_probe(node: Node, text: str) -> NodeFacts:
    """NodeFacts from the probe script's output."""
    sections = split_sections(text)
    clock, total, available = _host(sections.get("host", ""))
    gpu_text = sections.get("gpus", "")
    gpus, lost = parse_query_gpu(gpu_text)
    faults = parse_health(sections.get("gpuhealth", ""))
    gpus = [
        g.model_copy(update={"health": GpuHealth.faulty, "reasons": (*g.reasons, *faults[g.index])})
        if g.index in faults
        else g
        for g in gpus
    ]
    if "@missing" in gpu_text:
        tool = "missing"
    elif "@rc 0" in gpu_text or gpus:
        tool = "ok"
    else:
        tool = "failed: " + (gpu_text.splitlines()[0] if gpu_text else "no output")
    cpu = parse_cpuinfo(sections.get("cpu", ""))
    return NodeFacts(
        node=node.name,
        gpus=tuple(gpus),
        lost_gpus=tuple(lost),
        gpu_tool=tool,
        topology=parse_topology(sections.get("topo", "")),
        ib_ports=tuple(parse_ib_ports(sections.get("ib", ""))),
        cpu=Cpu(model=cpu.model, flags_missing=tuple(cpu.missing), virtual=cpu.virtual) if cpu else None,
        memory_total_kib=total,
        memory_available_kib=available,
        weights=_weights(sections.get("weights", ""), node),
        units=tuple(unit_state(b) for b in parse_show(sections.get("units", ""))),
        unit_labels=_labels(sections.get("labels", "")),
        engines=_engines(sections.get("engines", "")),
        clock=clock,
    )

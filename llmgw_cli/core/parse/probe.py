"""The node probe: the script sent to each node and the parse of what it prints.

One script per node, one round trip: the sections below each feed a parser of their own.

The script is the same text for the same cluster file and node (no per-run value), so it can
be installed on the node and run there on its own; its output is the only interface. Every
name the node chooses (file and folder names, index contents) reaches that output only as
base64 of NUL-separated fields, on a line of its own: nothing a node holds becomes program
text, and no name can start a line, so none can open a section. The parser splits on
``\n`` only and refuses a section printed twice.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections import defaultdict

from llmgw_cli.core.facts import Cpu, Engine, GpuHealth, NodeFacts, WeightsDir
from llmgw_cli.core.parse.cpuinfo import parse_cpuinfo
from llmgw_cli.core.parse.infiniband import parse_ib_ports
from llmgw_cli.core.parse.nvidia_smi import HEALTH_FIELDS, QUERY_FIELDS, parse_health, parse_query_gpu
from llmgw_cli.core.parse.systemctl import parse_show, unit_state
from llmgw_cli.core.parse.topo import parse_topology
from llmgw_cli.core.parse.units import parse_labels
from llmgw_cli.core.parse.weights import judge
from llmgw_cli.core.spec import ClusterSpec, Node
from llmgw_cli.core.templates import render


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
    """``{name: body}`` of the ``@@ NAME`` sections.

    Lines are split on ``\n`` only, as the shell wrote them (``str.splitlines`` would also
    split on form feeds, ``\x1c``-``\x1e``, ``\x85`` and U+2028, any of which a name can
    hold). The script prints each section once: a second header can only be forged, so it
    is a ValueError (the node's error), never a second source of units or labels."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.split("\n"):
        if line.startswith("@@ "):
            name = line[3:].strip()
            if name in sections:
                raise ValueError(f"section {name!r} printed twice")
            current = sections[name] = []
        elif current is not None:
            current.append(line)
    return {name: "\n".join(lines).strip("\n") for name, lines in sections.items()}


def complete(text: str, last: str = "end") -> bool:
    """Whether the output reached its closing ``@@ {last}`` line: a cut-off output (a lost
    connection, a killed script) must not read as "no units are running"."""
    return f"@@ {last}" in text.split("\n")


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _host(text: str) -> tuple[float | None, int | None, int | None]:
    clock = total = available = None
    for line in text.split("\n"):
        parts = line.split()
        if len(parts) < 2:
            continue
        if parts[0] == "clock":
            clock = _number(parts[1])
        elif parts[0] == "MemTotal:" and parts[1].isascii() and parts[1].isdigit():
            total = int(parts[1])
        elif parts[0] == "MemAvailable:" and parts[1].isascii() and parts[1].isdigit():
            available = int(parts[1])
    return clock, total, available


def _fields(blob: str) -> list[str] | None:
    """The NUL-separated fields of one base64 line; None when it is not valid base64."""
    try:
        raw = base64.b64decode(blob.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    fields = raw.decode("utf-8", "replace").split("\0")
    return fields[:-1] if fields and fields[-1] == "" else fields


def _entries(blob: str) -> list[tuple[str, int, str]]:
    """``find -printf '%y\\t%s\\t%P\\0'`` records; a malformed record is skipped."""
    entries = []
    for record in _fields(blob) or []:
        kind, _, rest = record.partition("\t")
        size, sep, rel = rest.partition("\t")
        if sep and len(kind) == 1 and size.isascii() and size.isdigit() and rel:
            entries.append((kind, int(size), rel))
    return entries


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

    for line in text.split("\n"):
        if line.startswith("@dir "):
            flush()
            current, entries, shards, free, present = line[5:], [], defaultdict(set), None, True
        elif current is None:
            continue
        elif line == "@absent":
            present = False
        elif line.startswith("@free_kib "):
            value = line[10:].strip()
            free = int(value) * 1024 if value.isascii() and value.isdigit() else None
        elif line.startswith("@entries "):
            entries.extend(_entries(line[9:]))
        elif line.startswith("@shards "):
            fields = _fields(line[8:])
            if fields and fields[0] and "/" not in fields[0]:
                shards[fields[0]].update(f for f in fields[1:] if f)
    flush()
    return tuple(dirs)


def _engines(text: str) -> tuple[Engine, ...]:
    engines: list[Engine] = []
    for line in text.split("\n"):
        if line.startswith("@engine "):
            path, _, state = line[8:].rpartition(" ")
            engines.append(Engine(path=path, found=state == "found"))
        elif line.startswith("@lib ") and engines:
            last = engines[-1]
            engines[-1] = last.model_copy(update={"missing_libraries": (*last.missing_libraries, line[5:])})
    return tuple(engines)


def printable(text: str) -> str:
    """``text`` with every character a terminal could act on (escapes, control characters)
    shown as ``?``: error messages may quote what a node printed."""
    return "".join(c if c.isprintable() else "?" for c in text)


BAD_OUTPUT = "bad-output"
"""``NodeFacts.error_kind`` of a node whose probe output could not be read."""


def parse_probe(node: Node, text: str) -> NodeFacts:
    """NodeFacts from the probe script's output. Output that cannot be read is this node's
    error (``error_kind`` ``bad-output``), never an exception that would take the other
    nodes of a gather down with it."""
    try:
        return _parse(node, text)
    except (ValueError, LookupError, TypeError, ArithmeticError) as exc:  # pydantic's errors are ValueErrors
        reason = printable(str(exc).split("\n", 1)[0][:200])
        return NodeFacts(
            node=node.name,
            error=f"probe output unreadable ({type(exc).__name__}: {reason})",
            error_kind=BAD_OUTPUT,
        )


def _parse(node: Node, text: str) -> NodeFacts:
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
    gpu_lines = gpu_text.split("\n")
    if "@missing" in gpu_lines:
        tool = "missing"
    elif "@rc 0" in gpu_lines or gpus:
        tool = "ok"
    else:
        tool = "failed: " + (gpu_lines[0] if gpu_text else "no output")
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
        unit_labels=parse_labels(sections.get("labels", "")),
        engines=_engines(sections.get("engines", "")),
        clock=clock,
    )

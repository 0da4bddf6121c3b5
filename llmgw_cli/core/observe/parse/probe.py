"""The node probe: the script sent to each node and the parse of what it prints.

One script per node, one round trip. A fact is its command and its parser together:
``SECTIONS`` lists each section's name, the shell that prints it and the function that
reads it into ``NodeFacts`` fields, and both the script (``templates/probe.sh.j2`` frames
them) and the parse are assembled from that list, so a new fact is one entry there.

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
import shlex
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Engine, Node
from llmgw_cli.core.engine.engine_flags import version_shaped
from llmgw_cli.core.engine.templates import render, render_text
from llmgw_cli.core.hosts.node_access import HELPER, MANAGED_PATHS, managed_accounts
from llmgw_cli.core.observe.facts import Cpu, Gpu, GpuHealth, NodeAccess, NodeFacts, WeightsDir
from llmgw_cli.core.observe.facts import Engine as EngineFact
from llmgw_cli.core.observe.parse.cpuinfo import parse_cpuinfo
from llmgw_cli.core.observe.parse.engine_env import KEY_PRESENT_SH
from llmgw_cli.core.observe.parse.infiniband import parse_ib_ports
from llmgw_cli.core.observe.parse.kernel_log import XIDS_READ, bus_key, parse_xids
from llmgw_cli.core.observe.parse.nvidia_smi import (
    HEALTH_FIELDS,
    QUERY_FIELDS,
    health_faults,
    parse_query_gpu,
)
from llmgw_cli.core.observe.parse.systemctl import parse_show, unit_state
from llmgw_cli.core.observe.parse.topo import parse_topology
from llmgw_cli.core.observe.parse.units import LABEL_PREFIX, UNIT_DIR, parse_labels
from llmgw_cli.core.observe.parse.weights import judge, snapshots
from llmgw_cli.core.observe.xid import xid
from llmgw_cli.core.planning.drain import DRAIN_DIR, parse_markers
from llmgw_cli.core.weights.snapshot import MANIFEST_SUFFIX


def engine_binaries(spec: ClusterSpec) -> list[str]:
    """The program of each profile (``vllm``, ``/opt/sglang/bin/python``...), once each."""
    return list(dict.fromkeys(p.argv0[0] for p in spec.profiles.values()))


def engine_programs(spec: ClusterSpec) -> list[tuple[str, str]]:
    """(program, distribution) of each profile's program, once each: the Python
    distribution whose metadata holds its version (``vllm``, ``sglang``), or ``""`` for a
    program that prints it itself (``llama-server --version``)."""
    found: dict[str, str] = {}
    for p in spec.profiles.values():
        found.setdefault(p.argv0[0], "" if p.engine is Engine.llama_server else p.engine.value)
    return list(found.items())


def probe_script(spec: ClusterSpec, node: Node) -> str:
    """The shell script that gathers one node's facts: every section of ``SECTIONS``."""
    return render(
        "probe.sh.j2",
        sections=[(section.name, section.script(spec, node).strip("\n")) for section in SECTIONS],
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
    snap_entries: list[tuple[str, int, str]] = []
    manifests: dict[str, str] = {}
    free: int | None = None
    present = True

    def flush() -> None:
        if current is not None:
            models = (
                judge(current, shared.get(current, False), entries, shards)
                + snapshots(current, shared.get(current, False), snap_entries, manifests)
                if present
                else []
            )
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
            snap_entries, manifests = [], {}
        elif current is None:
            continue
        elif line == "@absent":
            present = False
        elif line.startswith("@free_kib "):
            value = line[10:].strip()
            free = int(value) * 1024 if value.isascii() and value.isdigit() else None
        elif line.startswith("@entries "):
            entries.extend(_entries(line[9:]))
        elif line.startswith("@snapentries "):
            snap_entries.extend(_entries(line[13:]))
        elif line.startswith("@manifest "):
            fields = _fields(line[10:])
            if fields and len(fields) == 2 and fields[0].endswith(MANIFEST_SUFFIX):
                manifests[fields[0]] = fields[1]
        elif line.startswith("@shards "):
            fields = _fields(line[8:])
            if fields and fields[0] and "/" not in fields[0]:
                shards[fields[0]].update(f for f in fields[1:] if f)
    flush()
    return tuple(dirs)


def _engines(text: str) -> tuple[EngineFact, ...]:
    engines: list[EngineFact] = []
    for line in text.split("\n"):
        if line.startswith("@engine "):
            path, _, state = line[8:].rpartition(" ")
            engines.append(EngineFact(path=path, found=state == "found"))
        elif line.startswith("@lib ") and engines:
            last = engines[-1]
            engines[-1] = last.model_copy(update={"missing_libraries": (*last.missing_libraries, line[5:])})
        elif line.startswith("@version ") and engines:
            # the node's words: only a version-shaped one is taken
            said = line[9:].strip()
            version = said if version_shaped(said) else "unknown"
            engines[-1] = engines[-1].model_copy(update={"version": version})
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
    fields: dict[str, Any] = {}
    for section in SECTIONS:
        fields.update(section.parse(sections.get(section.name, ""), node, fields))
    return NodeFacts(node=node.name, **fields)


# --- the sections: each one's shell, beside the parser of what it prints ------------------

Fields = dict[str, Any]
"""``NodeFacts`` fields, by name."""


@dataclass(frozen=True)
class Section:
    """One fact of the probe: ``script`` prints it on the node, under ``@@ name``;
    ``parse`` reads that text (``""`` when the section is missing) into NodeFacts fields,
    given the fields of the sections before it."""

    name: str
    script: Callable[[ClusterSpec, Node], str]
    parse: Callable[[str, Node, Mapping[str, Any]], Fields]


def _shell(text: str) -> Callable[[ClusterSpec, Node], str]:
    """A section whose shell is the same on every node."""
    return lambda _spec, _node: text


HOST_SH = """\
echo "clock $(date +%s.%N 2>/dev/null || date +%s)"
grep -E '^(MemTotal|MemAvailable):' /proc/meminfo"""


def _parse_host(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    clock, total, available = _host(text)
    return {"clock": clock, "memory_total_kib": total, "memory_available_kib": available}


CPU_SH = "awk '/^$/ {exit} {print}' /proc/cpuinfo"


def _parse_cpu(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    cpu = parse_cpuinfo(text)
    return {
        "cpu": Cpu(model=cpu.model, flags_missing=tuple(cpu.missing), virtual=cpu.virtual) if cpu else None
    }


GPUS_SH = f"""\
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu={",".join(QUERY_FIELDS)} --format=csv,noheader,nounits 2>&1
  echo "@rc $?"
else
  echo "@missing"
fi"""


def _parse_gpus(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    gpus, lost = parse_query_gpu(text)
    lines = text.split("\n")
    if "@missing" in lines:
        tool = "missing"
    elif "@rc 0" in lines or gpus or lost:  # it answered, though it cannot open every card
        tool = "ok"
    else:
        tool = "failed: " + (lines[0] if text else "no output")
    return {"gpus": tuple(gpus), "lost_gpus": tuple(lost), "gpu_tool": tool}


GPUHEALTH_SH = f"""\
# Optional health fields, asked separately: a driver that lacks one refuses the whole query.
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu={",".join(HEALTH_FIELDS)} \
--format=csv,noheader,nounits 2>/dev/null"""


def _parse_gpuhealth(text: str, _node: Node, found: Mapping[str, Any]) -> Fields:
    """Marks the cards of the ``gpus`` section that report a fault."""
    faults = health_faults(text)
    gpus: tuple[Gpu, ...] = found.get("gpus", ())
    return {"gpus": tuple(_faulty(g, faults[g.index]) if g.index in faults else g for g in gpus)}


def _faulty(gpu: Gpu, found: list[tuple[str, str]]) -> Gpu:
    """``gpu`` marked faulty for ``found`` (cause, reason) pairs."""
    return gpu.model_copy(
        update={
            "health": GpuHealth.faulty,
            "reasons": (*gpu.reasons, *(why for _, why in found)),
            "causes": tuple(dict.fromkeys((*gpu.causes, *(cause for cause, _ in found)))),
        }
    )


XIDS_SH = f"""\
# The kernel log is root's to read on most systems: unprivileged (the gateway's account),
# the node helper reads it as root; its answer says "unreadable" where it cannot.
h={HELPER}
if [ "$(id -u)" != 0 ] && [ -x "$h" ]; then
  "$h" kernel-xids 2>/dev/null || echo "@source unreadable"
else
{XIDS_READ.rstrip()}
fi"""


def _parse_xids(text: str, _node: Node, found: Mapping[str, Any]) -> Fields:
    """The XID reports, each tied to the card at its bus id; a card with a fatal one
    (``core/observe/xid.py``) is faulty. Reports for a bus nvidia-smi lists no card at
    (one that fell off the bus) stay with ``gpu`` None."""
    lines = text.split("\n")
    source = next((ln[8:].strip() for ln in lines if ln.startswith("@source ")), "")
    if source not in ("journal", "dmesg", "unreadable"):
        source = ""
    gpus: tuple[Gpu, ...] = found.get("gpus", ())
    at = {key: g.index for g in gpus if g.pci_bus_id and (key := bus_key(g.pci_bus_id))}
    reports = [r.model_copy(update={"gpu": at.get(r.bus)}) for r in parse_xids(text)]
    fatal: dict[int, list[tuple[str, str]]] = {}
    for r in reports:
        meaning = xid(r.code)
        if r.gpu is not None and meaning.fatal:
            times = f" (x{r.count})" if r.count > 1 else ""
            fatal.setdefault(r.gpu, []).append((f"xid-{r.code}", f"XID {r.code}: {meaning.meaning}{times}"))
    marked = tuple(_faulty(g, fatal[g.index]) if g.index in fatal else g for g in gpus)
    return {"gpus": marked, "xids": tuple(reports), "kernel_log": source}


TOPO_SH = "command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi topo -m 2>&1"


def _parse_topo(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    return {"topology": parse_topology(text)}


IB_SH = """\
# one process for every port file: PATH:VALUE lines
grep -H . /sys/class/infiniband/*/ports/*/state /sys/class/infiniband/*/ports/*/phys_state \\
          /sys/class/infiniband/*/ports/*/rate /sys/class/infiniband/*/ports/*/link_layer 2>/dev/null"""


def _parse_ib(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    return {"ib_ports": tuple(parse_ib_ports(text))}


WEIGHTS_SH = """\
# Every name below comes from the node and is data, never program text: file and folder
# names and the shard names of each index go out NUL-separated and base64-encoded on one
# line ("@entries B64", "@shards B64" = folder NUL shard NUL ...), so no name can start a
# line, a section or a command of its own. Index files are read only from real folders
# directly inside the weights directory, never through a symlink (this runs as root).
{% for dir in weight_dirs %}
d={{ dir | shellquote }}
printf '@dir %s\\n' "$d"
if [ -d "$d" ]; then
  printf '@free_kib %s\\n' "$(df -Pk "$d" | awk 'NR==2 {print $4}')"
  printf '@entries '
  find "$d" -mindepth 1 -maxdepth 2 -printf '%y\\t%s\\t%P\\0' 2>/dev/null | base64 -w0
  echo
  (
    cd -P "$d" 2>/dev/null || exit 0
    real=$(pwd -P)
    for sub in ./*/; do
      m=${sub#./}
      m=${m%/}
      [ -L "./$m" ] && continue
      (
        cd -P "./$m" 2>/dev/null || exit 0
        # swapped for a symlink since the test above: it must still sit in the weights folder
        [ "$(cd .. && pwd -P)" = "$real" ] || exit 0
        [ -f model.safetensors.index.json ] || exit 0
        printf '@shards '
        {
          printf '%s\\0' "$m"
          dd if=model.safetensors.index.json iflag=nofollow,nonblock bs=1M count=16 status=none 2>/dev/null |
            grep -ao '"[^"]*\\.safetensors"' | tr -d '"' | sort -u | tr '\\n' '\\0'
        } | base64 -w0
        echo
      )
    done
    # repository snapshots: the whole hf/ tree (never through a symlink), then each
    # manifest ("@manifest B64" = <org>--<name>/<commit>.manifest.json NUL its text)
    [ -d hf ] && [ ! -L hf ] || exit 0
    printf '@snapentries '
    find hf -mindepth 1 -maxdepth 64 -printf '%y\\t%s\\t%P\\0' 2>/dev/null | head -c 67108864 | base64 -w0
    echo
    for m in hf/*/*.manifest.json; do
      [ -f "$m" ] && [ ! -L "$m" ] && [ ! -L "${m%/*}" ] || continue
      printf '@manifest '
      {
        printf '%s\\0' "${m#hf/}"
        dd if="$m" iflag=nofollow,nonblock bs=1M count=64 status=none 2>/dev/null
      } | base64 -w0
      echo
    done
  )
else
  echo "@absent"
fi
{% endfor %}"""


def _weights_script(_spec: ClusterSpec, node: Node) -> str:
    return render_text(WEIGHTS_SH, weight_dirs=[w.path for w in node.weights])


def _parse_weights(text: str, node: Node, _found: Mapping[str, Any]) -> Fields:
    return {"weights": _weights(text, node)}


ENGINES_SH = """\
{% for binary, dist in engine_programs %}
b={{ binary | shellquote }}
p=$(command -v "$b" 2>/dev/null)
if [ -n "$p" ]; then
  printf '@engine %s found\\n' "$b"
  # a script (#!) has no libraries of its own to miss; ldd is only for binaries
  # (nonblocking: a FIFO in the binary's place must not hang the probe)
  first=$(dd if="$p" bs=2 count=1 iflag=nonblock status=none 2>/dev/null | tr -d '\\0')
  case "$first" in
    "#!"*) ;;
    # library names come from the binary: one printable line each
    *) ldd "$p" 2>/dev/null | awk '/not found/ {print "@lib " $1}' | tr -c '\\n[:print:]' '?' ;;
  esac
  # its version, without starting it: from the metadata of its Python distribution in
  # the site-packages beside it (the program as found, and with its links resolved: a
  # venv's python is a link to the base interpreter), or from `--version`
  v=
{% if dist %}
  for d in "${p%/*}" "$(dirname "$(readlink -f "$p")")"; do
    for m in "$d"/../lib/python3*/site-packages/{{ dist }}-*.dist-info/METADATA \\
             "$d"/../lib/python3*/dist-packages/{{ dist }}-*.dist-info/METADATA; do
      [ -f "$m" ] || continue
      v=$(dd if="$m" bs=4096 count=1 iflag=nofollow,nonblock status=none 2>/dev/null |
        grep -m1 '^Version:' | cut -c10-90)
      break 2
    done
  done
{% else %}
  # only a binary is asked (a script in its place may do anything with any argument),
  # never as root: as nobody, for at most 5 seconds
  run=
  [ "$(id -u)" = 0 ] && run="setpriv --reuid=65534 --regid=65534 --clear-groups --"
  case "$first" in
    "#!"*) ;;
    *) command -v setpriv >/dev/null 2>&1 || [ -z "$run" ] &&
         v=$(cd / && timeout 5 $run "$p" --version </dev/null 2>&1 | head -c 4096 |
           sed -n 's/^version: *//p' | head -n 1 | cut -d' ' -f1 | cut -c1-80) ;;
  esac
{% endif %}
  printf '@version %s\\n' "$v" | tr -c '\\n[:print:]' '?'
else
  printf '@engine %s missing\\n' "$b"
fi
{% endfor %}"""


def _engines_script(spec: ClusterSpec, _node: Node) -> str:
    return render_text(ENGINES_SH, engine_programs=engine_programs(spec))


def _parse_engines(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    return {"engines": _engines(text)}


UNITS_SH = """\
set -f  # unit names are words to pass on, never patterns to expand
units=$(systemctl list-units 'llmgw-*' --all --plain --no-legend 2>/dev/null | awk '{print $1}')
# the monotonic clock the Timestamp*Monotonic properties are on (seconds since boot)
echo "@uptime $(cut -d' ' -f1 /proc/uptime 2>/dev/null)"
[ -n "$units" ] && systemctl show -p Id,LoadState,ActiveState,SubState,Result,MainPID,NRestarts,ExecMainCode,ExecMainStatus,ExecMainStartTimestampMonotonic,ExecMainExitTimestampMonotonic $units
set +f"""


def _uptime(text: str) -> float | None:
    line = next((ln for ln in text.split("\n") if ln.startswith("@uptime ")), "")
    return _number(line.removeprefix("@uptime ")) if line else None


def _parse_units(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    now = _uptime(text)
    return {"units": tuple(unit_state(b, now) for b in parse_show(text))}


LABELS_SH = f"grep -H '^{LABEL_PREFIX}' {UNIT_DIR}llmgw-*.service 2>/dev/null"


def _parse_labels(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    return {"unit_labels": parse_labels(text)}


NODE_ACCESS_SH = """\
# digests and accounts, never file contents; only as root (the sudo rule is root's to read)
if [ "$(id -u)" = 0 ]; then
  echo "@root"
  sha256sum {{ paths | map("shellquote") | join(" ") }} 2>/dev/null
  for u in {{ users | map("shellquote") | join(" ") }}; do
    id -u "$u" >/dev/null 2>&1 || echo "@missing $u"
  done
else
  echo "@unprivileged"
fi"""


def _node_access_script(spec: ClusterSpec, _node: Node) -> str:
    return render_text(NODE_ACCESS_SH, paths=MANAGED_PATHS, users=managed_accounts(spec))


def _parse_node_access(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    """``sha256sum`` lines and ``@missing USER`` lines after ``@root``; None without it."""
    lines = text.split("\n")
    if "@root" not in lines:
        return {"node_access": None}
    digests: dict[str, str] = {}
    missing: list[str] = []
    for line in lines:
        digest, sep, path = line.partition("  ")
        if line.startswith("@missing "):
            missing.append(line.removeprefix("@missing "))
        elif sep and len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            digests[path] = digest
    return {"node_access": NodeAccess(digests=digests, missing_accounts=tuple(missing))}


ENGINE_KEY_SH = f"""\
# whether the node holds an engine key: one word, never the key
if [ "$(id -u)" != 0 ]; then
  echo "@unprivileged"
elif {KEY_PRESENT_SH}; then
  echo "@present"
else
  echo "@absent"
fi"""


def _parse_engine_key(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    lines = text.split("\n")
    present = True if "@present" in lines else False if "@absent" in lines else None
    return {"engine_key_present": present}


MAX_MARKERS = 1024  # drain markers read per node
MARKER_BYTES = 64  # read of each (one number: the deadline)

DRAINING_SH = f"""\
# Drain markers: each file's name and the first bytes of its content go out NUL-separated
# and base64-encoded on a line of their own ("@marker B64" = name NUL content), so no name
# becomes program text or a line of output. Regular files only, never through a symlink.
d={shlex.quote(DRAIN_DIR)}
if [ -d "$d" ] && [ ! -L "$d" ]; then
  n=0
  for f in "$d"/*; do
    [ -f "$f" ] && [ ! -L "$f" ] || continue
    n=$((n + 1))
    [ "$n" -le {MAX_MARKERS} ] || break
    printf '@marker '
    {{
      printf '%s\\0' "${{f##*/}}"
      dd if="$f" iflag=nofollow,nonblock bs={MARKER_BYTES} count=1 status=none 2>/dev/null | tr -d '\\0'
    }} | base64 -w0
    echo
  done
fi"""


def _parse_draining(text: str, _node: Node, _found: Mapping[str, Any]) -> Fields:
    """``@marker`` lines -> unit name -> deadline (``core/planning/drain.py`` keeps only replica
    unit names with one finite number)."""
    entries: list[tuple[str, str]] = []
    for line in text.split("\n")[:MAX_MARKERS]:
        if line.startswith("@marker "):
            fields = _fields(line[8:])
            if fields is not None and len(fields) in (1, 2):
                entries.append((fields[0], fields[1] if len(fields) == 2 else ""))
    return {"draining": parse_markers(entries)}


SECTIONS: tuple[Section, ...] = (
    Section("host", _shell(HOST_SH), _parse_host),
    Section("cpu", _shell(CPU_SH), _parse_cpu),
    Section("gpus", _shell(GPUS_SH), _parse_gpus),
    Section("gpuhealth", _shell(GPUHEALTH_SH), _parse_gpuhealth),
    Section("xids", _shell(XIDS_SH), _parse_xids),
    Section("topo", _shell(TOPO_SH), _parse_topo),
    Section("ib", _shell(IB_SH), _parse_ib),
    Section("weights", _weights_script, _parse_weights),
    Section("engines", _engines_script, _parse_engines),
    Section("units", _shell(UNITS_SH), _parse_units),
    Section("labels", _shell(LABELS_SH), _parse_labels),
    Section("node-access", _node_access_script, _parse_node_access),
    Section("engine-key", _shell(ENGINE_KEY_SH), _parse_engine_key),
    Section("draining", _shell(DRAINING_SH), _parse_draining),
)
"""Every fact of the probe, in the order the script prints them (``gpuhealth`` and ``xids``
read the cards ``gpus`` found)."""


def section(name: str) -> Section:
    return next(s for s in SECTIONS if s.name == name)


def section_script(name: str, spec: ClusterSpec, node: Node) -> str:
    """One section's shell on its own, in the probe's environment: for a caller that must
    ask again what the probe could not read (a probe that did not run as root)."""
    return render("probe.sh.j2", sections=[(name, section(name).script(spec, node).strip("\n"))])


def parse_section(name: str, node: Node, text: str) -> NodeFacts:
    """NodeFacts with only what ``section_script``'s output (``text``) says filled in."""
    return NodeFacts(node=node.name, **section(name).parse(split_sections(text).get(name, ""), node, {}))

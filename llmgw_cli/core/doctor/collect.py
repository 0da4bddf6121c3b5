"""The doctor's node script (the probe plus ``templates/doctor.sh.j2``) and its parse.

One script per node, one round trip: the probe's sections are parsed by the probe's own
parser, the ``doctor-*`` sections here.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Node
from llmgw_cli.core.doctor.facts import Disk, DoctorFacts, GpuFabric, Limit, Listener
from llmgw_cli.core.engine.templates import render
from llmgw_cli.core.hosts.root_folders import ROOT_FOLDERS, Owned
from llmgw_cli.core.observe.parse.probe import probe_script, split_sections
from llmgw_cli.core.observe.parse.systemctl import parse_show

# Greedy up to the last ``",pid=N,fd=N))``: the pid ss prints after the last name is the
# kernel's, whatever a name holds (a name may itself read ``x",pid=1,fd=1)``).
_USERS = re.compile(r'users:\(\("(.*)",pid=([0-9]+),fd=[0-9]+\)\)', re.S)
_USERS_DONE = re.compile(r"pid=[0-9]+,fd=[0-9]+\)\)")
_UID = re.compile(r"[0-9]{1,10}")
_MODE = re.compile(r"[0-7]{1,4}")  # stat's %a
UNLIMITED_BYTES = 2**64 - 1  # what systemctl shows for infinity on some versions
MAX_OWNED = 256  # paths read of doctor-root-folders (about 60 on a usual node)


def doctor_part(weight_dirs: Sequence[str], root_folders: Sequence[str] = ROOT_FOLDERS) -> str:
    """The doctor's own sections (``templates/doctor.sh.j2``), run after the probe's."""
    return render("doctor.sh.j2", weight_dirs=list(weight_dirs), root_folders=list(root_folders))


def doctor_script(spec: ClusterSpec, node: Node) -> str:
    """The probe script followed by the doctor's extra sections."""
    return probe_script(spec, node) + doctor_part([w.path for w in node.weights])


def parse_limit(value: str, unit: int = 1) -> Limit | None:
    """``unlimited``/``infinity`` or a number of ``unit`` bytes; None when unreadable."""
    value = value.strip()
    if value in ("unlimited", "infinity"):
        return "unlimited"
    if value.isascii() and value.isdigit():
        number = int(value) * unit
        return "unlimited" if number >= UNLIMITED_BYTES else number
    return None


def _memlock(text: str) -> tuple[Limit | None, Limit | None, dict[str, Limit]]:
    soft = hard = None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "soft":
            soft = parse_limit(value, 1024)  # ulimit -l counts KiB
        elif key == "hard":
            hard = parse_limit(value, 1024)
    units: dict[str, Limit] = {}
    for block in parse_show("\n".join(line for line in text.splitlines() if "=" in line or not line)):
        limit = parse_limit(block.get("LimitMEMLOCK", ""))
        if "Id" in block and limit is not None:
            units[block["Id"]] = limit
    return soft, hard, units


def parse_fabric(text: str) -> tuple[GpuFabric, ...]:
    """``@gpu BUS`` followed by that GPU's ``State : X`` / ``Status : Y`` lines."""
    found: list[GpuFabric] = []
    gpu: str | None = None
    values: dict[str, str] = {}

    def flush() -> None:
        if gpu is not None and values:
            found.append(GpuFabric(gpu=gpu, state=values.get("State", ""), status=values.get("Status", "")))

    for line in text.splitlines():
        if line.startswith("@gpu "):
            flush()
            gpu, values = line[5:].strip(), {}
        else:
            key, sep, value = line.partition(":")
            if sep and key.strip() in ("State", "Status"):
                values[key.strip()] = value.strip()
    flush()
    return tuple(found)


def _fabric_manager(text: str) -> str | None:
    blocks = parse_show(text)
    if not blocks or blocks[0].get("LoadState", "not-found") == "not-found":
        return None
    return blocks[0].get("ActiveState", "unknown")


def _port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    return (host, int(port)) if port.isascii() and port.isdigit() else None


def _proc_net_tcp(lines: list[str]) -> list[Listener]:
    """``/proc/net/tcp{,6}``: ``sl local rem st ...``, hex addresses, st 0A = LISTEN."""
    found = []
    for line in lines:
        parts = line.split()
        if len(parts) > 3 and parts[3] == "0A" and ":" in parts[1]:
            host, _, port = parts[1].rpartition(":")
            found.append(Listener(address=host, port=int(port, 16)))
    return found


def _ss_records(blob: str) -> list[str]:
    """The listeners of ``ss -Htlnp``, one record each, from its base64-encoded output.

    A process name may hold a newline, so a line does not always start a record: a record
    whose ``users:((`` part has not yet reached its closing ``pid=N,fd=N))`` continues on
    the next line. A forged line would need a name of ``pid=1,fd=1))``, a newline and a
    whole ``LISTEN ...`` line, longer than the 15 bytes the kernel keeps of a name."""
    try:
        text = base64.b64decode(blob.strip(), validate=True).decode("utf-8", "replace")
    except (binascii.Error, ValueError):
        return []
    records: list[str] = []
    for line in text.split("\n"):
        if records and "users:((" in records[-1] and not _USERS_DONE.search(records[-1]):
            records[-1] += "\n" + line
        else:
            records.append(line)
    return records


def parse_listeners(text: str) -> tuple[tuple[Listener, ...], bool]:
    """Listening TCP sockets from ``ss -Htlnp`` (base64 after ``@ss``, or ``/proc/net/tcp``
    after ``@proc``), each with its process and systemd unit where ``ss`` could name them;
    and whether the list could be read at all."""
    lines = text.split("\n")
    if "@unknown" in lines:
        return (), False
    if "@proc" in lines:
        return tuple(_proc_net_tcp(lines)), True
    units: dict[int, str | None] = {}
    records: list[str] = []
    for line in lines:
        if line.startswith("@unit "):
            _, number, *unit = line.split(" ")
            if number.isascii() and number.isdigit():
                units[int(number)] = unit[0] if unit and unit[0] else None
        elif line.startswith("@ss "):
            records.extend(_ss_records(line[4:]))
    found = []
    for record in records:
        parts = record.split()
        if len(parts) < 4 or parts[0] != "LISTEN":
            continue
        local = _port(parts[3])
        if local is None:
            continue
        users = _USERS.search(record)
        pid = int(users.group(2)) if users else None
        found.append(
            Listener(
                address=local[0],
                port=local[1],
                process=users.group(1).split('",pid=', 1)[0] if users else "",
                pid=pid,
                unit=units.get(pid) if pid is not None else None,
            )
        )
    return tuple(found), True


def _disks(text: str) -> tuple[Disk, ...]:
    disks = []
    for line in text.splitlines():
        path, _, sizes = line.partition("\t")
        numbers = sizes.split()
        if len(numbers) == 2 and all(n.isascii() and n.isdigit() for n in numbers):
            disks.append(
                Disk(path=path, total_bytes=int(numbers[0]) * 1024, free_bytes=int(numbers[1]) * 1024)
            )
    return tuple(disks)


def _clock(text: str) -> float | None:
    try:
        return float(text.strip().splitlines()[0])
    except (ValueError, IndexError):
        return None


def _owned(fields: list[str]) -> Owned | None:
    """One ``@path`` record: path, uid, owner, octal mode, ``stat``'s file type."""
    if len(fields) != 5:
        return None
    path, uid, owner, mode, kind = fields
    if not (
        path.startswith("/")
        and path.isprintable()
        and owner.isprintable()
        and _UID.fullmatch(uid)
        and _MODE.fullmatch(mode)
    ):
        return None
    return Owned(path=path, uid=int(uid), owner=owner, mode=int(mode, 8), link=kind == "symbolic link")


def parse_owned(text: str) -> tuple[Owned, ...]:
    """The ``@path`` lines of doctor-root-folders, each path once, in the order printed. A
    path with a control character is left out: it would reach the operator's terminal."""
    found: dict[str, Owned] = {}
    for line in text.split("\n")[:MAX_OWNED]:
        if not line.startswith("@path "):
            continue
        try:
            raw = base64.b64decode(line[6:].strip(), validate=True)
        except (binascii.Error, ValueError):
            continue
        entry = _owned(raw.decode("utf-8", "replace").split("\0"))
        if entry is not None:
            found.setdefault(entry.path, entry)
    return tuple(found.values())


def parse_doctor(node: str, text: str) -> DoctorFacts:
    """DoctorFacts from the script's output (the probe's sections are ignored here). Output
    the probe's parser refuses (a section printed twice) gives nothing to check."""
    try:
        sections = split_sections(text)
    except ValueError:
        return DoctorFacts(node=node)
    soft, hard, units = _memlock(sections.get("doctor-memlock", ""))
    listeners, known = parse_listeners(sections.get("doctor-listen", "@unknown"))
    return DoctorFacts(
        node=node,
        memlock_soft=soft,
        memlock_hard=hard,
        unit_memlock=units,
        fabric=parse_fabric(sections.get("doctor-fabric", "")),
        fabric_manager=_fabric_manager(sections.get("doctor-fabricmanager", "")),
        listeners=listeners,
        listeners_known=known,
        disks=_disks(sections.get("doctor-disks", "")),
        root_folders=parse_owned(sections.get("doctor-root-folders", "")),
        clock_end=_clock(sections.get("doctor-clock", "")),
    )

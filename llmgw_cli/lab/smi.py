"""The lab's fake ``nvidia-smi``: answers from ``/etc/lab/gpus.json`` and ``/etc/lab/topo.txt``.

Standard library only: ``llmgw lab up`` copies this file into every node as
``/usr/bin/nvidia-smi`` (with a shebang naming the lab's Python), so it must not import
llmgw. The output formats follow real captures: ``--query-gpu`` joins cells with
``", "``, ``nounits`` drops units but keeps them in the header, an unreadable cell is a
bracketed string, an unknown field rejects the whole query. A GPU whose ``state`` is
``reset-required`` shows what a real one does: ``[GPU requires reset]`` cells,
``Reset Required : Yes``, ``System is not in ready state``. A ``lost`` GPU (fallen off
the bus) has no row: ``Unable to determine the device handle for GPU <bus>: Unknown
Error`` in its place, the other GPUs still answer, and the exit status is 15. An ``ecc``
GPU counts uncorrected ECC errors since boot; a ``remap-pending`` one has a row remap
waiting for a reset, a ``remap-failed`` one a failed remap (``llmgw lab fault``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

STATE_PATH = "/etc/lab/gpus.json"
TOPO_PATH = "/etc/lab/topo.txt"
RESET = "[GPU requires reset]"
NO_DRIVER = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. Make sure that the latest NVIDIA driver is installed and running.\n"

Gpu = dict[str, Any]
Doc = dict[str, Any]

# field -> (unit shown with units, value of a healthy idle GPU, unreadable when reset is required)
_FIELDS: dict[str, tuple[str, Callable[[Doc, Gpu], str], bool]] = {
    "index": ("", lambda d, g: str(g["index"]), False),
    "name": ("", lambda d, g: g["name"], False),
    "gpu_name": ("", lambda d, g: g["name"], False),
    "uuid": ("", lambda d, g: g["uuid"], False),
    "gpu_uuid": ("", lambda d, g: g["uuid"], False),
    "serial": ("", lambda d, g: g["serial"], False),
    "pci.bus_id": ("", lambda d, g: g["bus_id"], False),
    "gpu_bus_id": ("", lambda d, g: g["bus_id"], False),
    "driver_version": ("", lambda d, g: d["driver_version"], False),
    "count": ("", lambda d, g: str(len(d["gpus"])), False),
    "memory.total": ("MiB", lambda d, g: str(g["memory_total_mib"]), False),
    "memory.reserved": ("MiB", lambda d, g: str(g["memory_reserved_mib"]), False),
    "memory.used": ("MiB", lambda d, g: str(g.get("memory_used_mib", 0)), False),
    "memory.free": (
        "MiB",
        lambda d, g: str(g["memory_total_mib"] - g["memory_reserved_mib"] - g.get("memory_used_mib", 0)),
        False,
    ),
    "utilization.gpu": ("%", lambda d, g: "0", True),
    "utilization.memory": ("%", lambda d, g: "0", True),
    "temperature.gpu": ("", lambda d, g: str(30 + g["index"] % 5), True),
    "temperature.memory": ("", lambda d, g: str(38 + g["index"] % 4), True),
    "power.draw": ("W", lambda d, g: f"{68.5 + g['index'] * 0.37:.2f}", True),
    "power.limit": ("W", lambda d, g: f"{g['power_limit_w']:.2f}", False),
    "fan.speed": ("%", lambda d, g: "[N/A]", True),
    "clocks.sm": ("MHz", lambda d, g: "345", True),
    "clocks.max.sm": ("MHz", lambda d, g: "1980", False),
    "pstate": ("", lambda d, g: "P0", True),
    "persistence_mode": ("", lambda d, g: "Enabled", False),
    "compute_mode": ("", lambda d, g: "Default", False),
    "compute_cap": ("", lambda d, g: "9.0" if d["architecture"] == "Hopper" else "8.0", False),
    "mig.mode.current": ("", lambda d, g: "Disabled", False),
    "ecc.mode.current": ("", lambda d, g: "Enabled", False),
    "ecc.errors.uncorrected.volatile.total": ("", lambda d, g: str(_uncorrected(g)), True),
    "ecc.errors.uncorrected.aggregate.total": ("", lambda d, g: str(_uncorrected(g)), False),
    "retired_pages.pending": ("", lambda d, g: "[N/A]", False),
    "remapped_rows.pending": ("", lambda d, g: _yes(g, "remap-pending"), False),
    "remapped_rows.failure": ("", lambda d, g: _yes(g, "remap-failed"), False),
    "remapped_rows.uncorrectable": ("", lambda d, g: str(_uncorrected(g)), False),
    "reset_status.reset_required": ("", lambda d, g: "Yes" if _broken(g) else "No", False),
    "reset_status.drain_and_reset_recommended": ("", lambda d, g: "No", False),
    "pcie.link.gen.current": ("", lambda d, g: "5" if d["architecture"] == "Hopper" else "4", True),
    "pcie.link.width.current": ("", lambda d, g: "16", True),
    "clocks_event_reasons.active": ("", lambda d, g: "0x0000000000000001", True),
    "clocks_throttle_reasons.active": ("", lambda d, g: "0x0000000000000001", True),
    "vbios_version": ("", lambda d, g: "96.00.74.00.01", False),
}


def _broken(gpu: Gpu) -> bool:
    return bool(gpu.get("state") == "reset-required")


def _uncorrected(gpu: Gpu) -> int:
    """Uncorrected ECC errors since boot: 2 on a GPU in state ``ecc``."""
    return 2 if gpu.get("state") == "ecc" else 0


def _yes(gpu: Gpu, state: str) -> str:
    return "Yes" if gpu.get("state") == state else "No"


def query(doc: Doc, fields: list[str], fmt: str, only: int | None = None) -> tuple[str, int]:
    """``--query-gpu=<fields> --format=<fmt>``: the output and the exit status."""
    for f in fields:
        if f not in _FIELDS:
            return f'Field "{f}" is not a valid field to query.\n\n', 2
    opts = set(fmt.split(","))
    if "csv" not in opts:
        return '"--format" must contain "csv".\n', 2
    units = "nounits" not in opts
    lines = []
    if "noheader" not in opts:
        lines.append(", ".join(f"{f} [{_FIELDS[f][0]}]" if _FIELDS[f][0] else f for f in fields))
    for gpu in _selected(doc, only):
        if _lost(gpu):
            lines.append(_no_handle(gpu))
            continue
        cells = []
        for f in fields:
            unit, value, resettable = _FIELDS[f]
            if resettable and _broken(gpu):
                cells.append(RESET)
                continue
            text = value(doc, gpu)
            cells.append(f"{text} {unit}" if units and unit and not text.startswith("[") else text)
        lines.append(", ".join(cells))
    return "".join(line + "\n" for line in lines), _status(doc, only)


def _lost(gpu: Gpu) -> bool:
    return bool(gpu.get("state") == "lost")


def _no_handle(gpu: Gpu) -> str:
    """What nvidia-smi prints for a GPU that fell off the bus (4-digit PCI domain)."""
    return f"Unable to determine the device handle for GPU {gpu['bus_id'][4:].lower()}: Unknown Error"


def _status(doc: Doc, only: int | None) -> int:
    """15: a GPU is inaccessible (fallen off the bus), as in nvidia-smi's return codes."""
    return 15 if any(_lost(g) for g in _selected(doc, only)) else 0


def _selected(doc: Doc, only: int | None) -> list[Gpu]:
    return [g for g in doc["gpus"] if only is None or g["index"] == only]


def listing(doc: Doc) -> str:
    """``nvidia-smi -L``."""
    return "".join(
        _no_handle(g) + "\n" if _lost(g) else f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})\n"
        for g in doc["gpus"]
    )


def _kv(indent: int, key: str, value: object) -> str:
    pad = 42 - indent
    return f"{' ' * indent}{key:<{pad}}: {value}\n"


def _section(indent: int, title: str, rows: Sequence[tuple[str, object]]) -> str:
    return " " * indent + title + "\n" + "".join(_kv(indent + 4, k, v) for k, v in rows)


def details(doc: Doc, only: int | None = None, now: float | None = None) -> str:
    """``nvidia-smi -q``: header plus, per GPU, the blocks a health probe reads."""
    stamp = time.strftime("%a %b %d %H:%M:%S %Y", time.localtime(now))
    out = "\n==============NVSMI LOG==============\n\n"
    out += _kv(0, "Timestamp", stamp) + _kv(0, "Driver Version", doc["driver_version"])
    out += _kv(0, "CUDA Version", doc["cuda_version"]) + "\n"
    out += _kv(0, "Attached GPUs", len(doc["gpus"]))
    for g in _selected(doc, only):
        if _lost(g):
            out += _no_handle(g) + "\n"
            continue
        bad = _broken(g)
        not_ready = "System is not in ready state"
        total, reserved = g["memory_total_mib"], g["memory_reserved_mib"]
        used = g.get("memory_used_mib", 0)
        out += f"GPU {g['bus_id']}\n"
        out += "".join(
            _kv(4, k, v)
            for k, v in [
                ("Product Name", g["name"]),
                ("Product Brand", "NVIDIA"),
                ("Product Architecture", doc["architecture"]),
                ("Persistence Mode", "Enabled"),
            ]
        )
        out += _section(4, "MIG Mode", [("Current", "Disabled"), ("Pending", "Disabled")])
        out += "".join(
            _kv(4, k, v)
            for k, v in [
                ("Serial Number", g["serial"]),
                ("GPU UUID", g["uuid"]),
                ("Minor Number", g["index"]),
                ("Module ID", g["module_id"]),
            ]
        )
        out += _section(
            4,
            "GPU Reset Status",
            [("Reset Required", "Yes" if bad else "No"), ("Drain and Reset Recommended", "No")],
        )
        out += _section(4, "PCI", [("Bus Id", g["bus_id"])])
        out += _kv(4, "Fan Speed", not_ready if bad else "N/A")
        out += _kv(4, "Performance State", "P0")
        out += _section(
            4,
            "FB Memory Usage",
            [
                ("Total", f"{total} MiB"),
                ("Reserved", f"{reserved} MiB"),
                ("Used", f"{used} MiB"),
                ("Free", f"{total - reserved - used} MiB"),
            ],
        )
        util = [("Gpu", "0 %"), ("Memory", "0 %"), ("Encoder", "0 %"), ("Decoder", "0 %")]
        if bad:
            util = [(k, not_ready) for k, _ in util[:2]] + [(k, "Unknown Error") for k, _ in util[2:]]
        out += _section(4, "Utilization", util)
        out += "    ECC Errors\n"
        for period in ("Volatile", "Aggregate"):
            out += _section(8, period, [("DRAM Correctable", 0), ("DRAM Uncorrectable", _uncorrected(g))])
        out += _section(
            4,
            "Remapped Rows",
            [
                ("Correctable Error", 0),
                ("Uncorrectable Error", _uncorrected(g)),
                ("Pending", _yes(g, "remap-pending")),
                ("Remapping Failure Occurred", _yes(g, "remap-failed")),
            ],
        )
        out += _section(
            4, "Temperature", [("GPU Current Temp", not_ready if bad else f"{30 + g['index'] % 5} C")]
        )
        out += _section(
            4,
            "GPU Power Readings",
            [("Power Draw", "Unknown Error" if bad else f"{68.5 + g['index'] * 0.37:.2f} W")],
        )
        if doc.get("fabric_manager"):
            out += _section(4, "Fabric", [("State", "Completed"), ("Status", "Success")])
        out += "\n"
    return out


def _option(argv: list[str], name: str) -> str | None:
    """Value of ``--name=value`` or ``--name value``."""
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _index(argv: list[str]) -> int | None:
    for flag in ("-i", "--id"):
        value = _option(argv, flag)
        if value is not None:
            return int(value)
    return None


def run(argv: list[str], state_path: str = STATE_PATH, topo_path: str = TOPO_PATH) -> tuple[str, str, int]:
    """Answer one invocation: (stdout, stderr, exit status)."""
    try:
        with open(state_path, encoding="utf-8") as f:
            doc: Doc = json.load(f)
    except OSError:
        return NO_DRIVER, "", 9
    if argv[:1] == ["topo"]:
        if "-m" not in argv:
            return "", "fake nvidia-smi: only `topo -m` is simulated\n", 2
        try:
            with open(topo_path, encoding="utf-8") as f:
                return f.read(), "", 0
        except OSError:
            return NO_DRIVER, "", 9
    if "-L" in argv or "--list-gpus" in argv:
        return listing(doc), "", _status(doc, None)
    fields = _option(argv, "--query-gpu")
    if fields is not None:
        names = [f.strip() for f in fields.split(",") if f.strip()]
        out, code = query(doc, names, _option(argv, "--format") or "", _index(argv))
        return ("", out, code) if code == 2 else (out, "", code)
    if "-q" in argv or "--query" in argv:
        return details(doc, _index(argv)), "", _status(doc, _index(argv))
    if not argv:
        return details(doc), "", _status(doc, None)
    return "", f"fake nvidia-smi: unsupported arguments: {' '.join(argv)}\n", 2


def main() -> None:
    out, err, code = run(sys.argv[1:])
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.exit(code)


if __name__ == "__main__":
    main()

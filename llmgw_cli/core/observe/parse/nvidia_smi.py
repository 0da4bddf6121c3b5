"""``nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits``.

nvidia-smi's own rules: cells that cannot be read are bracketed strings
(``[N/A]``, ``[GPU requires reset]``); a lost GPU leaves an "Unable to determine the
device handle" line while the other rows still come; extra commas belong to the name.
An unknown field makes nvidia-smi refuse the whole query, so the core query holds only
fields every driver knows.
"""

from __future__ import annotations

import re

from llmgw_cli.core.observe.facts import Gpu, GpuHealth

QUERY_FIELDS = ("index", "uuid", "name", "memory.total", "memory.used", "pci.bus_id")
_FAULT_CELLS = ("[GPU requires reset]", "[Unknown Error]")
_LOST = re.compile(
    r"Unable to determine the device handle for GPU\s*((?:[0-9A-Fa-f]+:)+[0-9A-Fa-f]+\.[0-9A-Fa-f])"
)


def _int(cell: str | None) -> int | None:
    return int(cell) if cell is not None and cell.isdigit() else None


def _split(line: str, width: int, name_at: int) -> list[str]:
    cells = [c.strip() for c in line.split(", ")]
    if len(cells) > width and name_at >= 0:  # a name with ", " in it
        extra = len(cells) - width
        cells = [
            *cells[:name_at],
            ", ".join(cells[name_at : name_at + 1 + extra]),
            *cells[name_at + 1 + extra :],
        ]
    return cells + ["[N/A]"] * (width - len(cells))


def parse_query_gpu(text: str, fields: tuple[str, ...] = QUERY_FIELDS) -> tuple[list[Gpu], list[str]]:
    """GPUs from the CSV rows (``fields`` is the query's field list, in order), and the bus ids
    of GPUs nvidia-smi could not open at all."""
    gpus: list[Gpu] = []
    lost = [m.group(1) for m in _LOST.finditer(text)]
    name_at = fields.index("name") if "name" in fields else -1
    for line in text.splitlines():
        if not line.strip() or _LOST.search(line) or not line.split(",", 1)[0].strip().isdigit():
            continue
        row = dict(zip(fields, _split(line, len(fields), name_at), strict=False))
        reasons = [f"nvidia-smi reports {c}" for c in dict.fromkeys(row.values()) if c in _FAULT_CELLS]
        bus = row.get("pci.bus_id", "[N/A]")
        gpus.append(
            Gpu(
                index=int(row["index"]),
                uuid=row.get("uuid", ""),
                name=row.get("name", ""),
                memory_total=_int(row.get("memory.total")),
                memory_used=_int(row.get("memory.used")),
                pci_bus_id=None if bus.startswith("[") else bus,
                health=GpuHealth.faulty if reasons else GpuHealth.healthy,
                reasons=tuple(reasons),
                causes=("nvidia-smi",) if reasons else (),
            )
        )
    return gpus, lost


HEALTH_FIELDS = (
    "index",
    "reset_status.reset_required",
    "reset_status.drain_and_reset_recommended",
    "remapped_rows.pending",
    "remapped_rows.failure",
    "ecc.errors.uncorrected.volatile.total",
)
_HEALTH_REASONS = {  # field -> (cause, reason)
    "reset_status.reset_required": ("reset-required", "reset required"),
    "reset_status.drain_and_reset_recommended": ("drain-and-reset", "drain and reset recommended"),
    "remapped_rows.pending": ("remap-pending", "row remapping pending (reset needed)"),
    "remapped_rows.failure": ("remap-failed", "row remapping failed (memory repair exhausted)"),
}


def parse_health(text: str) -> dict[int, list[str]]:
    """Fault reasons per GPU index from the optional health query (a reset required or
    recommended, pending or failed row remaps, uncorrected ECC errors).
    Cells that read ``[N/A]``/``[Not Supported]`` say nothing either way."""
    return {index: [why for _, why in found] for index, found in health_faults(text).items()}


def health_faults(text: str) -> dict[int, list[tuple[str, str]]]:
    """``parse_health`` with each reason's cause, a word of a fixed set (``reset-required``,
    ``drain-and-reset``, ``remap-pending``, ``remap-failed``, ``ecc``): what a metric's
    label may carry."""
    faults: dict[int, list[tuple[str, str]]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(HEALTH_FIELDS) or not cells[0].isdigit():
            continue
        row = dict(zip(HEALTH_FIELDS, cells, strict=True))
        found = [pair for field, pair in _HEALTH_REASONS.items() if row[field].lower() == "yes"]
        ecc = row["ecc.errors.uncorrected.volatile.total"]
        if ecc.isascii() and ecc.isdigit() and int(ecc) > 0:
            found.append(("ecc", f"{ecc} uncorrected ECC errors since boot"))
        if found:
            faults[int(cells[0])] = found
    return faults

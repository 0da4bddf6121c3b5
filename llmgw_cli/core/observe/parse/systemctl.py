"""``systemctl show -p ... UNIT...``: ``key=value`` lines, one blank line between units.

systemd prints properties in its own order, not the order asked for (systemd#4907), so
blocks are parsed into dicts by key, never by position."""

from __future__ import annotations

from llmgw_cli.core.observe.unit_state import UnitState


def parse_show(text: str) -> list[dict[str, str]]:
    """One dict per unit block."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in [*text.splitlines(), ""]:
        if not line.strip():
            if current:
                blocks.append(current)
            current = {}
            continue
        key, sep, value = line.partition("=")
        if sep:
            current[key.strip()] = value
    return blocks


def _int(value: str | None) -> int | None:
    digits = (value or "").removeprefix("-")
    return int(value) if value is not None and digits.isascii() and digits.isdigit() else None


def _seconds(block: dict[str, str], key: str) -> float | None:
    """A ``...TimestampMonotonic`` property (microseconds since boot) in seconds; None
    when absent or 0 (never happened)."""
    value = _int(block.get(key))
    return value / 1e6 if value else None


def _ages(block: dict[str, str], now: float | None) -> tuple[float | None, float | None]:
    """(seconds since the main process started, how long it ran when it has exited) at
    ``now``, the node's monotonic clock in seconds (None: unknown)."""
    started = _seconds(block, "ExecMainStartTimestampMonotonic")
    exited = _seconds(block, "ExecMainExitTimestampMonotonic")
    age = max(0.0, now - started) if now is not None and started is not None else None
    lived = exited - started if started is not None and exited is not None and exited >= started else None
    return age, lived


def unit_state(block: dict[str, str], now: float | None = None) -> UnitState:
    """A UnitState from one block of ``systemctl show``; ``now``: the node's monotonic
    clock in seconds when it was read (``/proc/uptime``), for the main process's age."""
    age, lived = _ages(block, now)
    return UnitState(
        name=block.get("Id", ""),
        load_state=block.get("LoadState", "unknown"),
        active_state=block.get("ActiveState", "unknown"),
        sub_state=block.get("SubState", "unknown"),
        result=block.get("Result", ""),
        main_pid=_int(block.get("MainPID")) or 0,
        n_restarts=_int(block.get("NRestarts")) or 0,
        exec_main_code=_int(block.get("ExecMainCode")),
        exec_main_status=_int(block.get("ExecMainStatus")),
        age=age,
        lived=lived,
    )

"""``systemctl show -p ... UNIT...``: ``key=value`` lines, one blank line between units.

systemd prints properties in its own order, not the order asked for (systemd#4907), so
blocks are parsed into dicts by key, never by position."""

from __future__ import annotations

from llmgw_cli.core.facts import UnitState


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


def unit_state(block: dict[str, str]) -> UnitState:
    """A UnitState from one block of ``systemctl show``."""
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
    )

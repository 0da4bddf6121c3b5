"""llmgw's replica units as a node reports them: the ``X-Llmgw-*`` label lines of the unit
files (``templates/llmgw-replica.service.j2`` writes them) joined with each unit's state
from ``systemctl show``. Plan, status and doctor read units only through ``ReplicaUnit``."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping

from llmgw_cli.core.observe.facts import NodeFacts, ReplicaUnit
from llmgw_cli.core.observe.health import DEFAULT_START_TIMEOUT
from llmgw_cli.core.observe.unit_state import UnitState

UNIT_DIR = "/etc/systemd/system/"
LABEL_PREFIX = "X-Llmgw-"


def parse_labels(text: str) -> dict[str, dict[str, str]]:
    """``grep -H`` lines ``/etc/systemd/system/UNIT:X-Llmgw-KEY=VALUE`` as ``{unit: {KEY:
    VALUE}}``; anything else is not a label and is skipped."""
    labels: dict[str, dict[str, str]] = defaultdict(dict)
    for line in text.split("\n"):
        path, sep, rest = line.partition(":")
        unit = path.removeprefix(UNIT_DIR)
        key, eq, value = rest.partition("=")
        if sep and eq and path.startswith(UNIT_DIR) and "/" not in unit and key.startswith(LABEL_PREFIX):
            labels[unit][key.removeprefix(LABEL_PREFIX)] = value
    return dict(labels)


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isascii() and text.isdigit() else None


def _seconds(text: str | None) -> float:
    """The start timeout label; the profiles' default when a unit has none (written by an
    older llmgw) or an unreadable one."""
    try:
        value = float(text or "")
    except ValueError:
        return DEFAULT_START_TIMEOUT
    return value if math.isfinite(value) and value > 0 else DEFAULT_START_TIMEOUT


def _list(text: str) -> tuple[str, ...]:
    return tuple(item for item in text.split(",") if item)


def replica_unit(
    node: str, name: str, labels: Mapping[str, str], state: UnitState | None
) -> ReplicaUnit | None:
    """One unit's labels as a ReplicaUnit; None when they do not name a model and a replica
    number (not a unit llmgw wrote)."""
    model = labels.get("Model")
    replica = _number(labels.get("Replica"))
    if not model or replica is None:
        return None
    return ReplicaUnit(
        node=node,
        name=name,
        model=model,
        replica=replica,
        rank=_number(labels.get("Rank")),
        members=_list(labels.get("Members", "")) or (node,),
        gpus=_list(labels.get("Gpus", "")),
        port=_number(labels.get("Port")) or 0,
        spec_hash=labels.get("Spec-Hash", ""),
        start_timeout=_seconds(labels.get("Start-Timeout")),
        state=state,
    )


def replica_units(facts: NodeFacts) -> tuple[ReplicaUnit, ...]:
    """Every labelled replica unit of one node, with its state (None when systemd does
    not list it), in unit name order."""
    states = {u.name: u for u in facts.units}
    labels = facts.unit_labels
    found = (replica_unit(facts.node, name, labels[name], states.get(name)) for name in sorted(labels))
    return tuple(u for u in found if u is not None)

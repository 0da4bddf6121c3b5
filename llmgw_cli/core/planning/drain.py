"""Retiring a replica without cutting what it serves: the drain marker on the nodes and
the gateway's routing view, the two facts ``apply`` and the gateway share (pure).

``apply`` replaces a serving replica by starting its successor first, waiting until the
gateway routes it, then draining the old one: it writes a marker on every member node of
the old replica, and stops it once no request is in flight to it or the drain bound has
passed. Why a marker on the node rather than a call to the gateway's admin API: every
gateway (a hand-over instance during an upgrade, several gateways) sees it through the
probe it already runs, it survives a gateway restart, it needs no credential beyond the
root access ``apply`` has, and an ``apply`` that dies midway leaves a trace the next plan
reads (a replica left draining is deleted: it is out of rotation already).

- The marker: ``DRAIN_DIR/<replica unit name>``, one line: the deadline in seconds since
  the epoch on the node's clock (``marker_text``). The node helper writes and removes it
  (its ``drain-mark UNIT SECONDS`` and ``drain-clear UNIT...`` verbs, ``node/helper.py``),
  with the node's own clock; its ``remove`` takes a unit's marker with the unit. Only names
  of replica units and finite numbers are read back; a node's other files there are
  ignored.
- The routing view: each gateway process writes ``<gateway.state_dir>/routes/<pid>.json``
  whenever what it routes changes and at least once per discovery round, and removes it
  when it stops. ``apply`` reads those files (as root on the gateway host) to learn that
  every live gateway routes a successor, and that none routes a draining replica any
  more; the pid names the process to send ``PROBE_NOW_SIGNAL`` (probe now, not at the
  next round).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from llmgw_cli.core.clusterfile.spec import ClusterSpec, Model

# Root writes the markers, so they live in a folder of root's alone (0755: the gateway's
# unprivileged probe reads them), never inside a state folder another account owns: that
# account could swap the folder or a file in it for a link between root's steps.
DRAIN_DIR = "/var/lib/llmgw-drain"
DRAIN_GRACE = 60.0  # seconds past a marker's deadline after which its retirement is abandoned
PROBE_NOW_SIGNAL = "USR1"  # a gateway that gets it probes the nodes at once
ROUTES_DIR_NAME = "routes"
REPLICA_UNIT = re.compile(r"^llmgw-[a-z0-9.-]+-[0-9]+\.service$")


def drain_seconds(spec: ClusterSpec, model: Model) -> float:
    """How long a retired replica of ``model`` may finish its requests before it is stopped."""
    return model.drain_timeout if model.drain_timeout is not None else spec.gateway.drain_timeout


def marker_path(unit: str) -> str:
    if not REPLICA_UNIT.fullmatch(unit):
        raise ValueError(f"not a replica unit name: {unit!r}")
    return f"{DRAIN_DIR}/{unit}"


def marker_text(deadline: float) -> str:
    return f"{deadline:.3f}\n"


def parse_marker(text: str) -> float | None:
    """The deadline in a marker; None when it is not one finite number."""
    words = text.split()
    if len(words) != 1:
        return None
    try:
        value = float(words[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def parse_markers(entries: list[tuple[str, str]]) -> dict[str, float]:
    """``(file name, content)`` pairs read from ``DRAIN_DIR`` -> unit name -> deadline,
    keeping only replica unit names with a valid deadline."""
    found: dict[str, float] = {}
    for name, text in entries:
        deadline = parse_marker(text)
        if REPLICA_UNIT.fullmatch(name) and deadline is not None:
            found[name] = deadline
    return found


def abandoned(deadline: float, now: float) -> bool:
    """Whether a marker's retirement was given up (its ``apply`` died): the deadline
    passed ``DRAIN_GRACE`` ago."""
    return now > deadline + DRAIN_GRACE


# --- the gateway's routing view ------------------------------------------------------


def routes_dir(state_dir: str) -> str:
    return f"{state_dir.rstrip('/')}/{ROUTES_DIR_NAME}"


@dataclass(frozen=True)
class Routes:
    """What one gateway process routes: ready addresses by model, and the addresses it
    knows are draining (it routes nothing new to them)."""

    pid: int
    written: float  # wall clock
    ready: dict[str, frozenset[str]]
    draining: frozenset[str] = frozenset()

    def routes(self, model: str, address: str) -> bool:
        return address in self.ready.get(model, frozenset())


def routes_text(routes: Routes) -> str:
    return (
        json.dumps(
            {
                "pid": routes.pid,
                "written": routes.written,
                "ready": {m: sorted(a) for m, a in sorted(routes.ready.items())},
                "draining": sorted(routes.draining),
            },
            sort_keys=True,
        )
        + "\n"
    )


def parse_routes(text: str) -> Routes | None:
    """A routes file; None when it is not one (half written, foreign)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    pid, written, ready, draining = (data.get(k) for k in ("pid", "written", "ready", "draining"))
    if (
        not isinstance(pid, int)
        or isinstance(pid, bool)
        or pid <= 0
        or not isinstance(written, int | float)
        or not isinstance(ready, dict)
        or not isinstance(draining, list)
        or not all(isinstance(a, str) for a in draining)
        or not all(
            isinstance(m, str) and isinstance(a, list) and all(isinstance(x, str) for x in a)
            for m, a in ready.items()
        )
    ):
        return None
    return Routes(
        pid=pid,
        written=float(written),
        ready={m: frozenset(a) for m, a in ready.items()},
        draining=frozenset(draining),
    )

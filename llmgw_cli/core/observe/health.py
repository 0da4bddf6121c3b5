"""A replica's health: the one notion ``apply``, ``plan``, ``status`` and the gateway's
controller decide by, from what systemd says of its units (``UnitState``) and, when
known, the last answer of its health check.

- ``stopped``: no unit, or a unit stopped on purpose (inactive, ``Result=success``);
- ``failed``: systemd gave up on it (``ActiveState=failed``), or it was stopped after
  its engine failed (inactive with another ``Result``);
- ``crash-looping``: its engine exits and systemd keeps starting it again: it waits to
  be restarted (``SubState=auto-restart``) after a life shorter than its start timeout
  (or of unknown length), or it was restarted ``CRASH_RESTARTS`` times and its
  current life is not yet past its start timeout, or it runs past its start timeout and
  its health check says it is not ready;
- ``starting``: it runs, within its start timeout, and no health answer says ready yet
  (also: it waits to be restarted once after a long life: systemd brings it back);
- ``ready``: its health check answered ready, or (no answer known) its engine has run
  past its start timeout without being restarted over and over.

A replica of several units (one per node) is as bad as its worst unit. Only ``ready`` and
``starting`` replicas hold their cards and count towards a model's replicas; the others
are restarted by ``apply`` (once) and replaced by the gateway.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from enum import StrEnum

from llmgw_cli.core.observe.unit_state import UnitState

DEFAULT_START_TIMEOUT = 600.0
"""A profile's ``readiness.start_timeout`` unless it says otherwise (``core/clusterfile/spec.py``)."""

CRASH_RESTARTS = 2
"""Restarts by systemd within one start timeout that make a running engine crash-looping."""


class ReplicaState(StrEnum):
    ready = "ready"
    starting = "starting"
    crash_looping = "crash-looping"
    failed = "failed"
    stopped = "stopped"

    @property
    def alive(self) -> bool:
        """Ready or on its way to it: it holds its cards and is left alone."""
        return self in (ReplicaState.ready, ReplicaState.starting)


# worst first: a replica is as bad as its worst unit
_WORST = (
    ReplicaState.crash_looping,
    ReplicaState.failed,
    ReplicaState.stopped,
    ReplicaState.starting,
    ReplicaState.ready,
)


def unit_health(state: UnitState | None, start_timeout: float, healthy: bool | None = None) -> ReplicaState:
    """One unit's state (see the module's rules). ``healthy``: the last answer of the
    replica's health check (True: ready); None when nobody asked."""
    if state is None or state.load_state != "loaded":
        return ReplicaState.stopped
    if state.active_state == "failed":
        return ReplicaState.failed
    if state.sub_state.startswith("auto-restart"):  # auto-restart-queued on newer systemd
        died_starting = state.lived is None or state.lived < start_timeout
        return ReplicaState.crash_looping if died_starting else ReplicaState.starting
    if not state.up:
        return ReplicaState.stopped if state.result in ("", "success") else ReplicaState.failed
    if healthy:
        return ReplicaState.ready
    young = state.age is not None and state.age <= start_timeout
    if state.n_restarts >= CRASH_RESTARTS and (young or state.age is None):
        return ReplicaState.crash_looping
    if young:
        return ReplicaState.starting
    if healthy is False and state.age is not None:
        return ReplicaState.crash_looping
    return ReplicaState.ready


def worst(states: Iterable[ReplicaState]) -> ReplicaState:
    """The state of a replica made of units in ``states`` (none: stopped)."""
    found = set(states)
    return next((s for s in _WORST if s in found), ReplicaState.stopped)


def describe(state: ReplicaState, unit: UnitState | None) -> str:
    """``crash-looping (7 restarts, exit status 2)``: the state with what systemd says of
    why, for a replica that is not ready."""
    if unit is None or state is ReplicaState.ready:
        return state.value
    how = []
    if unit.n_restarts:
        how.append(f"{unit.n_restarts} restart{'s' if unit.n_restarts != 1 else ''}")
    if state is not ReplicaState.starting and unit.exec_main_status:
        how.append(f"exit status {unit.exec_main_status}")
    return f"{state.value} ({', '.join(how)})" if how else state.value


# systemd's own lines about a unit, which the journal of a replica holds beside the engine's
_MANAGER = re.compile(r"^(llmgw-[^ ]*\.service: |(Started|Stopped|Starting|Stopping|Failed to start) llmgw )")
_TELLING = re.compile(r"error|exception|fatal|denied|not found|no such|unrecognized|invalid", re.IGNORECASE)
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def telling_line(journal: str) -> str:
    """The line of a replica's journal tail that says best why it is not ready: the
    engine's last line naming an error, else its last line (systemd's own lines, ``...:
    Failed with result 'exit-code'.``, say only that it failed), with control characters
    shown as ``\\xNN`` (the journal is the node's data)."""
    lines = [ln.strip() for ln in journal.splitlines() if ln.strip()]
    engine = [ln for ln in lines if not _MANAGER.match(ln)]
    found = next((ln for ln in reversed(engine) if _TELLING.search(ln)), engine[-1] if engine else "")
    found = found or (lines[-1] if lines else "")
    return _shown(found)


def _shown(line: str) -> str:
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", line)[:500]


def journal_tail(journal: str, lines: int) -> tuple[str, ...]:
    """The last ``lines`` lines of a replica's journal tail that its engine wrote (systemd's
    own lines, restarts and exits that ``describe`` already says, only when the engine
    wrote none), control characters shown as ``\\xNN``, each at most 500 characters. The
    ``telling_line`` comes first when it is older than those: an engine's buffered stdout
    (a usage text) often reaches the journal after the error it printed on stderr."""
    found = [ln.strip() for ln in journal.splitlines() if ln.strip()]
    engine = [ln for ln in found if not _MANAGER.match(ln)] or found
    kept = [_shown(ln) for ln in engine[-lines:]] if lines > 0 else []
    telling = telling_line(journal)
    if telling and kept and telling not in kept:
        kept = [telling, *kept[max(0, len(kept) - lines + 1) :]]
    return tuple(kept)

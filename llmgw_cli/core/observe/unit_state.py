"""What systemd says of one unit: the value a replica's health is decided from
(``core/observe/health.py``), kept apart from the node facts (``core/observe/facts.py``),
which are themselves read through that health."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Fact(BaseModel):  # the same settings as every other fact (``facts.Fact``)
    model_config = ConfigDict(frozen=True, extra="forbid")


UP_STATES = ("active", "activating", "reloading")
"""The ``ActiveState`` values of a unit that runs (or is on its way to it)."""


class UnitState(_Fact):
    """What ``systemctl show`` says about one unit."""

    name: str
    load_state: str
    active_state: str
    sub_state: str
    result: str
    main_pid: int
    n_restarts: int
    exec_main_code: int | None
    exec_main_status: int | None
    # Seconds since its main process (running, or the last one) started, and how long
    # that one ran when it has exited; None when systemd did not say (the node's
    # monotonic clock: ``core/observe/health.py`` decides a replica's state from them).
    age: float | None = None
    lived: float | None = None

    @property
    def up(self) -> bool:
        return self.active_state in UP_STATES

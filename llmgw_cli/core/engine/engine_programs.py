"""Engine programs checked on their nodes before a replica's units start (pure).

systemd runs a replica unit's ``ExecStart=`` (and ``ExecStartPre=``) program as the
unit's ``User=``, inside the unit's sandbox. A program that account may not execute (the
file, or a folder above it, without ``x`` for it) or that the sandbox hides
(``core/hosts/sandbox.py``) fails every start with ``203/EXEC``, after the units are written
and the replica counted as starting. Before the units are written, each node is asked
(the node helper's ``exists`` verb) what each program resolves to there and whether each
engine account may run it; a node where the unit's account may not fails its start,
naming the program, the account, the owner and mode in the way, and the fix.

A program that is not on the node is left to systemd's own error, which the start
reports with the unit's journal; ``llmgw doctor`` names it before that.

Here: the programs of the units a plan writes (``program_checks``), the words each node
is asked (``by_node``), and how a node's answer, hostile data, is judged (``judge``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from llmgw_cli.core.hosts.sandbox import hidden_by, read_sandbox
from llmgw_cli.core.planning.plan import Plan
from llmgw_cli.core.weights.path_sources import plain_path

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}")  # the node helper's PROGRAM_NAME
_EXEC_KEYS = ("ExecStartPre", "ExecStart")


@dataclass(frozen=True)
class ProgramCheck:
    model: str
    node: str
    program: str  # as the unit names it: a path, or a name systemd looks up
    user: str  # the unit's User=
    unit_text: str  # the unit as it will be written: its sandbox is read from it


def unit_programs(text: str) -> tuple[str, tuple[str, ...]]:
    """The ``User=`` of a rendered replica unit and the programs of its ``Exec`` lines
    (each once, in order): the first word of each, as the node helper's ``check_unit``
    reads it."""
    user, section = "", ""
    programs: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("["):
            section = line
            continue
        key, eq, value = line.partition("=")
        if section != "[Service]" or not eq:
            continue
        if key.strip() == "User":
            user = value.strip()
        elif key.strip() in _EXEC_KEYS and value.split():
            word = value.split()[0]
            if word not in programs:
                programs.append(word)
    return user, tuple(programs)


def program_checks(plan: Plan) -> tuple[ProgramCheck, ...]:
    """One check per program of every unit ``plan`` writes, on that unit's node."""
    out: list[ProgramCheck] = []
    for action in plan.changes:
        for unit in action.write:
            user, programs = unit_programs(unit.text)
            out += [ProgramCheck(action.model, unit.node, p, user, unit.text) for p in programs]
    return tuple(out)


def askable(program: str) -> bool:
    """A program the node helper answers about: a plain absolute path or a bare name."""
    return plain_path(program) or _NAME.fullmatch(program) is not None


def by_node(checks: Iterable[ProgramCheck]) -> dict[str, list[str]]:
    """node -> the distinct programs it is asked about, in the order first met."""
    out: dict[str, list[str]] = {}
    for c in checks:
        words = out.setdefault(c.node, [])
        if askable(c.program) and c.program not in words:
            words.append(c.program)
    return out


def _text(value: object) -> str:
    """A name from the node: one printable line, bounded."""
    return _CONTROL.sub("?", str(value))[:500]


def judge(answer: Mapping[str, object], check: ProgramCheck) -> str:
    """Why ``check``'s unit could not run its program on its node, with the fix; ``""``
    when it can, or when the node's answer does not say (a program that is not there is
    systemd's to report)."""
    if not askable(check.program):
        return ""
    entry = answer.get(check.program)
    if not isinstance(entry, dict) or entry.get("kind") != "file":
        return ""
    found = entry.get("path")
    path = _text(found) if isinstance(found, str) and plain_path(found) else check.program
    where = check.program if path == check.program else f"{check.program} ({path})"
    directive = hidden_by(read_sandbox(check.unit_text), path) if path.startswith("/") else None
    if directive:
        return (
            f"the engine program {where} is hidden from its unit by {directive}: install the "
            "engine where the unit can see it (for example under /opt) and point the profile's "
            "`command` there"
        )
    by_user = entry.get("unrunnable")
    blocked = by_user.get(check.user) if isinstance(by_user, dict) else None
    if not isinstance(blocked, dict):
        return ""
    at, owner, mode = (_text(blocked.get(k, "?")) for k in ("path", "owner", "mode"))
    return (
        f"the engine program {where} cannot be run by {check.user}, the engine's account: "
        f"{at} (owner {owner}, mode {mode}); let {check.user} run it (for example "
        f"`chmod o+rx {at}`, or its group), or point the profile's `command` at a program it may run"
    )

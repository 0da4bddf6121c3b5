"""`llmgw logs` and `llmgw restart`: which replicas a reference names, and the engines'
journal lines as an operator reads them (pure).

A reference is ``MODEL`` (every replica of it that runs) or ``MODEL#N`` (replica N), as
`llmgw status` and the plan name replicas. The journal lines come from the nodes: they
are hostile data, so a control character (an escape sequence that would drive the
operator's terminal, a carriage return that would hide what came before it) is shown as
``\\xNN``, never passed through.
"""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass
from datetime import datetime

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.planning.plan import Running
from llmgw_cli.errors import UsageError

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")
_SINCE = re.compile(r"^[0-9A-Za-z :.+\-@]{1,64}$")
_SPAN = re.compile(r"^[0-9]+(s|sec|m|min|h|d|w)$")  # a bare span (10m): that long ago


@dataclass(frozen=True)
class Ref:
    model: str
    replica: int | None  # None: every replica of the model


def parse_ref(spec: ClusterSpec, value: str) -> Ref:
    """``MODEL`` or ``MODEL#N`` of the cluster file; a model it does not declare is a
    UsageError with the closest names."""
    name, number = split_ref(value)
    models = [m.name for m in spec.models]
    if name not in models:
        close = difflib.get_close_matches(name, models, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; its models are {', '.join(models)}"
        raise UsageError(f"no model {name!r} in the cluster file{hint}")
    return Ref(name, number)


def split_ref(value: str) -> tuple[str, int | None]:
    """``MODEL`` as (MODEL, None), ``MODEL#N`` as (MODEL, N). Anything else (no model, a
    ``#`` without a number, a sign, a digit that is not ASCII such as ``²``) is a
    UsageError: the one spelling of a replica that logs, restart and apply --replace read."""
    name, sep, number = value.partition("#")
    if not name or (sep and not (number.isascii() and number.isdigit())):
        raise UsageError(f"{value}: expected MODEL or MODEL#N, a model and a replica number (e.g. m#0)")
    return name, int(number) if sep else None


def chosen(ref: Ref, running: list[Running]) -> list[Running]:
    """The replicas ``ref`` names among those that run, by replica number; none is a
    UsageError naming those that do."""
    of_model = sorted((r for r in running if r.model == ref.model), key=lambda r: r.replica)
    found = [r for r in of_model if ref.replica is None or r.replica == ref.replica]
    if not found:
        what = ref.model if ref.replica is None else f"{ref.model}#{ref.replica}"
        others = ", ".join(f"{r.model}#{r.replica}" for r in of_model)
        raise UsageError(f"no replica {what} runs" + (f"; running: {others}" if others else ""))
    return found


def since_value(since: str | None) -> str | None:
    """``--since`` as journalctl takes it: a bare span (``10m``) means that long ago; a
    time (``2026-12-01 10:00``, ``today``, ``-1h``) goes as written. Refused when it holds
    anything a time could not."""
    if since is None:
        return None
    if not _SINCE.match(since):
        raise UsageError(
            f"--since {since!r}: give a time as journalctl reads it (e.g. '10 min ago', 'today')"
        )
    return f"{since} ago" if _SPAN.match(since) else since


def journal_command(unit: str, *, since: str | None, lines: int | None, follow: bool) -> str:
    """The journalctl command for one replica unit: its engine's lines (the unit's own and
    systemd's about it), each with its time as seconds since the epoch."""
    argv = [
        "journalctl",
        f"_SYSTEMD_UNIT={unit}",
        "+",
        f"UNIT={unit}",
        "--no-pager",
        "--all",
        "-o",
        "short-unix",
    ]
    if since is not None:
        argv += ["--since", since]
    if lines is not None:
        argv += ["-n", str(lines)]
    if follow:
        argv.append("-f")
    return shlex.join(argv)


def clean(text: str) -> str:
    """``text`` with every control character but the tab shown as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


@dataclass(frozen=True)
class Line:
    at: float  # seconds since the epoch, as the node's journal stamped it (0: unknown)
    label: str  # "node01 smollm2-135m#0"
    text: str  # the rest of the journal's line, cleaned

    def show(self) -> str:
        when = datetime.fromtimestamp(self.at).isoformat(timespec="milliseconds") if self.at else "-"
        return f"{when} {self.label} | {self.text}"


def parse_line(label: str, raw: str) -> Line | None:
    """One line of ``journalctl -o short-unix``: ``SECONDS HOST IDENT[PID]: MESSAGE``; the
    host is dropped (the label names the node). journalctl's own notes (``-- No entries
    --``) and blank lines are None."""
    raw = raw.rstrip("\n")
    if not raw.strip() or raw.startswith("-- "):
        return None
    stamp, _, rest = raw.partition(" ")
    try:
        at = float(stamp)
    except ValueError:
        return Line(0.0, label, clean(raw))
    _host, _, message = rest.partition(" ")
    return Line(at, label, clean(message))


def merged(lines: list[Line]) -> list[Line]:
    """Lines of several units in the order they were written (stable for equal times)."""
    return sorted(lines, key=lambda line: line.at)


def label(replica: Running, node: str) -> str:
    return f"{node} {replica.model}#{replica.replica}"

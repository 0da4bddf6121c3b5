"""Durations (``90s``, ``10m``, ``1h30m``) and sizes (``80GiB``) as they appear in the cluster file.

In memory a duration is a ``float`` of seconds and a size an ``int`` of bytes; when a spec
is written back out (JSON, docs) they take their human form again, so a spec round-trips.
A bare number is refused: ``idle_timeout: 10`` could mean seconds or minutes, and the
file should say which.

What is accepted is exactly the patterns below (ASCII digits, spaces between the parts
allowed), so that the JSON Schema, which carries the same patterns, agrees with the loader.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BeforeValidator, Field, PlainSerializer, WithJsonSchema

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?) *(ms|s|m|h|d)")
_DURATION_BODY = r" *([0-9]+(\.[0-9]+)? *(ms|s|m|h|d) *)+"
DURATION_PATTERN = f"^{_DURATION_BODY}$"
# A duration above zero has a digit other than 0 somewhere.
POSITIVE_DURATION_PATTERN = f"^(?=.*[1-9]){_DURATION_BODY}$"

_SIZE_UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE = re.compile(r" *([0-9]+(?:\.[0-9]+)?) *(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB) *")
SIZE_PATTERN = r"^ *[0-9]+(\.[0-9]+)? *(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB) *$"


# Bounds that keep every value usable as a timer or a byte count (a timeout of 10^300
# seconds overflows the event loop's clock; infinity is no integer).
MAX_DURATION = 365 * 86400.0
MAX_SIZE = 1024 * 2**40


def parse_duration(text: object) -> float:
    """Seconds in a duration such as ``90s``, ``10m``, ``1h30m`` or ``250ms``."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"expected a duration such as 90s, 10m or 1h, got {text!r}")
    if not isinstance(text, str):
        raise ValueError(f"{text} has no unit: write {text}s, {text}m or {text}h")
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration: write e.g. 90s, 10m, 1h or 1h30m")
    seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))
    if not seconds <= MAX_DURATION:  # also NaN and infinity, from hundreds of digits
        raise ValueError(f"{text!r} is longer than a year: give at most 365d")
    return seconds


def format_duration(seconds: float) -> str:
    """The shortest exact form of ``seconds``: 5400.0 -> ``1h30m``, 0.25 -> ``250ms``."""
    if seconds == 0:
        return "0s"
    if seconds != int(seconds):
        ms = round(seconds * 1000)
        return f"{ms}ms" if ms % 1000 else f"{ms // 1000}s"
    rest = int(seconds)
    parts = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)


def clock(seconds: float, gap: str = "") -> str:
    """Whole seconds as ``42s``, ``3m05s``, ``1h02m`` (``gap`` between the parts: ``3m 05s``):
    short, and of a steady width, for a time taken so far."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{gap}{whole % 60:02d}s"
    return f"{whole // 3600}h{gap}{whole % 3600 // 60:02d}m"


def parse_size(text: object) -> int:
    """Bytes in a size such as ``80GiB``, ``512MiB`` or ``2TB``."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"expected a size such as 80GiB, got {text!r}")
    if not isinstance(text, str):
        raise ValueError(f"{text} has no unit: write e.g. {text}GiB")
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size: write e.g. 80GiB, 512MiB or 2TB")
    size = float(match.group(1)) * _SIZE_UNITS[match.group(2)]
    if not size <= MAX_SIZE:  # also infinity, which no integer holds
        raise ValueError(f"{text!r} is larger than 1024TiB")
    return int(size)


def format_size(size: int) -> str:
    """The largest binary unit that divides ``size`` exactly: 85899345920 -> ``80GiB``."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size and size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return f"{size}B"


def _duration_schema(pattern: str) -> WithJsonSchema:
    return WithJsonSchema({"type": "string", "pattern": pattern, "examples": ["90s", "10m"]})


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str),
    _duration_schema(DURATION_PATTERN),
]
"""Seconds, written in the file as ``90s``, ``10m``, ``1h``."""

PositiveDuration = Annotated[
    float,
    BeforeValidator(parse_duration),
    Field(gt=0),
    PlainSerializer(format_duration, return_type=str),
    _duration_schema(POSITIVE_DURATION_PATTERN),
]
"""A duration above zero (``0s`` is refused): a timeout or the period of a task."""

Size = Annotated[
    int,
    BeforeValidator(parse_size),
    PlainSerializer(format_size, return_type=str),
    WithJsonSchema({"type": "string", "pattern": SIZE_PATTERN, "examples": ["80GiB"]}),
]
"""Bytes, written in the file as ``80GiB``, ``512MiB``."""

"""The written forms of cluster-file values as regular expressions, for the JSON Schema.

The loader checks each value with code whose messages say what is wrong and what to
write instead (``spec.py``, ``quantities.py``); the JSON Schema that editors read
(docs/cluster.schema.json) can only say the same with patterns. They are built here from
small parts, and tests compare each pattern with the code it mirrors, so that an editor
flags exactly what ``llmgw validate`` refuses.

Every pattern is written in the part of regex syntax that JSON Schema (ECMA-262) and
Python's ``re`` read alike: ``^``, ``$``, classes, groups, ``|``, counted repeats and
lookaheads; never ``\\d``, which is any Unicode digit in Python and 0-9 in ECMA-262 (``\\s``
is Unicode blanks in both, differing on U+FEFF alone). They are anchored and match whole
values; a value that holds a control character is refused by the schema separately
(``CONTROL_CHARACTERS``), as the loader refuses it for every string.
"""

from __future__ import annotations

import ipaddress

# What no string of a cluster file may hold (spec.forbidden_character says which it was):
# C0 controls, DEL, C1 controls and the Unicode line and paragraph separators.
CONTROL_CHARACTERS = "[\\x00-\\x1f\\x7f-\\x9f\\u2028\\u2029]"


def int_range(low: int, high: int) -> str:
    """A group matching the decimal numbers from ``low`` to ``high``, without leading zeros."""
    if not 0 <= low <= high:
        raise ValueError(f"no numbers from {low} to {high}")
    parts: list[str] = []
    start = low
    while start <= high:  # one run of numbers of the same length at a time
        end = min(high, 10 ** len(str(start)) - 1)
        parts += _same_length(str(start), str(end))
        start = end + 1
    return "(" + "|".join(parts) + ")"


def _same_length(low: str, high: str) -> list[str]:
    """Alternatives matching the numbers ``low``..``high``, both written with as many digits."""
    if len(low) == 1:
        return [low if low == high else f"[{low}-{high}]"]
    if low[0] == high[0]:
        return [low[0] + _group(_same_length(low[1:], high[1:]))]
    rest = len(low) - 1
    alternatives: list[str] = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * rest:  # the numbers that start with low's digit, up to ...999
        alternatives += [low[0] + _group(_same_length(low[1:], "9" * rest))]
        first += 1
    tail = high[1:] == "9" * rest
    whole_last = last if tail else last - 1
    if first <= whole_last:  # every number of this length that starts with these digits
        digits = str(first) if first == whole_last else f"[{first}-{whole_last}]"
        alternatives.append(digits + _any_digits(rest))
    if not tail:  # the numbers that start with high's digit, from ...000
        alternatives += [high[0] + _group(_same_length("0" * rest, high[1:]))]
    return alternatives


def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "(" + "|".join(alternatives) + ")"


def _any_digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


PORT = int_range(1, 65535)

# --- addresses --------------------------------------------------------------------

# An IPv4 address as Python's ipaddress reads it: four decimal octets, no leading zeros.
IPV4 = f"{int_range(0, 255)}(\\.{int_range(0, 255)}){{3}}"

_H16 = "[0-9A-Fa-f]{1,4}"
_LS32 = f"({_H16}:{_H16}|{IPV4})"


def _ipv6() -> str:
    """RFC 3986's IPv6address: eight groups, or fewer around one ``::``, the last two
    groups possibly written as an IPv4 address (what ipaddress.IPv6Address reads)."""
    alternatives = [f"({_H16}:){{6}}{_LS32}", f"::({_H16}:){{5}}{_LS32}"]
    # [ up to k groups ] "::" then the groups that are left
    tails = [f"({_H16}:){{4}}{_LS32}", f"({_H16}:){{3}}{_LS32}", f"({_H16}:){{2}}{_LS32}"]
    tails += [f"{_H16}:{_LS32}", _LS32, _H16, ""]
    for before, tail in enumerate(tails):
        head = f"{_H16}" if before == 0 else f"({_H16}:){{0,{before}}}{_H16}"
        alternatives.append(f"({head})?::{tail}")
    return "(" + "|".join(alternatives) + ")"


IPV6 = _ipv6()
# An IPv6 zone (`fe80::1%eth0`): an interface name or number.
ZONE_CHARACTERS = "[0-9A-Za-z_.-]"
IPV6_ZONED = f"{IPV6}(%{ZONE_CHARACTERS}+)?"

_LABEL = "[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_LABEL_NO_UNDERSCORE = "[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"


def host_name(underscore: bool = True) -> str:
    """A DNS name of labels up to 63 characters, 253 in all, with a final dot or not
    (spec._HOST_NAME): the lookahead bounds the whole run of name characters."""
    label, chars = (_LABEL, "A-Za-z0-9_.-") if underscore else (_LABEL_NO_UNDERSCORE, "A-Za-z0-9.-")
    return f"(?=[{chars}]{{1,253}}(?![{chars}])){label}(\\.{label})*\\.?"


HOST = f"({host_name()}|{IPV6_ZONED})"
IP_ADDRESS = f"({IPV4}|{IPV6_ZONED})"


def _ipv4_masks() -> list[str]:
    """Every netmask (255.255.0.0) and host mask (0.0.255.255) ipaddress takes after a `/`."""
    masks = {str(ipaddress.IPv4Network(f"0.0.0.0/{bits}").netmask) for bits in range(33)}
    masks |= {str(ipaddress.IPv4Network(f"0.0.0.0/{bits}").hostmask) for bits in range(33)}
    return sorted(masks)


_V4_SUFFIX = "(/(0*" + int_range(0, 32) + "|" + "|".join(m.replace(".", "\\.") for m in _ipv4_masks()) + "))"
_V6_SUFFIX = f"(/0*{int_range(0, 128)})"
# Addresses and networks as systemd's IPAddressAllow= takes them (no zone: it reads none).
NETWORK = f"({IPV4}{_V4_SUFFIX}?|{IPV6}{_V6_SUFFIX}?)"


def whole(pattern: str) -> str:
    """``pattern`` anchored to match a whole value."""
    return f"^{pattern}$"

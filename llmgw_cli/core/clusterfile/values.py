"""Strings of the cluster file that reach systemd units, shells and sockets.

Each is a type that checks its value with a message saying what to write instead, and
carries the same rule as a pattern for the JSON Schema (built in ``grammar.py``), so an
editor flags what the loader refuses. Where the written form has parts (``host:port``,
``[user@]host[:port]``, a PostgreSQL URL) the check reads it the way the pattern does:
brackets hold an IPv6 address, a `:` is followed by a port, nothing else is guessed at.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from llmgw_cli.core.clusterfile import grammar
from llmgw_cli.core.clusterfile.grammar import whole

# --- characters no value may hold ---------------------------------------------------

# C0 controls (newline, CR, tab, NUL...), DEL, C1 controls, the Unicode line and paragraph
# separators (Python's splitlines() breaks on them) and lone surrogates (no UTF-8 form).
_FORBIDDEN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_CHARACTER_NAMES = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL byte"}
CONTROL_CHARACTER = "control_character"


def forbidden_character(text: str) -> str | None:
    """What the first character of ``text`` that no cluster-file value may hold is, or None."""
    match = _FORBIDDEN.search(text)
    if match is None:
        return None
    char = match.group()
    name = _CHARACTER_NAMES.get(char, "a control character")
    return f"{name} (U+{ord(char):04X}) at character {match.start() + 1}"


def find_forbidden(value: Any) -> tuple[tuple[str | int, ...], bool, str] | None:
    """The first forbidden character in a raw value: a string, or the strings of a list or
    mapping (keys included), one level deep. Returns (path below the value, whether it is
    in a key, what it is). Deeper values are objects of their own and checked there."""
    if isinstance(value, str):
        found = forbidden_character(value)
        return ((), False, found) if found else None
    items: list[tuple[Any, bool, Any]] = []
    if isinstance(value, list | tuple):
        items = [(i, False, item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        for key, item in value.items():
            items += [(key, True, key), (key, False, item)]
    for part, is_key, item in items:
        found = forbidden_character(item) if isinstance(item, str) else None
        if found and isinstance(part, str | int):
            return ((part,), is_key, found)
    return None


# --- names and words ----------------------------------------------------------------

USER_PATTERN = r"^[a-z_][a-z0-9_-]{0,30}\$?$"
ENGINE_USER_PATTERN = r"^(?!root$)[a-z_][a-z0-9_-]{0,30}\$?$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"
# A Linux interface name, or NCCL's forms of it: a list, a `^` exclusion, an `=` exact match.
INTERFACE_PATTERN = r"^[=^]?[A-Za-z0-9_.:-]{1,15}(,[A-Za-z0-9_.:-]{1,15})*$"
# A word pasted into a unit as is: no blank, quote, backslash, `$` or `%` (systemd's
# variable and specifier signs) and no `;`.
# (No backslash before the quote: JavaScript's regexes in `u` mode refuse needless escapes.)
PLAIN_WORD_PATTERN = "^[^\\s\"'\\\\$%;`]+$"
ABSOLUTE_PLAIN_WORD_PATTERN = "^/[^\\s\"'\\\\$%;`]*$"
_HOST_NAME = re.compile(whole(grammar.host_name()))
_ZONE = re.compile(f"{grammar.ZONE_CHARACTERS}+")


def _matching(pattern: str, complaint: str) -> Callable[[str], str]:
    """A validator: the text as it is when it matches ``pattern``, else a ValueError that
    quotes the text and says ``complaint`` (what it is not, and what to give)."""

    def check(text: str) -> str:
        if not re.match(pattern, text):
            raise ValueError(f"{text!r} {complaint}")
        return text

    return check


_user_name = _matching(
    USER_PATTERN,
    "is not a user name: use lowercase letters, digits, '_' and '-', starting with a letter "
    "or '_', at most 32 characters (systemd's User= and sudo take nothing else)",
)
_env_name = _matching(
    ENV_NAME_PATTERN,
    "is not an environment variable name: use letters, digits and '_', not starting with a digit",
)
_interface = _matching(
    INTERFACE_PATTERN,
    "is not a network interface name: give one such as eth0, or NCCL's forms ^docker, =eth0, eth0,eth1",
)
_plain_word = _matching(
    PLAIN_WORD_PATTERN,
    "goes into a systemd unit as one word: it cannot hold blanks, quotes, backslashes or the signs $ % ; `",
)


def _engine_user(text: str) -> str:
    if text == "root":
        raise ValueError(
            "engines never run as root: they run code that comes with the model (custom "
            "modelling files, tokenizer scripts, pickled weights); give an unprivileged account "
            "such as llmgw"
        )
    return _user_name(text)


def _schema(pattern: str) -> Any:
    # The check is the validator (its message says what to do); the pattern is for editors.
    return Field(json_schema_extra={"pattern": pattern})


UserName = Annotated[str, AfterValidator(_user_name), _schema(USER_PATTERN)]
EngineUser = Annotated[str, AfterValidator(_engine_user), _schema(ENGINE_USER_PATTERN)]
EnvName = Annotated[str, AfterValidator(_env_name), _schema(ENV_NAME_PATTERN)]
Interface = Annotated[str, AfterValidator(_interface), _schema(INTERFACE_PATTERN)]
PlainWord = Annotated[str, AfterValidator(_plain_word), _schema(PLAIN_WORD_PATTERN)]
AbsolutePlainWord = Annotated[
    str, AfterValidator(_plain_word), Field(pattern=r"^/"), _schema(ABSOLUTE_PLAIN_WORD_PATTERN)
]
"""An absolute path written into a unit as one word."""


# --- addresses and ports ------------------------------------------------------------


def _ip(text: str, *, zone: bool = True) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address, or None. An IPv6 zone (``%eth0``) must be an interface
    name or number, and is refused with ``zone=False``."""
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    scope = getattr(address, "scope_id", None)
    if scope is not None and not (zone and _ZONE.fullmatch(scope)):
        return None
    return address


def _host(text: str) -> str:
    """An IP address or a DNS host name: nothing a shell or ssh could read as an option."""
    if _ip(text) is None and not _HOST_NAME.match(text):
        raise ValueError(
            f"{text!r} is not a host name or IP address: use letters, digits, '-', '_' and "
            "dots, or an IPv4/IPv6 address"
        )
    return text


def _ip_address(text: str) -> str:
    if _ip(text) is None:
        raise ValueError(f"{text!r} is not an IP address")
    return text


def _port_in_range(port: int) -> int:
    if not 1 <= port <= 65535:
        raise ValueError(f"port {port} is out of range: give a port from 1 to 65535")
    return port


def _port(text: str, whole_text: str) -> None:
    if not (text.isascii() and text.isdigit()):
        raise ValueError(f"{whole_text!r}: the port after ':' must be a number")
    _port_in_range(int(text))


def _ipv6_in_brackets(text: str, whole_text: str, *, zone: bool) -> None:
    address = _ip(text, zone=zone)
    if address is None or address.version != 6:
        raise ValueError(f"{whole_text!r}: brackets hold an IPv6 address, such as [::1] or [fd00::7]")


LISTEN_PATTERN = r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$"


def _listen(text: str) -> str:
    """``host:port`` or ``[IPv6]:port`` (the pattern LISTEN_PATTERN was checked first)."""
    host, _, port = text.rpartition(":")
    if host.startswith("["):
        _ipv6_in_brackets(host[1:-1], text, zone=False)
    else:  # the pattern lets no '_' and no ':' through: a host name or an IPv4 address
        _host(host)
    _port_in_range(int(port))
    return text


def _jump_host(text: str) -> str:
    """``[user@]host[:port]``: each part checked, so no ssh option can be smuggled in."""
    user, at, rest = text.rpartition("@")
    if at:
        _user_name(user)
    if rest.startswith("["):
        host, close, after = rest[1:].partition("]")
        if not close or (after and not after.startswith(":")):
            raise ValueError(f"{text!r}: write an IPv6 jump host as [address] or [address]:port")
        _ipv6_in_brackets(host, text, zone=True)
        if after:
            _port(after[1:], text)
    elif rest.count(":") == 1:
        host, _, port = rest.partition(":")
        _host(host)
        _port(port, text)
    else:
        _host(rest)
    return text


_USER = USER_PATTERN[1:-1]
_PORT = f"0*{grammar.PORT}"  # int() reads leading zeros
JUMP_HOST_PATTERN = whole(
    f"({_USER}@)?({grammar.host_name()}(:{_PORT})?|{grammar.IPV6_ZONED}"
    f"|\\[{grammar.IPV6_ZONED}\\](:{_PORT})?)"
)
LISTEN_SCHEMA_PATTERN = whole(
    f"(\\[{grammar.IPV6}\\]|{grammar.host_name(underscore=False)}):(?=[0-9]{{1,5}}$){_PORT}"
)

Host = Annotated[str, AfterValidator(_host), _schema(whole(grammar.HOST))]
IpAddress = Annotated[str, AfterValidator(_ip_address), _schema(whole(grammar.IP_ADDRESS))]
Port = Annotated[int, Field(ge=1, le=65535)]
JumpHost = Annotated[str, AfterValidator(_jump_host), _schema(JUMP_HOST_PATTERN)]
Listen = Annotated[
    str, Field(pattern=LISTEN_PATTERN), AfterValidator(_listen), _schema(LISTEN_SCHEMA_PATTERN)
]


# --- the store ----------------------------------------------------------------------

_STORE_URL = re.compile(
    f"postgres(ql)?://([^\\s:@/?#\\[\\]]+@)?({grammar.host_name()}|\\[{grammar.IPV6}\\])"
    f"(:{grammar.PORT})?/[^\\s/?#]+(\\?[^\\s#]*)?"
)


def _store_url(text: str) -> str:
    """A PostgreSQL URL without a password: ``postgresql://user@host:5432/db[?options]``."""
    scheme, _, rest = text.partition("://")
    if scheme not in ("postgresql", "postgres"):
        raise ValueError(
            f"{text!r}: give a postgresql://user@host:5432/database URL (leave `store` unset for "
            "SQLite in state_dir)"
        )
    if ":" in rest.partition("/")[0].rpartition("@")[0]:
        raise ValueError(
            f"{text!r}: the password must not be in the cluster file: put it in the file named by "
            "`gateway.store_password_file` or in $LLMGW_STORE_PASSWORD"
        )
    if any(ch.isspace() for ch in text):
        raise ValueError(f"{text!r}: no spaces in the store URL")
    if not _STORE_URL.fullmatch(text):
        raise ValueError(
            f"{text!r}: write postgresql://user@host:5432/database, optionally followed by "
            "?options (the host a name or [IPv6 address], the port from 1 to 65535, one database)"
        )
    return text


StoreUrl = Annotated[str, AfterValidator(_store_url), _schema(whole(_STORE_URL.pattern))]


# --- the engine firewall ------------------------------------------------------------

# Words systemd's IPAddressAllow= takes besides addresses and CIDR blocks.
FIREWALL_WORDS = ("localhost", "link-local", "multicast")


def _firewall_entry(text: str) -> str:
    """An IP address or CIDR block as systemd's ``IPAddressAllow=`` reads it (never a host
    name: systemd does not resolve names there, it would drop the entry; never an IPv6
    zone, which it does not read either)."""
    if text in FIREWALL_WORDS:
        return text
    try:
        if "%" in text:
            raise ValueError
        if "/" not in text:
            return str(ipaddress.ip_address(text))
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise ValueError(
            f"{text!r} is not an IP address or CIDR block (systemd's engine firewall takes no host names)"
        ) from None


FirewallEntry = Annotated[
    str,
    AfterValidator(_firewall_entry),
    _schema(whole(f"({'|'.join(FIREWALL_WORDS)}|{grammar.NETWORK})")),
]

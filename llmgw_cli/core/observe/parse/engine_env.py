"""A node's engine key file (``/etc/llmgw/engine.env``, ``NAME=value`` lines): the one
reading of it, for the operator's commands (over SSH) and the gateway (from a file).

Rules, as systemd's ``EnvironmentFile=`` reads the file for the engines: blank lines and
``#`` comments are skipped; spaces around the name do not count, nor spaces and quotes
around the value; when a name is assigned twice the last one holds.
A key that is empty once its spaces and quotes are gone is no key.

``KEY_PRESENT_SH`` is the same decision in shell, for the node probe: it tells whether a
node holds a key without the key ever leaving the node.
"""

from __future__ import annotations

from llmgw_cli.core.engine.engine_access import ENGINE_ENV_FILE, ENGINE_KEY_VAR

_SPACES = " \t\n\r\v\f"  # ASCII, as the shell's [[:space:]] in the C locale
_QUOTES = "'\""


def parse_env(text: str) -> dict[str, str]:
    """``{name: value}`` of the file's assignments (the last one of each name)."""
    found: dict[str, str] = {}
    for line in text.split("\n"):
        stripped = line.strip(_SPACES)
        if not stripped or stripped.startswith("#"):
            continue
        name, sep, value = stripped.partition("=")
        if sep and name.strip(_SPACES):
            found[name.strip(_SPACES)] = value.strip(_SPACES + _QUOTES)
    return found


def engine_key(text: str) -> str | None:
    """The engine key the file holds; None when it holds none (or an empty one)."""
    return parse_env(text).get(ENGINE_KEY_VAR) or None


KEY_PRESENT_SH = (
    # the last assignment of the key's name, then: does its value hold anything but
    # spaces and quotes? Exit status 0 when it does (the key itself is never printed).
    f"grep -E '^[[:space:]]*{ENGINE_KEY_VAR}[[:space:]]*=' {ENGINE_ENV_FILE} 2>/dev/null | tail -n 1 "
    "| cut -d= -f2- | grep -q '[^[:space:]\"'\\'']'"
)
"""Shell whose exit status says whether ``ENGINE_ENV_FILE`` holds a key (``engine_key``'s
rules); it prints nothing."""

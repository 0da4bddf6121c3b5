"""Hostile but legal values, and strict readers of what llmgw writes for systemd, shared by
the hostile-input tests and the unit verify tests."""

from __future__ import annotations

import re


def yaml_quoted(value: str) -> str:
    """A YAML double-quoted scalar that reads back as ``value``, control characters and all."""
    out = []
    for char in value:
        if char in '"\\':
            out.append("\\" + char)
        elif ord(char) < 0x20 or 0x7F <= ord(char) <= 0x9F or char in "\u2028\u2029":
            out.append(f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


# Each is legal in a cluster file and means something to systemd or a shell.
HOSTILE_ARGS = [
    "ExecStartPre=+/bin/sh -c 'id > /root/pwned'",
    "$HOME",
    "${LLMGW_ENGINE_KEY}",
    "$$",
    "--x=$(id)",
    "`id`",
    "%n",
    "%%",
    "100%",
    "'single'",
    '"double"',
    "back\\slash",
    "trailing\\",
    "\\x41\\n",
    "a b  c",
    ";",
    "a;b",
    "#not a comment",
    "",
    "*",
    "~",
    "é\u00a0ü",
]


def unit_keys(text: str) -> list[str]:
    """The directive names of a unit, in order (comments and section headers left out)."""
    keys = []
    for line in text.splitlines():
        if line.strip() and not line.startswith(("#", ";", "[")):
            key, sep, _ = line.partition("=")
            assert sep, f"not a directive: {line!r}"
            keys.append(key)
    return keys


def exec_argv(value: str) -> list[str]:
    """The argv systemd runs for an ``ExecStart=`` value made of bare words and whole-word
    double-quoted strings, as systemd's parser reads them (unquoting and C escapes, then
    ``%%`` and ``$$``). Anything else in the value is a failure: it is not what llmgw writes."""
    words: list[str] = []
    i = 0
    while i < len(value):
        if value[i] == " ":
            i += 1
            continue
        if value[i] == '"':
            word, i = [], i + 1
            while value[i] != '"':
                if value[i] == "\\":
                    assert value[i + 1] in '\\"', f"unexpected escape in {value!r}"
                    i += 1
                word.append(value[i])
                i += 1
            i += 1
            assert i == len(value) or value[i] == " ", f"quote inside a word: {value!r}"
            raw = "".join(word)
        else:
            end = value.find(" ", i)
            end = len(value) if end < 0 else end
            raw = value[i:end]
            assert not re.search(r"[\"'\\]", raw), f"bare word with quote or backslash: {raw!r}"
            i = end
        assert not re.search(r"%[^%]", raw.replace("%%", "")), f"specifier left in {raw!r}"
        assert not re.search(r"\$[^$]", raw.replace("$$", "")), f"variable left in {raw!r}"
        words.append(raw.replace("%%", "%").replace("$$", "$"))
    return words

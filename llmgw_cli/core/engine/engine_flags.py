"""The flags each engine version accepts, and the words of a command line that are flags
it does not.

The tables (``engine_flags/<engine>-<version>.json``) were dumped from the engines' own
argument parsers (``lab/engine_parsers.py``): every option string, with what it takes:
``value`` (one word), ``switch`` (none), ``optional`` (zero or one) or ``list`` (one or
more). They are read as package data, so they are there in an installed wheel too.

The walk reads a command line as argparse does: ``--flag=value`` is one word, a flag
that takes a value takes the next word whatever it looks like (``--x -1``, ``--x -y``),
other words are positional; a unique prefix of a long flag is that flag (argparse's
abbreviations, which both engines' parsers allow). vLLM's parser also reads
``--flag_name`` as ``--flag-name`` and ``--flag.key value`` as a sub-key of ``--flag``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Literal

Takes = Literal["value", "switch", "optional", "list"]
TAKES: frozenset[str] = frozenset(("value", "switch", "optional", "list"))

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+-]{0,63}$")


@dataclass(frozen=True)
class FlagTable:
    engine: str
    version: str
    flags: dict[str, Takes]

    def takes(self, word: str) -> Takes | None:
        """What the flag ``word`` (its name only, no ``=value``) takes; None when this
        version does not accept it."""
        found = self.flags.get(word)
        if found is not None or not word.startswith("--"):
            return found
        name, dot = word, False
        if self.engine == "vllm":
            name, dot = vllm_flag_name(word), "." in word
        found = self.flags.get(name) or self._abbreviated(name)
        return "value" if found is not None and dot else found

    def _abbreviated(self, name: str) -> Takes | None:
        """argparse takes a unique prefix of a long flag for the flag (``--tp`` is SGLang's
        ``--tp-size``); a prefix of several is refused as ambiguous."""
        matches = [flag for flag in self.flags if flag.startswith(name)]
        return self.flags[matches[0]] if len(matches) == 1 else None


def vllm_flag_name(word: str) -> str:
    """The flag vLLM's parser reads ``word`` (a name, no ``=value``) as: underscores are
    dashes, and ``--flag.key`` sets a key of ``--flag``."""
    return word.partition(".")[0].replace("_", "-")


def release(version: str) -> str:
    """The release part of a version: ``0.32.0+cpu`` -> ``0.32.0`` (the local part names
    a build of the same flags)."""
    return version.split("+", 1)[0]


def version_shaped(text: str) -> bool:
    """Whether ``text`` reads as a version (digits first, then digits, letters, ``.+-``)."""
    return _VERSION.match(text) is not None


def _folder() -> Traversable:
    return resources.files("llmgw_cli.core.engine").joinpath("engine_flags")


@cache
def table(engine: str, version: str) -> FlagTable | None:
    """The flag table of ``engine`` at ``version`` (its release part); None when llmgw has
    none for that version."""
    name = f"{engine}-{release(version)}.json"
    if not version_shaped(release(version)) or "/" in name:
        return None
    path = _folder().joinpath(name)
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    flags = {str(k): v for k, v in data["flags"].items() if v in TAKES}
    return FlagTable(engine=engine, version=release(version), flags=flags)


@cache
def has_tables(engine: str) -> bool:
    """Whether llmgw has a flag table for any version of ``engine`` (none for
    llama-server: its flags are not checked)."""
    return any(p.name.startswith(f"{engine}-") and p.name.endswith(".json") for p in _folder().iterdir())


def _flag_like(word: str) -> bool:
    """Whether argparse reads ``word`` as an option string: a leading ``-``, and not ``-``
    alone, a negative number or a word with a space."""
    return word.startswith("-") and word != "-" and not _NEGATIVE_NUMBER.match(word) and " " not in word


def unknown_flags(flags: FlagTable, argv: list[str]) -> list[tuple[int, str]]:
    """(index, word) of each word of ``argv`` that is a flag ``flags`` does not hold.
    ``argv``: the words after the program and its leading words (``vllm serve``)."""
    found: list[tuple[int, str]] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if word == "--":
            break  # the rest is positional
        if not _flag_like(word):
            continue
        name, eq, _ = word.partition("=")
        takes = flags.takes(name)
        if takes is None:
            found.append((i - 1, word))
        elif eq or takes == "switch":
            continue
        elif takes == "value":
            i += 1
        elif takes == "list":
            i += 1
            while i < len(argv) and not _flag_like(argv[i]):
                i += 1
        elif i < len(argv) and not _flag_like(argv[i]):  # optional
            i += 1
    return found

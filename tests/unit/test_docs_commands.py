"""Docs that cannot drift from the CLI: every `llmgw ...` command in README.md and docs/
is parsed against the real command tree.

Two kinds of mention:
- in a fenced code block (what a reader copies): the whole command line is parsed by the
  real parser (click's, under typer), so an option, a subcommand or a value that the CLI
  does not take fails here. A value written as a placeholder (``FILE``, ``MODEL#N``, all
  capitals) stands for any value;
- inline (``llmgw apply --replace MODEL#N`` in a sentence): the subcommands must exist and
  every option it names must be one of that command's, with its synopsis notation read
  as written: ``[...]`` optional, ``a|b`` alternatives (each one checked), ``...``
  repeatable.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
import typer.core

# typer carries its own copy of click (typer._click): its parser and errors are what the
# CLI runs, so they are what the docs are checked against.
from typer import _click as click
from typer._click import exceptions as click_errors

from llmgw_cli.cli.main import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INLINE = re.compile(r"`(llmgw [^`]+)`")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_.#\[\]-]*$")  # FILE, MODEL#N, PLAN.json is not one
SHELL_END = re.compile(r"\s(?:\||>|>>|<|&&|;|\|\|)\s.*$")

ROOT_COMMAND = typer.main.get_command(app)
INSTALLS = {"--install-completion"}  # parsing it runs it: it edits the shell's rc file


def mentions() -> list[tuple[str, int, str, bool]]:
    """(file, line, command, in a code block) for every `llmgw` command in the docs."""
    found: list[tuple[str, int, str, bool]] = []
    for path in DOCS:
        text = path.read_text()
        name = str(path.relative_to(ROOT))
        blocks = [(m.start(1), m.group(1)) for m in FENCE.finditer(text)]
        for start, body in blocks:
            joined = body.replace("\\\n", " ")
            for raw in joined.splitlines():
                line = re.sub(r"^\s*(?:\$\s+|sudo\s+)?(?:\S*/)?(?=llmgw\s)", "", raw)
                if not line.startswith("llmgw "):
                    continue
                line = re.sub(r"\s+#\s.*$", "", line)  # a comment after the command
                line = SHELL_END.sub("", line)
                at = text[:start].count("\n") + 1 + body[: body.find(raw)].count("\n")
                found.append((name, at, line.strip(), True))
        outside = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for m in INLINE.finditer(outside):
            found.append((name, outside[: m.start()].count("\n") + 1, m.group(1), False))
    return found


def resolve(words: list[str]) -> tuple[click.Command, list[str], list[str]]:
    """The command the words name (subcommands followed), the words left, its path."""
    command: click.Command = ROOT_COMMAND
    path = ["llmgw"]
    rest = words[1:]
    while isinstance(command, typer.core.TyperGroup) and rest and not rest[0].startswith("-"):
        sub = command.get_command(click.Context(command), rest[0])
        if sub is None:
            raise AssertionError(f"no command {' '.join([*path, rest[0]])}")
        command, path, rest = sub, [*path, rest[0]], rest[1:]
    return command, rest, path


def option_names(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        if isinstance(param, typer.core.TyperOption):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def synopsis_variants(line: str) -> list[list[str]]:
    """The command lines a synopsis stands for: optional groups kept, ``...`` dropped,
    each alternative of ``a|b`` (outside an option's own name) once."""
    text = line.replace("...", " ").replace("[", " ").replace("]", " ")
    words = shlex.split(text)
    variants: list[list[str]] = [[]]
    for word in words:
        choices = word.split("|") if "|" in word else [word]
        variants = [[*v, c] for v in variants for c in choices]
    return variants[:16]


CASES = mentions()


def test_the_docs_mention_commands() -> None:
    assert len(CASES) > 40
    assert any(block for *_, block in CASES)


@pytest.mark.parametrize(("doc", "line", "command", "block"), CASES, ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_a_documented_command_parses(doc: str, line: int, command: str, block: bool) -> None:
    where = f"{doc}:{line}: {command}"
    for words in synopsis_variants(command):
        try:
            cmd, rest, path = resolve(words)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        known = option_names(cmd)
        for word in rest:
            if word.startswith("-") and word != "-":
                name = word.split("=", 1)[0]
                assert name in known, f"{where}: {' '.join(path)} has no option {name}"
        if not block or INSTALLS & set(rest):
            continue  # an option that would change this machine is checked by name only
        try:
            cmd.make_context(" ".join(path), list(rest), resilient_parsing=False)
        except click_errors.BadParameter as exc:
            value = getattr(exc, "message", "")
            if not any(PLACEHOLDER.match(w) for w in rest):
                raise AssertionError(f"{where}: {value or exc}") from None
        except typer.Exit:  # an eager option (--version, --help) ends the parse: it parsed
            pass
        except click_errors.UsageError as exc:
            raise AssertionError(f"{where}: {exc.format_message()}") from None

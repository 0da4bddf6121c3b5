"""The `llmgw` command. Errors become messages and exit codes here, and only here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from llmgw_cli import __version__
from llmgw_cli.cli import gateway, keys, lab, render, store
from llmgw_cli.cli.apply import apply, plan
from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.cli.doctor import doctor
from llmgw_cli.cli.fetch import fetch
from llmgw_cli.cli.logs import logs, restart
from llmgw_cli.cli.status import status
from llmgw_cli.cli.usage import usage
from llmgw_cli.cli.views import problems_view, spec_headline, spec_summary
from llmgw_cli.core.docgen import json_schema
from llmgw_cli.errors import LlmgwError, SpecError

app = typer.Typer(
    name="llmgw",
    help="Run a catalog of LLMs on your own GPU servers, declared in one YAML file, "
    "driven over SSH and systemd.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.add_typer(render.app, name="render")
app.command()(status)
app.command()(plan)
app.command()(apply)
app.command()(doctor)
app.command()(fetch)
app.command()(logs)
app.command()(restart)
app.add_typer(lab.app, name="lab")
app.add_typer(gateway.app, name="gateway")
app.add_typer(keys.app, name="keys")
app.add_typer(store.app, name="store")
app.command()(usage)

out = Console()
err = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        out.print(f"llmgw {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """llmgw: one YAML file, many models, your GPU servers."""


@app.command()
def validate(file: ClusterFile = DEFAULT_FILE) -> None:
    """Check a cluster file: every problem is reported at once, with line and column.

    Exit code 0 when valid, 2 when it has problems.
    """
    spec = read_cluster(file)
    out.print(spec_headline(spec, str(file)), soft_wrap=True)
    out.print(spec_summary(spec))


@app.command()
def schema(
    output: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write to this file instead of stdout.")
    ] = None,
) -> None:
    """Print the JSON Schema of the cluster file (for editors and CI)."""
    text = json_schema()
    if output is None:
        sys.stdout.write(text)
    else:
        output.write_text(text, encoding="utf-8")


def main() -> None:
    """Console entry point: run the app, turn llmgw errors into messages and exit codes."""
    try:
        app()
    except SpecError as exc:
        err.print(problems_view(exc.problems), soft_wrap=True)
        sys.exit(exc.exit_code)
    except LlmgwError as exc:
        err.print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)


if __name__ == "__main__":
    main()

"""The `llmgw` command. Errors become messages and exit codes here, and only here."""

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw_cli import __version__
from llmgw_cli.cli import gateway, keys, lab, render, store
from llmgw_cli.cli.apply import apply, plan
from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.cli.doctor import doctor
from llmgw_cli.cli.fetch import fetch
from llmgw_cli.cli.status import status
from llmgw_cli.cli.usage import usage
from llmgw_cli.errors import LlmgwError, SpecError

if TYPE_CHECKING:
    from rich.console import Console

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
app.add_typer(lab.app, name="lab")
app.add_typer(gateway.app, name="gateway")
app.add_typer(keys.app, name="keys")
app.add_typer(store.app, name="store")
app.command()(usage)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"llmgw {__version__}\n")
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
    from rich.console import Console

    from llmgw_cli.cli.views import spec_headline, spec_summary

    spec = read_cluster(file)
    out = Console()
    out.print(spec_headline(spec, str(file)), soft_wrap=True)
    out.print(spec_summary(spec))


@app.command()
def schema(
    output: Annotated[
        Path | None, typer.Option("--out", "-o", help="Write to this file instead of stdout.")
    ] = None,
) -> None:
    """Print the JSON Schema of the cluster file (for editors and CI)."""
    from llmgw_cli.core.docgen import json_schema

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
        from llmgw_cli.cli.views import problems_view

        _stderr().print(problems_view(exc.problems), soft_wrap=True)
        sys.exit(exc.exit_code)
    except LlmgwError as exc:
        from rich.text import Text

        _stderr().print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        _stderr().print("interrupted")
        sys.exit(130)


def _stderr() -> "Console":
    from rich.console import Console

    return Console(stderr=True)


if __name__ == "__main__":
    main()

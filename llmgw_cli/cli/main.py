"""The `llmgw` command. Errors become messages and exit codes here, and only here: 0 done,
1 failed, 2 bad input, 130 interrupted (``errors.ExitCode``)."""

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from llmgw_cli import __version__
from llmgw_cli.cli import gateway, keys, lab, render, store
from llmgw_cli.cli.apply import apply, plan
from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster
from llmgw_cli.cli.doctor import doctor
from llmgw_cli.cli.fetch import fetch
from llmgw_cli.cli.status import status
from llmgw_cli.cli.usage import usage
from llmgw_cli.errors import Interrupted, LlmgwError, SpecError

if TYPE_CHECKING:
    from rich.console import Console


class _Commands(TyperGroup):
    """The root of every command: Ctrl-C anywhere below it becomes ``Interrupted``, so it
    ends like every other error, in ``main``, instead of as the exit status the library
    happens to choose (a prompt turns it into "Aborted!", exit 1)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise Interrupted("interrupted") from None
        except typer.Abort as exc:
            if isinstance(exc.__context__, KeyboardInterrupt):
                raise Interrupted("interrupted") from None
            raise


EXIT_CODES = (
    "Exit codes: 0 done; 1 failed (a node, a replica, a download: the message says which); "
    "2 bad input (the cluster file or an argument, nothing was done); 130 interrupted (Ctrl-C)."
)

app = typer.Typer(
    name="llmgw",
    cls=_Commands,
    help="Run a catalog of LLMs on your own GPU servers, declared in one YAML file, "
    "driven over SSH and systemd.",
    epilog=EXIT_CODES,
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
    except (Interrupted, KeyboardInterrupt):  # KeyboardInterrupt: before a command ran
        err = _stderr()
        if err.is_terminal:  # after the ^C the terminal shows
            err.line()
        err.print("interrupted", highlight=False)
        sys.exit(Interrupted.exit_code)
    except LlmgwError as exc:
        from rich.text import Text

        _stderr().print(Text.assemble(("error: ", "red"), str(exc)), soft_wrap=True)
        sys.exit(exc.exit_code)


def _stderr() -> "Console":
    from rich.console import Console

    return Console(stderr=True)


if __name__ == "__main__":
    main()

"""The `llmgw` command. Errors become messages and exit codes here, and only here: 0 done,
1 failed, 2 bad input, 130 interrupted (``errors.ExitCode``)."""

import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from llmgw_cli import __version__
from llmgw_cli.cli import gateway, keys, lab, render, store
from llmgw_cli.cli.apply import apply, plan
from llmgw_cli.cli.cordon import cordon, cordons, drain, uncordon
from llmgw_cli.cli.doctor import doctor
from llmgw_cli.cli.fetch import fetch
from llmgw_cli.cli.logs import logs, restart
from llmgw_cli.cli.status import status
from llmgw_cli.cli.usage import usage
from llmgw_cli.cli.validate import schema, validate
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
    add_completion=True,
)
# `llmgw --help` lists the commands in these panels, in this order.
INSPECT, CHANGE, SERVE, LAB = "Inspect (changes nothing)", "Change", "Serve", "Try it without GPUs"
app.command(rich_help_panel=INSPECT)(validate)
app.command(rich_help_panel=INSPECT)(status)
app.command(rich_help_panel=INSPECT)(doctor)
app.command(rich_help_panel=INSPECT)(plan)
app.command(rich_help_panel=INSPECT)(usage)
app.command(rich_help_panel=INSPECT)(logs)
app.command(rich_help_panel=INSPECT)(schema)
app.command(rich_help_panel=CHANGE)(apply)
app.command(rich_help_panel=CHANGE)(fetch)
app.command(rich_help_panel=CHANGE)(restart)
app.command(rich_help_panel=CHANGE)(cordon)
app.command(rich_help_panel=CHANGE)(drain)
app.command(rich_help_panel=CHANGE)(uncordon)
app.command(hidden=True)(cordons)
app.add_typer(keys.app, name="keys", rich_help_panel=CHANGE)
app.add_typer(store.app, name="store", rich_help_panel=CHANGE)
app.add_typer(gateway.app, name="gateway", rich_help_panel=SERVE)
app.add_typer(render.app, name="render", rich_help_panel=SERVE)
app.add_typer(lab.app, name="lab", rich_help_panel=LAB)


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


def main() -> None:
    """Console entry point: run the app, turn llmgw errors into messages and exit codes."""
    try:
        # the name scripts and completion know it by, also when run as `python -m llmgw_cli`
        app(prog_name="llmgw")
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

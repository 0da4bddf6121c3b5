"""`llmgw store migrate`: create or upgrade the schema of the gateways' store.

A gateway refuses to start on a PostgreSQL schema older than it knows, so an upgrade of
llmgw that brings a new schema runs this once (from any machine that reaches the
database) before the gateways are restarted. An empty database needs no step: the first
gateway creates the schema. SQLite (no ``gateway.store``) is upgraded by the gateway itself
when it opens the file: the command does the same on this machine's state directory.
"""

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster, with_store

app = typer.Typer(help="The gateways' store (keys, usage, coordination).", no_args_is_help=True)


@app.command()
def migrate(file: ClusterFile = DEFAULT_FILE) -> None:
    """Create or upgrade the store's schema (safe to run again, and from several places at once)."""
    from rich.console import Console
    from rich.text import Text

    spec = read_cluster(file)
    version = with_store(spec, lambda store: store.migrate())
    where = spec.gateway.store or f"{spec.gateway.state_dir}/gateway.sqlite3"
    Console().print(Text(f"store {where}: schema version {version}"))

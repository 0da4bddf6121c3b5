"""`llmgw keys create|list|revoke`: the gateway's API keys, in the store the cluster file
names (SQLite in the gateway's state directory, or PostgreSQL)."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, read_cluster, with_store
from llmgw_cli.cli.views import keys_view
from llmgw_cli.core.keys import TOKEN_PREFIX, ApiKey, hash_token, parse_expiry
from llmgw_cli.errors import InputError, UsageError

app = typer.Typer(help="API keys of the gateway.", no_args_is_help=True)
out = Console()


@app.command()
def create(
    name: Annotated[str, typer.Option("--name", help="Unique name (shown in usage and logs).")],
    file: ClusterFile = DEFAULT_FILE,
    models: Annotated[
        str | None, typer.Option("--models", help="Comma-separated models (default: all).")
    ] = None,
    expires: Annotated[
        str | None, typer.Option("--expires", help="Expiry date or time (UTC), e.g. 2027-01-31.")
    ] = None,
    admin: Annotated[bool, typer.Option("--admin", help="May use the admin API.")] = False,
) -> None:
    """Create a key and print it once: only its SHA-256 is stored."""
    spec = read_cluster(file)
    chosen = tuple(m.strip() for m in models.split(",") if m.strip()) if models else ()
    unknown = [m for m in chosen if m not in {x.name for x in spec.models}]
    if unknown:
        raise UsageError(f"--models: not in the catalog: {', '.join(unknown)}")
    try:
        expiry = parse_expiry(expires) if expires else None
    except ValueError:
        raise UsageError(f"--expires {expires!r}: give a date (2027-01-31) or an ISO time") from None
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(name, hash_token(token), chosen, expiry, datetime.now(UTC), admin=admin)
    with_store(spec, lambda store: store.add_key(key))
    print(token)


@app.command("list")
def list_keys(file: ClusterFile = DEFAULT_FILE) -> None:
    """Keys with their models, expiry and state (never the key itself)."""
    spec = read_cluster(file)
    out.print(keys_view(with_store(spec, lambda store: store.api_keys()), datetime.now(UTC)))


@app.command()
def revoke(
    name: Annotated[str, typer.Argument(help="Name of the key.")], file: ClusterFile = DEFAULT_FILE
) -> None:
    """Revoke a key; a running gateway refuses it within a few seconds."""
    spec = read_cluster(file)
    if not with_store(spec, lambda store: store.revoke(name)):
        raise InputError(f"no key named {name!r}")
    out.print(Text(f"revoked {name}"))

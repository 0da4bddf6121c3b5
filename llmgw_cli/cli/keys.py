"""`llmgw keys create|list|revoke`: the gateway's API keys, in the store the cluster file
names: PostgreSQL directly; SQLite on this machine when it is the gateway host, else on the
gateway host over SSH (``cli/store_access.py``)."""

import sys
from datetime import UTC, datetime
from typing import Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, StoreDir, read_cluster
from llmgw_cli.errors import InputError, LlmgwError, UsageError

app = typer.Typer(help="API keys of the gateway.", no_args_is_help=True)


@app.command()
def create(
    name: Annotated[str, typer.Option("--name", help="Unique name (shown in usage and logs).")],
    *,
    file: ClusterFile = DEFAULT_FILE,
    models: Annotated[
        str | None, typer.Option("--models", help="Comma-separated models (default: all).")
    ] = None,
    expires: Annotated[
        str | None, typer.Option("--expires", help="Expiry date or time (UTC), e.g. 2027-01-31.")
    ] = None,
    admin: Annotated[bool, typer.Option("--admin", help="May use the admin API.")] = False,
    store_dir: StoreDir = None,
) -> None:
    """Create a key and print it once: only its SHA-256 is stored."""
    import re
    import secrets

    from llmgw_cli.cli.store_access import forward, store_of, with_store
    from llmgw_cli.core.serving.keys import TOKEN_PREFIX, ApiKey, hash_token, parse_expiry
    from llmgw_cli.remote.gateway_store import store_host

    chosen = tuple(m.strip() for m in models.split(",") if m.strip()) if models else ()
    try:
        expiry = parse_expiry(expires) if expires else None
    except ValueError:
        raise UsageError(f"--expires {expires!r}: give a date (2027-01-31) or an ISO time") from None
    spec = None
    if store_dir is None:
        spec = read_cluster(file)
        unknown = [m for m in chosen if m not in {x.name for x in spec.models}]
        if unknown:
            raise UsageError(f"--models: not in the catalog: {', '.join(unknown)}")
        host = store_host(spec)
        if host is not None:
            args = [f"--name={name}", *([f"--models={','.join(chosen)}"] if chosen else [])]
            args += [*([f"--expires={expires}"] if expires else []), *(["--admin"] if admin else [])]
            said = forward(spec, file, host, ["keys", "create"], args).strip()
            if not re.fullmatch(re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_-]{20,100}", said):
                raise LlmgwError(f"the gateway host {host} did not answer with a key")
            print(said)
            return
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(name, hash_token(token), chosen, expiry, datetime.now(UTC), admin=admin)
    with_store(store_of(spec, store_dir), lambda store: store.add_key(key))
    print(token)


@app.command("list")
def list_keys(
    file: ClusterFile = DEFAULT_FILE,
    json_out: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    store_dir: StoreDir = None,
) -> None:
    """Keys with their models, expiry and state (never the key itself)."""
    from rich.console import Console

    from llmgw_cli.cli.store_access import forward, keys_json, parse_keys, store_of, with_store
    from llmgw_cli.cli.views import keys_view
    from llmgw_cli.remote.gateway_store import store_host

    spec = None if store_dir is not None else read_cluster(file)
    host = store_host(spec) if spec is not None else None
    if spec is not None and host is not None:
        keys = parse_keys(forward(spec, file, host, ["keys", "list"], ["--json"]))
    else:
        keys = with_store(store_of(spec, store_dir), lambda store: store.api_keys())
    if json_out:
        sys.stdout.write(keys_json(keys) + "\n")
    else:
        Console().print(keys_view(keys, datetime.now(UTC)))


@app.command()
def revoke(
    name: Annotated[str, typer.Argument(help="Name of the key.")],
    file: ClusterFile = DEFAULT_FILE,
    store_dir: StoreDir = None,
) -> None:
    """Revoke a key; every running gateway refuses it within a few seconds."""
    from rich.console import Console
    from rich.text import Text

    from llmgw_cli.cli.store_access import forward, store_of, with_store
    from llmgw_cli.remote.gateway_store import store_host

    spec = None if store_dir is not None else read_cluster(file)
    host = store_host(spec) if spec is not None else None
    if spec is not None and host is not None:
        forward(spec, file, host, ["keys", "revoke"], ["--", name])
    elif not with_store(store_of(spec, store_dir), lambda store: store.revoke(name)):
        raise InputError(f"no key named {name!r}")
    Console().print(Text(f"revoked {name}"))

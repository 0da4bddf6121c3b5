"""`llmgw keys create|set|list|revoke`: the gateway's API keys and their limits, in the store
the cluster file names: PostgreSQL directly; SQLite on this machine when it is the gateway
host, else on the gateway host over SSH (``cli/store_access.py``), with the options given
passed on."""

import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, StoreDir, read_cluster
from llmgw_cli.errors import InputError, LlmgwError, UsageError

if TYPE_CHECKING:
    from llmgw_cli.core.clusterfile.spec import ClusterSpec
    from llmgw_cli.core.serving.keys import ApiKey
    from llmgw_cli.gateway.store.sqlite import Store

app = typer.Typer(help="API keys of the gateway and their limits.", no_args_is_help=True)

Rpm = Annotated[
    str | None,
    typer.Option(
        "--rpm",
        metavar="N",
        help="Requests per minute, over a sliding minute (e.g. 60); 'none' removes the limit.",
    ),
]
Tpm = Annotated[
    str | None,
    typer.Option(
        "--tpm",
        metavar="N",
        help="Tokens (prompt + completion) per minute (e.g. 100000 or 100k); 'none' removes the limit.",
    ),
]
MaxParallel = Annotated[
    str | None,
    typer.Option(
        "--max-parallel",
        metavar="N",
        help="Requests in flight at once, every gateway process together (e.g. 4); 'none' removes the limit.",
    ),
]
BudgetOption = Annotated[
    str | None,
    typer.Option(
        "--budget",
        metavar="TOKENS/day|TOKENS/month",
        help="Tokens per UTC day or calendar month (e.g. 100000/day, 5M/month): the count starts"
        " again at 00:00 UTC or on the 1st; 'none' removes the budget.",
    ),
]
PriorityOption = Annotated[
    str | None,
    typer.Option(
        "--priority",
        metavar="high|normal|low",
        help="Place in a model's queue when one forms: high keys before normal ones, normal"
        " before low (default normal; 'none' means normal).",
    ),
]


def _changes(
    rpm: str | None, tpm: str | None, max_parallel: str | None, budget: str | None, priority: str | None
) -> dict[str, object]:
    from llmgw_cli.core.serving.limits import parse_changes
    from llmgw_cli.errors import LimitError

    try:
        return parse_changes(
            {"rpm": rpm, "tpm": tpm, "max_parallel": max_parallel, "budget": budget, "priority": priority}
        )
    except LimitError as exc:
        raise UsageError(str(exc)) from None


def _models(text: str) -> tuple[str, ...]:
    """``--models``: names separated by commas; ``all`` (or nothing): every model."""
    if text.strip().lower() == "all":
        return ()
    return tuple(m.strip() for m in text.split(",") if m.strip())


def _expiry(text: str) -> datetime | None:
    """``--expires``: a date or an ISO time (UTC unless it says); ``never`` or ``none``: no expiry."""
    from llmgw_cli.core.serving.keys import parse_expiry

    if text.strip().lower() in ("never", "none"):
        return None
    try:
        return parse_expiry(text)
    except ValueError:
        raise UsageError(f"--expires {text!r}: give a date (2027-01-31), an ISO time or never") from None


def _check_models(spec: "ClusterSpec", chosen: tuple[str, ...]) -> None:
    # a model's name or one of its adapters' (a key may be given an adapter on its own)
    known = {x.name for x in spec.models} | {a.name for x in spec.models for a in x.adapters}
    unknown = [m for m in chosen if m not in known]
    if unknown:
        raise UsageError(f"--models: not in the catalog: {', '.join(unknown)}")


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
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_parallel: MaxParallel = None,
    budget: BudgetOption = None,
    priority: PriorityOption = None,
    admin: Annotated[bool, typer.Option("--admin", help="May use the admin API.")] = False,
    store_dir: StoreDir = None,
) -> None:
    """Create a key and print it once: only its SHA-256 is stored. Without limits a key may
    use as much as the gateway serves."""
    import re
    import secrets

    from llmgw_cli.cli.store_access import forward, store_of, with_store
    from llmgw_cli.core.serving.keys import TOKEN_PREFIX, ApiKey, hash_token
    from llmgw_cli.core.serving.limits import NO_LIMITS, changed, option_args
    from llmgw_cli.remote.gateway_store import store_host

    chosen = _models(models) if models else ()
    expiry = _expiry(expires) if expires else None
    changes = _changes(rpm, tpm, max_parallel, budget, priority)
    spec = None
    if store_dir is None:
        spec = read_cluster(file)
        _check_models(spec, chosen)
        host = store_host(spec)
        if host is not None:
            args = [f"--name={name}", *([f"--models={','.join(chosen)}"] if chosen else [])]
            args += [
                *([f"--expires={expiry.isoformat()}"] if expiry else []),
                *(["--admin"] if admin else []),
            ]
            said = forward(spec, file, host, ["keys", "create"], [*args, *option_args(changes)]).strip()
            if not re.fullmatch(re.escape(TOKEN_PREFIX) + r"[A-Za-z0-9_-]{20,100}", said):
                raise LlmgwError(f"the gateway host {host} did not answer with a key")
            print(said)
            return
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    key = ApiKey(
        name,
        hash_token(token),
        chosen,
        expiry,
        datetime.now(UTC),
        admin=admin,
        limits=changed(NO_LIMITS, changes),
    )
    with_store(store_of(spec, store_dir), lambda store: store.add_key(key))
    print(token)


@app.command("set")
def set_key(
    name: Annotated[str, typer.Argument(help="Name of the key.")],
    *,
    file: ClusterFile = DEFAULT_FILE,
    rpm: Rpm = None,
    tpm: Tpm = None,
    max_parallel: MaxParallel = None,
    budget: BudgetOption = None,
    priority: PriorityOption = None,
    models: Annotated[
        str | None, typer.Option("--models", help="Comma-separated models; 'all' for every model.")
    ] = None,
    expires: Annotated[
        str | None,
        typer.Option("--expires", help="Expiry date or time (UTC), e.g. 2027-01-31; 'never' for none."),
    ] = None,
    store_dir: StoreDir = None,
) -> None:
    """Change a key's limits, models or expiry: only the options given change. Every running
    gateway applies the change within a few seconds."""

    from llmgw_cli.cli.store_access import forward, store_of, with_store
    from llmgw_cli.core.serving.limits import option_args
    from llmgw_cli.remote.gateway_store import shown, store_host

    changes = _changes(rpm, tpm, max_parallel, budget, priority)
    chosen = _models(models) if models is not None else None
    expiry = _expiry(expires) if expires is not None else None
    if not changes and chosen is None and expires is None:
        raise UsageError(
            "give what to change: --rpm, --tpm, --max-parallel, --budget, --priority, --models or --expires"
        )
    spec = None
    if store_dir is None:
        spec = read_cluster(file)
        _check_models(spec, chosen or ())
        host = store_host(spec)
        if host is not None:
            args = option_args(changes)
            args += [f"--models={','.join(chosen) or 'all'}"] if chosen is not None else []
            args += [f"--expires={expiry.isoformat() if expiry else 'never'}"] if expires is not None else []
            said = forward(spec, file, host, ["keys", "set"], [*args, "--", name])
            print(shown(said))
            return

    async def change(store: "Store") -> "ApiKey | None":
        return await _change(store, name, changes, chosen, (expiry,) if expires is not None else None)

    key = with_store(store_of(spec, store_dir), change)
    if key is None:
        raise InputError(f"no key named {name!r}")
    print(shown(_summary(key)))  # the name is whoever made the key's: printable characters only


async def _change(
    store: "Store",
    name: str,
    changes: dict[str, object],
    models: tuple[str, ...] | None,
    expires: tuple[datetime | None] | None,
) -> "ApiKey | None":
    """The key ``name`` with ``changes`` made to its limits, and its models and expiry
    replaced when given (None: kept; ``expires`` is ``(None,)`` for "never"), as written;
    None: no such key."""
    from dataclasses import replace

    from llmgw_cli.core.serving.limits import changed

    key = next((k for k in await store.api_keys() if k.name == name), None)
    if key is None:
        return None
    new = replace(
        key,
        limits=changed(key.limits, changes),
        models=key.models if models is None else models,
        expires=key.expires if expires is None else expires[0],
    )
    if new.limits != key.limits and not await store.set_limits(name, new.limits):
        return None
    if (new.models, new.expires) != (key.models, key.expires) and not await store.set_access(
        name, new.models, new.expires
    ):
        return None
    return new


def _summary(key: "ApiKey") -> str:
    from llmgw_cli.core.serving.limits import describe

    expiry = key.expires.isoformat() if key.expires else "never"
    return (
        f"{key.name}: limits {describe(key.limits)}; models {','.join(key.models) or 'all'}; expires {expiry}"
    )


@app.command("list")
def list_keys(
    file: ClusterFile = DEFAULT_FILE,
    json_out: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    store_dir: StoreDir = None,
) -> None:
    """Keys with their models, expiry, state and limits, and the use against each limit:
    the last minute's requests and tokens, this day's or month's budget (never the key
    itself)."""
    from rich.console import Console

    from llmgw_cli.cli.store_access import (
        forward,
        keys_and_use,
        keys_json,
        parse_keys,
        parse_use,
        store_of,
        with_store,
    )
    from llmgw_cli.cli.views import keys_view
    from llmgw_cli.remote.gateway_store import store_host

    spec = None if store_dir is not None else read_cluster(file)
    host = store_host(spec) if spec is not None else None
    if spec is not None and host is not None:
        said = forward(spec, file, host, ["keys", "list"], ["--json"])
        keys, use = parse_keys(said), parse_use(said)
    else:
        now = time.time()
        keys, use = with_store(store_of(spec, store_dir), lambda store: keys_and_use(store, now))
    if json_out:
        sys.stdout.write(keys_json(keys, use) + "\n")
    else:
        Console().print(keys_view(keys, datetime.now(UTC), use))


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

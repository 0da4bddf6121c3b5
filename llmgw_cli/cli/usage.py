"""`llmgw usage`: requests, tokens, errors and latency per day, key and model, and each
key's limits beside its use, from the store the cluster file names (the same ways as
`llmgw keys`: ``cli/store_access.py``)."""

import sys
from datetime import date
from typing import Annotated

import typer

from llmgw_cli.cli.common import DEFAULT_FILE, ClusterFile, StoreDir, read_cluster, stdout_console
from llmgw_cli.errors import UsageError


def _day(text: str | None) -> str | None:
    if text is None:
        return None
    try:
        if len(text) != 10:
            raise ValueError(text)
        return date.fromisoformat(text).isoformat()
    except ValueError:
        raise UsageError(f"--since {text!r}: give a day as YYYY-MM-DD, e.g. 2026-12-01") from None


def usage(
    file: ClusterFile = DEFAULT_FILE,
    since: Annotated[
        str | None, typer.Option("--since", metavar="DAY", help="From this day on (YYYY-MM-DD, UTC).")
    ] = None,
    json_out: Annotated[bool, typer.Option("--json", help="JSON instead of a table.")] = False,
    store_dir: StoreDir = None,
) -> None:
    """Requests, tokens, errors and mean latency per day, key and model, as the gateways
    wrote them (each gateway process writes its totals every few seconds), then each key's
    totals beside its limits (JSON: each row carries its key's limits)."""
    from llmgw_cli.cli.store_access import (
        forward,
        parse_usage,
        parse_usage_limits,
        store_of,
        usage_and_limits,
        usage_json,
        with_store,
    )
    from llmgw_cli.cli.views import usage_view
    from llmgw_cli.remote.gateway_store import store_host

    day = _day(since)
    spec = None if store_dir is not None else read_cluster(file)
    host = store_host(spec) if spec is not None else None
    if spec is not None and host is not None:
        said = forward(spec, file, host, ["usage"], ["--json", *([f"--since={day}"] if day else [])])
        rows, limits = parse_usage(said), parse_usage_limits(said)
    else:
        rows, limits = with_store(store_of(spec, store_dir), lambda store: usage_and_limits(store, day))
    if json_out:
        sys.stdout.write(usage_json(rows, limits) + "\n")
    else:
        stdout_console().print(usage_view(rows, limits or None))  # none: an llmgw there without limits

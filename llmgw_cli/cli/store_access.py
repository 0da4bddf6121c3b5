"""What `llmgw keys` and `llmgw usage` share: the store the cluster file names, opened from
here or reached through the gateway host (``remote/gateway_store.py`` says which), and the
JSON they exchange with the gateway host (parsed as hostile data: another machine's output)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from llmgw_cli.cli.session import Session
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.errors import InputError, LlmgwError
from llmgw_cli.gateway.store.sqlite import SqliteStore, Store, Usage, open_store
from llmgw_cli.remote.gateway_store import on_gateway_host, shown

T = TypeVar("T")


def with_store(opened: Callable[[], Store], call: Callable[[Store], Awaitable[T]]) -> T:
    """``call`` on a store, opened and closed around it."""

    async def run() -> T:
        store = opened()
        try:
            return await call(store)
        finally:
            await store.close()

    return asyncio.run(run())


def store_of(spec: ClusterSpec | None, store_dir: Path | None) -> Callable[[], Store]:
    """How to open the store: ``--store-dir``'s SQLite, else the cluster file's."""
    if store_dir is not None:
        return lambda: SqliteStore(store_dir)
    assert spec is not None
    return lambda: open_store(spec)


def forward(spec: ClusterSpec, file: Path, host: str, command: list[str], args: list[str]) -> str:
    """Run ``llmgw COMMAND ARGS`` on the gateway host against its own store; what it
    printed on stdout. Its error (exit 2: the input; else a failure) is raised with its
    message."""
    with Session(spec, file.resolve().parent) as session:
        result = session.run(on_gateway_host(spec, session.conns, host, command, args))
    if result.ok:
        return result.stdout
    said = (
        shown(result.stderr or result.stdout).removeprefix("error: ") or f"exit status {result.exit_status}"
    )
    kind = InputError if result.exit_status == 2 else LlmgwError
    raise kind(f"on the gateway host {host}: {said}")


# --- the JSON `keys list --json` and `usage --json` print ------------------------------------


def keys_json(keys: list[ApiKey]) -> str:
    """Every key without its digest (nothing a client could use)."""
    return json.dumps(
        [
            {
                "name": k.name,
                "models": list(k.models),
                "expires": k.expires.isoformat() if k.expires else None,
                "created": k.created.isoformat() if k.created else None,
                "revoked": k.revoked,
                "admin": k.admin,
            }
            for k in keys
        ],
        indent=1,
    )


def _text(row: dict[str, Any], name: str, *, most: int = 200) -> str:
    value = row.get(name)
    if not isinstance(value, str) or len(value) > most:
        raise ValueError(name)
    return value


def _time(row: dict[str, Any], name: str) -> datetime | None:
    value = row.get(name)
    return None if value is None else datetime.fromisoformat(_text(row, name))


def _count(row: dict[str, Any], name: str) -> int:
    value = row.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(name)
    return value


def _rows(text: str, what: str) -> list[dict[str, Any]]:
    try:
        rows = json.loads(text)
    except ValueError:
        rows = None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise LlmgwError(f"the gateway host's answer is not a list of {what} (an older llmgw there?)")
    return rows


def parse_keys(text: str) -> list[ApiKey]:
    """``keys_json``'s output, from another machine: a bad answer is an error, never shown."""
    keys = []
    for row in _rows(text, "keys"):
        try:
            models = row.get("models")
            if not isinstance(models, list) or not all(isinstance(m, str) and len(m) <= 200 for m in models):
                raise ValueError("models")
            revoked, admin = row.get("revoked"), row.get("admin")
            if not isinstance(revoked, bool) or not isinstance(admin, bool):
                raise ValueError("revoked")
            keys.append(
                ApiKey(
                    _text(row, "name"),
                    "",
                    tuple(models),
                    _time(row, "expires"),
                    _time(row, "created"),
                    revoked=revoked,
                    admin=admin,
                )
            )
        except ValueError as exc:
            raise LlmgwError(f"the gateway host's answer has a bad key ({exc})") from None
    return keys


def usage_json(rows: list[Usage]) -> str:
    return json.dumps([u.as_dict() for u in rows], indent=1)


def parse_usage(text: str) -> list[Usage]:
    """``usage_json``'s output, from another machine."""
    found = []
    for row in _rows(text, "usage rows"):
        try:
            mean = row.get("mean_latency_ms")
            if isinstance(mean, bool) or not isinstance(mean, int | float) or not mean >= 0:
                raise ValueError("mean_latency_ms")
            requests = _count(row, "requests")
            found.append(
                Usage(
                    _text(row, "day", most=10),
                    _text(row, "key"),
                    _text(row, "model"),
                    requests,
                    _count(row, "prompt_tokens"),
                    _count(row, "completion_tokens"),
                    _count(row, "errors"),
                    float(mean) * requests,
                )
            )
        except ValueError as exc:
            raise LlmgwError(f"the gateway host's answer has a bad usage row ({exc})") from None
    return found

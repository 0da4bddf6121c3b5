"""What `llmgw keys` and `llmgw usage` share: the store the cluster file names, opened from
here or reached through the gateway host (``remote/gateway_store.py`` says which), each
key's use against its limits (from the store's counters), and the JSON they exchange with
the gateway host (parsed as hostile data: another machine's output)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from llmgw_cli.cli.session import Session
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.core.serving.limits import NO_LIMITS, Limits, as_dict, from_dict
from llmgw_cli.core.serving.ratelimit import budget_window, earlier_slots, slot_window
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


# --- each key's use against its limits -------------------------------------------------------


@dataclass(frozen=True)
class KeyUse:
    """What a key used of its limits, from the store's counters: requests and tokens over
    the last minute ``minute`` (its slots, ``s:FIRST..s:LAST``: the one under way and the
    five before it), and tokens in the budget's period ``period`` (``d:YYYY-MM-DD`` or
    ``M:YYYY-MM``; "" without a budget)."""

    minute: str
    requests: int = 0
    tokens: int = 0
    period: str = ""
    budget: int = 0

    def as_dict(self) -> dict[str, object]:
        return {
            "minute": self.minute,
            "requests": self.requests,
            "tokens": self.tokens,
            "period": self.period or None,
            "budget": self.budget,
        }


async def key_use(store: Store, keys: list[ApiKey], now: float) -> dict[str, KeyUse]:
    """The use of every key with a metered limit (rpm, tpm or a budget) at ``now``; the
    others count nothing."""
    current = slot_window(now)
    recent = [*earlier_slots(current)[1:], current.id]
    minute = f"{recent[0]}..{recent[-1]}"
    found = {}
    for key in keys:
        if not key.limits.metered:
            continue
        budget = key.limits.budget
        period = budget_window(budget.period, now).id if budget is not None else ""
        requests = sum((await store.used(key.name, "requests", recent)).values())
        tokens = sum((await store.used(key.name, "tokens", recent)).values())
        spent = (await store.used(key.name, "budget", [period]))[period] if period else 0
        found[key.name] = KeyUse(minute, requests, tokens, period, spent)
    return found


async def keys_and_use(store: Store, now: float) -> tuple[list[ApiKey], dict[str, KeyUse]]:
    keys = await store.api_keys()
    return keys, await key_use(store, keys, now)


# --- the JSON `keys list --json` and `usage --json` print ------------------------------------


def keys_json(keys: list[ApiKey], use: dict[str, KeyUse] | None = None) -> str:
    """Every key without its digest (nothing a client could use), with its limits and,
    for a key with a metered limit, its use (``KeyUse``; null otherwise)."""
    return json.dumps(
        [
            {
                "name": k.name,
                "models": list(k.models),
                "expires": k.expires.isoformat() if k.expires else None,
                "created": k.created.isoformat() if k.created else None,
                "revoked": k.revoked,
                "admin": k.admin,
                "limits": as_dict(k.limits),
                "use": u.as_dict() if (u := (use or {}).get(k.name)) is not None else None,
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
                    limits=_limits(row),
                )
            )
        except ValueError as exc:
            raise LlmgwError(f"the gateway host's answer has a bad key ({exc})") from None
    return keys


def _limits(row: dict[str, Any]) -> Limits:
    """A row's ``limits`` (none from an llmgw older than the limits: no limits)."""
    return NO_LIMITS if "limits" not in row else from_dict(row["limits"])


def parse_use(text: str) -> dict[str, KeyUse]:
    """The use of each key in ``keys_json``'s output, from another machine."""
    found = {}
    for row in _rows(text, "keys"):
        use = row.get("use")
        if use is None:
            continue
        try:
            if not isinstance(use, dict):
                raise ValueError("use")
            period = use.get("period")
            found[_text(row, "name")] = KeyUse(
                _text(use, "minute", most=40),
                _count(use, "requests"),
                _count(use, "tokens"),
                "" if period is None else _text(use, "period", most=20),
                _count(use, "budget"),
            )
        except ValueError as exc:
            raise LlmgwError(f"the gateway host's answer has a bad key ({exc})") from None
    return found


def usage_json(rows: list[Usage], limits: dict[str, Limits] | None = None) -> str:
    """The usage rows, each with its key's limits (null: a key the store does not know)."""
    known = limits or {}
    return json.dumps(
        [{**u.as_dict(), "limits": as_dict(known[u.key]) if u.key in known else None} for u in rows],
        indent=1,
    )


async def usage_and_limits(store: Store, since: str | None) -> tuple[list[Usage], dict[str, Limits]]:
    return await store.usage(since), {k.name: k.limits for k in await store.api_keys()}


def parse_usage_limits(text: str) -> dict[str, Limits]:
    """Each key's limits in ``usage_json``'s output, from another machine."""
    found = {}
    for row in _rows(text, "usage rows"):
        try:
            if row.get("limits") is not None:
                found[_text(row, "key")] = _limits(row)
        except ValueError as exc:
            raise LlmgwError(f"the gateway host's answer has a bad usage row ({exc})") from None
    return found


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

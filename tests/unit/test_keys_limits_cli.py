"""`llmgw keys create|set|list` with limits, and `llmgw usage` beside them, run for real
against each store a user has: SQLite on the gateway host (``--store-dir``, what the
command runs there), SQLite reached through the gateway host (the forwarded command must
carry every option), and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from llmgw_cli.cli import store_access
from llmgw_cli.cli.main import app
from llmgw_cli.cli.views import keys_view
from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.serving.keys import ApiKey
from llmgw_cli.core.serving.limits import Budget, Limits, Priority
from llmgw_cli.core.serving.ratelimit import budget_window, slot_window
from llmgw_cli.errors import InputError, LlmgwError
from llmgw_cli.gateway.store.sqlite import SqliteStore, Store, Usage
from tests.pg import Postgres

CATALOG = """
profiles: {llama: {engine: llama-server}}
models:
  - {name: a, source: "https://example.invalid/a.gguf", profile: llama}
  - {name: b, source: "https://example.invalid/b.gguf", profile: llama}
"""


def llmgw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw_cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "250", **(env or {})},
        timeout=120,
        check=False,
    )


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def listed(*args: str, env: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    return {k["name"]: k for k in json.loads(ok(llmgw("keys", "list", "--json", *args, env=env)))}


def count(store: Store, key: str, counter: str, window: str, n: int) -> None:
    """What a gateway counts for a key (``add_used``, as it does)."""

    async def add() -> None:
        try:
            await store.add_used(key, counter, window, n)
        finally:
            await store.close()

    asyncio.run(add())


def test_keys_with_limits_in_the_gateway_hosts_store(tmp_path: Path) -> None:
    store = ("--store-dir", str(tmp_path))
    token = ok(
        llmgw(
            "keys",
            "create",
            "--name",
            "team-a",
            "--rpm",
            "60",
            "--tpm",
            "100k",
            "--budget",
            "5M/month",
            "--max-parallel",
            "4",
            "--priority",
            "high",
            *store,
        )
    ).strip()
    assert token.startswith("llmgw-")
    ok(llmgw("keys", "create", "--name", "free", *store))
    keys = listed(*store)
    assert keys["team-a"]["limits"] == {
        "rpm": 60,
        "tpm": 100000,
        "max_parallel": 4,
        "budget": "5000000/month",
        "priority": "high",
    }
    assert keys["free"]["limits"] == {
        "rpm": None,
        "tpm": None,
        "max_parallel": None,
        "budget": None,
        "priority": "normal",
    }
    assert keys["free"]["use"] is None  # nothing counted for a key without limits
    assert token not in json.dumps(keys)

    said = ok(
        llmgw("keys", "set", "team-a", "--rpm", "none", "--budget", "100000/day", "--models", "a", *store)
    )
    assert "team-a" in said and "budget 100000/day" in said
    keys = listed(*store)
    assert keys["team-a"]["limits"] == {  # only what was given changed
        "rpm": None,
        "tpm": 100000,
        "max_parallel": 4,
        "budget": "100000/day",
        "priority": "high",
    }
    assert keys["team-a"]["models"] == ["a"] and keys["team-a"]["expires"] is None
    ok(
        llmgw(
            "keys", "set", "team-a", "--expires", "2030-01-31", "--models", "all", "--priority", "low", *store
        )
    )
    keys = listed(*store)
    assert keys["team-a"]["models"] == [] and str(keys["team-a"]["expires"]).startswith("2030-01-31")
    assert keys["team-a"]["limits"]["priority"] == "low"  # type: ignore[index]
    ok(llmgw("keys", "set", "team-a", "--expires", "never", *store))
    assert listed(*store)["team-a"]["expires"] is None

    # the use against each limit: the last minute's requests and tokens (six slots), this
    # period's budget
    now = time.time()
    slot, day = slot_window(now), budget_window("day", now).id
    minute = f"s:{int(slot.start // 10) - 5}..{slot.id}"
    count(SqliteStore(tmp_path), "team-a", "tokens", slot.id, 3400)
    count(SqliteStore(tmp_path), "team-a", "budget", day, 52_000)
    count(SqliteStore(tmp_path), "team-a", "budget", "d:2020-01-01", 99)  # another day: not this one's
    use = listed(*store)["team-a"]["use"]
    assert isinstance(use, dict)
    if use["minute"] == minute:  # (the slot did not turn between counting and listing)
        assert (use["requests"], use["tokens"]) == (0, 3400)
    assert (use["period"], use["budget"]) == (day, 52_000)
    table = ok(llmgw("keys", "list", *store))
    assert "52000/100000 per day" in table and "low" in table

    # `llmgw usage` shows each key's limits beside its use
    async def write() -> None:
        sq = SqliteStore(tmp_path)
        await sq.add_usage("b1", [Usage("2026-12-01", "team-a", "a", 3, 10, 20, 0, 30.0)])
        await sq.close()

    asyncio.run(write())
    (row,) = json.loads(ok(llmgw("usage", "--json", *store)))
    assert (row["key"], row["requests"], row["limits"]["tpm"], row["limits"]["budget"]) == (
        "team-a",
        3,
        100000,
        "100000/day",
    )
    shown = ok(llmgw("usage", *store))
    assert "tpm 100000, parallel 4, budget 100000/day, priority low" in shown


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["create", "--name", "x", "--budget", "10/week"],
            "--budget '10/week': give TOKENS/day or TOKENS/month",
        ),
        (["create", "--name", "x", "--rpm", "0"], "--rpm '0': give a positive whole number"),
        (["create", "--name", "x", "--priority", "urgent"], "--priority 'urgent': give high, normal or low"),
        (["set", "k", "--max-parallel", "many"], "--max-parallel 'many': give a positive whole number"),
        (["set", "k"], "give what to change: --rpm"),
        (["set", "k", "--expires", "soon"], "--expires 'soon': give a date"),
        (["set", "nobody", "--rpm", "5"], "no key named 'nobody'"),
    ],
)
def test_bad_limits_and_unknown_keys_are_refused_with_what_to_give(
    tmp_path: Path, args: list[str], message: str
) -> None:
    ok(llmgw("keys", "create", "--name", "k", "--rpm", "7", "--store-dir", str(tmp_path)))
    done = llmgw("keys", *args, "--store-dir", str(tmp_path))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert listed("--store-dir", str(tmp_path))["k"]["limits"]["rpm"] == 7  # type: ignore[index]


def test_keys_help_explains_each_limit() -> None:
    for command in ("create", "set"):
        text = " ".join(ok(llmgw("keys", command, "--help")).split())
        for words in (
            "Requests per minute",
            "Tokens (prompt + completion) per minute",
            "in flight",
            "TOKENS/day",
            "00:00 UTC",
            "high keys before normal",
            "'none' removes",
        ):
            assert words in text, (command, words)


def test_keys_through_the_gateway_host_carry_every_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite on another host: the command runs there (here standing in for SSH: the same
    llmgw with ``--store-dir`` and the forwarded arguments, as ``remote_command`` builds it)."""
    state = tmp_path / "state"
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "cluster: {name: t}\nnodes:\n  - {name: far, address: 198.51.100.2}\ngateway: {host: far}\n" + CATALOG
    )
    sent: list[tuple[list[str], list[str]]] = []

    def on_host(spec: ClusterSpec, file: Path, host: str, command: list[str], args: list[str]) -> str:
        assert host == "far"
        sent.append((command, args))
        done = llmgw(*command, "--store-dir", str(state), *args)
        if done.returncode:
            raise (InputError if done.returncode == 2 else LlmgwError)(
                f"on the gateway host {host}: {done.stderr}"
            )
        return done.stdout

    monkeypatch.setattr(store_access, "forward", on_host)
    monkeypatch.setenv("COLUMNS", "250")
    runner = CliRunner()

    def cli(*args: str) -> str:
        done = runner.invoke(app, [*args, "-f", str(cluster)])
        assert done.exit_code == 0, (done.output, done.exception)
        return done.output

    assert cli(
        "keys", "create", "--name", "team-a", "--rpm", "60", "--budget", "100k/day", "--models", "a"
    ).startswith("llmgw-")
    assert sent[-1] == (
        ["keys", "create"],
        ["--name=team-a", "--models=a", "--rpm=60", "--budget=100000/day"],
    )
    cli(
        "keys",
        "set",
        "team-a",
        "--tpm",
        "5k",
        "--rpm",
        "none",
        "--priority",
        "high",
        "--models",
        "all",
        "--expires",
        "2030-01-31",
    )
    assert sent[-1][0] == ["keys", "set"] and sent[-1][1][-2:] == ["--", "team-a"]
    assert json.loads(cli("keys", "list", "--json"))[0]["limits"] == {
        "rpm": None,
        "tpm": 5000,
        "max_parallel": None,
        "budget": "100000/day",
        "priority": "high",
    }
    assert sent[-1] == (["keys", "list"], ["--json"])
    table = cli("keys", "list")
    assert "0/5000" in table and "0/100000 per day" in table
    assert json.loads(cli("usage", "--json")) == []
    # the names in the catalog are checked here, before anything is sent
    refused = runner.invoke(app, ["keys", "set", "team-a", "--models", "nope", "-f", str(cluster)])
    assert refused.exit_code != 0 and "not in the catalog: nope" in str(refused.exception)
    assert sent[-1][0] == ["usage"]


def test_keys_with_limits_in_postgresql(tmp_path: Path, postgres: Postgres) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        f"cluster: {{name: t}}\ngateway: {{hosts: [198.51.100.2, 198.51.100.3], store: '{postgres.new_database()}'}}\n"
    )
    env = {"LLMGW_STORE_PASSWORD": postgres.password}
    ok(llmgw("keys", "create", "--name", "team-a", "--max-parallel", "3", "-f", str(cluster), env=env))
    ok(
        llmgw(
            "keys",
            "set",
            "team-a",
            "--budget",
            "5M/month",
            "--max-parallel",
            "none",
            "-f",
            str(cluster),
            env=env,
        )
    )
    key = listed("-f", str(cluster), env=env)["team-a"]
    assert key["limits"] == {
        "rpm": None,
        "tpm": None,
        "max_parallel": None,
        "budget": "5000000/month",
        "priority": "normal",
    }
    assert key["use"] == {
        "minute": key["use"]["minute"],  # type: ignore[index]
        "requests": 0,
        "tokens": 0,
        "period": budget_window("month", time.time()).id,
        "budget": 0,
    }
    missing = llmgw("keys", "set", "nobody", "--rpm", "1", "-f", str(cluster), env=env)
    assert missing.returncode == 2 and "no key named 'nobody'" in missing.stderr


def test_keys_list_never_cuts_a_name_in_80_columns() -> None:
    """The name is what `keys set` and `revoke` take: whole, however many limits a key has
    and however narrow the terminal (80 columns when output is not a terminal)."""
    limits = Limits(
        rpm=60, tpm=100_000, max_parallel=4, budget=Budget(5_000_000, "month"), priority=Priority.high
    )
    keys = [
        ApiKey("far-user", "d1", models=("smollm2-135m",)),
        ApiKey("team-analytics-production", "d2", models=("a-long-model-name", "another-one"), limits=limits),
    ]
    console = Console(width=80, record=True)
    console.print(keys_view(keys, datetime.now(UTC)))
    text = console.export_text()
    assert "far-user" in text and "team-analytics-production" in text
    for line in ("rpm 0/60", "tpm 0/100000", "parallel 4", "priority high"):
        assert line in text
    assert max(len(line) for line in text.splitlines()) <= 80

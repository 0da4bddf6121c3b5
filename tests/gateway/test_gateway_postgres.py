"""`llmgw gateway run` on the PostgreSQL store, end to end: a real server (the ``postgres``
fixture), the password in a file named by the cluster file, the schema made by
`llmgw store migrate`, keys made and revoked by `llmgw keys`, usage written by the gateway
and read back from the database after it stopped."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import openai

from llmgw_cli.gateway.store.postgres import PostgresStore
from llmgw_cli.gateway.store.sqlite import SCHEMA_VERSION
from tests.gateway.harness import Engine, Gateway
from tests.gateway.test_gateway import MESSAGES, model
from tests.pg import Postgres
from tests.waiting import wait_until


def test_gateway_on_postgres(tmp_path: Path, postgres: Postgres) -> None:
    url = postgres.new_database()
    password = tmp_path / "store-password"
    password.write_text(postgres.password + "\n")
    password.chmod(0o600)
    engine = Engine(tmp_path, "chat")
    gw = Gateway(
        tmp_path,
        [model("chat", "always")],
        {"chat": [engine.address]},
        store=url,
        store_password_file=str(password),
    )
    assert gw.cli("store", "migrate").endswith(f"schema version {SCHEMA_VERSION}")
    key = gw.cli("keys", "create", "--name", "k")
    gw.cli("keys", "create", "--name", "other")
    assert not (tmp_path / "state" / "gateway.sqlite3").exists()  # everything went to PostgreSQL
    gw.start()
    try:
        client = gw.client(key)
        for _ in range(3):
            client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=5)
        served = [3]  # requests answered with the key, the ones before the revocation took hold too
        gw.cli("keys", "revoke", "k")

        def refused() -> bool:
            try:
                client.chat.completions.create(model="chat", messages=MESSAGES, max_tokens=1)
            except openai.AuthenticationError:
                return True
            served[0] += 1
            return False

        wait_until(refused, timeout=15, interval=0.2, what="the revoked key to be refused")
        assert gw.stop() == 0  # writes what it counted
    finally:
        if gw.proc is not None and gw.proc.poll() is None:
            gw.stop()
        engine.stop()

    async def stored() -> list[tuple[str, str, int]]:
        store = PostgresStore(url, postgres.password)
        try:
            return [(u.key, u.model, u.requests) for u in await store.usage()]
        finally:
            await store.close()

    assert asyncio.run(stored()) == [("k", "chat", served[0])]  # each counted once, none lost


def test_gateway_refuses_an_older_schema(tmp_path: Path, postgres: Postgres) -> None:
    """After an upgrade of llmgw that brings a new schema, a gateway started before
    `llmgw store migrate` ran says so and exits, rather than running on the old tables."""
    url = postgres.new_database()
    password = tmp_path / "store-password"
    password.write_text(postgres.password)
    gw = Gateway(
        tmp_path, [model("chat", "always")], {"chat": []}, store=url, store_password_file=str(password)
    )
    assert "schema version" in gw.cli("store", "migrate")
    postgres.sql("UPDATE meta SET value = 1 WHERE name = 'schema_version'", database=url.rsplit("/", 1)[1])
    argv = [sys.executable, "-m", "llmgw_cli", "gateway", "run", "-f", str(gw.cluster), "--workers", "1"]
    done = subprocess.run(
        [*argv, "--replicas", str(gw.replicas), "--engine-key-file", str(tmp_path / "engine.env")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "schema version 1, this llmgw needs" in done.stderr and "run llmgw store migrate" in done.stderr
    assert postgres.password not in done.stderr + done.stdout

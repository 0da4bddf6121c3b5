"""A gateway member in a process of its own, for the store tests: it opens the store the
arguments name, takes the lead, prints its fencing number and waits to be killed.

    python -m tests.gateway.store_member sqlite STATE_DIR
    python -m tests.gateway.store_member postgres URL   (password in $LLMGW_STORE_PASSWORD)
"""

from __future__ import annotations

import asyncio
import sys

from llmgw_cli.gateway.store.sqlite import SqliteStore, Store


def open_named(kind: str, where: str) -> Store:
    if kind == "sqlite":
        return SqliteStore(where)
    from llmgw_cli.gateway.store.postgres import PostgresStore, read_password  # noqa: PLC0415 (only when asked for)

    return PostgresStore(where, read_password(None))


async def main(kind: str, where: str) -> None:
    store = open_named(kind, where)
    leadership = store.leadership("child")
    fence = await leadership.try_acquire()
    print(fence, flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))

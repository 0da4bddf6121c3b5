#!/usr/bin/env python3
"""The least a probe of N nodes can cost in Python: one asyncssh connection per node, the
same probe script llmgw renders for that node sent as one command, all nodes at once, and
nothing else (no cluster file, no parsing of the answers, no table). bench/probe.py runs
it as its own process beside `llmgw status`, so both pay an interpreter's start.

    python bench/minimal_probe.py TARGETS.json

TARGETS.json: a list of {host, port, user, key, known_hosts, script}. Exits 1 when a
node's answer lacks the probe's end marker.
"""

from __future__ import annotations

import asyncio
import json
import sys

import asyncssh

END = "@@ end"  # the probe script's last line: the answer is whole


async def probe(target: dict[str, str | int]) -> bool:
    async with asyncssh.connect(
        str(target["host"]),
        port=int(target["port"]),
        username=str(target["user"]),
        client_keys=[str(target["key"])],
        known_hosts=str(target["known_hosts"]),
        agent_path=None,
    ) as conn:
        done = await conn.run("sh -s", input=str(target["script"]))
        return END in str(done.stdout).split("\n")


async def main(path: str) -> int:
    with open(path) as f:
        targets = json.load(f)
    answered = await asyncio.gather(*(probe(t) for t in targets))
    print(f"{sum(answered)}/{len(targets)} answered")
    return 0 if all(answered) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1])))

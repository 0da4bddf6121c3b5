"""The lab tests' load generator (tests/integration/load.py) counts what a client sees:
streams through a real gateway to one simulated engine that is SIGKILLed mid-stream.
The streams it was sending are cut, the requests after it are refused (no replica), the
ones before it completed."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.gateway.harness import Engine, Gateway
from tests.integration.load import access_log, running_load
from tests.waiting import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.any_loop]  # the tests' load generator

MODELS: list[dict[str, object]] = [
    {"name": "m", "source": "org/m", "fetch": "engine", "profile": "sim", "scaling": {"min": 1, "max": 1}}
]


def test_completed_refused_and_cut_are_told_apart(tmp_path: Path) -> None:
    engine = Engine(tmp_path, "m", tokens_per_second=10)  # a 16-token stream: 1.6 s
    gw = Gateway(tmp_path, MODELS, {"m": [engine.address]})
    key = gw.cli("keys", "create", "--name", "user")
    gw.start()
    try:
        with running_load(f"http://127.0.0.1:{gw.port}/v1", key, "m", concurrency=4, timeout=20) as load:
            # every worker mid-stream: a chunk arrived, the last one not yet
            wait_until(
                lambda: sum(1 for r in load.requests if r.chunks > 1 and not r.done) == 4,
                timeout=10,
                what=load.failures,
            )
            killed = time.time()
            engine.stop(signal.SIGKILL)
            wait_until(lambda: len(load.refused) >= 2, timeout=30, what=load.failures)
    finally:
        gw.stop()
    print(load.totals())
    assert len(load.completed) >= 4, load.failures()
    assert all(r.ended < killed for r in load.completed), load.failures()
    # the four streams in flight when the engine died, each after some chunks
    assert len(load.cut) == 4, load.failures()
    assert all(r.started < killed and r.chunks > 1 for r in load.cut), load.failures()
    # after it, no replica: refused before any chunk, with the gateway's status and text
    assert all(r.started > killed - 0.5 and r.chunks == 0 for r in load.refused), load.failures()
    assert all(r.status is not None and r.status >= 500 and r.error for r in load.refused), load.failures()
    assert len(load.finished) == len(load.requests) == len(load.completed) + len(load.cut) + len(load.refused)
    assert f"{len(load.refused)} refused" in load.totals() and "4 cut" in load.totals()
    failed = 4 + len(load.refused)  # one line each, the first 20, then one "... N more"
    assert len(load.failures().splitlines()) == 1 + min(20, failed) + (failed > 20)
    # the gateway's own log saw the same requests
    assert len(access_log(gw.log, "m")) == len(load.requests)

#!/usr/bin/env python3
"""Soak: streams through the real gateway while a replica's engine is SIGKILLed.

    sudo .venv/bin/python bench/soak.py                       # c=64, 10 min, a kill a minute
    sudo .venv/bin/python bench/soak.py --concurrency 16 --seconds 120 --kill-every 20

Boots the 4-node lab (`llmgw lab up`, root) and takes it down at the end: nothing else
may use the lab meanwhile. The scenario is tests/integration/soak.py's (the 70-second
version is tests/integration/test_soak_lab.py): one always-on model with two replicas on
two nodes (simulated vLLM, 8 tokens/s, a 16-token reply: a stream of about 2 s), the
official ``openai`` client streaming at ``--concurrency``, and every ``--kill-every``
seconds ``systemctl kill -s KILL`` of one replica's unit (the two in turn, each once the
other is back in rotation; systemd restarts it after the unit's RestartSec, 15 s).

Reports: requests; failures before the first byte (the target is 0: a request that
meets the killed replica is retried on the other); streams cut, and for each cut whether
it ran on the replica killed while it ran (from the gateway's access log and the kill
times); requests retried.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.conftest import NODES, STATE, Lab, LabNode, lab_unavailable, llmgw
from tests.integration.soak import soak, soak_gateway


def boot() -> Lab:
    """The 4-node lab, booted afresh (a stale one taken down first); exits 2 where the lab
    cannot run."""
    reason = lab_unavailable()
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        raise SystemExit(2)
    llmgw("lab", "down", "--state", str(STATE), check=False)  # a stale lab from a crashed run
    llmgw("lab", "up", "--nodes", str(NODES), "--state", str(STATE))
    record = json.loads((STATE / "lab.json").read_text())
    return Lab(
        state=STATE,
        nodes=[LabNode(n["name"], n["index"], n["ip"], n["pid1"]) for n in record["nodes"]],
        key=STATE / "id_ed25519",
        known_hosts=STATE / "known_hosts",
        ssh_config=STATE / "ssh_config",
        cluster_file=STATE / "cluster.yaml",
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--kill-every", type=float, default=60)
    args = parser.parse_args()
    lab = boot()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="llmgw-soak-") as folder,
            soak_gateway(lab, Path(folder)) as gw,
        ):
            began = time.monotonic()
            result = soak(
                lab, gw, concurrency=args.concurrency, seconds=args.seconds, kill_every=args.kill_every
            )
            took = time.monotonic() - began
    finally:
        llmgw("lab", "down", "--state", str(STATE), check=False)

    print(
        f"concurrency {args.concurrency}, {args.seconds:g} s, a replica killed every {args.kill_every:g} s "
        f"({took:.0f} s with the gateway's stop)"
    )
    print(
        f"requests: {len(result.streams)} ({len(result.streams) / args.seconds:.1f}/s), logged {len(result.log)}"
    )
    print(
        f"failed before the first byte: {len(result.before_first_byte)} at the client, "
        f"{len(result.logged_failures)} in the log {dict(Counter(x['status'] for x in result.logged_failures))}"
    )
    print(
        f"retried (attempts > 1): {len(result.retried)} {dict(Counter(x['attempts'] for x in result.retried))}"
    )
    on_killed = len(result.cut) - len(result.unexplained_cuts)
    print(
        f"streams cut: {len(result.cut)}, {on_killed} on the replica killed while they ran, "
        f"{len(result.unexplained_cuts)} not; broken at the client: {len(result.broken)}"
    )
    t0 = result.kills[0].at if result.kills else 0.0
    for kill in result.kills:
        cuts = sum(1 for x in result.cut if result.killer(x) is kill)
        print(f"  kill at +{kill.at - t0:6.1f} s of {kill.address} ({kill.unit}): {cuts} streams cut")
    print(f"longest wait for the other replica before a kill: {max(result.waits, default=0):.1f} s")
    for line in result.unexplained_cuts[:10]:
        print(f"  unexplained cut: {line}")
    for stream in result.before_first_byte[:10]:
        print(f"  failed before the first byte: {stream.error}")
    return 0 if not result.before_first_byte and not result.unexplained_cuts else 1


if __name__ == "__main__":
    sys.exit(main())

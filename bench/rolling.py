#!/usr/bin/env python3
"""Replacing an always-on model's replica under load: the rolling path (the new replica
first) against the old stop-then-start path, side by side on the same lab.

    flock /tmp/llmgw-lab.lock .venv/bin/python bench/rolling.py --runs 3

Boots the 4-node lab (`llmgw lab up`, root) and takes it down at the end. Each run builds
the rig of tests/integration/rolling.py on node01 (one always-on model, `min: 1`, the
simulated vLLM, the real gateway on this machine), streams through the gateway with the
official openai client at ``--concurrency`` for ``--seconds`` (tests/integration/load.py;
longer if the new replica has not answered a request by then, up to 90 s after `apply`),
and a third of the way in runs `apply --yes` with a spec change (an engine flag):

- surge: the model takes 4 of node01's 8 cards: the new replica starts on the free ones
  first, then the old one is drained and stopped;
- in-place: the model takes all 8 cards: no successor fits, so `apply --yes
  --allow-downtime` stops the old replica and starts the new one in its place (the path
  every replace took before the rolling one).

Reports per run and as medians: requests, refused (failed before the first chunk), cut
(failed after it), the longest time with no request completing, how long `apply` took,
and the time from `apply` to the new replica's first byte to a client (the first request
the gateway's access log shows on the new replica's address after its engine started).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.soak import boot
from tests.integration.conftest import STATE, Lab, llmgw
from tests.integration.load import Load, access_log
from tests.integration.rolling import model, rig

CHANGE = ["--gpu-memory-utilization", "0.85"]
MODEL = "rolled"
MORE = 90.0  # seconds after apply the run may go on, waiting for the new replica to answer


@dataclass
class Run:
    path: str
    requests: int
    refused: int
    cut: int
    gap: float  # longest time with no request completing
    apply_seconds: float
    serving: float | None  # apply -> the new replica's first byte to a client
    exit_code: int

    def line(self) -> str:
        serving = "never" if self.serving is None else f"{self.serving:.1f} s"
        return (
            f"{self.path:8} requests {self.requests:5}, refused {self.refused:4}, cut {self.cut:3}, "
            f"longest with nothing completing {self.gap:5.1f} s, apply {self.apply_seconds:5.1f} s "
            f"(exit {self.exit_code}), apply -> new replica serving {serving}"
        )


def longest_gap(load: Load, since: float, until: float) -> float:
    ends = sorted([since, until, *(r.ended for r in load.completed if since <= r.ended <= until)])
    return max(b - a for a, b in itertools.pairwise(ends))


def one(lab: Lab, folder: Path, path: str, args: argparse.Namespace, logs: Path | None) -> Run:
    tp = 4 if path == "surge" else 8
    entry: dict[str, Any] = model(MODEL, tp=tp, tokens_per_second=args.tokens_per_second)
    with rig(lab, folder, ("node01",), [entry]) as made:
        (old,) = made.units(MODEL)
        made.write([{**entry, "args": CHANGE}])
        load = Load(f"http://127.0.0.1:{made.port}/v1", made.key, MODEL, concurrency=args.concurrency)
        began = time.monotonic()
        thread = threading.Thread(target=lambda: asyncio.run(load.run()))
        thread.start()
        time.sleep(args.seconds / 3)
        applied_at = time.time()
        done = made.apply("--yes", *(["--allow-downtime"] if path == "in-place" else []))
        apply_seconds = time.time() - applied_at
        news = [u for u in made.units(MODEL) if u.pid != old.pid]
        address = made.address(news[0]) if len(news) == 1 else ""
        # The run lasts --seconds, and at least until the new replica has answered a
        # request (at most MORE seconds after apply): its figure must not be cut short.
        served = len(load.completed)
        limit = time.monotonic() + MORE
        while time.monotonic() < limit and (
            time.monotonic() < began + args.seconds or (address and len(load.completed) == served)
        ):
            if address and address not in made.ready(MODEL):
                served = len(load.completed)
            time.sleep(0.25)
        load.halt.set()
        thread.join()
        ended = time.time()
        made.stop_gateway()  # its access log complete
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
            (logs / f"{folder.name}.apply.txt").write_text(made.applied())
            (logs / f"{folder.name}.gateway.log").write_text(made.log_text())
        if done.returncode != 0:
            print(made.applied(), file=sys.stderr)
        serving = None
        if address:
            started = made.started_at(news[0])
            firsts = [
                float(x["ts"]) - float(x["ms"]) / 1000 + float(x["first_byte_ms"]) / 1000
                for x in access_log(made.log, MODEL)
                if x["replica"] == address and x["status"] == 200
            ]
            firsts = [t for t in firsts if t > started]
            serving = min(firsts) - applied_at if firsts else None
        return Run(
            path,
            len(load.finished),
            len(load.refused),
            len(load.cut),
            longest_gap(load, load.t0, ended),
            apply_seconds,
            serving,
            done.returncode,
        )


def median(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}–{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="runs of each path (alternating)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--logs", type=Path, help="keep each run's apply output and gateway log here")
    parser.add_argument("--seconds", type=float, default=40)
    parser.add_argument(
        "--tokens-per-second", type=float, default=200, help="the simulated engine's pace (200: its default)"
    )
    args = parser.parse_args()
    lab = boot()
    runs: list[Run] = []
    try:
        with tempfile.TemporaryDirectory(prefix="llmgw-rolling-") as folder:
            for i in range(args.runs):
                for path in ("surge", "in-place"):
                    runs.append(one(lab, Path(folder) / f"{path}-{i}", path, args, args.logs))
                    print(runs[-1].line(), flush=True)
    finally:
        llmgw("lab", "down", "--state", str(STATE), check=False)
    print(
        f"\nconcurrency {args.concurrency}, {args.seconds:g} s a run, {args.tokens_per_second:g} tokens/s, "
        f"{args.runs} runs of each path; medians (min–max):"
    )
    for path in ("surge", "in-place"):
        mine = [r for r in runs if r.path == path]
        print(
            f"{path:8} requests {median([r.requests for r in mine])}, refused {median([r.refused for r in mine])}, "
            f"cut {median([r.cut for r in mine])}, longest with nothing completing {median([r.gap for r in mine])} s, "
            f"apply {median([r.apply_seconds for r in mine])} s, apply -> new replica serving "
            f"{median([r.serving for r in mine if r.serving is not None])} s"
        )
    return 0 if all(r.exit_code == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())

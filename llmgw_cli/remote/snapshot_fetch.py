"""Bring whole repository snapshots onto nodes: each file from the Hub once per group.

Per model and group of nodes (a fabric by default, as for single files): when a node of
the group holds the snapshot complete already, it is the seed; otherwise the first node
that needs it downloads it from the Hub (its ``snapshot`` job, with the Hub's URLs). The
seed serves its snapshot folder to peers (``serve-snapshot``), and every other node runs a
``snapshot`` job whose URLs point at that server (``peer: true``): a file the seed does not
hold yet is answered 503, and the copying node asks again, so it copies each file as soon
as the seed has it, while the seed is still downloading the next. Every node checks every
file against the Hub's digest itself: a peer is trusted for nothing but bytes.

A copy that fails because of the peer (kind ``peer``: its server gone, the file missing once
the seed's job ended) is done again from the Hub, so a failed seed costs origin bytes, not
the snapshot. A job is detached from the SSH session, as single-file jobs are: a later run
attaches to it through the node's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import defaultdict
from typing import Any

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.engine.engines import weights_folder
from llmgw_cli.core.weights.fetch import group_key
from llmgw_cli.core.weights.peers import Peers
from llmgw_cli.core.weights.snapshot import (
    DEFAULT_ENDPOINT,
    Snapshot,
    parse_snapshot_check,
    parse_snapshot_status,
    peer_snapshot_job,
    poll_snapshot_job,
    serve_snapshot_job,
    snapshot_folder,
    snapshot_job,
    verify_snapshot_job,
)
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import FetchEvent
from llmgw_cli.remote.fetch import POLL_SECONDS, SERVE_IDLE_SECONDS, Fetcher, FetchResult, _host

RESTARTS = 3  # times a job that died (node rebooted, killed) is started again


async def bring_snapshots(
    fetcher: Fetcher,
    spec: ClusterSpec,
    wanted: dict[str, list[str]],
    snapshots: dict[str, Snapshot],
    *,
    peers: Peers = Peers.fabric,
    endpoint: str | None = None,
    token: str | None = None,
) -> list[FetchResult]:
    """Every (model, node) of ``wanted`` with its snapshot in place; one result each."""
    work = [
        _group(_Run(fetcher, spec, model, snapshots[model], endpoint, token), nodes)
        for model, nodes in wanted.items()
        for nodes in _groups(spec, nodes, peers).values()
    ]
    done = await asyncio.gather(*work)
    return [r for group in done for r in group]


def _groups(spec: ClusterSpec, nodes: list[str], peers: Peers) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for name in nodes:
        groups[group_key(spec.node(name), peers)].append(name)
    return groups


async def _group(run: _Run, nodes: list[str]) -> list[FetchResult]:
    """One group's nodes (with ``Peers.off``, each node is a group of its own)."""
    fetcher, model, snap = run.fetcher, run.model, run.snap
    held = await asyncio.gather(*(run.complete(n) for n in nodes))
    results = [
        FetchResult(model, n, True, "present", "disk") for n, ok in zip(nodes, held, strict=True) if ok
    ]
    count = len(snap.files)
    for r in results:
        fetcher.report(
            FetchEvent(model, r.node, "present", "disk", snap.total_bytes, snap.total_bytes, "", count, count)
        )
    needing = [n for n, ok in zip(nodes, held, strict=True) if not ok]
    if not needing:
        return results
    seed = next((n for n, ok in zip(nodes, held, strict=True) if ok), None)
    origin: asyncio.Task[FetchResult] | None = None
    if seed is None:
        seed = needing.pop(0)
        origin = asyncio.create_task(run.from_hub(seed))
        await run.started(seed)  # its job holds the snapshot's lock: peers may ask it now
    copies = [run.from_peer(n, seed, origin) for n in needing]
    results += list(await asyncio.gather(*([origin] if origin else []), *copies))
    await run.stop_server()
    return results


class _Run:
    """One model's snapshot brought onto one group: the jobs, the seed's server."""

    def __init__(  # noqa: PLR0917 (one object per model and group: its parts, in order)
        self,
        fetcher: Fetcher,
        spec: ClusterSpec,
        model: str,
        snap: Snapshot,
        endpoint: str | None,
        token: str | None,
    ) -> None:
        self.fetcher, self.spec, self.model, self.snap = fetcher, spec, model, snap
        self.endpoint, self.token = endpoint, token
        self.server: tuple[str, str, int] | None = None  # (seed, url prefix, pid)
        self._serving = asyncio.Lock()
        self._started: dict[str, asyncio.Event] = defaultdict(asyncio.Event)

    def _weights(self, node: str) -> str:
        return weights_folder(self.spec.node(node))

    async def complete(self, node: str) -> bool:
        """Whether the node holds the snapshot complete (its manifest, every file in place)."""
        try:
            answer = await self.fetcher.call(node, verify_snapshot_job(self.snap, self._weights(node)))
        except NodeError:
            return False
        return parse_snapshot_check(answer).complete

    async def started(self, node: str) -> None:
        await self._started[node].wait()

    async def from_hub(self, node: str) -> FetchResult:
        job = snapshot_job(self.snap, self._weights(node), self.endpoint or DEFAULT_ENDPOINT, self.token)
        return await self._follow(node, job, "origin")

    async def from_peer(self, node: str, seed: str, origin: asyncio.Task[FetchResult] | None) -> FetchResult:
        try:
            prefix = await self._serve(seed)
        except NodeError as exc:
            why = exc.reason
        else:
            r = await self._follow(node, peer_snapshot_job(self.snap, self._weights(node), prefix), seed)
            if r.ok or r.kind not in {"peer", "checksum", "interrupted", "node", "not-found", "http"}:
                return r
            why = r.message
        if origin is not None and not origin.done():
            with contextlib.suppress(Exception):
                await origin  # the seed's own download may still bring it: wait, then look again
        self.fetcher.report(FetchEvent(self.model, node, "fetching", "origin", message=f"peer {seed}: {why}"))
        return await self.from_hub(node)

    async def _serve(self, seed: str) -> str:
        async with self._serving:
            if self.server is None:
                secret = secrets.token_urlsafe(24)
                address = self.spec.node(seed).engine_host  # where peers reach it: its URL names it
                config = serve_snapshot_job(
                    self._weights(seed),
                    self.snap.repo,
                    self.snap.commit,
                    secret,
                    SERVE_IDLE_SECONDS,
                    bind=address,
                )
                out = await self.fetcher.call(seed, config)
                port, pid = out.get("port"), out.get("pid")
                if out.get("state") != "serving" or not isinstance(port, int) or not 0 < port < 65536:
                    raise NodeError(seed, "failed", f"could not serve its snapshot to peers: {out}")
                address = _host(address)
                self.server = (seed, f"http://{address}:{port}/{secret}/", pid if isinstance(pid, int) else 0)
            return self.server[1]

    async def stop_server(self) -> None:
        if self.server is None or self.fetcher.helper:
            return  # the helper kills nothing: the server stops by itself once idle
        seed, _, pid = self.server
        if pid > 0:
            with contextlib.suppress(NodeError):
                await self.fetcher.transport(seed).run(f"kill {pid} 2>/dev/null", root=True)

    async def _follow(self, node: str, job: dict[str, Any], source: str) -> FetchResult:
        """Start (or attach to) the node's job and poll it to its end; start it again if it
        died, up to RESTARTS times."""
        began = time.monotonic()
        total = self.snap.total_bytes
        files = len(self.snap.files)
        self.fetcher.report(FetchEvent(self.model, node, "fetching", source, 0, total, "", 0, files))
        poll = poll_snapshot_job(self._weights(node), self.snap.repo, self.snap.commit)
        try:
            for _ in range(RESTARTS):
                first = await self.fetcher.call(node, job)
                state = first.get("state")
                if state == "present":
                    self._started[node].set()
                    return self._ok(node, "present", source, began)
                if state == "error":
                    return self._failed(node, source, first)
                polls = 0
                while True:
                    polls += 1
                    await asyncio.sleep(min(POLL_SECONDS, 0.05 * polls))
                    answer = await self.fetcher.call(node, poll)
                    free = answer.get("free") is True
                    if not free:
                        self._started[node].set()
                    status = parse_snapshot_status(answer.get("status"))
                    if status.state == "done":
                        self._started[node].set()
                        return self._ok(node, "done", source, began)
                    if status.state == "error" and (free or status.finished):
                        return self._failed(node, source, {"kind": status.kind, "message": status.message})
                    self.fetcher.report(
                        FetchEvent(
                            self.model,
                            node,
                            "fetching",
                            source,
                            min(status.bytes_done, total),  # the node's counts, bounded by
                            total,  # the snapshot's own (from the Hub, not the node)
                            files=min(status.files_done, files),
                            files_total=files,
                        )
                    )
                    if free and polls > 10:
                        break  # nobody holds the lock and it is not finished: the job died
        except NodeError as exc:
            return self._failed(node, source, {"kind": "node", "message": exc.reason})
        finally:
            self._started[node].set()  # peers waiting on a seed that failed go on and find out
        return self._failed(node, source, {"kind": "interrupted", "message": "the job stopped 3 times"})

    def _ok(self, node: str, state: str, source: str, began: float) -> FetchResult:
        size, files = self.snap.total_bytes, len(self.snap.files)
        self.fetcher.report(FetchEvent(self.model, node, state, source, size, size, "", files, files))
        return FetchResult(
            self.model, node, True, state, source, "", "", size, time.monotonic() - began, None
        )

    def _failed(self, node: str, source: str, answer: dict[str, Any]) -> FetchResult:
        kind = str(answer.get("kind") or "failed")
        message = str(answer.get("message") or "failed")
        where = snapshot_folder(self._weights(node), self.snap.repo, self.snap.commit)
        return self.fetcher.fail(self.model, node, source, f"{where}: {message}", kind)

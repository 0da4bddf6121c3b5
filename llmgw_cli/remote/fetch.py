"""Bring model weights onto nodes: from the origin once per group, then peer to peer.

Bytes never pass through the control host. Each node runs the fetcher (``node/``, piped to
``python3 -``), which downloads from the origin or from a peer's temporary file server;
the control host only starts those jobs and polls their status files.

Contract: a ``Fetcher`` runs the spreads of one FetchPlan concurrently. Within a spread,
the origin download comes first; then every node that has the file serves one copy at a
time, and every node that finishes starts serving too, so copies fan out as a tree
(about log2(N) rounds). A job on a node is detached from the SSH session: if the control
host goes away the download goes on, and a later run attaches to it through the node's
lock instead of starting a second one. A job that died (killed, node rebooted) is started
again and resumes from its partial file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shlex
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.core.hosts.node_access import helper_config
from llmgw_cli.core.weights.fetch import FetchPlan, Spread, target_path, token_for
from llmgw_cli.core.weights.fetch_progress import NodeProgress, amounts, least_advanced, progress_text
from llmgw_cli.core.weights.path_sources import MAX_PATHS, Check, by_node, judge, not_there, parse_answer
from llmgw_cli.errors import NodeError
from llmgw_cli.progress import FetchEvent, FetchReport, Phase, Report
from llmgw_cli.remote.connect import Connections
from llmgw_cli.remote.node_code import HELPER_SOURCE, NODEFETCH_SOURCE
from llmgw_cli.remote.nodeops import NodeOps
from llmgw_cli.remote.transport import Transport

POLL_SECONDS = 0.5
SERVE_IDLE_SECONDS = 120
ORIGIN_FAULTS = ("not-found", "auth", "checksum", "size", "tls", "http")
"""Failures that every node would meet again at the origin: do not try the next node."""
PATH_SOURCE = "path source"
"""The ``source`` of a path source's check: checked where it is, brought from nowhere (a
space, so never a peer's node name)."""

SCRIPT = NODEFETCH_SOURCE


@dataclass(frozen=True)
class Served:
    """A seed's peer server: the URL prefix its file is under, the process to stop, and
    the seed's origin record, which every copy from it is checked against."""

    prefix: str
    pid: int
    origin: dict[str, Any] | None


@dataclass(frozen=True)
class FetchResult:
    model: str
    node: str
    ok: bool
    state: str  # present, done, failed
    source: str
    message: str = ""
    kind: str = ""
    bytes: int = 0
    seconds: float = 0.0
    sha256: str | None = None
    origin: dict[str, Any] | None = None  # what the origin sent: {"url", "size", "sha256", ...}


def piped_helper(words: Sequence[str], config: str) -> str:
    """A program for ``python3 -I -`` as root: the node helper's own code (this package's,
    not the node's installed copy) answering ``words`` with ``config`` (``helper_config``)
    in place of its config file. Both travel as JSON string literals, never as code."""
    return (
        "import json, sys\n"
        "namespace = {'__name__': 'llmgw_node_helper'}\n"
        f"exec(compile({HELPER_SOURCE!r}, 'node-helper', 'exec'), namespace)\n"
        f"sys.exit(namespace['piped'](json.loads({json.dumps(list(words))!r}), {config!r}))\n"
    )


def node_script(config: dict[str, Any]) -> str:
    """The node program with its configuration; it travels on stdin (a token too)."""
    return f"{SCRIPT}\nmain(json.loads({json.dumps(config)!r}))\n"


def _count(value: object) -> int:
    """A byte count from a node's answer (hostile data: garbage counts as 0)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class Fetcher:
    """Runs FetchPlans through ``conns`` (the caller's, left open), or through connections
    of its own that ``close`` closes (like an HTTP client given a transport, or not)."""

    def __init__(
        self,
        spec: ClusterSpec,
        base: Path,
        report: FetchReport,
        *,
        token: str | None = None,
        hf_endpoint: str | None = None,
        conns: Connections | None = None,
    ) -> None:
        self.spec, self.base, self.report = spec, base, report
        self._conns = conns if conns is not None else Connections(spec, base)
        self._owned = conns is None
        # The gateway's transports reach the node helper only: jobs go to its `fetch` verb,
        # which runs the fetcher apply installed, for files in the weights folders only.
        self.helper = self._conns.access is not None
        self._token, self._endpoint = token, hf_endpoint

    def transport(self, node: str) -> Transport:
        return self._conns.to(node)

    async def close(self) -> None:
        if self._owned:
            await self._conns.close()

    async def run(self, plan: FetchPlan) -> list[FetchResult]:
        """Every spread and every path check of ``plan``; one result per (model, node)."""
        for s in plan.spreads:
            for node in s.nodes:
                self.report(FetchEvent(s.model, node, "waiting", "origin" if node == s.origin else "peer"))
        groups = await asyncio.gather(*(self._spread(s) for s in plan.spreads), self.check_paths(plan.checks))
        return [r for g in groups for r in g]

    async def check_paths(self, checks: Sequence[Check]) -> list[FetchResult]:
        """Whether each path source of ``checks`` is on its node, a non-empty file or
        folder (one question per node, all nodes at once); one result per check."""
        asked = by_node(checks)
        answers = dict(
            zip(asked, await asyncio.gather(*(self.ask_exists(n, p) for n, p in asked.items())), strict=True)
        )
        results = []
        for model, node, path in checks:
            answer = answers.get(node, {})
            if isinstance(answer, NodeError):
                why = f"cannot check {path}: {answer.reason}"
                results.append(self.fail(model, node, PATH_SOURCE, why, "node"))
            elif why := judge(answer, path, self.spec.profiles[self.spec.model(model).profile].user):
                results.append(self.fail(model, node, PATH_SOURCE, not_there(path, node, why), "missing"))
            else:
                results.append(FetchResult(model, node, True, "present", PATH_SOURCE))
        return results

    async def ask_exists(self, node: str, paths: list[str]) -> dict[str, object] | NodeError:
        """The node's answer to ``exists PATHS`` (parsed, not judged), or why there is none,
        at most MAX_PATHS paths a question. The gateway asks the installed helper; the
        operator pipes the helper's code with the config apply writes for the node
        (``node/helper.py``'s ``piped``)."""
        answer: dict[str, object] = {}
        for start in range(0, len(paths), MAX_PATHS):
            words = ["exists", *paths[start : start + MAX_PATHS]]
            try:
                if self.helper:
                    done = await NodeOps(self.transport(node), root=False).call(*words)
                else:
                    config = helper_config(self.spec, self.spec.node(node), self._endpoint)
                    script = piped_helper(words, config)
                    done = await self.transport(node).run("python3 -I -", root=True, stdin=script)
            except NodeError as exc:
                return exc
            if not done.ok:
                lines = (done.stderr or done.stdout).strip().splitlines()
                return NodeError(node, "failed", lines[-1] if lines else f"exit status {done.exit_status}")
            answer |= parse_answer(done.stdout)
        return answer

    async def _spread(self, s: Spread) -> list[FetchResult]:
        results: list[FetchResult] = []
        waiting = deque(s.copies)
        seeds = list(s.seeds)
        sha = s.sha256
        candidate = s.origin
        while candidate is not None:
            r = await self._job(s, candidate, s.url, sha, "origin")
            results.append(r)
            if r.ok:
                seeds.append(candidate)  # its copies are checked against its origin record
                break
            if r.kind in ORIGIN_FAULTS or not waiting:
                for node in waiting:  # the origin would answer every node the same way
                    results.append(self.fail(s.model, node, "origin", f"not tried: {r.message}", r.kind))
                return results
            candidate = waiting.popleft()  # this node's own problem (disk full...): the next one tries
        servers: dict[str, Served] = {}
        tasks: set[asyncio.Task[None]] = set()

        async def serve_from(seed: str) -> None:
            while waiting:
                node = waiting.popleft()
                r = await self._copy(s, seed, node, sha, servers)
                results.append(r)
                if r.ok:
                    tasks.add(asyncio.create_task(serve_from(node)))

        try:
            for seed in seeds:
                tasks.add(asyncio.create_task(serve_from(seed)))
            while tasks:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                tasks -= done
                for task in done:
                    task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*(self._stop(seed, served.pid) for seed, served in servers.items()))
        return results

    async def _copy(
        self, s: Spread, seed: str, node: str, sha: str | None, servers: dict[str, Served]
    ) -> FetchResult:
        """Copy from ``seed``, checked against what the seed's origin download recorded (and
        the pinned sha256); when the peer cannot serve, fall back to the origin. A copy
        that does not match fails: the seed's file changed, and the origin is not asked to
        make up for a weights folder someone else writes."""
        why = ""
        try:
            if seed not in servers:
                servers[seed] = await self._serve(seed, s.paths[seed])
            served = servers[seed]
            if served.origin is None and not sha:
                raise NodeError(seed, "failed", f"{s.paths[seed]} has no record of what the origin sent")
            url = served.prefix + quote(PurePosixPath(s.paths[node]).name)
            r = await self._job(s, node, url, sha, seed, origin=served.origin)
            if r.ok or r.kind in ("disk-full", "seed-changed"):
                return r
            why = r.message
        except NodeError as exc:
            why = exc.reason
        self.report(FetchEvent(s.model, node, "fetching", "origin", message=f"peer {seed} failed: {why}"))
        return await self._job(s, node, s.url, sha, "origin")

    async def _serve(self, seed: str, path: str) -> Served:
        secret = secrets.token_urlsafe(24)
        bind = self.spec.node(seed).engine_host  # where peers reach it: the URL below names it
        config = {"mode": "serve", "file": path, "secret": secret, "idle": SERVE_IDLE_SECONDS, "bind": bind}
        out = await self.call(seed, config)
        if out.get("state") != "serving":
            raise NodeError(seed, "failed", f"could not serve {path} to peers: {out}")
        port, pid = _count(out.get("port")), _count(out.get("pid"))
        if not 0 < port < 65536 or not pid:
            raise NodeError(seed, "failed", f"the peer server on {seed} gave no usable port and pid")
        origin = out.get("origin")
        return Served(
            f"http://{_host(bind)}:{port}/{secret}/", pid, origin if isinstance(origin, dict) else None
        )

    async def _stop(self, seed: str, pid: int) -> None:
        if self.helper:
            return  # the helper kills nothing: the server stops by itself once idle
        with contextlib.suppress(NodeError):  # else the server stops by itself once idle
            await self.transport(seed).run(f"kill {pid} 2>/dev/null", root=True)

    async def call(self, node: str, config: dict[str, Any]) -> dict[str, Any]:
        """Run the node program with job ``config`` on ``node``; its last line, parsed."""
        if self.helper:
            ops = NodeOps(self.transport(node), root=False)
            result = await ops.call("fetch", stdin=json.dumps(config))
        else:
            result = await self.transport(node).run("python3 -", root=True, stdin=node_script(config))
        lines = result.stdout.strip().splitlines()
        if not result.ok or not lines:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise NodeError(node, "failed", f"python3 on the node failed: {' / '.join(tail)}")
        try:
            data = json.loads(lines[-1])
        except ValueError:
            raise NodeError(node, "failed", "the node program printed something that is not JSON") from None
        return data if isinstance(data, dict) else {}

    def fail(self, model: str, node: str, source: str, message: str, kind: str) -> FetchResult:
        self.report(FetchEvent(model, node, "failed", source, message=message))
        return FetchResult(model, node, False, "failed", source, message, kind)

    async def _job(
        self,
        s: Spread,
        node: str,
        url: str,
        sha: str | None,
        source: str,
        *,
        origin: dict[str, Any] | None = None,
    ) -> FetchResult:
        started = time.monotonic()
        self.report(FetchEvent(s.model, node, "fetching", source))
        config: dict[str, Any] = {
            "mode": "fetch",
            "url": url,
            "target": s.paths[node],
            "sha256": sha,
            "token": token_for(url, self._token, self._endpoint),
        }
        if source != "origin":  # a peer's copy: checked against the seed's origin record
            config |= {"seed": source, "origin": origin}
        try:
            final = await self._follow(node, config, s.model, source)
        except NodeError as exc:
            return self.fail(s.model, node, source, exc.reason, "node")
        seconds = time.monotonic() - started
        state = final.get("state")
        if state in ("present", "done"):
            size = _count(final.get("bytes"))
            self.report(FetchEvent(s.model, node, str(state), source, size, size))
            origin = final.get("origin")
            return FetchResult(
                s.model,
                node,
                True,
                str(state),
                source,
                "",
                "",
                size,
                seconds,
                final.get("sha256"),
                origin if isinstance(origin, dict) else None,
            )
        kind = str(final.get("kind") or "failed")
        message = str(final.get("message") or "failed")
        if kind == "auth":
            message += ": the repository is gated or private, or the token is wrong; set HF_TOKEN to a token with access"
        return self.fail(s.model, node, source, f"{url if source == 'origin' else source}: {message}", kind)

    async def _follow(self, node: str, config: dict[str, Any], model: str, source: str) -> dict[str, Any]:
        """Start (or attach to) the job and poll it to its end; restart it if it dies."""
        # The node program reads the lock and the status without following links: `flock`
        # or `cat` on those paths, as root, would open whatever a planted link names.
        poll = {"mode": "poll", "target": config["target"]}
        for _ in range(3):
            first = await self.call(node, config)
            if first.get("state") in ("present", "error"):
                return first
            unreadable, polls = 0, 0
            while True:
                polls += 1
                await asyncio.sleep(min(POLL_SECONDS, 0.05 * polls))  # small files end fast
                answer = await self.call(node, poll)
                free = answer.get("free") is True
                status = answer.get("status")
                status = status if isinstance(status, dict) else {}
                unreadable = 0 if status else unreadable + 1
                if not status and not (free and unreadable > 10):
                    continue  # torn or not yet written: read it again
                if status.get("state") in ("done", "present", "error"):  # present: verified, kept
                    return dict(status)
                total = _count(status.get("total")) or None
                self.report(FetchEvent(model, node, "fetching", source, _count(status.get("bytes")), total))
                if free:
                    break  # nobody holds the lock and it is not finished: the job died
        return {
            "state": "error",
            "kind": "interrupted",
            "message": "the download on the node stopped 3 times",
        }


async def verified(fetcher: Fetcher, spec: ClusterSpec, held: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The ``held`` pairs that may be trusted, as the node program sees them: a regular
    file (not a link, nothing planted beside it) that the node remembers having checked
    (by inode, size, mtime and ctime) against its model's pinned sha256, else against the
    size and sha256 its origin record says the origin sent. Any other gets a fetch job:
    the node hashes a never-checked file there (detached: that can take longer than one
    command may run) and keeps it when it matches; a wrong file, or one without a pin or
    a record, is replaced only by a complete download; a planted one fails with the
    node's reason."""

    async def one(model: str, node: str) -> bool:
        sha, url = spec.model(model).sha256, spec.model(model).source
        target = target_path(spec.model(model), spec.node(node))
        try:
            job = {"mode": "verify", "target": target, "sha256": sha, "url": url, "quick": True}
            out = await fetcher.call(node, job)
        except NodeError:
            return False
        return out.get("state") in ("verified", "present")

    pairs = sorted(held)
    oks = await asyncio.gather(*(one(m, n) for m, n in pairs))
    return {pair for pair, ok in zip(pairs, oks, strict=True) if ok}


async def held_on_nodes(
    fetcher: Fetcher, spec: ClusterSpec, wanted: dict[str, list[str]]
) -> set[tuple[str, str]]:
    """``(model, node)`` pairs whose target file exists on a node (one command per node).
    Every node is asked, not only the wanted ones: any holder can seed its peers."""
    by_node: dict[str, list[tuple[str, str]]] = {}
    for model in wanted:
        for node in [n.name for n in spec.nodes]:
            by_node.setdefault(node, []).append((model, target_path(spec.model(model), spec.node(node))))

    async def one(node: str, pairs: list[tuple[str, str]]) -> set[tuple[str, str]]:
        cmd = "; ".join(f"test -s {shlex.quote(p)} && echo {shlex.quote(p)}" for _, p in pairs) + "; true"
        try:
            if fetcher.helper:
                out = await NodeOps(fetcher.transport(node), root=False).call("held", *(p for _, p in pairs))
            else:
                out = await fetcher.transport(node).run(cmd, root=True)
        except NodeError:
            return set()
        found = set(out.stdout.splitlines())
        return {(m, node) for m, p in pairs if p in found}

    sets = await asyncio.gather(*(one(n, p) for n, p in by_node.items()))
    return await verified(fetcher, spec, set().union(*sets))


_PHASES = {"present": Phase.done, "done": Phase.done, "failed": Phase.failed}  # by FetchEvent.state
_UNDER_WAY = ("waiting", "fetching")


def _where(source: str) -> str:
    return {"origin": "origin", "disk": "disk", "peer": "a peer"}.get(source, f"peer {source}")


def _progress_lines(report: Report, *, by_model: bool = False) -> FetchReport:
    """Fetch events as the executor's (subject, message) lines: ``model@node: fetching
    142/191 files, 512 of 810 GB from origin`` (``core/weights/fetch_progress.py`` says how).

    By node (``apply``, a row per node): a line for each state a node enters, and one per
    10% of its bytes. By model (the gateway, whose model has one progress text): the line
    of the least advanced node of the model whose fetch is under way, ``(the least
    advanced of 3 nodes)`` when several are, one per 1% of it; a node that ends (done,
    failed) says so in a line of its own, then the least advanced of those left is said
    again: while any fetch is under way, the last line is about one."""
    steps = 100 if by_model else 10
    last: dict[str, tuple[object, ...]] = {}
    under_way: dict[str, dict[str, tuple[NodeProgress, str]]] = {}  # model -> node -> (progress, tail)

    def say(
        model: str, node: str, key: tuple[object, ...], message: str, phase: Phase, *, again: bool
    ) -> None:
        subject = model if by_model and phase is Phase.working else f"{model}@{node}"
        if last.get(subject) == key and not again:
            return
        last[subject] = key
        report(f"{model}@{node}", message, phase)

    def slowest(model: str, *, again: bool = False) -> None:
        nodes = under_way.get(model, {})
        node = least_advanced({n: p for n, (p, _) in nodes.items()})
        if node is None:
            return
        p, tail = nodes[node]
        among = f" (the least advanced of {len(nodes)} nodes)" if len(nodes) > 1 else ""
        key = (node, p.state, int(p.fraction * steps), len(nodes), tail)
        say(model, node, key, progress_text(p) + tail + among, Phase.working, again=again)

    def on_event(e: FetchEvent) -> None:
        remark = f": {e.message}" if e.message else ""
        if e.state in _UNDER_WAY:
            p = NodeProgress(e.state, e.bytes, e.total, e.files, e.files_total)
            tail = f" from {_where(e.source)}{remark}"
            under_way.setdefault(e.model, {})[e.node] = (p, tail)
            if by_model:
                slowest(e.model)
            else:
                key = (p.state, int(p.fraction * steps), remark)
                say(e.model, e.node, key, progress_text(p) + tail, Phase.working, again=False)
            return
        nodes = under_way.get(e.model, {})
        nodes.pop(e.node, None)
        size = f", {amounts(e.bytes, None)}" if e.bytes else ""
        where = "" if e.source == PATH_SOURCE else f" from {_where(e.source)}"  # said in the remark
        message = f"weights {e.state}{where}{size}{remark}"
        say(e.model, e.node, (e.state,), message, _PHASES.get(e.state, Phase.working), again=False)
        if by_model and nodes:
            slowest(e.model, again=True)

    return on_event

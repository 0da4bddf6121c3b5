"""The gateway's live state and its background work: keys, replicas, health, usage flushes.

What it routes, it tells: with a routes directory (``core/planning/drain.py``: ``routes/`` in the
state folder), the process writes ``<pid>.json`` there (ready addresses by model, and the
addresses it knows are being drained) whenever that changes and at least once per
discovery round, and removes it when it stops. ``apply`` reads those files to know when
every gateway routes a new replica and none routes one it drains; it sends SIGUSR1
(``probe_now``) to have the nodes probed within ``DISCOVER_SOON``. The upstream
connections follow the pool: an address that leaves it keeps no connection
(``Upstreams.retain``).

Every gateway process is a member of the cluster's store (``coordination.py``): one leads
(probes the nodes, runs the controllers, publishes the replica set), the others follow
(route to the published replicas); ``Coordinator`` decides, and switches ``source``
between the process's own (``probe_source``) and the publication.

Contract (concurrency): everything here runs on one asyncio loop. Request handlers read
``keys``, ``catalog`` and the pool and bump counters without awaiting in between, so they
need no lock. Background tasks replace ``keys`` and ``catalog`` (with its ``aliases`` and
``fallbacks``) wholesale (one assignment),
never mutate them in place. The store's calls are coroutines (SQLite's run in a worker
thread), made from background jobs only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp

from llmgw_cli.core.clusterfile.spec import ClusterSpec, GatewaySettings, Model
from llmgw_cli.core.observe.parse.engine_env import engine_key
from llmgw_cli.core.planning.drain import Routes, routes_text
from llmgw_cli.core.serving import aliases
from llmgw_cli.core.serving.adapters import adapter_table
from llmgw_cli.core.serving.affinity import Policy, Thresholds
from llmgw_cli.core.serving.key_labels import labelled_keys
from llmgw_cli.core.serving.keys import ApiKey, hash_token
from llmgw_cli.core.serving.redact import redact
from llmgw_cli.core.serving.routing import Health, Pool, route_settings
from llmgw_cli.errors import InputError
from llmgw_cli.gateway.control.controller import Controller
from llmgw_cli.gateway.control.coordination import Coordinator, FencedHold, FencedNodes
from llmgw_cli.gateway.control.replicas import Nodes, RemoteNodes
from llmgw_cli.gateway.control.sources import ProbeSource, PublishedSource, ReplicaSource
from llmgw_cli.gateway.control.workers import alive
from llmgw_cli.gateway.serving.accesslog import AccessLog
from llmgw_cli.gateway.serving.admission import Admission
from llmgw_cli.gateway.serving.limit_state import LimitState
from llmgw_cli.gateway.serving.metrics import Metrics
from llmgw_cli.gateway.serving.signals_poll import next_wait, scrape_signals
from llmgw_cli.gateway.serving.upstream import Upstreams
from llmgw_cli.gateway.store.sqlite import Store
from llmgw_cli.gateway.store.usage import Meter
from llmgw_cli.polling import wait_event
from llmgw_cli.remote.cluster_lock import Hold, LocalLock

log = logging.getLogger("llmgw.gateway")

DISCOVER_SOON = 1.0  # seconds at most from SIGUSR1, or a ready replica failing, to a probe round
# seconds between two looks at the store that an unknown API key causes (``authenticate_fresh``)
MISS_LOOK_EVERY = 1.0
KEY_LABELS_EVERY = 600.0  # seconds between two reads of the keys' usage for the metrics' labels
KEY_USAGE_DAYS = 7


def read_engine_key(path: Path) -> str:
    """The engine key from an env file (``LLMGW_ENGINE_KEY=...``, as apply writes it)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"engine key file {path}: {exc.strerror} (give it with --engine-key-file)") from None
    key = engine_key(text)
    if key is None:
        raise InputError(f"engine key file {path}: no LLMGW_ENGINE_KEY=... line with a key")
    return key


def read_engine_keys(path: Path) -> dict[str, tuple[str, ...]]:
    """The engine keys by node from the map ``apply`` writes on the gateway host
    (JSON ``{"node": ["current key", "key before a rotation"]}``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(f"engine key map {path}: {exc.strerror} (give it with --engine-keys-file)") from None
    except ValueError as exc:
        raise InputError(
            f"engine key map {path}: not JSON ({exc}); run `llmgw apply` to rewrite it"
        ) from None
    if not isinstance(data, dict) or not all(
        isinstance(keys, list) and all(isinstance(k, str) for k in keys) for keys in data.values()
    ):
        raise InputError(f'engine key map {path}: expected {{"node": ["key", ...]}}; run `llmgw apply`')
    return {str(node): tuple(keys) for node, keys in data.items()}


def job_intervals(
    settings: GatewaySettings,
    *,
    discover_every: float | None = None,
    health_every: float | None = None,
    flush_every: float | None = None,
) -> dict[str, float]:
    """Seconds between two rounds of the gateway's periodic jobs: each one given here (a
    command-line flag), else the cluster file's ``gateway.discover_every``,
    ``health_every`` and ``flush_every``."""
    given = {"discover": discover_every, "health": health_every, "flush": flush_every}
    from_file = {
        "discover": settings.discover_every,
        "health": settings.health_every,
        "flush": settings.flush_every,
    }
    return {job: seconds if (seconds := given[job]) is not None else from_file[job] for job in from_file}


def routing_of(spec: ClusterSpec) -> dict[str, tuple[Policy, Thresholds]]:
    """Each model's routing policy and overload thresholds (``route_settings``)."""
    return {m.name: route_settings(m) for m in spec.models}


class Gateway:
    def __init__(  # noqa: PLR0915 (the gateway's state, each part set once: no logic)
        self,
        spec: ClusterSpec,
        source: ReplicaSource,
        store: Store,
        engine_key: str,
        *,
        engine_keys: Callable[[], dict[str, tuple[str, ...]]] | None = None,
        reload_spec: Callable[[], ClusterSpec] | None = None,
        discover_every: float | None = None,
        health_every: float | None = None,
        flush_every: float | None = None,
        keys_every: float = 5.0,
        access_log: AccessLog | None = None,
        manage_replicas: bool = False,
        lock: Hold | None = None,
        routes: Path | None = None,
        nodes: Nodes | None = None,
        can_lead: bool | None = None,
        member: str | None = None,
    ) -> None:
        """``source``: a ``ProbeSource`` makes a process that may lead (``can_lead``
        overrides that: tests give fake ``nodes``); a ``PublishedSource`` one that always
        follows; any other (a fixed list) one that neither leads nor follows.
        ``discover_every``, ``health_every``, ``flush_every``: seconds that replace the
        cluster file's (``job_intervals``); those left None follow the file, reloads too."""
        self.spec = spec
        self.catalog: dict[str, Model] = {m.name: m for m in spec.models}
        # each model's routing policy and thresholds, made once, not on every request
        self.routing: dict[str, tuple[Policy, Thresholds]] = routing_of(spec)
        # alias -> model, and each model's fallbacks in order (``core/serving/aliases.py``)
        self.aliases, self.fallbacks = aliases.tables(spec.models)
        # adapter name -> its model (LoRA); (replica address, adapter) -> the load under
        # way there, which the requests that wait for it share
        self.adapters, self.adapter_loads = (
            adapter_table(spec.models),
            dict[tuple[str, str], asyncio.Future[str]](),
        )
        self.source = source  # where discovery reads now: probe_source, or the publication
        self.probe_source = source  # this process's own source
        self.store = store
        self.engine_key = engine_key  # one key for every engine: the fallback without a map
        self.read_engine_keys = engine_keys  # the per-node map, read again on every reload
        self.engine_keys: dict[str, tuple[str, ...]] = engine_keys() if engine_keys else {}
        self.reload_spec = reload_spec
        self._given_intervals = {
            "discover_every": discover_every,
            "health_every": health_every,
            "flush_every": flush_every,
        }
        self.every = {
            **job_intervals(spec.gateway, **self._given_intervals),
            "keys": keys_every,
            "reconcile": 1.0,
            "signals": spec.gateway.signals_interval,
            "labels": KEY_LABELS_EVERY,
            "limits": 60.0,
        }
        self.pool = Pool()
        self.meter = Meter()
        self.metrics = Metrics()
        self.admission = Admission(spec.gateway.model_concurrency)
        self.keys: dict[str, ApiKey] = {}
        self.upstreams = Upstreams(spec.gateway.timeouts.connect, {})
        self.health_session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._discover_soon = asyncio.Event()  # set: probe the nodes now, not at the next round
        self._last_round = float("-inf")  # monotonic time the last probe round began
        # The routes file of this process (None: none is written) and what it says now.
        self.routes_file = routes / f"{os.getpid()}.json" if routes is not None else None
        self._routed: tuple[dict[str, frozenset[str]], frozenset[str]] | None = None
        self._signals = False  # whether start installed the SIGUSR1 handler
        self._routes_error: str | None = None  # why the last write of the routes file failed
        self._saved_use: dict[str, float] = {}  # the last use rows this process saved last
        # Who leads: one process of the cluster, the one whose coordinator holds the lead.
        self.follows = isinstance(source, PublishedSource)
        if can_lead is None:
            can_lead = isinstance(source, ProbeSource)
        can_lead = can_lead and not self.follows
        self.coordinator = Coordinator(store, member, can_lead=can_lead)
        if nodes is None and isinstance(source, ProbeSource):
            nodes = RemoteNodes(source)
        if can_lead and nodes is not None:  # every node action and lock hold: fence-checked
            nodes = FencedNodes(nodes, self.coordinator.check)
            lock = FencedHold(lock if lock is not None else LocalLock(), self.coordinator.check)
        # The one owner of the models' replicas. It starts and stops them only while this
        # process leads and manages replicas (a probed cluster with manage_replicas); else
        # it observes.
        self.manage_replicas = manage_replicas
        self._miss_look: asyncio.Future[None] | None = None  # authenticate_fresh's last look
        self._key_usage: list[tuple[str, int]] = []  # (key, tokens) rows: read_key_usage
        # per-key limits: this process's allowances (gateway/serving/limiting.py)
        self.limits = LimitState()
        self._spawned: set[asyncio.Task[None]] = set()
        self._miss_look_at = 0.0
        self.controller = Controller(
            lambda: self.spec,
            self.pool,
            self.admission,
            self.metrics,
            self.health_status,
            nodes=nodes if can_lead else None,
            store=store,
            manages=False,  # until the coordinator leads
            lock=lock,
        )
        self.controller.changed = self._routing_changed
        self.controller.secrets = self.known_secrets
        self.access_log = access_log
        if access_log is not None:  # lines it had to drop (serving went faster than its writes)
            access_log.on_drop = self.metrics.log_dropped
        self._upstream_settings()

    def known_secrets(self) -> tuple[str, ...]:
        """The secrets this process holds by value: the engine keys."""
        return (self.engine_key, *(k for keys in self.engine_keys.values() for k in keys))

    def redact(self, text: str) -> str:
        """``text`` without any secret (``core/serving/redact.py``), these keys included."""
        return redact(text, self.known_secrets())

    def _upstream_settings(self) -> None:
        """What every upstream request shares, built once per configuration, not per request."""
        timeouts = self.spec.gateway.timeouts
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        self.upstreams.configure(timeouts.connect, headers)
        # Keys are per node: each engine host gets its own node's key(s).
        by_host = {
            node.engine_host: self.engine_keys[node.name]
            for node in self.spec.nodes
            if node.name in self.engine_keys
        }
        self.upstreams.configure_keys(by_host, (self.engine_key,) if self.engine_key else ())
        # The read timeout bounds every wait for the engine. A non-streamed answer arrives
        # whole, so first_byte; engines open a stream at once (the role chunk), so idle
        # bounds every gap of it.
        self.plain_timeout = timeouts.first_byte
        self.stream_timeout = timeouts.idle

    # --- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        # Before the routes file first names this process: apply signals the processes it
        # names, and SIGUSR1's default action ends a process.
        self._signals = _on_signal(signal.SIGUSR1, self.probe_now)
        self._clear_stale_routes()
        self.health_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), cookie_jar=aiohttp.DummyCookieJar()
        )
        await self.coordinator.start(self, follows=self.follows)  # leads, follows, or neither
        await self.load_keys()
        await self.read_key_usage()
        if self.controller.manages:  # when each replica last served, from before a restart
            self.controller.saved = await self.store.last_use()
        await self.discover()
        await self.check_health()
        self.controller.observe()
        if self.access_log is not None:  # its writer thread, until ``stop`` writes the rest
            self.access_log.start()
        jobs: list[tuple[str, Callable[[], object]]] = [
            ("discover", self.discover),
            ("health", self.check_health),
            ("flush", self.flush),
            # the API keys: the coordinator reloads them when their version changed
            ("keys", self.load_engine_keys),
            # each process reads the engines' /metrics for its own pool's routing
            ("signals", self.poll_signals),
            # which keys the metrics name, when there are more than gateway.metrics_keys
            ("labels", self.read_key_usage),
            # the limit allowances of windows that ended (keys idle since)
            ("limits", lambda: self.limits.limiter.prune(time.time())),
        ]
        jobs.append(("reconcile", self.controller.tick))
        for name, job in jobs:
            self._tasks.append(asyncio.create_task(self._every(name, job), name=f"gateway-{name}"))
        self.coordinator.run()

    async def quiesce(self) -> None:
        """The first step of a stop: no new decision about replicas, and the starts and
        stops under way cancelled (another gateway process may be running already: an
        upgrade's). Requests are still served; discovery and health checks go on."""
        reconcile = [t for t in self._tasks if t.get_name() == "gateway-reconcile"]
        for task in reconcile:
            task.cancel()
        await asyncio.gather(*reconcile, return_exceptions=True)
        await self.coordinator.resign()  # another process may lead at once
        await self.controller.stop()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background (a store write after an answer has gone); kept
        until it ends, and waited for at ``stop``."""
        task = asyncio.create_task(work)
        self._spawned.add(task)
        task.add_done_callback(self._spawned.discard)

    async def stop(self) -> None:
        if self._miss_look is not None:
            self._miss_look.cancel()
        if self._spawned:
            await asyncio.wait(self._spawned, timeout=5)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self._forget_routes()
        if self._signals:
            asyncio.get_running_loop().remove_signal_handler(signal.SIGUSR1)
            self._signals = False
        await self.coordinator.stop()
        await self.controller.stop()
        try:
            await self.flush()
        except Exception:
            log.exception("could not write the last usage totals")
        if self.access_log is not None:
            self.access_log.close()  # every line still queued
        self.upstreams.close()
        if self.health_session is not None:
            await self.health_session.close()
        await self.probe_source.close()  # the connections discovery held to the nodes
        await self.store.close()

    async def _every(self, name: str, job: Callable[[], object]) -> None:
        while True:
            if name == "discover":
                await self._until_discovery_due()
            elif name == "signals":
                await asyncio.sleep(next_wait(self.every[name]))
            else:
                await asyncio.sleep(self.every[name])
            try:
                result = job()
                if asyncio.iscoroutine(result):
                    await result
            except Exception:  # a background job never dies: log it, try again next round
                log.exception("gateway %s failed", name)

    async def _until_discovery_due(self) -> None:
        """The next probe round is due after ``discover_every``, or as soon as a ready
        replica failed its health check (a lost node is then noticed within one probe,
        not one interval later) or ``probe_now`` was called, but never sooner than
        ``DISCOVER_SOON`` after the last one began."""
        if await wait_event(self._discover_soon, self.every["discover"]):
            await asyncio.sleep(max(0.0, self._last_round + DISCOVER_SOON - time.monotonic()))
        self._discover_soon.clear()
        self._last_round = time.monotonic()

    def probe_now(self) -> None:
        """SIGUSR1 (``apply``, after it started a replica or marked one draining): probe the
        nodes within ``DISCOVER_SOON``, not at the next round."""
        self._discover_soon.set()

    async def reload(self) -> None:
        """SIGHUP: read the cluster file again; listeners and open connections are kept."""
        if self.reload_spec is None:
            return
        try:
            spec = await asyncio.to_thread(self.reload_spec)
        except Exception as exc:
            log.error("reload refused, keeping the running configuration: %s", exc)
            return
        if (spec.gateway.listen, spec.gateway.admin_listen, spec.gateway.metrics_listen) != (
            self.spec.gateway.listen,
            self.spec.gateway.admin_listen,
            self.spec.gateway.metrics_listen,
        ):
            log.warning("listener addresses changed in the cluster file: they apply at the next restart")
        self.spec = spec
        self.catalog = {m.name: m for m in spec.models}
        self.routing = routing_of(spec)
        self.aliases, self.fallbacks = aliases.tables(spec.models)
        self.adapters = adapter_table(spec.models)
        self.every.update(job_intervals(spec.gateway, **self._given_intervals))  # the next round on
        self.every["signals"] = spec.gateway.signals_interval
        self._upstream_settings()
        await self.load_keys()
        await self.discover()
        await self.check_health()
        log.info("reloaded the cluster file: %d models", len(self.catalog))

    # --- background jobs ----------------------------------------------------------

    async def load_keys(self) -> None:
        keys = await self.store.api_keys()
        self.keys = {k.digest: k for k in keys}
        self._label_keys()
        await self.load_engine_keys()

    def _label_keys(self) -> None:
        """The keys the metrics name, from the keys and the last usage read."""
        names = [k.name for k in self.keys.values()]
        self.metrics.label_keys(labelled_keys(names, self._key_usage, self.spec.gateway.metrics_keys))

    async def read_key_usage(self) -> None:
        """Each key's tokens over the last ``KEY_USAGE_DAYS`` days, read again every
        ``every["labels"]`` when there are more keys than ``gateway.metrics_keys``."""
        if len(self.keys) <= self.spec.gateway.metrics_keys:
            self._key_usage = []
        else:
            since = (datetime.now(UTC) - timedelta(days=KEY_USAGE_DAYS)).date().isoformat()
            rows = await self.store.usage(since)
            self._key_usage = [(u.key, u.prompt_tokens + u.completion_tokens) for u in rows]
        self._label_keys()

    async def load_engine_keys(self) -> None:
        """The engine key map again, when apply rewrote it (a new node, a rotation): on
        the keys timer, so a rotation needs no signal to reach the gateway."""
        if self.read_engine_keys is None:
            return
        try:
            keys = await asyncio.to_thread(self.read_engine_keys)
        except Exception as exc:
            log.error("engine key map not reloaded, keeping the keys in use: %s", exc)
            return
        if keys != self.engine_keys:
            self.engine_keys = keys
            self._upstream_settings()
            log.info("engine keys reloaded: %d node(s)", len(keys))

    async def discover(self) -> None:
        # A replica being started may not be active yet: the controller adds it.
        source = self.source
        found = self.controller.with_starts(await source.discover(self.spec))
        if source is self.coordinator.follower_source:
            self.coordinator.followed()  # the leader's model states, with its replica set
        self.pool.replace({m: a for m, a in found.items() if m in self.catalog}, time.monotonic())
        self.controller.observe()
        self.write_routes()  # once per round at least, so its age tells this process is alive

    # --- what it routes -----------------------------------------------------------

    def _routing_changed(self) -> None:
        """After every look at the pool (``Controller.observe``): the upstream connections
        follow it, and the routes file is written when what it says changed."""
        self.upstreams.retain(r.address for r in self.pool.all())
        self.coordinator.changed()  # the leader publishes what changed
        if self.routes_file is not None and self._routing() != self._routed:
            self.write_routes()

    def _routing(self) -> tuple[dict[str, frozenset[str]], frozenset[str]]:
        ready: dict[str, set[str]] = {}
        for r in self.pool.all():
            if r.health is Health.ready:
                ready.setdefault(r.model, set()).add(r.address)
        return {m: frozenset(a) for m, a in ready.items()}, self.controller.draining()

    def write_routes(self) -> None:
        """The routes file, replaced atomically (a temporary file in the same folder,
        renamed over it); a failure is logged, never raised (routing goes on)."""
        if self.routes_file is None:
            return
        ready, draining = routing = self._routing()
        text = routes_text(Routes(os.getpid(), time.time(), ready, draining))
        folder = self.routes_file.parent
        try:
            if not folder.is_dir():
                folder.mkdir(mode=0o755, parents=True, exist_ok=True)
                folder.chmod(0o755)  # whatever the umask: apply reads it as root, others may look
            fd, temporary = tempfile.mkstemp(prefix=f".{self.routes_file.name}.", dir=folder)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    os.fchmod(out.fileno(), 0o644)
                    out.write(text)
                os.replace(temporary, self.routes_file)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        except OSError as exc:
            if str(exc) != self._routes_error:  # once, not at every look
                log.error("cannot write the routes file %s: %s", self.routes_file, exc)
                self._routes_error = str(exc)
            return
        if self._routes_error is not None:
            log.info("routes file written again: %s", self.routes_file)
            self._routes_error = None
        self._routed = routing

    def _clear_stale_routes(self) -> None:
        """Remove the routes files of gateway processes that are gone (an unclean stop
        leaves one; its pid may name another process one day)."""
        if self.routes_file is None or not self.routes_file.parent.is_dir():
            return
        for path in self.routes_file.parent.glob("*.json"):
            if path.stem.isdigit() and not alive(int(path.stem)):
                with contextlib.suppress(OSError):
                    path.unlink()
                    log.info("removed the routes file of a gateway process that is gone: %s", path)

    def _forget_routes(self) -> None:
        """A clean stop: this process routes nothing more."""
        if self.routes_file is None:
            return
        self._routed = None
        try:
            self.routes_file.unlink(missing_ok=True)
        except OSError as exc:
            log.error("cannot remove the routes file %s: %s", self.routes_file, exc)
        self.routes_file = None  # no write after this one

    async def check_health(self) -> None:
        replicas = self.pool.all()
        statuses = await asyncio.gather(*(self.health_status(r.address, r.model) for r in replicas))
        now = time.monotonic()
        for replica, status in zip(replicas, statuses, strict=True):
            before = replica.health
            self.pool.checked(replica, status, now)
            if before is Health.ready and replica.health is not Health.ready:
                self._discover_soon.set()  # is its node still there? ask now
            if replica.health is not before:
                log.info(
                    "replica %s of %s: %s -> %s",
                    replica.address,
                    replica.model,
                    before.value,
                    replica.health.value,
                )
        self.controller.observe()  # admission follows the ready count; waiters are woken

    def signals_stale_after(self) -> float:
        """Signals older than this no longer count for routing: three missed rounds (the
        longest jittered wait, plus the scrape's timeout, each)."""
        settings = self.spec.gateway
        return 3 * (settings.signals_interval * 1.2 + settings.signals_timeout)

    async def poll_signals(self) -> None:
        """Scrape every ready replica's /metrics at once, each bounded by
        ``signals_timeout``; a failed scrape leaves the replica's last signals to age."""
        session = self.health_session
        if session is None:
            return
        timeout = self.spec.gateway.signals_timeout
        replicas = [r for r in self.pool.all() if r.health is Health.ready and r.model in self.catalog]
        found = await asyncio.gather(
            *(
                scrape_signals(
                    session,
                    r.address,
                    self.spec.profiles[self.catalog[r.model].profile].engine.value,
                    self.upstreams.keys_for(r.address),
                    timeout,
                )
                for r in replicas
            )
        )
        now = time.monotonic()
        for replica, signals in zip(replicas, found, strict=True):
            if signals is not None:
                self.pool.scraped(replica, signals, now)

    async def health_status(self, address: str, model: str) -> int | None:
        """The HTTP status of the replica's readiness path, or None when unreachable."""
        assert self.health_session is not None
        path = (
            self.spec.profiles[self.catalog[model].profile].readiness.path
            if model in self.catalog
            else "/health"
        )
        timeout = aiohttp.ClientTimeout(total=max(2.0, self.spec.gateway.timeouts.connect))
        try:
            async with self.health_session.get(f"http://{address}{path}", timeout=timeout) as resp:
                return resp.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    def flush_log(self) -> None:
        """Write the access lines queued so far (the writer thread does every 0.2 s)."""
        if self.access_log is not None:
            self.access_log.flush()

    async def flush(self) -> None:
        await self.share_last_use()
        # A batch whose write failed goes first, unchanged (the store applies an id once),
        # then what was counted since: two writes at most, so a busy gateway never loops.
        for _ in range(2):
            batch = self.meter.batch()
            if batch is None:
                return
            await self.store.add_usage(*batch)
            self.meter.sent(batch[0])

    async def share_last_use(self) -> None:
        """Every process saves when each replica last served a request through it (the
        times that changed since its last save); the leader reads them all back, so a
        replica busy through another process is not idle to its controller."""
        rows = self.controller.last_use_rows()
        fresh = {key: at for key, at in rows.items() if self._saved_use.get(key) != at}
        if fresh:
            await self.store.save_last_use(fresh)
        self._saved_use = rows
        if self.controller.manages:
            self.controller.saved = await self.store.last_use()

    # --- per request --------------------------------------------------------------

    def authenticate(self, token: str | None) -> ApiKey | None:
        """The valid key whose digest is the token's (``hash_token``), or None."""
        if token is None:
            return None
        key = self.keys.get(hash_token(token))
        if key is None:
            return None
        if key.expires is None:  # no clock read (microseconds a request) for a key without one
            return None if key.revoked else key
        return key if key.valid(datetime.now(UTC)) else None

    async def authenticate_fresh(self, token: str | None) -> ApiKey | None:
        """``authenticate`` again after a look at the store, for a token this process does
        not know: a key made a moment ago reaches every process's watch within
        ``WATCH_EVERY``, and a client that uses it at once must not be refused by the one
        process that has not looked yet. The look reads the keys' version (and the keys
        when it changed); unknown tokens cause one at most every ``MISS_LOOK_EVERY`` per
        process, so a flood of bad keys costs the store one cheap read a second. Requests
        that miss meanwhile wait for the look under way, or are refused at once."""
        if token is None:
            return None
        now = time.monotonic()
        look = self._miss_look
        if look is None or (look.done() and now - self._miss_look_at >= MISS_LOOK_EVERY):
            self._miss_look_at = now
            look = self._miss_look = asyncio.ensure_future(self._look_for_keys())
        if not look.done():
            await asyncio.shield(look)  # a client that leaves does not cancel it
        return self.authenticate(token)

    async def _look_for_keys(self) -> None:
        try:
            await self.coordinator.look_keys()
        except Exception as exc:  # the store unreachable: the keys in memory decide
            log.warning("gateway store: cannot look for new keys: %s", exc)


def _on_signal(signum: int, handler: Callable[[], None]) -> bool:
    """Install ``handler`` for ``signum`` on the running loop; False where signals cannot
    be handled (not the main thread)."""
    try:
        asyncio.get_running_loop().add_signal_handler(signum, handler)
    except (RuntimeError, ValueError):
        return False
    return True

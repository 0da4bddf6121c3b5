"""The three listeners and the process's signals.

- public ``listen``: the OpenAI API and ``/health``;
- ``admin_listen``: the ``/admin`` dashboard, ``/admin/api/*`` and ``/metrics``; every
  request needs an admin key (Bearer, or the password of HTTP Basic for a browser);
- ``metrics_listen``: only ``/metrics`` and ``/health``, so monitoring never reaches admin.

The public listener runs on the gateway's own HTTP/1.1 server (``http1.py``, the routes of
``public_routes``), or with ``gateway.http_server: aiohttp`` on aiohttp's (``public_app``);
the admin and metrics listeners on aiohttp's. ``exchange.py`` names what the public paths
need of either server's requests and answers.

Clients are bounded in time (``gateway.client_timeouts``): a connection that has not sent
a whole request head ``header`` seconds after it opened or after its previous answer is
closed (aiohttp's keep-alive timer, ``http1``'s head deadline: not restarted by bytes that
trickle in, so it bounds a slow head and an idle connection alike); a body must arrive within ``body``; a
client whose socket stays full for ``write`` (it stopped reading) is dropped by
``WriteWatch``, which cancels its handler: the model slot is freed and the engine's
connection closed. ``gateway.tls`` puts TLS on the public listener.

Started by systemd, the gateway takes its listeners from ``llmgw-gateway.socket``
(``gateway/control/systemd.py``) instead of binding them, and reports ``READY=1`` once it serves:
two gateway processes can then accept from the same sockets, which is how an upgrade hands
over without refusing a connection. Started by hand, it binds its listeners itself.
One of several workers (``gateway/control/workers.py``), it binds the public listener with
``SO_REUSEPORT`` (the others bind it too) and serves the admin and metrics listeners only
when it is worker 0; its ``READY=1`` goes to the supervisor, which tells systemd once
every worker serves.

SIGHUP reloads the cluster file (listeners and connections stay); SIGTERM/SIGINT stop the
replica controller first (a gateway that is leaving starts and stops no replica), then
stop accepting, let requests and streams in flight finish for up to ``drain_timeout`` while
answering what still arrives on open connections (each answer closing its connection;
an idle one is closed after ``IDLE_CLOSE``), write the pending usage, and return.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict

from llmgw_cli.core.clusterfile.spec import GatewayTls
from llmgw_cli.core.planning.controller import Phase, public_progress
from llmgw_cli.core.serving.keys import bearer
from llmgw_cli.core.serving.redact import redact
from llmgw_cli.errors import LlmgwError
from llmgw_cli.gateway.control import systemd
from llmgw_cli.gateway.control.fleet import FleetCollector
from llmgw_cli.gateway.control.state import Gateway, log
from llmgw_cli.gateway.serving import admin, http1, limiting
from llmgw_cli.gateway.serving.exchange import Incoming
from llmgw_cli.gateway.serving.openai_error import REQUEST_ID_HEADER, add_request_id, error, request_id
from llmgw_cli.gateway.serving.proxy import GATEWAY, forward
from llmgw_cli.gateway.store.sqlite import ModelState
from llmgw_cli.gateway.store.usage import merged


async def health(_request: object) -> web.Response:
    return web.Response(status=200)


async def models(request: Incoming) -> web.Response:
    """The models the key may use, each followed by an entry per alias of it (``alias_of``
    names the model)."""
    gw: Gateway = request.app[GATEWAY]
    key = gw.authenticate(bearer(request.headers.get("Authorization")))
    if key is None:
        return error(401, "Missing or invalid API key.", "invalid_request_error", "invalid_api_key")
    controller = gw.controller
    phases = controller.phases()
    progress = {name: controller.progress(name) for name, phase in phases.items() if phase is Phase.starting}
    data: list[dict[str, object]] = []
    for m in gw.catalog.values():
        # an adapter, as vLLM lists it: its model is its `parent` and `root` (a key may
        # be given an adapter without its model)
        data.extend(
            {
                "id": a.name,
                "object": "model",
                "created": 0,
                "owned_by": "llmgw",
                "parent": m.name,
                "root": m.name,
                "state": phases[m.name].value,
                "mode": m.mode.value,
                "progress": public_progress(progress.get(m.name, "")),
            }
            for a in m.adapters
            if key.allows(a.name)
        )
        if not key.allows(m.name):
            continue
        entry = {
            "id": m.name,
            "object": "model",
            "created": 0,
            "owned_by": "llmgw",
            "state": phases[m.name].value,
            "mode": m.mode.value,
            # what its start does now, in a few fixed words (fetching weights: 3/9 files,
            # engine loading); empty unless starting
            "progress": public_progress(progress.get(m.name, "")),
        }
        data.append(entry)
        data.extend({**entry, "id": alias, "alias_of": m.name} for alias in m.aliases)
    withheld = "; ".join(f"{name}: {text}" for name, text in progress.items() if text)
    if withheld:  # the whole progress text, for the operator, under the answer's request id
        log.info("request %s: /v1/models: %s", request_id(request), withheld)
    return web.json_response({"object": "list", "data": data})


async def _forward_aiohttp(request: web.Request) -> web.StreamResponse:
    answer = await forward(request)
    assert isinstance(answer, web.StreamResponse)  # on aiohttp's server, aiohttp's answers
    if request.content.exception() is not None:
        # A body that did not decode (the answer closes the connection): aiohttp would read
        # the rest after the answer (its lingering close), meet the same error again and
        # log it as unhandled. Marked read to the end, it is not read again.
        request.content.feed_eof()
    return answer


def public_app(gw: Gateway) -> web.Application:
    # client_max_size is a backstop; the handler answers an over-size body itself in the
    # OpenAI error format.
    app = web.Application(client_max_size=gw.spec.gateway.max_request_size)
    app[GATEWAY] = gw
    app.on_response_prepare.append(add_request_id)
    app.on_response_prepare.append(limiting.add_rate_headers)  # a limited key's x-ratelimit-*
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, _forward_aiohttp)
    return app


def public_routes() -> dict[tuple[str, str], http1.Handler]:
    """The public listener's routes on the lean server (``http1``)."""
    routes: dict[tuple[str, str], http1.Handler] = {("GET", "/health"): health, ("GET", "/v1/models"): models}
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        routes["POST", path] = forward
    return routes


def _lean_prepare(request: http1.Request, headers: CIMultiDict[str]) -> None:
    """What ``on_response_prepare`` adds on aiohttp: the request id, a limited key's
    x-ratelimit-* headers."""
    headers[REQUEST_ID_HEADER] = request_id(request)
    rate = request.get(limiting.RATE_HEADERS)
    if rate:
        for name, value in rate.items():
            headers.setdefault(name, value)


def lean_server(gw: Gateway) -> http1.Server:
    settings = gw.spec.gateway
    return http1.Server(
        public_routes(),
        {GATEWAY: gw},
        max_body=settings.max_request_size,
        header_timeout=settings.client_timeouts.header,
        prepare=_lean_prepare,
    )


@web.middleware
async def _admin_only(request: web.Request, handler: Any) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    key = gw.authenticate(admin.admin_token(request.headers.get("Authorization")))
    if key is None:
        return error(
            401, "Missing or invalid API key.", "invalid_request_error", "invalid_api_key", admin.CHALLENGE
        )
    if not key.admin:
        return error(403, "This key is not an admin key.", "invalid_request_error", "not_admin")
    response: web.StreamResponse = await handler(request)
    return response


async def admin_usage(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    stored = await gw.store.usage()
    return web.json_response({"usage": [u.as_dict() for u in merged(stored, gw.meter.pending())]})


async def admin_replicas(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    controller = gw.controller
    phases = controller.phases()
    return web.json_response(
        {
            "replicas": [r.as_dict(time.monotonic()) for r in gw.pool.all()],
            "queued": gw.admission.queued(),
            "models": {
                name: _model_row(controller.model_state(name, phase)) for name, phase in phases.items()
            },
            "leader": gw.coordinator.leading,  # this process leads the cluster
            "actions": [a.as_dict() for a in controller.actions],
        }
    )


def _model_row(state: ModelState) -> dict[str, object]:
    """A model on the dashboard (a follower's: the leader's, as published)."""
    return {
        "phase": state.phase,
        "progress": state.progress,
        "failures": state.failures,
        "last_failure": state.last_failure,
    }


def admin_app(gw: Gateway) -> web.Application:
    app = web.Application(middlewares=[_admin_only])
    app[GATEWAY] = gw
    app.router.add_get("/admin/api/usage", admin_usage)
    app.router.add_get("/admin/api/replicas", admin_replicas)
    admin.add_routes(app, admin=True)
    return app


def metrics_app(gw: Gateway) -> web.Application:
    app = web.Application()
    app[GATEWAY] = gw
    admin.add_routes(app, admin=False)
    app.router.add_get("/health", health)
    return app


class ClientMistakes(logging.Filter):
    """aiohttp logs a request its HTTP parser refuses (a 400: a control character in a
    header, a broken request line) as an error with a traceback. That is a client's
    mistake, and anyone can send it as often as they like: it becomes one debug line,
    without the traceback. Errors in the gateway's own code keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = (
                "refused a malformed request: %s",
                (" ".join(str(exc.message).split())[:200],),
            )
            record.exc_info = None
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


class RedactLog(logging.Filter):
    """On a handler of the gateway's log: every line it writes, a traceback's too, without
    the secrets ``core/serving/redact.py`` knows and those ``secrets`` returns (the engine keys).
    A start's failure and a fetch's progress quote what nodes and engines said."""

    def __init__(self, secrets: Callable[[], Iterable[str]]) -> None:
        super().__init__()
        self.secrets = secrets

    def filter(self, record: logging.LogRecord) -> bool:
        known = tuple(self.secrets())
        record.msg, record.args = redact(record.getMessage(), known), ()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text, known)
        if record.stack_info:
            record.stack_info = redact(record.stack_info, known)
        return True


def redact_log(handler: logging.Handler, gw: Gateway) -> None:
    """Put ``RedactLog`` on ``handler`` (once) for ``gw``'s secrets."""
    if not any(isinstance(f, RedactLog) for f in handler.filters):
        handler.addFilter(RedactLog(gw.known_secrets))


class Listening:
    """What serves: aiohttp's runners, the lean servers and their listening sockets."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.lean: list[http1.Server] = []
        self.sites: list[asyncio.Server] = []

    def connections(self) -> list[Any]:
        """Every client connection of every listener: aiohttp's and the lean server's."""
        found: list[Any] = [c for r in self.runners if r.server is not None for c in r.server.connections]
        for server in self.lean:
            found.extend(server.connections)
        return found


class WriteWatch:
    """Drops clients that stopped reading. A connection whose transport has paused writing
    (its socket and the buffer above it are full) at every look for ``timeout`` seconds is
    aborted; losing the connection cancels its handler (``handler_cancellation``), which
    frees the model slot and closes the engine's connection. One task looks at every
    connection a few times per ``timeout``: nothing is added to the path of a write."""

    def __init__(self, serving: Listening, timeout: float) -> None:
        self.serving = serving
        self.timeout = timeout
        self.stalled: dict[Any, float] = {}  # connection -> when it was first seen full

    def look(self, now: float) -> int:
        """Abort the connections full since ``timeout`` ago; how many were aborted."""
        seen: dict[Any, float] = {}
        dropped = 0
        for conn in self.serving.connections():
            if not conn.writing_paused or conn.transport is None:
                continue
            since = seen[conn] = self.stalled.get(conn, now)
            if now - since >= self.timeout:
                log.info("dropping a client that has not read for %gs", self.timeout)
                conn.transport.abort()
                dropped += 1
        self.stalled = seen
        return dropped

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        every = min(1.0, self.timeout / 4)
        while True:
            await asyncio.sleep(every)
            self.look(loop.time())


def tls_context(tls: GatewayTls) -> ssl.SSLContext:
    """A server context with the ssl module's current defaults, TLS 1.2 at least."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ssl.SSLError) as exc:
        raise LlmgwError(
            f"gateway.tls: cannot load the certificate {tls.cert} with the key {tls.key}: {exc} "
            "(both PEM files, readable by the gateway's account)"
        ) from None
    return context


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


async def _start_site(
    runner: web.AppRunner,
    listen: str,
    sockets: list[socket.socket] | None,
    context: ssl.SSLContext | None,
    shared: bool = False,
) -> None:
    """Accept on ``sockets`` (inherited from systemd) or, when None, on ``listen`` bound
    here (with ``SO_REUSEPORT`` when ``shared``: the other workers bind it too)."""
    try:
        if sockets is None:
            host, port = split_listen(listen)
            site = web.TCPSite(
                runner, host, port, backlog=2048, ssl_context=context, reuse_port=shared or None
            )
            await site.start()
        else:
            for sock in sockets:
                await web.SockSite(runner, sock, backlog=2048, ssl_context=context).start()
    except OSError as exc:
        raise LlmgwError(f"cannot listen on {listen}: {exc.strerror or exc}") from None


# A leaving gateway closes a kept-alive connection once it has been idle this long. A
# request the client sends on it at the moment it closes meets a reset: the race of every
# HTTP/1.1 server that closes idle connections. Clients do not reuse a connection idle for
# longer than their own keep-alive expiry (httpx, which the official openai client uses:
# 5 s), so a server that waits longer than that never closes one under their request; it
# answers what arrives meanwhile (with "Connection: close").
IDLE_CLOSE = 8.0


class Connections:
    """Which client connections are handling a request (a middleware counts them), and,
    once the gateway is leaving, when each last finished one. Its answers then close their
    connection (``Connection: close``)."""

    def __init__(self) -> None:
        self.busy: dict[object, int] = {}  # connection -> requests in progress on it
        self.last: dict[object, float] = {}  # connection -> when its last request ended (leaving only)
        self.leaving = False

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        conn = request.protocol
        self.busy[conn] = self.busy.get(conn, 0) + 1
        try:
            response: web.StreamResponse = await handler(request)
            # Only an answer not sent yet: one whose head said keep-alive must keep the
            # connection open, or the client's next request on it would meet a closed socket.
            if self.leaving and not response.prepared:
                response.force_close()  # the client opens its next connection elsewhere
            return response
        finally:
            left = self.busy.pop(conn) - 1
            if left:
                self.busy[conn] = left
            if self.leaving:
                self.last[conn] = asyncio.get_running_loop().time()

    async def on_prepare(self, _request: web.Request, response: web.StreamResponse) -> None:
        if self.leaving:
            response.force_close()  # a stream that begins now closes its connection at its end


async def _start_lean(
    server: http1.Server,
    listen: str,
    sockets: list[socket.socket] | None,
    context: ssl.SSLContext | None,
    shared: bool = False,
) -> list[asyncio.Server]:
    """``_start_site`` for the lean server."""
    loop = asyncio.get_running_loop()
    try:
        if sockets is None:
            host, port = split_listen(listen)
            return [
                await loop.create_server(
                    server, host, port, backlog=2048, ssl=context, reuse_port=shared or None
                )
            ]
        return [await loop.create_server(server, sock=sock, backlog=2048, ssl=context) for sock in sockets]
    except OSError as exc:
        raise LlmgwError(f"cannot listen on {listen}: {exc.strerror or exc}") from None


async def _stop_accepting(serving: Listening, inherited: list[socket.socket]) -> None:
    """Stop every listener. asyncio's own loop (before Python 3.12) attaches a connection it
    accepted a moment later, in a task of its own, and resets it when the listener was
    closed in between: with sockets another process accepts from too, that is a refused
    request. So first no more accepts on the inherited sockets, then let those tasks run,
    then close."""
    loop = asyncio.get_running_loop()
    for sock in inherited:
        with contextlib.suppress(Exception):  # uvloop accepts in libuv: nothing to remove
            loop.remove_reader(sock.fileno())
    for _ in range(3):
        await asyncio.sleep(0)
    for listening in serving.sites:
        listening.close()
    for lean in serving.lean:
        lean.leaving = True  # answers not begun yet close their connection
    for runner in serving.runners:
        for site in list(runner.sites):
            await site.stop()


async def _lame_duck(
    serving: Listening, conns: Connections, bound: float, inherited: list[socket.socket]
) -> None:
    """Stop accepting (another gateway process may accept from the same sockets now); then,
    until every connection is closed or ``bound`` seconds have passed, answer what arrives
    on the open ones (each answer closing its connection) and close each once it has been
    idle for ``IDLE_CLOSE``. What is still open after ``bound`` is closed: its requests are
    cut."""
    conns.leaving = True
    await _stop_accepting(serving, inherited)
    loop = asyncio.get_running_loop()
    start = loop.time()

    def busy(conn: Any) -> bool:
        return conn.busy if isinstance(conn, http1.Connection) else bool(conns.busy.get(conn))

    def idle_since(conn: Any, now: float) -> float:
        if isinstance(conn, http1.Connection):
            return max(conn.idle_since, start)
        return conns.last.setdefault(conn, now)

    while True:
        now = loop.time()
        open_conns = serving.connections()
        if not open_conns:
            return
        if now - start >= bound:
            break
        for conn in open_conns:
            if not busy(conn) and now - idle_since(conn, now) >= IDLE_CLOSE:
                # Idle: nothing of it is in flight. ``close()`` only asks a connection to
                # end after its requests, and an idle one waiting for its next request
                # stays open (aiohttp 3.14): the drain would wait out its bound.
                conn.force_close()
        await asyncio.sleep(0.1)
    cut = sum(1 for c in open_conns if busy(c))
    if cut:
        log.warning("drain bound (%ss) reached with %d requests in flight: cut", bound, cut)
    for conn in open_conns:
        conn.force_close()  # its handler is cancelled: the engine's request with it


def _listeners(
    gw: Gateway, worker: int | None
) -> list[tuple[web.Application | http1.Server, str, ssl.SSLContext | None]]:
    """The apps this process serves, each with its listener's name and TLS context: all
    three for one process or worker 0 of several; the public one only for other workers
    (the admin and metrics pages describe the process that answers: one, always the same)."""
    settings = gw.spec.gateway
    public_tls = tls_context(settings.tls) if settings.tls is not None else None
    public = lean_server(gw) if settings.http_server == "httptools" else public_app(gw)
    listeners: list[tuple[web.Application | http1.Server, str, ssl.SSLContext | None]] = [
        (public, "listen", public_tls)
    ]
    if not worker:
        listeners.append((admin_app(gw), "admin_listen", None))
        if settings.metrics_listen:
            listeners.append((metrics_app(gw), "metrics_listen", None))
    return listeners


def _listening(listen: str, context: ssl.SSLContext | None, inherited: bool) -> None:
    log.info(
        "listening on %s%s%s",
        listen,
        " (TLS)" if context is not None else "",
        f" (from {systemd.SOCKET_UNIT})" if inherited else "",
    )


def _inherited(addresses: dict[str, str]) -> dict[str, list[socket.socket]] | None:
    """The sockets systemd passed, by listener; None when it passed none."""
    inherited = systemd.inherited_sockets()
    return systemd.assign(inherited, addresses) if inherited else None


async def _start_listeners(  # noqa: PLR0917 (serve's parts, passed once)
    gw: Gateway,
    listeners: list[tuple[web.Application | http1.Server, str, ssl.SSLContext | None]],
    serving: Listening,
    conns: Connections,
    where: tuple[dict[str, str], dict[str, list[socket.socket]] | None, int | None],
    watches: list[asyncio.Task[None]],
) -> None:
    """Start each listener: on its inherited sockets, else bound to its address."""
    settings = gw.spec.gateway
    clients = settings.client_timeouts
    addresses, passed, worker = where
    for app, name, context in listeners:
        listen = addresses[name]
        shared = worker is not None and name == "listen"
        inherited = passed[name] if passed is not None else None
        if isinstance(app, http1.Server):
            serving.lean.append(app)
            serving.sites.extend(await _start_lean(app, listen, inherited, context, shared))
            watches.append(asyncio.create_task(app.watch_heads(), name="gateway-head-watch"))
            _listening(listen, context, passed is not None)
            log.info("the public listener runs on the gateway's own HTTP/1.1 server (httptools)")
            continue
        # handler_cancellation: a client that disconnects cancels its handler, which
        # closes the upstream connection, so the engine stops generating.
        # keepalive_timeout: aiohttp closes a connection that has not sent a whole
        # request head this long after it opened or its last answer ended.
        app.middlewares.append(conns.middleware)
        app.on_response_prepare.append(conns.on_prepare)
        runner = web.AppRunner(
            app,
            handler_cancellation=True,
            shutdown_timeout=settings.drain_timeout,
            access_log=None,
            keepalive_timeout=clients.header,
        )
        await runner.setup()
        serving.runners.append(runner)
        await _start_site(runner, listen, inherited, context, shared)
        _listening(listen, context, passed is not None)


async def serve(gw: Gateway, ready: asyncio.Event | None = None, worker: int | None = None) -> None:
    """Run until SIGTERM or SIGINT; the caller owns the loop. ``worker``: this process is
    that worker of several (``gateway/control/workers.py``): it binds the public listener with
    ``SO_REUSEPORT``, and only worker 0 serves the admin and metrics listeners."""
    settings = gw.spec.gateway
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, ClientMistakes) for f in server_log.filters):
        server_log.addFilter(ClientMistakes())
    addresses = {"listen": settings.listen, "admin_listen": settings.admin_listen}
    if settings.metrics_listen:
        addresses["metrics_listen"] = settings.metrics_listen
    # Checked before anything starts: a socket unit that disagrees with the cluster file
    # is refused at once, with what to do.
    passed = _inherited(addresses)
    await gw.start()
    # The registry exists once there is something true to report: until now /metrics
    # answers 503 (the listeners below open after this today; the 503 keeps it so if
    # they ever open first).
    gw.metrics.build(FleetCollector(gw))
    serving = Listening()
    conns = Connections()
    watches = [
        asyncio.create_task(
            WriteWatch(serving, settings.client_timeouts.write).run(),
            name="gateway-write-watch",
        )
    ]
    try:
        await _start_listeners(
            gw, _listeners(gw, worker), serving, conns, (addresses, passed, worker), watches
        )
        loop = asyncio.get_running_loop()
        log.info("event loop: %s", type(loop).__module__.partition(".")[0])  # asyncio or uvloop
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(gw.reload()))
        # Everything loaded so far (modules, the spec, keys) lives as long as the process:
        # move it out of the garbage collector's sight, so collections triggered by
        # per-request garbage do not rescan it.
        gc.freeze()
        systemd.notify("READY=1")
        if ready is not None:
            ready.set()
        await stop.wait()
        systemd.notify("STOPPING=1")
        # A gateway that is leaving decides nothing more about replicas: during an upgrade
        # the next one runs already, and it decides.
        await gw.quiesce()
        log.info("stopping: draining requests in flight for up to %ss", settings.drain_timeout)
        started = time.monotonic()
        await _lame_duck(
            serving, conns, settings.drain_timeout, [x for v in (passed or {}).values() for x in v]
        )
    finally:
        for watch in watches:
            watch.cancel()
        # Each listener stops accepting, then waits for its handlers (up to drain_timeout).
        await asyncio.gather(*(r.cleanup() for r in serving.runners), *(s.close() for s in serving.lean))
        await gw.stop()
    log.info("stopped after draining %.1fs", time.monotonic() - started)

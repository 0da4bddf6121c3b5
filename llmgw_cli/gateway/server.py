"""The three listeners and the process's signals.

- public ``listen``: the OpenAI API and ``/health``;
- ``admin_listen``: the ``/admin`` dashboard, ``/admin/api/*`` and ``/metrics``; every
  request needs an admin key (Bearer, or the password of HTTP Basic for a browser);
- ``metrics_listen``: only ``/metrics`` and ``/health``, so monitoring never reaches admin.

SIGHUP reloads the cluster file (listeners and connections stay); SIGTERM/SIGINT stop
accepting, let requests and streams in flight finish for up to ``drain_timeout``, write
the pending usage, and return.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from typing import Any

from aiohttp import web

from llmgw_cli.core.keys import bearer, hash_token
from llmgw_cli.core.routing import ModelState, model_state
from llmgw_cli.errors import LlmgwError
from llmgw_cli.gateway import admin
from llmgw_cli.gateway.fleet import FleetCollector
from llmgw_cli.gateway.proxy import GATEWAY, error, forward
from llmgw_cli.gateway.state import Gateway, log
from llmgw_cli.gateway.usage import merged


async def health(_request: web.Request) -> web.Response:
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    if gw.authenticate(bearer(request.headers.get("Authorization")), hash_token) is None:
        return error(401, "Missing or invalid API key.", "invalid_request_error", "invalid_api_key")
    data = [
        {
            "id": m.name,
            "object": "model",
            "created": 0,
            "owned_by": "llmgw",
            "state": _state(gw, m.name),
            "mode": m.mode.value,
        }
        for m in gw.catalog.values()
    ]
    return web.json_response({"object": "list", "data": data})


def _state(gw: Gateway, name: str) -> str:
    state = model_state(gw.catalog[name], gw.pool.of(name))
    if state is ModelState.on_demand and gw.supervisor is not None and name in gw.supervisor.starting:
        state = ModelState.loading
    return state.value


def public_app(gw: Gateway) -> web.Application:
    # client_max_size is a backstop; the handler answers an over-size body itself in the
    # OpenAI error format.
    app = web.Application(client_max_size=gw.spec.gateway.max_request_size)
    app[GATEWAY] = gw
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, forward)
    return app


@web.middleware
async def _admin_only(request: web.Request, handler: Any) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    key = gw.authenticate(admin.admin_token(request.headers.get("Authorization")), hash_token)
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
    stored = await asyncio.to_thread(gw.store.usage)
    return web.json_response({"usage": [u.as_dict() for u in merged(stored, gw.meter.pending())]})


async def admin_replicas(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    supervisor = gw.supervisor
    return web.json_response(
        {
            "replicas": [r.as_dict() for r in gw.pool.all()],
            "queued": gw.admission.queued(),
            "starting": {m: supervisor.progress.get(m, "") for m in sorted(supervisor.starting)}
            if supervisor
            else {},
            "failed": {m: why for m, (_, why) in supervisor.failed.items()} if supervisor else {},
        }
    )


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


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


async def serve(gw: Gateway, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM or SIGINT; the caller owns the loop."""
    settings = gw.spec.gateway
    await gw.start()
    # The registry exists once there is something true to report: until now /metrics
    # answers 503 (the listeners below open after this today; the 503 keeps it so if
    # they ever open first).
    gw.metrics.build(FleetCollector(gw))
    listeners = [(public_app(gw), settings.listen), (admin_app(gw), settings.admin_listen)]
    if settings.metrics_listen:
        listeners.append((metrics_app(gw), settings.metrics_listen))
    runners: list[web.AppRunner] = []
    try:
        for app, listen in listeners:
            # handler_cancellation: a client that disconnects cancels its handler, which
            # closes the upstream connection, so the engine stops generating.
            runner = web.AppRunner(
                app, handler_cancellation=True, shutdown_timeout=settings.drain_timeout, access_log=None
            )
            await runner.setup()
            runners.append(runner)
            host, port = split_listen(listen)
            try:
                await web.TCPSite(runner, host, port, backlog=2048).start()
            except OSError as exc:
                raise LlmgwError(f"cannot listen on {listen}: {exc.strerror or exc}") from None
            log.info("listening on %s", listen)
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(gw.reload()))
        # Everything loaded so far (modules, the spec, keys) lives as long as the process:
        # move it out of the garbage collector's sight, so collections triggered by
        # per-request garbage do not rescan it.
        gc.freeze()
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("stopping: draining requests in flight for up to %ss", settings.drain_timeout)
        started = time.monotonic()
    finally:
        # Each listener stops accepting, then waits for its handlers (up to drain_timeout).
        await asyncio.gather(*(r.cleanup() for r in runners))
        await gw.stop()
    log.info("stopped after draining %.1fs", time.monotonic() - started)

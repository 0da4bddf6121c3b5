"""The public OpenAI API: authenticate, route, forward, stream back, meter.

Hot path, per request: one dict lookup for the key, one ``json.loads`` of the body, one
pick from the pool, one upstream request on a pooled connection. Streams are written to
the client once per upstream read (never re-split into SSE events), and usage is read
from the tail of the stream, so no chunk is parsed on the way.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llmgw_cli.core.keys import ApiKey, bearer, hash_token
from llmgw_cli.core.routing import Health, ModelState, Replica, model_state
from llmgw_cli.gateway.state import Gateway
from llmgw_cli.gateway.upstream import Answer, ConnectFailed, Disconnected, UpstreamError

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)

STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_ATTEMPTS = 3
TAIL_READS = 16  # reads of a stream kept to find the usage chunk at its end


def error(
    status: int, message: str, kind: str, code: str, headers: dict[str, str] | None = None
) -> web.Response:
    """An error in the OpenAI format."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/json", headers=headers
    )


@dataclass
class Outcome:
    """What one request did, for the log line, the usage meter and the metrics."""

    key: str = "-"
    model: str = "-"
    replica: str = "-"
    status: int = 0
    prompt: int = 0
    completion: int = 0
    stream: bool = False
    first_byte_ms: float = 0.0
    attempts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _usage_from(data: Any) -> tuple[int, int]:
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (prompt if isinstance(prompt, int) else 0, completion if isinstance(completion, int) else 0)


_USAGE_FIELD = re.compile(rb'"(prompt|completion)_tokens"\s*:\s*(\d+)')


def body_usage(data: bytes) -> tuple[int, int]:
    """Usage of a whole JSON answer without parsing it: an embeddings answer can be
    megabytes of floats, and ``usage`` sits at its end (vLLM, SGLang, llama-server)."""
    at = data.rfind(b'"usage"')
    if at < 0:
        return 0, 0
    found = {m.group(1): int(m.group(2)) for m in _USAGE_FIELD.finditer(data, at, at + 400)}
    return found.get(b"prompt", 0), found.get(b"completion", 0)


def _event_around(data: bytes, at: int) -> tuple[int, int]:
    """Start and end (after its blank line, or -1 when there is none) of the SSE event
    holding offset ``at``."""
    start = data.rfind(b"\n\n", 0, at)
    end = data.find(b"\n\n", at)
    return (0 if start < 0 else start + 2), (-1 if end < 0 else end + 2)


def stream_usage(tail: bytes) -> tuple[int, int]:
    """Usage from the last ``data:`` event that carries one (the include_usage chunk).
    Only events around a ``"usage"`` key are looked at: a tail can hold a whole stream."""
    before = len(tail)
    while (at := tail.rfind(b'"usage"', 0, before)) >= 0:
        start, end = _event_around(tail, at)
        line = tail[start : None if end < 0 else end].strip()
        if line.startswith(b"data: {"):
            try:
                found = _usage_from(json.loads(line[6:]))
            except ValueError:
                found = (0, 0)
            if found != (0, 0):
                return found
        before = start
    return 0, 0


_EMPTY_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')


def without_usage_event(chunk: bytes) -> bytes:
    """``chunk`` without the include_usage event (empty ``choices``, a ``usage`` object)
    that the gateway asked for on the client's behalf. Only whole events in one read are
    recognised; one split across reads passes through, as a valid OpenAI chunk."""
    at = chunk.find(b'"usage"')
    while at >= 0:
        start, end = _event_around(chunk, at)
        if end < 0:  # not a whole event
            return chunk
        event = chunk[start:end]
        if event.lstrip().startswith(b"data: {") and _EMPTY_CHOICES.search(event):
            chunk = chunk[:start] + chunk[end:]
            end = start
        at = chunk.find(b'"usage"', end)
    return chunk


INCLUDE_USAGE = b',"stream_options":{"include_usage":true}}'


def with_include_usage(body: bytes, payload: dict[str, Any]) -> bytes:
    """``body`` asking for the usage chunk at the end of a stream. Without
    ``stream_options`` in a plain UTF-8 object, the option is spliced in before the closing
    brace rather than the whole body encoded again."""
    options = payload.get("stream_options")
    if options is None and "stream_options" not in payload:
        head, tail = body.lstrip()[:1], body.rstrip()
        if head == b"{" and tail.endswith(b"}"):
            return tail[:-1] + INCLUDE_USAGE
    payload["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    return json.dumps(payload).encode()


async def forward(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    started = time.monotonic()
    outcome = Outcome()
    try:
        response = await _forward(request, gw, outcome, started)
        outcome.status = outcome.status or response.status
        return response
    except asyncio.CancelledError:
        # The client went away; the upstream request is closed with us. A client that read
        # to `data: [DONE]` and hung up without waiting for the end of the body (the openai
        # client does) got the whole answer: that is a 200, not a 499.
        outcome.status = 200 if outcome.extra.get("done") else 499
        raise
    finally:
        key: ApiKey | None = outcome.extra.get("api_key")
        seconds = time.monotonic() - started
        if key is not None and outcome.model != "-":
            gw.meter.record(
                key.name,
                outcome.model,
                prompt=outcome.prompt,
                completion=outcome.completion,
                error=outcome.status >= 400,
                latency_ms=seconds * 1000,
                now=time.time(),
            )
        first_chunk: float | None = outcome.extra.get("first_chunk")
        gw.metrics.observe(
            outcome.model,
            outcome.status,
            outcome.key,
            prompt=outcome.prompt,
            completion=outcome.completion,
            seconds=seconds,
            first_token=None if first_chunk is None else first_chunk - started,
        )
        if gw.access_log is not None:
            gw.access_log.write(
                {
                    "ts": round(time.time(), 3),
                    "path": request.path,
                    "key": outcome.key,
                    "model": outcome.model,
                    "replica": outcome.replica,
                    "status": outcome.status,
                    "stream": outcome.stream,
                    "prompt_tokens": outcome.prompt,
                    "completion_tokens": outcome.completion,
                    "attempts": outcome.attempts,
                    "first_byte_ms": round(outcome.first_byte_ms, 3),
                    "ms": round(seconds * 1000, 3),
                }
            )


async def _forward(request: web.Request, gw: Gateway, outcome: Outcome, started: float) -> web.StreamResponse:
    key = gw.authenticate(bearer(request.headers.get("Authorization")), hash_token)
    if key is None:
        return error(401, "Missing or invalid API key.", "invalid_request_error", "invalid_api_key")
    outcome.key = key.name
    limit = gw.spec.gateway.max_request_size
    if (request.content_length or 0) > limit:
        return error(413, f"Request body over {limit} bytes.", "invalid_request_error", "request_too_large")
    content = request.content
    try:
        if request.content_length is not None and content.is_eof():
            body = content.read_nowait()  # the usual case: the whole body came with the head
        else:
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"Request body over {limit} bytes.", "invalid_request_error", "request_too_large")
    try:
        payload = json.loads(body)
    except ValueError:
        return error(400, "The body is not valid JSON.", "invalid_request_error", "invalid_json")
    name = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(name, str):
        return error(400, "The request names no model.", "invalid_request_error", "missing_model")
    model = gw.catalog.get(name)
    if model is None:
        return error(404, f"The model `{name}` does not exist.", "invalid_request_error", "model_not_found")
    if not key.allows(name):
        return error(
            403, f"This key may not use the model `{name}`.", "invalid_request_error", "model_not_allowed"
        )
    outcome.model = name
    outcome.extra["api_key"] = key
    outcome.stream = payload.get("stream") is True and request.path in STREAMING_PATHS
    if outcome.stream:
        options = payload.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            # Ask the engine for the usage chunk so streams are metered; the relay takes
            # it out again (a client that did not ask may read choices[0] of every chunk).
            outcome.extra["hide_usage"] = True
            body = with_include_usage(body, payload)

    settings = gw.spec.gateway
    limit = settings.model_concurrency * max(1, gw.pool.ready_count(name))
    if not await gw.admission.enter(name, limit, settings.model_queue):
        return error(
            429,
            f"Too many requests for `{name}`; retry later.",
            "rate_limit_error",
            "overloaded",
            {"Retry-After": "1"},
        )
    try:
        return await _route(request, gw, outcome, body, started)
    finally:
        gw.admission.leave(name)


async def _wait_ready(gw: Gateway, name: str, deadline: float) -> Replica | None:
    """A ready replica, waiting up to ``deadline`` while one is loading or being started."""
    while True:
        replica = gw.pool.pick(name, time.monotonic())
        if replica is not None or time.monotonic() >= deadline:
            return replica
        starting = gw.supervisor is not None and name in gw.supervisor.starting
        if not starting and not any(r.health in (Health.loading, Health.unknown) for r in gw.pool.of(name)):
            return None
        await asyncio.sleep(0.1)


def _unavailable(gw: Gateway, name: str) -> web.Response:
    state = model_state(gw.catalog[name], gw.pool.of(name))
    supervisor = gw.supervisor
    if supervisor is not None and state is ModelState.on_demand:
        failure = supervisor.failure(name)
        if failure is not None:
            return error(
                503,
                f"The model `{name}` could not be started: {failure}",
                "server_error",
                "model_start_failed",
                {"Retry-After": "30"},
            )
        if name in supervisor.starting:
            state = ModelState.loading
    if state is ModelState.off:
        return error(
            404,
            f"The model `{name}` is switched off (no scaling in the cluster file).",
            "invalid_request_error",
            "model_off",
        )
    if state is ModelState.loading:
        doing = supervisor.progress.get(name) if supervisor is not None else None
        return error(
            503,
            f"The model `{name}` is loading{f' ({doing})' if doing else ''}; retry shortly.",
            "server_error",
            "model_loading",
            {"Retry-After": "5"},
        )
    if state is ModelState.on_demand:
        message = (
            f"The model `{name}` runs on demand and is not running; this gateway does not start "
            "models (it routes to a fixed replica list, or `gateway.manage_replicas` is off)."
        )
    else:
        message = f"No replica of `{name}` is in rotation."
    return error(503, message, "server_error", "model_unavailable", {"Retry-After": "30"})


async def _route(
    request: web.Request, gw: Gateway, outcome: Outcome, body: bytes, started: float
) -> web.StreamResponse:
    name = outcome.model
    timeout = gw.stream_timeout if outcome.stream else gw.plain_timeout
    tried: set[str] = set()
    replica = gw.pool.pick(name, time.monotonic())
    if replica is None:
        if gw.supervisor is not None:
            gw.supervisor.want(name)  # starts an on-demand model; never waits
        replica = await _wait_ready(gw, name, started + gw.spec.gateway.load_wait)
        if replica is None:
            return _unavailable(gw, name)
    last_error = ""
    stale_retried = False
    while replica is not None and outcome.attempts < MAX_ATTEMPTS:
        current = replica
        outcome.attempts += 1
        outcome.replica = replica.address
        tried.add(replica.address)
        replica.outstanding += 1
        replica.requests += 1
        try:
            try:
                upstream = await gw.upstreams.request(
                    replica.address, request.path, body, timeout, fresh=stale_retried
                )
            except (ConnectFailed, Disconnected) as exc:
                # Nothing reached the client and the engine did not answer: try again.
                gw.metrics.retry(name)
                last_error = str(exc)
                if isinstance(exc, Disconnected) and not stale_retried:
                    # Most likely a pooled keep-alive connection the engine had closed
                    # (llama-server closes after every stream): once, on the same replica,
                    # on a new connection.
                    stale_retried = True
                    continue
                gw.pool.failed(replica, time.monotonic())
                replica = gw.pool.pick(name, time.monotonic(), frozenset(tried))
                continue
            except UpstreamError as exc:
                return error(502, f"The engine did not answer: {exc}", "server_error", "upstream_error")
            gw.pool.succeeded(replica)
            outcome.first_byte_ms = (time.monotonic() - started) * 1000
            try:
                return await _relay(request, upstream, outcome)
            finally:
                upstream.release()  # closes the connection unless the answer was read to its end
        finally:
            current.outstanding -= 1
            current.last_used = time.time()  # a stream counts as use until it ends
    return error(
        502, f"No replica of `{name}` could be reached: {last_error}", "server_error", "upstream_error"
    )


async def _relay(request: web.Request, upstream: Answer, outcome: Outcome) -> web.StreamResponse:
    if upstream.status == 401:
        return error(502, "The engine refused the gateway's engine key.", "server_error", "upstream_auth")
    content_type = upstream.content_type or "application/json"
    if not content_type.startswith("text/event-stream"):
        try:
            data = await upstream.read()
        except UpstreamError as exc:
            return error(502, f"The engine broke off its answer: {exc}", "server_error", "upstream_error")
        if upstream.status == 200:
            outcome.prompt, outcome.completion = body_usage(data)
        return web.Response(status=upstream.status, body=data, headers={"Content-Type": content_type})
    out = web.StreamResponse(
        status=upstream.status, headers={"Content-Type": content_type, "Cache-Control": "no-cache"}
    )
    await out.prepare(request)
    # The last reads only: copying a growing tail on every read cost more than the relay.
    tail: deque[bytes] = deque(maxlen=TAIL_READS)
    hide_usage = outcome.extra.get("hide_usage", False)
    try:
        while chunk := await upstream.next_chunk():
            if not tail:  # the first chunk: time to first token, for the metrics
                outcome.extra["first_chunk"] = time.monotonic()
            tail.append(chunk)
            sent = without_usage_event(chunk) if hide_usage and b'"usage"' in chunk else chunk
            if sent and upstream.complete:  # the last read: one write with the body's end
                await out.write_eof(sent)
            elif sent:
                await out.write(sent)
    except UpstreamError:
        # Bytes already reached the client: the stream can only be cut. The log line says
        # so. An engine that closes its connection right after the last event (llama-server
        # does) can end here with the whole answer sent. (The caller's release closes the
        # upstream connection.)
        outcome.extra["cut"] = True
        return out
    except ConnectionResetError:
        # The client left: the caller's release closes the upstream connection, which
        # stops the generation. One that had read to `data: [DONE]` got a whole answer.
        _stream_end(tail, outcome)
        outcome.status = 200 if outcome.extra.get("done") else 499
        return out
    finally:
        # Whatever ended the stream (its end, a cut, the client leaving, cancellation), the
        # tokens that went out are metered: they were made and delivered.
        _stream_end(tail, outcome)
    await out.write_eof()  # nothing more when the last read ended the body
    return out


def _stream_end(tail: deque[bytes], outcome: Outcome) -> None:
    data = b"".join(tail)
    outcome.prompt, outcome.completion = stream_usage(data)
    outcome.extra["done"] = data.rstrip().endswith(b"data: [DONE]")

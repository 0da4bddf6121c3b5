"""The public OpenAI API: authenticate, route, forward, stream back, meter.

Hot path, per request: one dict lookup for the key, one ``json.loads`` of the body, one
pick from the pool, one upstream request on a pooled connection. Streams are written to
the client once per upstream read (never re-split into SSE events), and usage is read
from the tail of the stream, so no chunk is parsed on the way.

Every request is hostile data: the body must be a UTF-8 JSON object nested at most
``MAX_DEPTH`` deep, and the fields the gateway itself acts on (``model``, ``stream``,
``stream_options``) must have their JSON types; anything else is a 400 in the OpenAI error
format, never a 500. When the body could read differently to the engine than to the
gateway (a key given twice, or spelled with escapes), the engine gets the gateway's own
reading of it, encoded again.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from llmgw_cli.core.keys import ApiKey, bearer, hash_token
from llmgw_cli.core.routing import Health, ModelState, RoutedReplica, model_state
from llmgw_cli.errors import ConnectFailed, Disconnected, UpstreamError
from llmgw_cli.gateway.state import Gateway
from llmgw_cli.gateway.upstream import Answer

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)

STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_ATTEMPTS = 3
TAIL_READS = 16  # reads of a stream kept to find the usage chunk at its end
MAX_DEPTH = 64  # deepest nesting of arrays and objects in a request body
BYTES_PER_TOKEN = 4  # estimate of a prompt's tokens when the engine never said


def error(
    status: int,
    message: str,
    kind: str,
    code: str,
    headers: dict[str, str] | None = None,
    *,
    param: str | None = None,
) -> web.Response:
    """An error in the OpenAI format."""
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
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
    prompt_estimate: int = 0  # prompt tokens to meter when the engine never reported usage
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


class BadRequest(Exception):
    """A client mistake in the body: answered 400 with this message, code and param."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param

    def response(self) -> web.Response:
        return error(400, self.message, "invalid_request_error", self.code, param=self.param)


_KEEP = b'"[]{}'
_NOT_KEPT = bytes(b for b in range(256) if b not in _KEEP)
_STRING = re.compile(rb'"[^"]*"')
_PAIR = re.compile(rb"\[\]|\{\}")


def too_deep(body: bytes, limit: int = MAX_DEPTH, *, escaped: bool = True) -> bool:
    """Whether a valid JSON text nests arrays and objects more than ``limit`` deep.

    Bodies with fewer brackets than ``limit`` (most) are answered by two counts. Else
    brackets inside strings must not count: escaped backslashes and quotes are dropped
    (left to right, as a parser reads them), then all but quotes and brackets, so what is
    left of each string is ``"`` brackets ``"``, dropped in turn. Each round then removes
    the innermost pairs: a text ``limit`` deep is empty after ``limit`` rounds. All of it
    runs in C, over a copy no longer than the body's quotes and brackets. ``escaped``
    False says the body has no backslash (skips two passes)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    if escaped:
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    rest = body.translate(None, _NOT_KEPT)
    rest = _STRING.sub(b"", rest)
    for _ in range(limit):
        if not rest:
            return False
        rest = _PAIR.sub(b"", rest)  # one pass: only pairs that are innermost now
    return bool(rest)


_READ_KEYS = (b'"model"', b'"stream"', b'"stream_options"')


def parse_body(body: bytes) -> tuple[dict[str, Any], bytes]:
    """The request's JSON object and the body to send on, or BadRequest.

    The body sent on is the client's own bytes, unless the engine's JSON parser could read
    a field the gateway acts on differently: a key given twice (parsers keep the first or
    the last) or a body with ``\\u`` escapes (a key can be spelled with them). Then it is
    the gateway's reading, encoded again."""
    if not json.detect_encoding(body).startswith("utf-8"):
        raise BadRequest("The body must be JSON in UTF-8.", "invalid_json")
    try:
        payload = json.loads(body)
    except ValueError:
        raise BadRequest("The body is not valid JSON.", "invalid_json") from None
    except RecursionError:
        raise BadRequest(f"The body nests deeper than {MAX_DEPTH} levels.", "invalid_json") from None
    if not isinstance(payload, dict):
        raise BadRequest("The body must be a JSON object.", "invalid_json")
    escaped = b"\\" in body
    if too_deep(body, escaped=escaped):
        raise BadRequest(f"The body nests deeper than {MAX_DEPTH} levels.", "invalid_json")
    name = payload.get("model")
    if name is None:
        raise BadRequest("The request names no model.", "missing_model", "model")
    if not isinstance(name, str):
        raise BadRequest("`model` must be a string.", "invalid_type", "model")
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false.", "invalid_type", "stream")
    options = payload.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise BadRequest("`stream_options` must be an object.", "invalid_type", "stream_options")
        include = options.get("include_usage")
        if include is not None and not isinstance(include, bool):
            raise BadRequest(
                "`stream_options.include_usage` must be true or false.", "invalid_type", "stream_options"
            )
    if (escaped and b"\\u" in body) or any(body.count(k) > 1 for k in _READ_KEYS):
        body = json.dumps(payload).encode()
    return payload, body


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
        if outcome.attempts and not (outcome.prompt or outcome.completion):
            # Gone before the engine said what it used: its prompt was read all the same.
            outcome.prompt = outcome.prompt_estimate
            outcome.extra["estimated"] = True
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
                    "usage_estimated": bool(outcome.extra.get("estimated")),
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
    settings = gw.spec.gateway
    try:
        if request.content_length is not None and content.is_eof():
            body = content.read_nowait()  # the usual case: the whole body came with the head
        else:
            # A client that trickles its body holds a socket: it gets a bounded time.
            async with asyncio.timeout(settings.client_timeouts.body):
                body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"Request body over {limit} bytes.", "invalid_request_error", "request_too_large")
    except TimeoutError:
        late = error(
            408,
            f"The request body did not arrive within {settings.client_timeouts.body:g}s.",
            "invalid_request_error",
            "request_timeout",
        )
        late.force_close()
        return late
    try:
        payload, body = parse_body(body)
    except BadRequest as exc:
        return exc.response()
    name: str = payload["model"]
    model = gw.catalog.get(name)
    if model is None:
        return error(404, f"The model `{name}` does not exist.", "invalid_request_error", "model_not_found")
    if not key.allows(name):
        return error(
            403, f"This key may not use the model `{name}`.", "invalid_request_error", "model_not_allowed"
        )
    outcome.model = name
    outcome.extra["api_key"] = key
    outcome.prompt_estimate = len(body) // BYTES_PER_TOKEN
    outcome.stream = payload.get("stream") is True and request.path in STREAMING_PATHS
    if outcome.stream:
        options = payload.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            # Ask the engine for the usage chunk so streams are metered; the relay takes
            # it out again (a client that did not ask may read choices[0] of every chunk).
            outcome.extra["hide_usage"] = True
            body = with_include_usage(body, payload)

    limit = settings.model_concurrency * max(1, gw.pool.ready_count(name))
    key_queue = max(1, math.ceil(settings.model_queue * settings.key_queue_share))
    if not await gw.admission.enter(name, limit, settings.model_queue, key.name, key_queue):
        queued = gw.admission.queued().get(name, 0)
        if queued < settings.model_queue and gw.admission.key_waiting(name, key.name) >= key_queue:
            return error(
                429,
                f"This key has {key_queue} requests waiting for `{name}`, its share of the "
                "queue; retry later.",
                "rate_limit_error",
                "key_overloaded",
                {"Retry-After": "1"},
            )
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


async def _wait_ready(gw: Gateway, name: str, deadline: float) -> RoutedReplica | None:
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
    events = 0  # `data:` events the engine sent: its tokens, if it never says its usage
    try:
        while chunk := await upstream.next_chunk():
            if not tail:  # the first chunk: time to first token, for the metrics
                outcome.extra["first_chunk"] = time.monotonic()
            tail.append(chunk)
            events += chunk.count(b"data:")
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
        _stream_end(tail, events, outcome)
        outcome.status = 200 if outcome.extra.get("done") else 499
        return out
    finally:
        # Whatever ended the stream (its end, a cut, the client leaving, cancellation), the
        # tokens the engine made are metered.
        _stream_end(tail, events, outcome)
    await out.write_eof()  # nothing more when the last read ended the body
    return out


def _stream_end(tail: deque[bytes], events: int, outcome: Outcome) -> None:
    """Usage from the engine's usage chunk. A stream that ended before it (the client hung
    up, which closes the engine's connection and stops the generation; or a cut) is
    metered from what the engine sent: one completion token per event (engines send one
    token per event unless told to batch them, so this is a floor), and the prompt
    estimated from the body's size, as the gateway cannot tokenize it."""
    data = b"".join(tail)
    done = data.rstrip().endswith(b"data: [DONE]")
    outcome.extra["done"] = done
    outcome.prompt, outcome.completion = stream_usage(data)
    if not (outcome.prompt or outcome.completion):
        outcome.prompt = outcome.prompt_estimate
        outcome.completion = max(0, events - done)
        outcome.extra["estimated"] = True

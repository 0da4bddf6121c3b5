"""The public OpenAI API: authenticate, admit, route, relay, meter.

Hot path, per request: one dict lookup for the key, one ``json.loads`` of the body, one
choice from the pool (the model's routing policy; with ``prefix``, a hash of the parsed
prompt's first KiB), one upstream request on a pooled connection. The body is checked in
``request_body``, a stream's bytes are handled in ``sse`` (both pure), errors take the
OpenAI format of ``openai_error``. Here: the request's path through the gateway, and the
``RequestRecord`` that the log line, the usage meter and the metrics are written from.

Aliases and fallbacks (``core/serving/aliases.py``): a name that is no model's costs one
more lookup, in the alias table. A model with fallbacks that cannot answer (the
controller's ``Unavailable``, or every attempt a 5xx or a failure before the first byte
reached the client) hands the request to the next fallback its key may use; the last
model tried answers whatever happens, as a model without fallbacks does. The engine gets
the name of the model that serves (engines check ``model``), the answer says it in
``x-llmgw-served-by``, and the request is metered, counted and logged under it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

from aiohttp import web

from llmgw_cli.core.clusterfile.spec import Model
from llmgw_cli.core.planning.controller import Unavailable
from llmgw_cli.core.serving.adapters import LOAD_PATH, load_body, loaded_by_answer, node_at
from llmgw_cli.core.serving.affinity import BLOCK_CHARS, Policy, Thresholds, request_key, session_of
from llmgw_cli.core.serving.aliases import usable
from llmgw_cli.core.serving.keys import ApiKey, bearer
from llmgw_cli.core.serving.limits import parallel_share
from llmgw_cli.core.serving.ratelimit import Refused, Ticket
from llmgw_cli.core.serving.routing import RoutedReplica
from llmgw_cli.errors import AdapterNotLoaded, BadRequest, ConnectFailed, Disconnected, UpstreamError
from llmgw_cli.gateway.control.state import Gateway, log
from llmgw_cli.gateway.serving import limiting
from llmgw_cli.gateway.serving.admission import Admit
from llmgw_cli.gateway.serving.exchange import Incoming, Outgoing, open_stream
from llmgw_cli.gateway.serving.openai_error import bad_request, error, request_id, withheld
from llmgw_cli.gateway.serving.request_body import parse_body, with_include_usage
from llmgw_cli.gateway.serving.sse import StreamRelay, body_usage
from llmgw_cli.gateway.serving.upstream import Answer

GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)

STREAMING_PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_ATTEMPTS = 3
BYTES_PER_TOKEN = 4  # estimate of a prompt's tokens when the engine never said
SERVED_BY = "x-llmgw-served-by"  # the model that served, on every answer of a known model


@dataclass
class RequestRecord:
    """What one request did, for the log line, the usage meter and the metrics."""

    key: str = "-"  # the key's name, once authenticated
    api_key: ApiKey | None = None  # once it may use the model: its usage is metered
    model: str = "-"  # the model that serves (or failed last): metered and counted under it
    asked: str = "-"  # the name the client sent: the model's, or an alias of it
    base: str = ""  # a LoRA adapter's model, whose replicas serve it; empty: ``model``'s own
    replica: str = "-"
    route: str = "-"  # why that replica (core/serving/affinity.py's Reason)
    status: int = 0
    stream: bool = False
    hide_usage: bool = False  # the gateway asked for the usage event; the client did not
    attempts: int = 0
    first_byte_ms: float = 0.0  # the engine's answer head, from the request's start
    first_chunk: float | None = None  # monotonic time of a stream's first read
    prompt: int = 0
    completion: int = 0
    prompt_estimate: int = 0  # prompt tokens to meter when the engine never reported usage
    usage_estimated: bool = False  # prompt and completion are the gateway's estimates
    done: bool = False  # the stream reached `data: [DONE]`: the client got the whole answer
    cut: bool = False  # the engine broke the stream off after bytes had reached the client
    ticket: Ticket | None = None  # what the key's limits counted: settled once the usage is known


async def forward(request: Incoming) -> Outgoing:
    gw = request.app[GATEWAY]
    started = time.monotonic()
    record = RequestRecord()
    try:
        response = await _forward(request, gw, record, started)
        if not response.prepared:  # a stream's head went out already
            if record.model != "-":
                response.headers[SERVED_BY] = record.model
            transport = request.transport
            if transport is None or transport.is_closing():
                # The client went away as its answer came: aiohttp, which writes the
                # answer once the handler returns (no turn of the loop between), finds
                # its connection closing and sends nothing. (Written here instead, the
                # answer would reach the client before it is counted and logged.)
                _client_gone(record)
                return response
        record.status = record.status or response.status
        return response
    except asyncio.CancelledError:
        # The client went away (aiohttp cancels the handler); the upstream request is
        # closed with us. A client that read to `data: [DONE]` and hung up without waiting
        # for the end of the body (the openai client does) got the whole answer: that is a
        # 200, not a 499.
        _client_gone(record)
        raise
    except ConnectionResetError:
        # The client went away and the handler learnt it first, writing to its closing
        # connection (aiohttp cancels the handler only at its next turn of the loop): the
        # same 499. (The engines' errors are UpstreamError: this is always the client's.)
        _client_gone(record)
        return web.Response(status=499)  # aiohttp finds the connection closed: nothing is sent
    finally:
        seconds = time.monotonic() - started
        if record.ticket is not None and record.api_key is not None:
            limiting.settle(gw, record.api_key, record.ticket, record.prompt + record.completion)
        if record.api_key is not None and record.model != "-":
            gw.meter.record(
                record.api_key.name,
                record.model,
                prompt=record.prompt,
                completion=record.completion,
                error=record.status >= 400,
                latency_ms=seconds * 1000,
                now=time.time(),
            )
        first_chunk = record.first_chunk
        gw.metrics.observe(
            record.model,
            record.status,
            record.key,
            prompt=record.prompt,
            completion=record.completion,
            seconds=seconds,
            first_token=None if first_chunk is None else first_chunk - started,
        )
        if gw.access_log is not None:
            # the values of accesslog.FIELDS, in order: encoded (and rounded) by its writer
            gw.access_log.write(
                (
                    time.time(),
                    request_id(request),  # as the answer's x-request-id says
                    request.path,
                    record.key,
                    record.model,
                    record.asked,
                    record.replica,
                    record.route,
                    record.status,
                    record.stream,
                    record.prompt,
                    record.completion,
                    record.usage_estimated,
                    record.attempts,
                    record.first_byte_ms,
                    record.cut,
                    seconds * 1000,
                )
            )


def _client_gone(record: RequestRecord) -> None:
    """The status and usage of a request whose client went away."""
    record.status = 200 if record.done else 499
    if record.attempts and not (record.prompt or record.completion):
        # Gone before the engine said what it used: its prompt was read all the same.
        record.prompt = record.prompt_estimate
        record.usage_estimated = True


async def _body(request: Incoming, gw: Gateway) -> bytes | Outgoing:
    """The request's body, or the error that answers it: over ``max_request_size`` (before
    or after decompression), a compressed body that does not decompress, or one that did
    not arrive within the body timeout."""
    limit = gw.spec.gateway.max_request_size
    if (request.content_length or 0) > limit:
        return error(413, f"Request body over {limit} bytes.", "invalid_request_error", "request_too_large")
    content = request.content
    settings = gw.spec.gateway
    try:
        if request.content_length is not None and content.is_eof():
            return content.read_nowait()  # the usual case: the whole body came with the head
        # A client that trickles its body holds a socket: it gets a bounded time.
        async with asyncio.timeout(settings.client_timeouts.body):
            return await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"Request body over {limit} bytes.", "invalid_request_error", "request_too_large")
    except (web.HTTPBadRequest, web.RequestPayloadError):  # the own server's, aiohttp's
        message = "The request body does not decode (its Content-Encoding or chunked framing is broken)."
        broken = error(400, message, "invalid_request_error", "invalid_body")
        broken.force_close()  # what follows on the connection cannot be trusted (nor read: aiohttp)
        return broken
    except TimeoutError:
        late = error(
            408,
            f"The request body did not arrive within {settings.client_timeouts.body:g}s.",
            "invalid_request_error",
            "request_timeout",
        )
        late.force_close()
        return late


async def _forward(request: Incoming, gw: Gateway, record: RequestRecord, started: float) -> Outgoing:
    token = bearer(request.headers.get("Authorization"))
    # an unknown token: maybe a key made a moment ago, which this process has not read yet
    key = gw.authenticate(token) or await gw.authenticate_fresh(token)
    if key is None:
        return error(401, "Missing or invalid API key.", "invalid_request_error", "invalid_api_key")
    record.key = key.name
    body = await _body(request, gw)
    if not isinstance(body, bytes):
        return body
    try:
        payload, body = parse_body(body)
    except BadRequest as exc:
        return bad_request(exc)
    name = record.asked = payload["model"]
    model = _resolve(gw, key, name)
    if isinstance(model, web.Response):
        return model
    if name in gw.adapters:  # served by its model's replicas, under its own name
        record.base = model.name
    elif model.name != name:  # the engine checks the name: it gets its model's
        name = payload["model"] = model.name
        body = json.dumps(payload).encode()
    record.model = name
    record.api_key = key
    fallbacks = _fallbacks(gw, key, name)
    policy, thresholds = gw.routing[model.name]  # an adapter's: its model's replicas serve it
    route_key = _route_key(request, payload, body) if policy is Policy.prefix else None
    record.prompt_estimate = len(body) // BYTES_PER_TOKEN
    record.stream = payload.get("stream") is True and request.path in STREAMING_PATHS
    if record.stream:
        options = payload.get("stream_options")
        if not (isinstance(options, dict) and options.get("include_usage") is True):
            # Ask the engine for the usage chunk so streams are metered; the relay takes
            # it out again (a client that did not ask may read choices[0] of every chunk).
            record.hide_usage = True
            body = with_include_usage(body, payload)

    if key.limits.metered and (limited := await _limited(request, gw, key, record)) is not None:
        return limited
    if (full := await _enter(gw, model.name, key)) is not None:
        return full
    try:
        answer = await _route(
            request, gw, record, body, started, route=Route(route_key, policy, thresholds), last=not fallbacks
        )
    finally:
        gw.admission.leave(model.name, key.name)
    if answer is None:
        return await _fall_back(
            request, gw, record, key=key, payload=payload, started=started, fallbacks=fallbacks
        )
    return answer


async def _limited(request: Incoming, gw: Gateway, key: ApiKey, record: RequestRecord) -> web.Response | None:
    """The key's rpm, tpm and budget (``limiting.py``): the 429 of a refusal, or None (the
    request is counted, its ticket kept to settle its tokens, its headers set)."""
    decided = await limiting.admit(gw, key, record.prompt_estimate)
    headers = limiting.headers_for(gw, key)
    if headers:
        request[limiting.RATE_HEADERS] = headers  # on the answer, whatever it is
    if isinstance(decided, Refused):
        return limiting.refused(decided, headers)
    record.ticket = decided.ticket
    return None


async def _enter(gw: Gateway, name: str, key: ApiKey) -> web.Response | None:
    """A slot of ``name`` (the caller leaves it), or the 429 that says why not. The limit
    (model_concurrency per ready replica) follows capacity: the controller resizes it
    whenever the model's ready count changes."""
    settings, limits = gw.spec.gateway, key.limits
    key_queue = max(1, math.ceil(settings.model_queue * settings.key_queue_share))
    parallel = parallel_share(limits.max_parallel, gw.controller.members) if limits.max_parallel else None
    admitted = await gw.admission.enter(
        name, settings.model_queue, key.name, key_queue, priority=limits.priority, key_parallel=parallel
    )
    if admitted is Admit.entered:
        return None
    if admitted is Admit.key_parallel:
        message = (
            f"This key has its {parallel} requests in flight through this gateway process "
            f"(its share of max_parallel {limits.max_parallel}) and no room to wait for `{name}`; "
            "retry later."
        )
        return error(429, message, "rate_limit_error", "key_parallel", {"Retry-After": "1"})
    if admitted is Admit.key_queue_full:
        message = (
            f"This key has {key_queue} requests waiting for `{name}`, its share of the queue; retry later."
        )
        return error(429, message, "rate_limit_error", "key_overloaded", {"Retry-After": "1"})
    return error(
        429,
        f"Too many requests for `{name}`; retry later.",
        "rate_limit_error",
        "overloaded",
        {"Retry-After": "1"},
    )


def _resolve(gw: Gateway, key: ApiKey, name: str) -> Model | web.Response:
    """The model ``name`` asks for (its own name, else an alias of it; for an adapter, the
    model that serves it), or the refusal. A key's model list names adapters themselves."""
    model = gw.catalog.get(name)
    if model is None and (served := gw.adapters.get(name)) is not None:
        if not key.allows(name):
            return error(
                403, f"This key may not use the model `{name}`.", "invalid_request_error", "model_not_allowed"
            )
        return gw.catalog[served.base]
    if model is None:
        aliased = gw.aliases.get(name)  # a name no model has: maybe an alias
        if aliased is None:
            return error(
                404, f"The model `{name}` does not exist.", "invalid_request_error", "model_not_found"
            )
        model = gw.catalog[aliased]
    if not key.allows(model.name):
        return error(
            403, f"This key may not use the model `{name}`.", "invalid_request_error", "model_not_allowed"
        )
    return model


def _fallbacks(gw: Gateway, key: ApiKey, name: str) -> tuple[str, ...]:
    """The models to try after ``name``, in order, that ``key`` may use (most models have none)."""
    chain = gw.fallbacks.get(name)
    return usable(chain, key.allows) if chain else ()


def _route_key(request: Incoming, payload: dict[str, object], body: bytes) -> str | None:
    """The prefix policy's key, from the body parsed once above, never again."""
    session = session_of(payload, request.headers.get("x-session-id"))
    # A body shorter than one block cannot hold a block of prompt (its JSON spends at
    # least a byte per character of text, and more on the field names around it).
    if session or len(body) >= BLOCK_CHARS:
        return request_key(payload, session)
    return None


async def _fall_back(
    request: Incoming,
    gw: Gateway,
    record: RequestRecord,
    *,
    key: ApiKey,
    payload: dict[str, object],
    started: float,
    fallbacks: tuple[str, ...],
) -> Outgoing:
    """The request, for each fallback in turn until one answers: the last answers
    whatever happens (its refusal or failure is the client's answer). A fallback whose
    queue is full is skipped; the load wait counts from the request's start."""
    for n, name in enumerate(fallbacks):
        last = n == len(fallbacks) - 1
        record.model = payload["model"] = name
        body = json.dumps(payload).encode()
        if record.hide_usage:  # the usage chunk, asked of each engine as of the first
            body = with_include_usage(body, payload)
        policy, thresholds = gw.routing[name]
        route = Route(
            _route_key(request, payload, body) if policy is Policy.prefix else None, policy, thresholds
        )
        if (full := await _enter(gw, name, key)) is not None:
            if not last:
                continue
            return full
        try:
            answer = await _route(request, gw, record, body, started, route=route, last=last)
        finally:
            gw.admission.leave(name, key.name)
        if answer is not None:
            return answer
    raise AssertionError("the last fallback always answers")


def _refused(why: Unavailable, rid: str) -> web.Response:
    """The answer to a request for a model that has no ready replica in time. What the
    gateway knows of why goes to its log, under the request id the answer names."""
    if why.status == 404:
        return error(why.status, why.message, "invalid_request_error", why.code)
    message = why.message
    if why.detail:
        loading = why.code == "model_loading"  # a start's progress, not a fault
        _log_detail(logging.INFO if loading else logging.WARNING, rid, why.code, why.detail)
        message = withheld(message, rid)
    return error(why.status, message, "server_error", why.code, why.headers)


def _upstream_failed(request: Incoming, gw: Gateway, reason: str, detail: str) -> web.Response:
    """A 502: ``reason`` for the client, ``detail`` (an engine's address, what broke) for
    the log, under the request id the answer names."""
    rid = request_id(request)
    _log_detail(logging.WARNING, rid, reason, gw.redact(detail))
    return error(502, withheld(reason, rid), "server_error", "upstream_error")


def _log_detail(level: int, rid: str, what: str, detail: str) -> None:
    """One log record; each of its lines (a journal's, a traceback's) begins with the
    request id, so a search for the id finds them all."""
    lines = detail.splitlines() or [""]
    log.log(level, "\n".join(f"request {rid}: {what}: {line}" for line in lines))


NONE_TRIED: frozenset[str] = frozenset()


class Route(NamedTuple):
    """How one request is routed: its key (None: no prefix or not the prefix policy) and
    its model's policy and thresholds. A tuple: one is made for every request."""

    key: str | None
    policy: Policy
    thresholds: Thresholds


def _choose(gw: Gateway, record: RequestRecord, route: Route, tried: set[str]) -> RoutedReplica | None:
    """The replica for the next attempt, its reason counted and kept for the log line."""
    found = gw.pool.choose(
        record.base or record.model,
        time.monotonic(),
        key=route.key,
        policy=route.policy,
        thresholds=route.thresholds,
        exclude=frozenset(tried) if tried else NONE_TRIED,
        stale_after=gw.signals_stale_after(),
        prefer=record.model if record.base else None,
    )
    if found is None:
        return None
    replica, reason = found
    record.route = reason.value
    gw.metrics.routed(record.model, route.policy.value, reason.value)
    return replica


async def _route(
    request: Incoming,
    gw: Gateway,
    record: RequestRecord,
    body: bytes,
    started: float,
    *,
    route: Route,
    last: bool = True,
) -> Outgoing | None:
    """The answer of ``record.model``'s replicas. Not the ``last`` model to try: None when
    it has none (``Unavailable``) or every attempt failed before a byte reached the
    client, for the next fallback."""
    name = record.model
    timeout = gw.stream_timeout if record.stream else gw.plain_timeout
    tried: set[str] = set()
    replica = _choose(gw, record, route, tried)
    if replica is None:
        # None ready: the controller starts one if it may, and waits up to load_wait.
        found = await gw.controller.ensure_ready(record.base or name, started + gw.spec.gateway.load_wait)
        if isinstance(found, Unavailable):
            if not last:
                _passed_on(request, name, f"{found.code}: {found.message}")
                return None
            return _refused(found, request_id(request))
        # Ready now (no await since): the policy chooses among the ready ones.
        replica = _choose(gw, record, route, tried) or found
    last_error = ""
    stale_retried = False
    while replica is not None and record.attempts < MAX_ATTEMPTS:
        current = replica
        record.attempts += 1
        record.replica = replica.address
        tried.add(replica.address)
        replica.outstanding += 1
        replica.requests += 1
        try:
            try:
                upstream = await _send(gw, replica, record, request.path, body, timeout, fresh=stale_retried)
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
                replica = _choose(gw, record, route, tried)
                continue
            except UpstreamError as exc:
                if not last:
                    _passed_on(request, name, gw.redact(str(exc)))
                    return None
                return _upstream_failed(request, gw, _unanswered(exc, name), str(exc))
            gw.pool.succeeded(replica)
            record.first_byte_ms = (time.monotonic() - started) * 1000
            try:
                return await _relay(request, gw, upstream, record, last)
            finally:
                upstream.release()  # closes the connection unless the answer was read to its end
        finally:
            current.outstanding -= 1
            current.last_used = time.time()  # a stream counts as use until it ends
    if not last:
        _passed_on(request, name, gw.redact(last_error) or "no replica could be reached")
        return None
    return _upstream_failed(request, gw, f"No replica of `{name}` could be reached.", last_error)


async def _send(  # noqa: PLR0917 (one attempt of _route: its parts, in order)
    gw: Gateway,
    replica: RoutedReplica,
    record: RequestRecord,
    path: str,
    body: bytes,
    timeout: float,
    *,
    fresh: bool,
) -> Answer:
    """One attempt's request to ``replica``; a LoRA adapter's is loaded there first
    (``AdapterNotLoaded`` when the engine refuses it)."""
    if record.base:
        refused = await _load_adapter(gw, replica, record.model)
        if refused:
            raise AdapterNotLoaded(refused)
    upstream = await gw.upstreams.request(replica.address, path, body, timeout, fresh=fresh)
    if record.base and upstream.status == 404:  # the engine lost the adapter (it restarted)
        replica.adapters.discard(record.model)
    return upstream


def _unanswered(exc: UpstreamError, name: str) -> str:
    """What the client is told of an engine that failed its request."""
    if isinstance(exc, AdapterNotLoaded):
        return f"The engine could not load the adapter `{name}`."
    return "The engine did not answer."


async def _load_adapter(gw: Gateway, replica: RoutedReplica, adapter: str) -> str:
    """Load ``adapter`` onto ``replica`` unless it has it: one load per replica and adapter,
    which concurrent first requests share. Empty when loaded, else why not (the engine's
    answer, for the log). ``ConnectFailed``, ``Disconnected`` and other ``UpstreamError``
    pass to the caller, which treats them as its request's own."""
    if adapter in replica.adapters:
        return ""
    key = (replica.address, adapter)
    pending = gw.adapter_loads.get(key)
    if pending is None:
        pending = asyncio.ensure_future(_send_load(gw, replica, adapter))
        gw.adapter_loads[key] = pending
        pending.add_done_callback(lambda _: gw.adapter_loads.pop(key, None))
    return await asyncio.shield(pending)


async def _send_load(gw: Gateway, replica: RoutedReplica, adapter: str) -> str:
    served = gw.adapters.get(adapter)
    node = node_at(gw.spec, replica.address)
    if served is None or node is None:
        return f"no node of the cluster file serves {replica.address}"
    # the path is the cluster file's, on the replica's node: never a request's
    answer = await gw.upstreams.request(
        replica.address, LOAD_PATH, load_body(served.adapter, node), gw.plain_timeout
    )
    try:
        data = await answer.read()
    finally:
        answer.release()
    if loaded_by_answer(answer.status, data):
        replica.adapters.add(adapter)
        log.info("loaded adapter %s onto %s", adapter, replica.address)
        return ""
    return f"{replica.address} answered {answer.status} to loading {adapter}: {data[:500].decode(errors='replace')}"


def _passed_on(request: Incoming, name: str, why: str) -> None:
    """Log why ``name`` hands the request to its next fallback, under the answer's request id."""
    _log_detail(
        logging.INFO, request_id(request), f"`{name}` could not answer, trying its next fallback", why
    )


async def _relay(
    request: Incoming, gw: Gateway, upstream: Answer, record: RequestRecord, last: bool = True
) -> Outgoing | None:
    """The engine's answer, relayed. Not the ``last`` model to try: None for a 5xx (or a
    refused engine key), before a byte of it reaches the client."""
    if not last and (upstream.status >= 500 or upstream.status == 401):
        _passed_on(request, record.model, f"the engine answered {upstream.status}")
        return None
    if upstream.status == 401:
        return error(502, "The engine refused the gateway's engine key.", "server_error", "upstream_auth")
    content_type = upstream.content_type or "application/json"
    if not content_type.startswith("text/event-stream"):
        try:
            data = await upstream.read()
        except UpstreamError as exc:
            if not last:
                _passed_on(request, record.model, gw.redact(str(exc)))
                return None
            return _upstream_failed(request, gw, "The engine broke off its answer.", str(exc))
        if upstream.status == 200:
            record.prompt, record.completion = body_usage(data)
        return web.Response(status=upstream.status, body=data, headers={"Content-Type": content_type})
    # The head goes out now. A client gone already is a ConnectionResetError here, which
    # ``forward`` records as a 499 (the caller's release closes the upstream connection).
    out = await open_stream(
        request,
        upstream.status,
        {"Content-Type": content_type, "Cache-Control": "no-cache", SERVED_BY: record.model},
    )
    relay = StreamRelay(hide_usage=record.hide_usage)
    sending = b""  # the bytes of the write under way: lost if the client is gone
    gone: bytes | None = None  # the write that found the client gone
    try:
        while chunk := await upstream.next_chunk():
            if record.first_chunk is None:  # time to first token, for the metrics
                record.first_chunk = time.monotonic()
            sending = relay.feed(chunk)
            if upstream.complete:  # the last read: one write with the body's end
                sending += relay.rest()
                await out.write_eof(sending)
            elif sending:
                await out.write(sending)
            sending = b""  # written
        sending = relay.rest()
        await out.write_eof(sending)  # nothing more when the last read ended the body
    except UpstreamError:
        # Bytes already reached the client: the stream can only be cut (the log line says
        # so). An engine that closes its connection right after the last event (llama-server
        # does) can end here with the whole answer sent. (The caller's release closes the
        # upstream connection.)
        record.cut = True
        _metered(relay, record)
        if not record.done and request.transport is not None:
            # Half an answer must not read as a whole one: the client's body breaks off as
            # the engine's did, without the end of the chunked body (aiohttp then skips it).
            request.transport.close()
        return out
    except ConnectionResetError:
        # The client left at a write (its connection closing before aiohttp cancelled the
        # handler): the caller's release closes the upstream connection,
        # which stops the generation.
        gone = sending
    except asyncio.CancelledError:
        # The client left and the server cancelled the handler, maybe in the middle of a
        # write (the lean server delivers it there): what was being written did not go out.
        gone = sending
        raise
    finally:
        # Whatever ended the stream (its end, a cut, the client leaving, cancellation), the
        # tokens the engine made are metered.
        _metered(relay, record)
        if gone is not None:
            # One that had read to `data: [DONE]` got a whole answer; not when `[DONE]` was
            # in the write that found it gone (the stream's end, unless that write was empty).
            record.done = record.done and not gone.strip()
    if gone is not None:
        record.status = 200 if record.done else 499
    return out


def _metered(relay: StreamRelay, record: RequestRecord) -> None:
    usage = relay.usage(record.prompt_estimate)
    record.prompt, record.completion = usage.prompt, usage.completion
    record.usage_estimated, record.done = usage.estimated, usage.done

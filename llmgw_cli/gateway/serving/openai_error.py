"""Errors in the OpenAI format: what every listener of the gateway answers when it refuses.

``{"error": {"message", "type", "param", "code"}}``, with the HTTP status and any headers
(``Retry-After``) the caller gives. Clients (the official ``openai`` library among them)
read ``type`` and ``code``; ``message`` is for people.

Every answer of the public listener carries a request id (``x-request-id``, the header
OpenAI's API answers with, which its client reads as ``request_id``). An answer that
withholds what the gateway knows (why a start failed, what an engine said) names that id
in its message, and the gateway's log line with the detail carries it too: the client
reads a reason, the operator finds the rest.
"""

from __future__ import annotations

import json
import random
import secrets

from aiohttp import web

from llmgw_cli.errors import BadRequest
from llmgw_cli.gateway.serving.exchange import Incoming

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID = web.RequestKey("request_id", str)
# Ids are 96 random bits from a generator seeded once per process from the system's
# randomness, not drawn from it per request (a system call each). They are correlation
# handles, not secrets; unlike a counter, they say nothing of the gateway's traffic.
_IDS = random.Random(secrets.randbits(128))


def request_id(request: Incoming) -> str:
    """This request's id, made on first use: ``req_`` and 24 hex digits."""
    found: str | None = request.get(_REQUEST_ID)
    if found is None:
        found = request[_REQUEST_ID] = f"req_{_IDS.getrandbits(96):024x}"
    return found


async def add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the id in every answer's head, a stream's too."""
    response.headers[REQUEST_ID_HEADER] = request_id(request)


def withheld(message: str, rid: str) -> str:
    """A client's message whose detail went to the log under ``rid``."""
    return f"{message} (request id {rid})"


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


def bad_request(exc: BadRequest) -> web.Response:
    """A body the gateway refuses (``request_body.parse_body``): a 400."""
    return error(400, exc.message, "invalid_request_error", exc.code, param=exc.param)

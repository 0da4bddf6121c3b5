"""Errors in the OpenAI format: what every listener of the gateway answers when it refuses.

``{"error": {"message", "type", "param", "code"}}``, with the HTTP status and any headers
(``Retry-After``) the caller gives. Clients (the official ``openai`` library among them)
read ``type`` and ``code``; ``message`` is for people.
"""

from __future__ import annotations

import json

from aiohttp import web

from llmgw_cli.errors import BadRequest


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

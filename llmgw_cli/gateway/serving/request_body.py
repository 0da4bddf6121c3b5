"""A client's request body, checked before anything acts on it: no I/O, no asyncio.

Every request is hostile data: the body must be a UTF-8 JSON object nested at most
``MAX_DEPTH`` deep, and the fields the gateway itself acts on (``model``, ``stream``,
``stream_options``) must have their JSON types; anything else is a ``BadRequest`` (a 400
in the OpenAI error format), never a 500. When the body could read differently to the
engine than to the gateway (a key given twice, or spelled with escapes), the engine gets
the gateway's own reading of it, encoded again.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmgw_cli.errors import BadRequest

MAX_DEPTH = 64  # deepest nesting of arrays and objects in a request body


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

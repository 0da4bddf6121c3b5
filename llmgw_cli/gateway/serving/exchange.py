"""What the public OpenAI paths need of a request and an answer, whichever server runs them.

The public listener runs on ``http1`` (the lean server) or on aiohttp's (the admin and
metrics listeners always, the public one with ``gateway.http_server: aiohttp``). Both
requests offer the few members ``Incoming`` names; both answers those of ``Outgoing``,
and a streamed answer ``Streaming``'s. ``open_stream`` begins a streamed answer on either.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, cast, overload

from aiohttp import web
from multidict import CIMultiDict

from llmgw_cli.gateway.serving import http1


class Body(Protocol):
    def is_eof(self) -> bool: ...

    def read_nowait(self) -> bytes: ...


class Headers(Protocol):
    """A request's headers: case-insensitive names."""

    @overload
    def get(self, name: str, /) -> str | None: ...

    @overload
    def get(self, name: str, default: None, /) -> str | None: ...


class App(Protocol):
    def __getitem__(self, key: Any) -> Any: ...


class Incoming(Protocol):
    """A request, as the public paths read it."""

    @property
    def app(self) -> App: ...

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> Headers: ...

    @property
    def content_length(self) -> int | None: ...

    @property
    def content(self) -> Body: ...

    @property
    def transport(self) -> asyncio.Transport | None: ...

    async def read(self) -> bytes: ...

    @overload
    def get(self, key: Any, /) -> Any: ...

    @overload
    def get(self, key: Any, default: Any, /) -> Any: ...

    def __getitem__(self, key: Any) -> Any: ...

    def __setitem__(self, key: Any, value: Any) -> None: ...


class Outgoing(Protocol):
    """An answer, plain or streamed."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> CIMultiDict[str]: ...

    @property
    def prepared(self) -> bool: ...

    def force_close(self) -> None: ...


class Streaming(Outgoing, Protocol):
    """A streamed answer whose head was sent."""

    async def write(self, data: bytes) -> None: ...

    async def write_eof(self, data: bytes = b"") -> None: ...


async def open_stream(request: Incoming, status: int, headers: dict[str, str]) -> Streaming:
    """Begin a streamed answer to ``request``: its head goes out now."""
    if isinstance(request, http1.Request):
        return await request.open_stream(status, headers)
    out = web.StreamResponse(status=status, headers=headers)
    await out.prepare(cast(web.Request, request))
    return out

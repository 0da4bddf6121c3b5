"""The CLI's own event loop for its synchronous commands.

A command that runs its steps from synchronous code, with prompts and printing between
them (``plan``, ``apply``, ``status``), holds one ``Session``: the loop that runs each step
and the ``Connections`` that step uses. The loop is the CLI's, so it lives here; the
connections are the remote layer's and stay there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from llmgw_cli.core.clusterfile.spec import ClusterSpec
from llmgw_cli.remote.connect import Connections

T = TypeVar("T")


class Session:
    """One event loop and one ``Connections`` for a command that runs its steps from
    synchronous code, with prompts and printing between them (``plan``, ``apply``): an
    asyncssh connection belongs to the loop that opened it, so the loop is kept from one
    step to the next instead of a new ``asyncio.run`` per step."""

    def __init__(self, spec: ClusterSpec, base: Path, *args: Any, **kwargs: Any) -> None:
        """The arguments of ``Connections``."""
        self._runner = asyncio.Runner()
        self.conns = Connections(spec, base, *args, **kwargs)

    def run(self, step: Coroutine[Any, Any, T]) -> T:
        return self._runner.run(step)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._runner.run(self.conns.close())
        finally:
            self._runner.close()

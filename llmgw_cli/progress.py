"""How long-running work tells its caller what it is doing: the progress callbacks.

Three shapes, because the callers show three different things:

- ``LineReport``: one line of text about the whole job; the lab's ``up`` and ``down``
  report this way, and the CLI prints each line as it comes.
- ``Report``, the common one: ``(subject, message)``, where the subject is what the
  message is about: a node, ``model#replica``, ``model@node`` or the gateway. Probes
  (``connecting``, ``done``, ``failed``), apply's executor, engine keys, the gateway's
  install and the node set-up report this way, so the CLI can keep one line per subject.
- ``FetchReport``: a ``FetchEvent`` with the bytes fetched and the total, so the CLI
  can draw one progress bar per model and node.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmgw_cli.remote.fetch import FetchEvent

LineReport = Callable[[str], None]
Report = Callable[[str, str], None]
FetchReport = Callable[["FetchEvent"], None]


def quiet(_: str) -> None:
    """A ``LineReport`` that shows nothing: the default where nobody watches."""

"""Who copies weights from whom (``llmgw fetch --peers``), apart from ``core/weights/fetch.py`` so
the command line names the choices without loading the core."""

from __future__ import annotations

from enum import StrEnum


class Peers(StrEnum):
    """Which nodes may copy a file from each other instead of from the origin."""

    fabric = "fabric"  # nodes of one fabric (nodes without a fabric form one group)
    cluster = "cluster"  # every node
    off = "off"  # every node downloads from the origin

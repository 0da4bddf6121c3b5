"""How far a fetch of weights is, as one short text: ``fetching 142/191 files, 512 of 810 GB``.

The text is what a client waiting for an on-demand start reads (the 503 ``model_loading``
message, ``/v1/models``), what the admin dashboard shows and what ``apply`` prints.

Units: decimal (``GB`` is 10^9 bytes, as the Hugging Face Hub shows a repository's size).
One unit for both numbers, chosen by the total (by the bytes done when the total is not
known): ``GB`` from 1 GB up, ``MB`` below. Both numbers get the same decimals: none when
the larger is 100 or more in that unit, one otherwise (``1.2 of 4.0 GB``, ``512 of 810 GB``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

GB = 10**9
MB = 10**6


def amounts(done: int, total: int | None) -> str:
    """``512 of 810 GB``; ``512 GB`` when the total is not known (None or 0)."""
    top = total or done
    unit, name = (GB, "GB") if top >= GB else (MB, "MB")
    digits = 0 if top / unit >= 100 else 1
    if not total:
        return f"{done / unit:.{digits}f} {name}"
    return f"{done / unit:.{digits}f} of {total / unit:.{digits}f} {name}"


@dataclass(frozen=True)
class NodeProgress:
    """One node's fetch of one model's weights, as its last event said. ``files`` and
    ``files_total`` are set for a repository snapshot, None for a single file."""

    state: str  # waiting, fetching (the states of a fetch under way)
    bytes: int = 0
    total: int | None = None
    files: int | None = None
    files_total: int | None = None

    @property
    def fraction(self) -> float:
        """How much of it is done, 0 to 1 (0 while the total is not known)."""
        if self.total:
            return min(1.0, self.bytes / self.total)
        if self.files_total:
            return min(1.0, (self.files or 0) / self.files_total)
        return 0.0


def progress_text(p: NodeProgress) -> str:
    """``fetching 142/191 files, 512 of 810 GB`` for a snapshot, ``fetching 512 of 810 MB``
    for a single file, the bare state while nothing is known."""
    parts = []
    if p.files_total is not None:
        parts.append(f"{p.files or 0}/{p.files_total} files")
    if p.total or p.bytes:
        parts.append(amounts(p.bytes, p.total))
    return f"{p.state} {', '.join(parts)}" if parts else p.state


def least_advanced(nodes: Mapping[str, NodeProgress]) -> str | None:
    """The node whose fetch is least far (by the fraction of its bytes done, then by its
    name), of the nodes of one model whose fetch is under way; None when none is.

    A replica that spans nodes serves only once every one of them holds the weights, so
    the model's progress is the least advanced node's: a sum would say "90%" while one node
    is still at 10%."""
    if not nodes:
        return None
    return min(nodes, key=lambda n: (nodes[n].fraction, n))

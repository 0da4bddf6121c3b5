"""A node's faulty cards, each with why and what the operator does: one reading for
``llmgw status``, the gateway's metrics and ``llmgw doctor``.

A card is faulty when nvidia-smi says so (cells it cannot read, a reset required or
recommended, row remapping pending or failed, uncorrected ECC errors since boot), when
the kernel log holds a fatal XID for it (``core/observe/xid.py``), or when nvidia-smi
cannot open it at all (fallen off the bus: ``NodeFacts.lost_gpus``; it has no index,
so it is named by its PCI bus id).
"""

from __future__ import annotations

from llmgw_cli.core.observe.facts import Fact, GpuHealth, NodeFacts
from llmgw_cli.core.observe.parse.kernel_log import bus_key
from llmgw_cli.core.observe.xid import RESET_GPU, RESTART_BM, xid

REMAP_FAILED = "drain the node and replace the card (RMA): its memory repair is exhausted"
LOST = "lost"  # the cause of a card nvidia-smi cannot open

# the operator's action for each cause that is not an XID, most pressing first
_ACTIONS = {
    "remap-failed": REMAP_FAILED,
    LOST: RESTART_BM,
    "reset-required": RESET_GPU,
    "drain-and-reset": RESET_GPU,
    "remap-pending": RESET_GPU,
    "ecc": RESET_GPU,
    "nvidia-smi": RESET_GPU,
}


class FaultyCard(Fact):
    """One card out of placement: ``gpu`` is its index, or its PCI bus id when nvidia-smi
    cannot open it."""

    gpu: str
    causes: tuple[str, ...]  # words of a fixed set: ``Gpu.causes``, or ``lost``
    reasons: tuple[str, ...]
    action: str


def card_action(causes: tuple[str, ...]) -> str:
    """What to do about a card with these causes: the most pressing of them."""
    for cause, action in _ACTIONS.items():
        if cause in causes:
            return action
    for cause in causes:
        code = cause.removeprefix("xid-")
        if code.isdigit():
            return xid(int(code)).action
    return RESET_GPU


def faulty_cards(facts: NodeFacts) -> list[FaultyCard]:
    """The node's faulty cards: those nvidia-smi lists as faulty, then those it cannot open."""
    cards = [
        FaultyCard(gpu=str(g.index), causes=g.causes, reasons=g.reasons, action=card_action(g.causes))
        for g in facts.gpus
        if g.health is GpuHealth.faulty
    ]
    for bus in facts.lost_gpus:
        key = bus_key(bus)
        seen = [r for r in facts.xids if key is not None and r.bus == key]
        reasons = (
            "nvidia-smi cannot open it: fallen off the bus",
            *(f"XID {r.code}: {xid(r.code).meaning}" for r in seen),
        )
        causes = (LOST, *(f"xid-{r.code}" for r in seen if xid(r.code).fatal))
        cards.append(FaultyCard(gpu=bus, causes=causes, reasons=reasons, action=card_action(causes)))
    return cards


def xid_notes(facts: NodeFacts) -> list[str]:
    """The XID reports that take no card out, one line each: codes whose first action is
    to restart the program (or none), and reports for a bus where no card is known."""
    lost = {bus_key(b) for b in facts.lost_gpus}
    notes = []
    for r in facts.xids:
        meaning = xid(r.code)
        times = f" x{r.count}" if r.count > 1 else ""
        if r.gpu is None and r.bus in lost:
            continue  # told with its card (faulty_cards)
        where = f"GPU {r.gpu}" if r.gpu is not None else f"PCI {r.bus} (no card nvidia-smi lists)"
        if r.gpu is not None and meaning.fatal:
            continue  # the card is faulty: told with it
        notes.append(f"{where}: XID {r.code}{times}: {meaning.meaning}; action: {meaning.action}")
    return notes
